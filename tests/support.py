"""Small models and tokenizers that several test packages build (importable as `support`: pyproject's pytest
pythonpath puts tests/ on sys.path).  Fixtures shared between files live in conftest.py."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import tiktoken
import torch

from minigpt import GPT, GPTConfig
from minigpt.core.chat_template import IM_END, IM_START
from minigpt.core.hf_tokenizer import HFTokenizer
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer


def varied_gpt(
    arch: str = "gpt",
    n_kv_head: int = 4,
    attention: str = "sdpa",
    vocab_size: int = 60,
    block_size: int = 32,
    seed: int = 0,
    **config: object,
) -> GPT:
    """A 2-layer, width-32 random GPT with larger-than-init weights, in eval mode: its greedy output varies from
    token to token, so a cache that fed wrong positions or keys would change it (at init scale greedy repeats one
    token)."""
    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(
            arch=arch,
            n_layer=2,
            n_head=4,
            n_kv_head=n_kv_head,
            n_embd=32,
            block_size=block_size,
            vocab_size=vocab_size,
            attention=attention,
            **config,
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
            elif p.dim() >= 2:
                p.normal_(0, 2 / math.sqrt(p.shape[-1]))
    return model.eval()


def scripted_gpt(vocab_size: int, script: dict[int, int], block_size: int = 64) -> GPT:
    """A GPT whose greedy token at position p is script[p], whatever the ids before it: its blocks add nothing, its
    state at p is position p's one-hot embedding, and the head's row script[p] reads that coordinate."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            n_layer=1, n_head=2, n_embd=block_size, block_size=block_size, vocab_size=vocab_size, tie_embeddings=False
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("transformer.h.") or name in ("transformer.wte.weight", "lm_head.weight"):
                p.zero_()
        model.transformer.wpe.weight.copy_(torch.eye(block_size))
        for position, token in script.items():
            model.lm_head.weight[token, position] = 1.0
    return model.eval()


def byte_bpe() -> tiktoken.Encoding:
    """A tiktoken byte-level BPE with no merges and an end-of-text token 256, built in-process (no download)."""
    return tiktoken.Encoding(
        "tiny-bpe",
        pat_str=r"\S+|\s+",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": 256},
    )


def random_ids(batch: int = 2, length: int = 5, vocab: int = 60, seed: int = 1) -> torch.Tensor:
    """(batch, length) token ids below vocab, the same for a seed."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail (TimeoutError) instead of hanging: SIGALRM interrupts a blocking open() or read()."""

    def expired(*a):
        raise TimeoutError(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------ chat: a conversation and the bases

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42, é☃"},
    {"role": "user", "content": "And 1 + 1?"},
    {"role": "assistant", "content": "2"},
]
# ChatML as SmolLM2-Instruct ships it: no {% generation %} tag
SMOL_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def small_bpe() -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate([b"Wh", b"at", b" 1", b"12"])}
    return tiktoken.Encoding(
        name="small_bpe", pat_str=GPT2_PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)}
    )


def hf_base(with_markers: bool) -> HFTokenizer:
    """A byte-level BPE made by `tokenizers`, with the ChatML markers as special tokens when asked (SmolLM2's way)."""
    import tokenizers as t

    alphabet = sorted(t.pre_tokenizers.ByteLevel.alphabet())
    backend = t.Tokenizer(t.models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = t.decoders.ByteLevel()
    specials = ["<|endoftext|>"] + ([IM_START, IM_END] if with_markers else [])
    backend.add_special_tokens([t.AddedToken(s, special=True, normalized=False) for s in specials])
    return HFTokenizer(backend.to_str(), eos_id=backend.token_to_id("<|endoftext|>"))


def spm_bpe(decoder: str) -> HFTokenizer:
    """A SentencePiece-style BPE trained here: "▁" for spaces, <0xNN> byte fallback for characters it lacks, and
    the decoder of Llama 2's files (Strip: the prefix space goes) or of Metaspace's (the first token's space goes)."""
    import tokenizers as t

    trainer = t.Tokenizer(t.models.BPE())
    trainer.pre_tokenizer = t.pre_tokenizers.Metaspace(prepend_scheme="first")  # pieces start with "▁"
    corpus = "the thing and the other things, hello world and the end of it all\n" * 20
    trainer.train_from_iterator([corpus], t.trainers.BpeTrainer(vocab_size=120, show_progress=False))
    trained = json.loads(trainer.to_str())["model"]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    pieces += [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if p not in pieces]
    merges = [tuple(m) for m in trained["merges"]]
    backend = t.Tokenizer(
        t.models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True, unk_token="<unk>")
    )
    backend.pre_tokenizer = trainer.pre_tokenizer
    if decoder == "llama2":
        steps = [
            t.decoders.Replace("▁", " "),
            t.decoders.ByteFallback(),
            t.decoders.Fuse(),
            t.decoders.Strip(" ", 1, 0),
        ]
        backend.decoder = t.decoders.Sequence(steps)
    else:
        backend.decoder = t.decoders.Metaspace(prepend_scheme="first")
    return HFTokenizer(backend.to_str(), bos_id=1, eos_id=2)


BASES = {
    "char": lambda: CharTokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n?."),
    "byte": ByteTokenizer,
    "tiktoken": lambda: TiktokenTokenizer(small_bpe()),
    "hf": lambda: hf_base(with_markers=False),
}


# ------------------------------------------------------------------ the attention lab: a prompt and a random model

LAB_CHARS = "\n !',./:;<>?abcdefghijklmnopqrstuvwxyz"  # no "Z": a prompt with it must be refused
LAB_PROMPT = "a // b </script> c, a // b\nd"  # "//" and "</script>" must not leak into the page's markup


def lab_model(
    arch: str = "gpt",
    n_layer: int = 2,
    n_head: int = 4,
    n_kv_head: int | None = None,
    block_size: int = 32,
    vocab_size: int = len(LAB_CHARS),
    seed: int = 0,
) -> GPT:
    """A random GPT over LAB_CHARS for the attention lab's tests (tests/lab, tests/cli/test_attention.py)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        arch=arch,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head or n_head,
        n_embd=32,
        block_size=block_size,
        vocab_size=vocab_size,
        attention="sdpa",
    )
    model = GPT(cfg)
    with torch.no_grad():  # larger than init, so attention is far from uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 2 / math.sqrt(p.shape[-1]))
    return model.eval()


def count_model_builds(monkeypatch) -> list[str]:
    """Record the device type of every GPT built from here on (GPT.__init__ patched for the test): a load builds
    its one model on the meta device and fills it (issue 35), so the list a load leaves is ["meta"]."""
    builds: list[str] = []
    init = GPT.__init__

    def counted(self, config):
        builds.append(torch.get_default_device().type)
        init(self, config)

    monkeypatch.setattr(GPT, "__init__", counted)
    return builds


def keep_training_graphs(monkeypatch) -> list:
    """Collect the TrainingGraphs every --compile_mode graphed run records from here on (their replays count the
    training forwards that replayed)."""
    from minigpt.training import callbacks

    graphs: list = []
    record = callbacks.record_training_graphs
    monkeypatch.setattr(callbacks, "record_training_graphs", lambda *args: graphs.append(record(*args)) or graphs[-1])
    return graphs


RUNS = """import contextlib, io, json, runpy, signal, sys
script, results = sys.argv[1], []
for argv in json.loads(sys.argv[2]):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new process starts (an export ignores it at exit)
    sys.argv, err = [script, *argv], io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__"); code = 0
        except SystemExit as e:
            code = e.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def script_runs(script: str, argvs: list[list[str]], timeout: float = 300) -> list[tuple[int, str]]:
    """`python SCRIPT ARGV` for each argv, as from a shell (exit code, stderr), in one child interpreter: the
    imports are paid once."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", RUNS, script, json.dumps(argvs)],
        cwd=repo,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]


def flags(args: dict) -> list[str]:
    """{"optim.learning_rate": 0.01, ...} -> ["--optim.learning_rate", "0.01", ...]: a command line for train.py."""
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def scalars(run) -> dict[str, list[float]]:
    """Every scalar a run logged to TensorBoard: tag -> its values in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
