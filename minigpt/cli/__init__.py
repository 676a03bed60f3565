"""The command lines: `minigpt train|sample|eval|export|attention` and the scripts train.py, sample.py, ...

Each command imports only what it needs: sample, eval, export and attention import no Lightning.
"""
