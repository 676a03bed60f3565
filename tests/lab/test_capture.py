"""The attention lab's capture (minigpt.lab.capture): captured weights are the manual path's own, per-head metrics,
the induction run, the memory budget, and the library call's one-line error."""

import math

import numpy as np
import pytest
import torch

from minigpt import GPT, GPTConfig, attention_maps
from minigpt.core.errors import UserError
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer
from minigpt.lab.capture import (
    capture_attention,
    head_metrics,
    induction_scores,
    random_repeated_ids,
    token_strings,
)
from support import LAB_CHARS as CHARS
from support import LAB_PROMPT as PROMPT
from support import lab_model as random_model
from support import spm_bpe


def hand_built(scale: float = 10.0) -> GPT:
    """One layer, two heads, by hand: head 0 attends to the previous token, head 1 to the first token.
    Token embeddings are zero and position p is the one-hot vector e_p, so q and k see positions only."""
    T, C = 16, 32
    model = GPT(GPTConfig(arch="gpt", n_layer=1, n_head=2, n_embd=C, block_size=T, vocab_size=8, bias=True))
    hs = C // 2
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.transformer.h[0].ln_1, model.transformer.h[0].ln_2, model.transformer.ln_f):
            norm.weight.fill_(1.0)
        model.transformer.wpe.weight[:, :T] = torch.eye(T)
        attn = model.transformer.h[0].attn.c_attn  # rows: q head 0, q head 1, k head 0, k head 1, v
        for t in range(1, T):
            attn.weight[t - 1, t] = scale  # head 0's query at position t points at key direction t - 1
        for s in range(T):
            attn.weight[2 * hs + s, s] = scale  # head 0's key at position s: direction s
        attn.bias[hs] = scale  # head 1's query: the same direction everywhere
        attn.weight[3 * hs, 0] = scale  # head 1's key: large at position 0 only
    return model.eval()


@pytest.mark.parametrize("arch,n_kv_head", [("gpt", 4), ("llama", 2)])
def test_captured_weights_are_the_manual_paths_own(arch, n_kv_head):
    model = random_model(arch, n_kv_head=n_kv_head)  # runs the sdpa path
    tok = CharTokenizer(CHARS)
    tokens, weights = attention_maps(model, tok, PROMPT)
    T = len(PROMPT)
    assert tokens == list(PROMPT) and weights.shape == (2, 4, T, T) and weights.dtype == torch.float32

    model.set_attention("manual")
    own: list[torch.Tensor] = []
    with torch.no_grad():
        model(torch.tensor([tok.encode(PROMPT)]), attn_weights=own)
    assert torch.equal(weights, torch.stack(own)[:, 0])
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, T), atol=1e-5)
    assert torch.all(weights.triu(1) == 0)
    if n_kv_head < 4:  # heads sharing a key/value head still have their own queries
        assert not torch.allclose(weights[:, 0], weights[:, 1])


def test_metrics_on_hand_built_weights():
    T = 6
    prev = torch.zeros(T, T)
    prev[0, 0] = 1
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1
    first = torch.zeros(T, T)
    first[:, 0] = 1
    uniform = torch.ones(T, T).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    m = head_metrics(torch.stack([prev, first, uniform]))
    assert m["previous"].tolist() == [
        1.0,
        pytest.approx(0.2),
        pytest.approx(np.mean([1 / (t + 1) for t in range(1, T)])),
    ]
    assert m["first"].tolist()[:2] == [pytest.approx(0.2), 1.0]  # query 1's previous token is the first
    assert m["entropy"][:2].tolist() == [0.0, 0.0]
    assert m["entropy"][2].item() == pytest.approx(np.mean([math.log(t + 1) for t in range(1, T)]), rel=1e-5)
    assert m["distance"].tolist()[:2] == [1.0, pytest.approx(np.mean(range(1, T)))]

    n = 4  # [r, r]: an induction head looks from position i to i - n + 1
    induction = torch.zeros(2 * n, 2 * n)
    induction[0, 0] = 1
    for i in range(1, 2 * n):
        induction[i, i - n + 1 if i >= n else i - 1] = 1
    sink = torch.zeros(2 * n, 2 * n)
    sink[:, 0] = 1  # a first-token head never looks at i - n + 1 >= 1
    assert induction_scores(torch.stack([induction, sink]), n).tolist() == [1.0, 0.0]


def test_hand_built_model_has_a_previous_token_head_and_a_sink_head():
    capture = capture_attention(hand_built(), CharTokenizer("abcdefgh"), "abcdefghabcdefgh")  # 16 = block_size
    m = capture.metrics
    assert m["previous"][0, 0] > 0.99 and m["first"][0, 1] > 0.99
    assert m["first"][0, 0] < 0.2 and m["previous"][0, 1] < 0.2
    assert m["distance"][0, 0] == pytest.approx(1.0, abs=1e-3)
    assert capture.induction_tokens == 8 and m["induction"].max() < 0.1  # no induction head here


def test_induction_run_is_a_repeated_random_sequence_without_end_of_text():
    tok = CharTokenizer("".join(map(chr, range(200, 456))))
    tok.eot_id = 7  # as a BPE tokenizer has one
    ids = random_repeated_ids(tok, 50, seed=3)
    assert ids[:50] == ids[50:] and len(set(ids)) > 40 and tok.eot_id not in ids
    assert ids == random_repeated_ids(tok, 50, seed=3) != random_repeated_ids(tok, 50, seed=4)


def test_a_capture_over_the_memory_budget_is_refused_before_running(monkeypatch):
    """The (L, H, T, T) weights are computed in full or not at all: a TinyLlama shape over 1,900 tokens would take
    10 GB, so a prompt over the budget is one line naming the size and the longest prompt that fits."""
    from minigpt.lab import capture

    model = random_model()  # 2 layers x 4 heads
    monkeypatch.setattr(capture, "WEIGHTS_BUDGET", 2 * 4 * 10**2 * 4)  # exactly 10 tokens' weights
    assert attention_maps(model, CharTokenizer(CHARS), "a" * 10)[1].shape[-1] == 10
    monkeypatch.setattr(model, "attention_weights", lambda *a, **k: pytest.fail("computed despite the budget"))
    with pytest.raises(
        UserError,
        match=r"the prompt is 11 tokens: its attention weights \(2 layers x 4 heads x "
        r"11\^2 floats\) .* shorten it to 10 tokens or fewer",
    ):
        attention_maps(model, CharTokenizer(CHARS), "a" * 11)


def test_library_call_raises_user_error_for_an_empty_prompt():
    with pytest.raises(UserError, match="empty"):
        attention_maps(random_model(), CharTokenizer(CHARS), "")


def test_library_call_raises_user_error_for_another_models_tokenizer():
    """A byte tokenizer's ids past a char model's vocabulary: one line naming it, not the embedding's IndexError."""
    model = random_model()
    with pytest.raises(UserError, match=rf"token id 122 is outside the model's vocabulary \(0 to {len(CHARS) - 1}\)"):
        attention_maps(model, ByteTokenizer(), "a z")


def test_tokens_that_split_a_character_show_it_and_their_part():
    """Byte-level tokens of one character each decode to U+FFFD alone; the lab labels them with the character and
    which part each is, and keeps U+FFFD only for bytes that make no character."""
    tokenizer = ByteTokenizer()
    assert token_strings(tokenizer, tokenizer.encode("aé 😀")) == [
        *["a", "é(1/2)", "é(2/2)", " "],
        *["😀(1/4)", "😀(2/4)", "😀(3/4)", "😀(4/4)"],
    ]
    assert token_strings(tokenizer, [0xFF, 97, 0xE2, 0x80]) == ["\ufffd", "a", "\ufffd", "\ufffd"]  # a cut-off tail


def test_sentencepiece_tokens_keep_their_leading_space():
    """A SentencePiece piece ("▁world", Llama 2's and Gemma's tokenizers) decoded alone loses its space, so the labels
    read "hello", "world", "thing", "s" with no word boundary; each is decoded after the tokens before it."""
    tokenizer = spm_bpe("llama2")
    assert token_strings(tokenizer, tokenizer.encode("hello world and the things é")) == [
        *["hello", " world", " and", " the", " thing", "s", " ", "é(1/2)", "é(2/2)"]
    ]
