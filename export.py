"""Export a minigpt checkpoint as a Hugging Face model directory (GPT2LMHeadModel or LlamaForCausalLM).

    python export.py --ckpt out/RUN --out hf/my-model
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('hf/my-model')"

The command line is minigpt/cli/export.py, the export minigpt/export/hf.py; `python export.py --help` lists the flags.
Installed, the same command is `minigpt export ...`.
"""

from minigpt.cli.export import main

if __name__ == "__main__":
    main()
