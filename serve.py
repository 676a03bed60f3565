"""Serve a minigpt model over OpenAI's API (Chat Completions, Completions), with a chat page in the browser.

    python serve.py --ckpt out/sft                    # http://127.0.0.1:8000/ is the chat page, /v1 the API
    python serve.py --ckpt hf:HuggingFaceTB/SmolLM2-135M-Instruct --port 8080 --api_key KEY

The command line is minigpt/cli/serve.py, the server minigpt/serve/ (docs/serve.md); `python serve.py --help` lists
the flags.  Installed, the same command is `minigpt serve ...`; it needs the serve extra (pip install -e ".[serve]").
"""

if __name__ == "__main__":
    import gc

    gc.disable()  # before torch loads; minigpt.cli.main.run_command says why, and resumes collecting
    from minigpt.cli.main import run_command

    run_command("serve")
