"""Evaluate a checkpoint on a text file: `python eval.py --ckpt out/default --text file.txt` (nats/token, bits/char)."""

from minigpt.evaluate import entry

if __name__ == "__main__":
    entry()
