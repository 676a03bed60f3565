"""Train a GPT: `python train.py` (configs/default.yaml) or `python train.py --config configs/X.yaml [--key value ...]`.

See `python train.py --help` for every key; the logic lives in minigpt/cli/train.py.  Installed, the same
command is `minigpt train ...`.
"""

if __name__ == "__main__":
    import gc

    gc.disable()  # before torch loads; minigpt.cli.main.run_command says why, and resumes collecting
    from minigpt.cli.main import run_command

    run_command("train")
