"""Evaluate a checkpoint on a text file: `python eval.py --ckpt out/default --text file.txt` (nats/token, bits/char).

The command line is minigpt/cli/eval.py; `python eval.py --help` lists the flags.  Installed: `minigpt eval ...`.
"""

from minigpt.cli.eval import main

if __name__ == "__main__":
    main()
