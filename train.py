"""Train a GPT: `python train.py` (configs/default.yaml) or `python train.py --config configs/X.yaml [--key value ...]`.

See `python train.py --help` for every key; the logic lives in minigpt/cli/train.py.  Installed, the same
command is `minigpt train ...`.
"""

if __name__ == "__main__":
    from minigpt.cli.cuda_start import start_cuda_early

    start_cuda_early()  # one GPU: its context made in a thread while the line below imports Lightning
    from minigpt.cli.train import entry

    entry()
