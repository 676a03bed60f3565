"""Generate text from a trained minigpt checkpoint.

    python sample.py --ckpt out/RUN --prompt "ROMEO:" --max_new_tokens 300
    python sample.py --prompt - < prompt.txt --num_samples 3 --temperature 0.9 --top_p 0.95
    python sample.py --temperature 0 --no-kv-cache        # greedy, recomputing the context every step

The command line is minigpt/cli/sample.py, the generation minigpt/core/generation.py; `python sample.py --help`
lists the flags.  Installed, the same command is `minigpt sample ...`.
"""

if __name__ == "__main__":
    import gc

    gc.disable()  # before torch loads; minigpt.cli.main.run_command says why, and resumes collecting
    from minigpt.cli.main import run_command

    run_command("sample")
