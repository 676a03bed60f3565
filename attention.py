"""Look at every attention head of a trained minigpt checkpoint on one prompt.

    python attention.py --ckpt out/default --prompt "def forward(self, x):"
    python attention.py --prompt-file prompt.txt --out figures/attention

Writes attention.html (head view, model view, per-head table; opens offline), PNG figures and attention.npz
into --out (default out/attention).  The command line is minigpt/cli/attention.py; `--help` lists the flags.
Installed, the same command is `minigpt attention ...`.
"""

if __name__ == "__main__":
    import gc

    gc.disable()  # before torch loads; minigpt.cli.main.run_command says why, and resumes collecting
    from minigpt.cli.main import run_command

    run_command("attention")
