"""Evaluate a checkpoint on a text file: `python eval.py --ckpt out/default --text file.txt` (nats/token, bits/char).

The command line is minigpt/cli/eval.py; `python eval.py --help` lists the flags.  Installed: `minigpt eval ...`.
"""

if __name__ == "__main__":
    import gc

    gc.disable()  # before torch loads; minigpt.cli.main.run_command says why, and resumes collecting
    from minigpt.cli.main import run_command

    run_command("eval")
