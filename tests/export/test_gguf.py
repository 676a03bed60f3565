"""GGUF export, proven by llama.cpp (xllamacpp, in this process): the file minigpt writes runs in a runtime nobody
here wrote and computes what minigpt computes.

- f32, every architecture path (gpt and llama blocks, tied and untied heads, biases or none, GQA and MQA, an
  explicit head size, Llama 3 RoPE scaling): llama.cpp's greedy choice equals minigpt's at each of 40 greedy steps
  and its next-token log-probabilities match (random weights, every one drawn: a wrong layout changes every logit);
- small trained models: llama.cpp's own greedy run writes minigpt's tokens, its perplexity is minigpt's, and the
  quantized files agree with f32 (q8_0: >= 95 % of greedy choices, perplexity within 2 %);
- a chat fine-tune answers through llama.cpp's chat API, with the template the file carries, and stops at the end
  of its turn;
- an imported Hugging Face Llama folder (built here with transformers) exports with its tokenizer and template.

llama.cpp runs with an f32 KV cache and without flash attention here (tests/export/llamacpp_server.py), so the
comparison measures the export, not llama.cpp's f16 cache; its gpt2 GELU reads a float16 table, so gpt logits
agree to about 1e-3."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from minigpt.core.chat import chat
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.generation import generate
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer
from minigpt.export.gguf import export_gguf

sys.path.insert(0, str(Path(__file__).parent))
from gguf_models import random_model, trained_chat_model, trained_model, words_text
from llamacpp_server import LlamaCpp

gguf = pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is as fast

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {
    "gpt": dict(arch="gpt"),
    "gpt-untied-tanh": dict(arch="gpt", tie_embeddings=False, gelu_approximate="tanh", norm_eps=1e-6, mlp_hidden=160),
    "gpt-no-bias-gqa": dict(arch="gpt", bias=False, n_kv_head=2),  # zero biases: llama.cpp's gpt2 needs them
    "llama-gqa": dict(arch="llama", n_kv_head=2),
    "llama-untied-mqa-head_dim": dict(arch="llama", n_kv_head=1, head_dim=24, tie_embeddings=False, mlp_hidden=96),
    "llama-rope-scaling": dict(arch="llama", n_kv_head=2, rope_base=5000.0, rope_scaling=LLAMA3, norm_eps=1e-6),
    "llama-bias": dict(arch="llama", bias=True, n_kv_head=2),
}
PROMPT = list("héllo wörld ☃".encode())


def greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return generate(model, torch.tensor([ids]), max_new_tokens=n, temperature=0)[0, len(ids) :].tolist()


def log_probs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float64 log-probabilities of the next token after each prefix."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0][0].double(), -1)


@pytest.mark.parametrize("name", CASES)
def test_llama_cpp_computes_what_minigpt_computes(name, tmp_path):
    model = random_model(seed=list(CASES).index(name), **CASES[name])
    export_gguf(model, ByteTokenizer(), tmp_path / "model.gguf")
    ours = greedy(model, PROMPT, 40)
    assert len(set(ours)) > 8  # a real continuation, not one token repeated
    reference = log_probs(model, PROMPT + ours)
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        assert llama.argmax_along(PROMPT, ours) == ours  # its greedy choice at each of the 40 steps
        for t in (len(PROMPT), len(PROMPT) + 20, len(PROMPT) + 39):
            theirs = llama.next_logprobs((PROMPT + ours)[:t], 8)
            diff = max(abs(reference[t - 1, i].item() - lp) for i, lp in theirs.items())
            assert diff < (3e-3 if model.config.arch == "gpt" else 1e-4), (t, diff)


def test_a_model_named_phi3_without_phi3s_tokens_loads_in_llama_cpp(tmp_path):
    """Under a name that says Phi-3, llama.cpp looks up </s>, <unk>, <s> and <|endoftext|> by name and fails to load
    a vocabulary without them: such an export is renamed, with a note (a run folder named my-phi3-run failed)."""
    model = random_model(n_layer=1, n_embd=32, vocab_size=256)
    result = export_gguf(model, ByteTokenizer(), tmp_path / "model.gguf", name="my-phi3-run")
    assert any("'my-phi 3-run'" in note and "which this vocabulary lacks" in note for note in result.notes)
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        assert llama.tokenize("hi") == list(b"hi")


# ------------------------------------------------------------------------------------------------- trained models


class Trained:
    """A small trained model with its tokenizer, exported on first use in each weight type, and llama.cpp's
    teacher-forced scores of each file on held-out text (greedy choice and log-probability at 95 positions)."""

    def __init__(self, model, tokenizer, root: Path) -> None:
        self.model, self.tokenizer, self.root = model, tokenizer, root
        self.held_out = tokenizer.encode(words_text(n_lines=20, seed=1))[: model.config.block_size]
        self.paths: dict[str, Path] = {}
        self.runs: dict[str, tuple[list[int], list[float]]] = {}

    def path(self, gguf_type: str) -> Path:
        if gguf_type not in self.paths:
            self.paths[gguf_type] = export_gguf(
                self.model, self.tokenizer, self.root / f"{gguf_type}.gguf", gguf_type
            ).path
        return self.paths[gguf_type]

    def scores(self, gguf_type: str) -> tuple[list[int], list[float]]:
        if gguf_type not in self.runs:
            with LlamaCpp(self.path(gguf_type)) as llama:
                self.runs[gguf_type] = llama.scores(self.held_out, 33, self.tokenizer.vocab_size)
        return self.runs[gguf_type]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Trained]:
    """A char-level llama (GQA) and a byte-level gpt (untied), trained for a few seconds on lines of words."""
    text = words_text()
    out = {}
    for kind, tokenizer, config in (
        ("char-llama", CharTokenizer(text), dict(arch="llama", n_kv_head=2)),
        ("byte-gpt", ByteTokenizer(), dict(arch="gpt", tie_embeddings=False)),
    ):
        model = trained_model(tokenizer.encode(text), tokenizer.vocab_size, **config)
        out[kind] = Trained(model, tokenizer, tmp_path_factory.mktemp(kind))
    return out


@pytest.mark.parametrize("kind", ["char-llama", "byte-gpt"])
def test_llama_cpp_writes_minigpts_greedy_text_and_scores_it_alike(trained, kind):
    run = trained[kind]
    model, tokenizer, held_out = run.model, run.tokenizer, run.held_out
    prompt = tokenizer.encode("the quick brown")
    ours = greedy(model, prompt, 48)
    newline = tokenizer.encode("\n")
    with LlamaCpp(run.path("f32")) as llama:
        assert llama.tokenize("the quick brown") == prompt
        completion = llama.completion(prompt, 48)
        assert completion["tokens"] == ours  # llama.cpp's own greedy run, 48 tokens
        assert completion["content"] == tokenizer.decode(ours)
        # a newline is text, printed and read as such (a char export's start token, it was a control token)
        forced = llama.completion(prompt, 2, logit_bias=[[newline[0], 100]])
        assert (forced["tokens"], forced["content"]) == (newline * 2, "\n\n")
        assert llama.post("/tokenize", {"content": "a\nb", "parse_special": False})["tokens"] == tokenizer.encode(
            "a\nb"
        )
    nll = -sum(log_probs(model, held_out)[t - 1, held_out[t]].item() for t in range(33, len(held_out)))
    assert -sum(run.scores("f32")[1]) == pytest.approx(nll, rel=1e-3)


def quantization(run: Trained, gguf_type: str) -> tuple[float, float]:
    """(share of positions where the gguf_type file's greedy choice is f32's, its perplexity / f32's)."""
    (reference, f32_lp), (choices, lp) = run.scores("f32"), run.scores(gguf_type)
    agreement = sum(a == b for a, b in zip(choices, reference)) / len(reference)
    return agreement, math.exp((sum(f32_lp) - sum(lp)) / len(lp))


@pytest.mark.parametrize("kind", ["char-llama", "byte-gpt"])
@pytest.mark.parametrize(
    "gguf_type, min_agreement, max_ppl_change",
    [
        ("q8_0", 0.95, 0.02),
        pytest.param("f16", 0.99, 0.002, marks=pytest.mark.slow),
        pytest.param("bf16", 0.98, 0.005, marks=pytest.mark.slow),
        pytest.param("q4_0", 0.90, 0.05, marks=pytest.mark.slow),
    ],
)
def test_quantized_files_agree_with_f32(trained, kind, gguf_type, min_agreement, max_ppl_change):
    agreement, ppl_ratio = quantization(trained[kind], gguf_type)
    assert agreement >= min_agreement and abs(ppl_ratio - 1) <= max_ppl_change, (agreement, ppl_ratio)


def test_smaller_types_make_smaller_files_and_say_what_they_hold(trained):
    run = trained["byte-gpt"]
    paths = {q: run.path(q) for q in ("f32", "f16", "bf16", "q8_0", "q4_0")}
    sizes = {q: p.stat().st_size for q, p in paths.items()}
    assert sizes["f32"] > sizes["f16"] == sizes["bf16"] > sizes["q8_0"] > sizes["q4_0"]
    reader = gguf.GGUFReader(paths["q4_0"])
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_qkv.weight"] == "Q4_0" and types["output.weight"] == "Q8_0"  # the output kept finer
    assert types["position_embd.weight"] == types["blk.0.attn_norm.bias"] == "F32"


def test_rows_that_are_not_whole_blocks_stay_f16_and_are_counted(tmp_path):
    model = random_model(arch="llama", n_embd=48, n_head=4, mlp_hidden=64, vocab_size=256)  # rows of 48: no block
    result = export_gguf(model, ByteTokenizer(), tmp_path / "model.gguf", "q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    kept = sorted(name for name, kind in types.items() if kind == "F16")
    assert result.kept_f16 == len(kept) > 0
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # its rows are mlp_hidden = 64 wide
    ours = greedy(model, PROMPT, 16)
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        assert sum(a == b for a, b in zip(llama.argmax_along(PROMPT, ours), ours)) >= 14


# ------------------------------------------------------------------------------------------------- chat

QA = [
    ("What is 2+2?", "4"),
    ("Capital of France?", "Paris."),
    ("Say hi in German.", "Hallo!"),
    ("Colour of the sky?", "Blue, mostly."),
    ("Snowman emoji?", "☃"),
    ("Spell café.", "c-a-f-é"),
]
# not ChatML: llama.cpp can only answer if it renders the template the file carries
TEMPLATE = (
    "{% for m in messages %}{{ '[' + m['role'] + ']: ' }}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '[assistant]: ' }}{% endif %}"
)


def test_a_chat_model_answers_through_llama_cpps_chat_api_and_stops_at_end_of_turn(tmp_path):
    tokenizer = ChatTokenizer.for_base(ByteTokenizer(), TEMPLATE)
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QA]
    model = trained_chat_model(tokenizer, conversations, arch="llama", block_size=64, steps=200)
    result = export_gguf(model, tokenizer, tmp_path / "chat.gguf")
    assert result.vocab.eos == result.vocab.end_of_turn == tokenizer.token_id("<|im_end|>")
    with LlamaCpp(tmp_path / "chat.gguf") as llama:
        for question, answer in QA:
            assert chat(model, tokenizer, question) == answer
            assert llama.chat([{"role": "user", "content": question}]) == (answer, "stop")
        prompt = tokenizer.encode_chat(conversations[0][:1], add_generation_prompt=True)[0]
        assert llama.greedy(prompt, 20) == tokenizer.encode("4<|im_end|>")  # it stops at end of turn by itself
