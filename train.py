"""Train a GPT: `python train.py` (configs/default.yaml) or `python train.py --config configs/X.yaml [--key value ...]`.

See `python train.py --help` for every key; the logic lives in minigpt/cli/train.py.  Installed, the same
command is `minigpt train ...`.
"""

from minigpt.cli.train import entry

if __name__ == "__main__":
    entry()
