"""Generation (minigpt.core.generation): KV cache vs full recompute, generation past block_size and the cache's
refill, seeds, stop tokens, top-k/top-p, the empty prompt."""

from __future__ import annotations

import pytest
import torch

from minigpt.core.errors import UserError
from minigpt.core.generation import Sampling, filter_logits, generate, prompt_ids, refill_length, sample_next
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer
from support import byte_bpe, random_ids, varied_gpt

PATHS = ["sdpa", "manual", "einops"]
CHARS = "\n !',.:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXY"
BLOCK = 32  # varied_gpt's block_size


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head", [("gpt", 4), ("gpt", 2), ("llama", 4), ("llama", 2)])
def test_greedy_with_cache_equals_without(arch, n_kv_head, attention):
    model = varied_gpt(arch, n_kv_head, attention)
    idx = random_ids()
    n = BLOCK - idx.size(1)  # fill the block exactly: no refill, so both must compute the same function
    with_cache = generate(model, idx, n, temperature=0, use_kv_cache=True)
    without = generate(model, idx, n, temperature=0, use_kv_cache=False)
    assert with_cache.shape == (2, BLOCK)
    assert torch.equal(with_cache[:, :5], idx)
    assert torch.equal(with_cache, without)
    assert len(set(with_cache[0, 5:].tolist())) > 4  # varied output, so the comparison means something


@pytest.mark.parametrize("use_kv_cache", [True, False])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_generation_longer_than_block_size(arch, use_kv_cache):
    model = varied_gpt(arch, 2)
    idx = random_ids(length=7)
    n = 2 * BLOCK + 5  # past the block twice: three refills of the cache
    out = generate(
        model, idx, n, temperature=0.8, use_kv_cache=use_kv_cache, generator=torch.Generator().manual_seed(0)
    )
    assert out.shape == (2, 7 + n)
    assert torch.equal(out[:, :7], idx)
    assert out.min() >= 0 and out.max() < model.config.vocab_size
    # a prompt longer than the block is cropped to its last block_size tokens, and kept in the output
    long_prompt = random_ids(batch=1, length=BLOCK + 10)
    out = generate(model, long_prompt, 10, temperature=0, use_kv_cache=use_kv_cache)
    assert out.shape == (1, BLOCK + 20) and torch.equal(out[:, : BLOCK + 10], long_prompt)
    cropped = generate(model, long_prompt[:, -BLOCK:], 1, temperature=0, use_kv_cache=use_kv_cache)
    assert out[0, BLOCK + 10] == cropped[0, -1]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_cache_refill_is_a_fresh_prefill_of_the_last_tokens(arch):
    """When the cache is full, the loop re-fills it from the last block_size // 2 tokens at positions 0..
    and decodes on from there: until it is full again, every token is what a plain forward over the
    window starting at the refill point predicts."""
    model = varied_gpt(arch, 2)
    keep = refill_length(BLOCK)
    assert keep == BLOCK // 2
    idx = random_ids(batch=1, length=4)
    # the cache holds tokens 0..BLOCK-1 when token BLOCK is sampled; the next step is the refill
    n = BLOCK + 1 + keep - 4  # fill the block, refill, then fill it again
    out = generate(model, idx, n, temperature=0)
    assert torch.equal(out[:, : BLOCK + 1], generate(model, idx, BLOCK + 1 - 4, temperature=0, use_kv_cache=False))
    start = BLOCK + 1 - keep  # the refill sees out[start:BLOCK+1] at positions 0..keep-1
    with torch.inference_mode():
        expected = model(out[:, start : BLOCK + keep])[0].argmax(-1)  # predicts tokens start+1 .. BLOCK+keep
    assert torch.equal(out[0, BLOCK + 1 :], expected[0, keep - 1 :])


def test_same_seed_same_samples_different_seed_different():
    model = varied_gpt("gpt", 4)
    idx = random_ids()

    def sample(seed, **kw):
        return generate(model, idx, 25, temperature=1.0, generator=torch.Generator().manual_seed(seed), **kw)

    a, b, c = sample(1337), sample(1337), sample(7)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(sample(3, top_k=5, top_p=0.9), sample(3, top_k=5, top_p=0.9))
    # with the cache or without, the same seed draws the same tokens (within the block)
    assert torch.equal(sample(1337, use_kv_cache=False), a)


def test_the_generated_ids_are_an_ordinary_tensor():
    """Generated ids feed training (self-training, RL) and get edited: an inference tensor (generate ran under
    inference_mode) refused both."""
    model = varied_gpt("gpt", 4)
    out = generate(model, random_ids(), 8, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert not out.is_inference()
    model.train()
    model(out[:, :-1], out[:, 1:])[1].backward()
    out[:, 0] = 1


def test_stop_token_stops_pads_and_streams():
    model = varied_gpt("gpt", 4)
    idx = random_ids(batch=3, length=3, seed=4)
    free = generate(model, idx, 20, temperature=0)[:, 3:]
    stop = int(free[0, 4])  # row 0 produces it at step 4
    firsts = [row.index(stop) if stop in row else None for row in free.tolist()]
    seen = []
    out = generate(model, idx, 20, temperature=0, stop_token=stop, on_token=lambda t: seen.append(t.clone()))
    gen = out[:, 3:]
    # every row is the free-running output up to its first stop token, then padding with the stop token
    expected_len = 20 if None in firsts else max(firsts) + 1
    assert gen.size(1) == expected_len
    for row, first in enumerate(firsts):
        if first is None:
            assert torch.equal(gen[row], free[row, :expected_len])
        else:
            assert torch.equal(gen[row, : first + 1], free[row, : first + 1])
            assert (gen[row, first:] == stop).all()
    assert torch.equal(torch.stack(seen, dim=1), gen)  # on_token saw every step, in order
    # a single sequence ends right at its stop token
    one = generate(model, idx[:1], 20, temperature=0, stop_token=stop)
    assert one.size(1) == 3 + 5 and one[0, -1] == stop


TINY_TEMPERATURES = (1e-40, 1e-45, 1e-300, 5e-324)  # float32 overflows (or rounds the divisor to 0) at each


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_temperature_samples_the_greedy_tokens(temperature):
    """Dividing float32 logits by 1e-40 overflowed to inf and NaN, which was refused as broken weights: any
    temperature > 0 samples, and a tiny one gives the greedy limit (ties drawn evenly, never one alone)."""
    model = varied_gpt("gpt", 4)
    idx = random_ids(batch=3)
    greedy = generate(model, idx, 20, temperature=0)
    for kw in ({}, {"top_k": 5}, {"top_p": 0.9}, {"use_kv_cache": False}):
        out = generate(model, idx, 20, temperature=temperature, generator=torch.Generator().manual_seed(0), **kw)
        assert torch.equal(out, greedy), kw
    tied = torch.tensor([[0.0, 7.5, 7.5, 7.0, -3.0]]).repeat(400, 1)  # two tied maxima, a close third
    drawn = sample_next(tied, temperature, generator=torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {1, 2} and 150 < int((drawn == 1).sum()) < 250
    with pytest.raises(UserError, match="NaN/inf logits"):  # broken weights are still named as such
        sample_next(torch.tensor([[0.0, float("nan"), 1.0]]), temperature)


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_greedy_refuses_nan_logits_as_sampling_does(use_kv_cache):
    """argmax picks a NaN: greedy decoding of broken weights gave token after token of garbage and exit 0, where
    sampling named the broken weights.  Here position 5's learned embedding is NaN: the first token is fine, the
    second step's logits are all NaN."""
    model = varied_gpt("gpt", 4)
    with torch.no_grad():
        model.transformer.wpe.weight[5].fill_(float("nan"))
    idx = random_ids(batch=2, length=5)
    assert generate(model, idx, 1, temperature=0, use_kv_cache=use_kv_cache).shape == (2, 6)
    for temperature in (0, 0.8):
        with pytest.raises(UserError, match="NaN/inf logits"):
            generate(model, idx, 3, temperature=temperature, use_kv_cache=use_kv_cache)
    with pytest.raises(UserError, match="NaN/inf logits"):
        sample_next(torch.full((1, 4), float("-inf")), temperature=0)  # nothing finite to choose either


def test_vocab_size_limits_sampled_ids():
    model = varied_gpt("gpt", 4)
    out = generate(model, random_ids(), 40, temperature=2.0, generator=torch.Generator().manual_seed(0), vocab_size=3)
    assert out[:, 5:].max() < 3


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    out = filter_logits(logits, top_k=2)
    kept = torch.isfinite(out)
    assert kept.sum(dim=1).tolist() == [2, 2]
    assert set(kept[0].nonzero().flatten().tolist()) <= {1, 2, 3}  # two of the three tied maxima
    assert kept[1].nonzero().flatten().tolist() == [0, 1]
    assert torch.equal(out[kept], logits[kept])  # kept logits unchanged
    out = filter_logits(logits, top_k=4)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1, 2, 3, 5]
    assert torch.isfinite(filter_logits(logits, top_k=1)).sum().item() == 2
    assert torch.equal(filter_logits(logits, top_k=100), logits)  # k past the vocabulary keeps everything
    with pytest.raises(UserError, match="top_k must be >= 1"):
        Sampling(top_k=0)  # the settings are checked where they are declared; filter_logits trusts them


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=2.5), "top_k must be a whole number, got 2.5"),
        (dict(max_new_tokens=2.0), "max_new_tokens must be a whole number, got 2.0"),
        (dict(temperature="0.7"), "temperature must be a number, got '0.7'"),
    ],
)
def test_sampling_settings_of_the_wrong_type_are_one_user_error(kwargs, match):
    """A number given as text or a fraction where a count belongs (was a TypeError from inside torch.topk/empty)."""
    with pytest.raises(UserError, match=match):
        generate(varied_gpt("gpt", 4, vocab_size=64), torch.tensor([[1, 2]]), **{"max_new_tokens": 3, **kwargs})


@pytest.mark.parametrize(
    "idx,kwargs,match",
    [
        (torch.tensor([[1.0, 2.0]]), {}, "idx must hold token ids"),
        (torch.zeros(0, 3, dtype=torch.long), {}, r"got shape \(0, 3\)"),
        (torch.tensor([[1, 2]]), dict(vocab_size=0), "vocab_size must be a whole number >= 1"),
    ],
)
def test_a_prompt_that_is_not_token_ids_is_a_clear_error(idx, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(varied_gpt("gpt", 4, vocab_size=64), idx, 3, **kwargs)


def test_token_ids_outside_the_vocabulary_are_one_user_error():
    """What a prompt encoded with another tokenizer gives: one line naming the id and the fix, not torch's
    IndexError from the embedding (or, for a negative id, another token read silently)."""
    from minigpt.evaluation.loss import evaluate_tokens

    model = varied_gpt("gpt", 4, vocab_size=64)
    for bad in (64, -1):
        with pytest.raises(UserError, match=rf"^token id {bad} is outside the model's vocabulary \(0 to 63\); encode"):
            generate(model, torch.tensor([[1, bad, 2]]), 3)
    with pytest.raises(UserError, match=r"^token ids from 1 to 99 are not all in the model's vocabulary \(0 to 63\)"):
        evaluate_tokens(model, [1, 2, 99])


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # shuffled: sorted it is 0.5, 0.3, 0.15, 0.05
    logits = probs.log().repeat(2, 1)
    logits[1] = logits[1] * 2 + 1  # a sharper second row: probs 0.735, 0.265... of the same order

    def kept(top_p):
        return [torch.isfinite(row).nonzero().flatten().tolist() for row in filter_logits(logits, top_p=top_p)]

    assert kept(0.8)[0] == [1, 3]  # 0.5 + 0.3 reaches 0.8 exactly
    assert kept(0.81)[0] == [0, 1, 3]
    assert kept(0.95)[0] == [0, 1, 3]
    assert kept(0.951)[0] == [0, 1, 2, 3]
    assert kept(1.0)[0] == [0, 1, 2, 3]
    assert kept(0.1)[0] == [1]  # the top token always stays
    sharp = (logits[1]).softmax(-1)
    assert sharp[1] < 0.8 < sharp[1] + sharp[3]
    assert kept(0.8)[1] == [1, 3]
    out = filter_logits(logits, top_p=0.8)
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])
    # both filters: top-k first, then the nucleus of what is left
    assert torch.isfinite(filter_logits(logits, top_k=3, top_p=0.99)[0]).nonzero().flatten().tolist() == [0, 1, 3]
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(UserError, match="top_p must be in"):
            Sampling(top_p=bad)


def test_empty_prompt_starts_from_start_of_text_newline_or_end_of_text():
    assert prompt_ids(CharTokenizer(CHARS), "") == CharTokenizer(CHARS).encode("\n")
    assert prompt_ids(ByteTokenizer(), "") == [10]
    bpe = TiktokenTokenizer(byte_bpe())
    assert prompt_ids(bpe, "") == [bpe.eot_id] == [256]
    assert prompt_ids(CharTokenizer("ab"), "") == [0]  # no newline in the vocabulary: token 0
    tokenizers = pytest.importorskip("tokenizers")
    from minigpt.core.tokenizers import HFTokenizer

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "a": 2}, unk_token="<s>"))
    # Llama's and Gemma's way: a document starts with <s>/<bos>, so a text from nothing does too
    assert prompt_ids(HFTokenizer(backend.to_str(), bos_id=0, eos_id=1), "") == [0]
    assert prompt_ids(HFTokenizer(backend.to_str(), eos_id=1), "") == [1]
