"""Export a minigpt checkpoint as a Hugging Face model directory (GPT2LMHeadModel or LlamaForCausalLM), or as one
GGUF file for llama.cpp, Ollama and LM Studio.

    python export.py --ckpt out/RUN --out hf/my-model
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('hf/my-model')"
    python export.py --ckpt out/RUN --format gguf --out my-model.gguf --gguf_type q8_0   # llama-cli -m my-model.gguf

The command line is minigpt/cli/export.py, the exports minigpt/export/hf.py and gguf.py; `python export.py --help`
lists the flags.
Installed, the same command is `minigpt export ...`.
"""

if __name__ == "__main__":
    import gc

    gc.disable()  # before torch loads; minigpt.cli.main.run_command says why, and resumes collecting
    from minigpt.cli.main import run_command

    run_command("export")
