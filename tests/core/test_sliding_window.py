"""Sliding-window attention (issue 45): a query at position i sees the keys at i - window < j <= i, on every attention
path, per layer (layer_types), with its own RoPE base (rope_local_base); a sliding layer's KV cache keeps only its
window (a ring buffer) and decodes as the full forward computes; partial rotary embeddings (Phi-3's)."""

from __future__ import annotations

import pytest
import torch

import minigpt.core.compiled as compiled
from minigpt import GPT, ConfigError, GPTConfig
from minigpt.core.chat import ChatSession
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.decode_graphs import DecodeGraphs
from minigpt.core.generation import generate
from minigpt.core.model import apply_rope, rope_cache
from minigpt.core.tokenizers import CharTokenizer
from support import random_ids, varied_gpt

pytestmark = pytest.mark.usefixtures("one_thread")
PATHS = ["sdpa", "manual", "einops"]
MIXED = ["sliding_attention", "full_attention"]
WINDOW = 8
# (arch, n_kv_head, layer_types): both blocks, GQA, every layer sliding or one of two
VARIANTS = [("gpt", 4, None), ("llama", 2, None), ("llama", 2, MIXED), ("gpt", 2, MIXED)]


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 rounding, relative to the logits' size (these reach ~5): a ring cache adds its keys in
    another order than the full forward."""
    return (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def swa_gpt(arch="llama", n_kv_head=2, layer_types=None, attention="sdpa", window=WINDOW, **config) -> GPT:
    return varied_gpt(
        arch, n_kv_head, attention, block_size=64, sliding_window=window, layer_types=layer_types, **config
    )


def logits_and_grads(model: GPT, attention: str, idx: torch.Tensor):
    model.set_attention(attention)
    model.zero_grad()
    logits, loss = model(idx, idx)
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch,n_kv_head,layer_types", VARIANTS)
def test_paths_agree_with_a_window_shorter_than_the_sequence(arch, n_kv_head, layer_types):
    model = swa_gpt(arch, n_kv_head, layer_types)
    idx = random_ids(batch=3, length=48)
    ref_logits, ref_grads = logits_and_grads(model, "sdpa", idx)
    for attention in ("manual", "einops"):
        logits, grads = logits_and_grads(model, attention, idx)
        assert (logits - ref_logits).abs().max().item() <= 1e-5, attention
        for name, grad in grads.items():
            scale = ref_grads[name].abs().max().item()
            assert (grad - ref_grads[name]).abs().max().item() <= 1e-4 * scale + 1e-12, (attention, name)
    full = GPT(GPTConfig(**{**model.config.to_dict(), "sliding_window": None, "layer_types": None})).eval()
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (full(idx)[0][:, :WINDOW] - ref_logits[:, :WINDOW]).abs().max() <= 1e-5  # within the window: the same
        assert (full(idx)[0][:, WINDOW:] - ref_logits[:, WINDOW:]).abs().max() > 1e-2  # past it: the window bites


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_token_reaches_the_next_window_positions_and_no_further(attention, arch):
    """One layer: the token at j changes the outputs at j .. j + window - 1 (each of them) and none other."""
    config = GPTConfig(
        arch=arch, n_layer=1, n_head=4, n_kv_head=2, n_embd=32, block_size=64, vocab_size=60, attention=attention
    )
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**config.to_dict(), "sliding_window": WINDOW})).eval()
    idx = random_ids(batch=2, length=40)
    j = 13
    changed = idx.clone()
    changed[:, j] = (idx[:, j] + 1) % 60
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[:, :j], b[:, :j])
    assert torch.equal(a[:, j + WINDOW :], b[:, j + WINDOW :])
    for i in range(j, j + WINDOW):
        assert (a[:, i] - b[:, i]).abs().max() > 1e-6, i


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head,layer_types", VARIANTS)
def test_kv_cache_decodes_past_the_window_as_the_full_forward(attention, arch, n_kv_head, layer_types):
    """Prefills shorter and longer than the window, a chunk, then one token at a time to position 60: the logits of
    the full forward; a sliding layer's cache holds its window, a full one every position."""
    model = swa_gpt(arch, n_kv_head, layer_types, attention)
    idx = random_ids(batch=2, length=60)
    with torch.no_grad():
        full = model(idx)[0]
        for prompt in (5, 20):
            cache = model.new_kv_cache(batch_size=2)
            steps = [model(idx[:, :prompt], kv_cache=cache, input_pos=0)[0]]
            steps.append(model(idx[:, prompt : prompt + 3], kv_cache=cache, input_pos=prompt)[0])
            for pos in range(prompt + 3, idx.size(1)):
                steps.append(model(idx[:, pos : pos + 1], kv_cache=cache, input_pos=pos)[0])
            assert close(torch.cat(steps, dim=1), full), prompt
            for layer, types in zip(cache, layer_types or ["sliding_attention"] * 2):
                assert layer.k.size(2) == (WINDOW if types == "sliding_attention" else 64)


@pytest.mark.parametrize("attention", PATHS)
def test_rows_at_their_own_positions_decode_as_each_would_alone_past_the_window(attention):
    """A server's batch: prompts shorter and longer than the window, prefilled alone and copied into the batch's
    cache; a row that leaves is replaced by the last (copy_row within the cache); every row's logits are its own."""
    model = swa_gpt("llama", 2, MIXED, attention)
    g = torch.Generator().manual_seed(4)
    lengths = [3, 12, 20]
    seqs = [torch.randint(0, 60, (n + 14,), generator=g) for n in lengths]
    with torch.no_grad():
        alone = [model(s[None])[0][0] for s in seqs]
        cache = model.new_kv_cache(batch_size=4)
        for row, (s, n) in enumerate(zip(seqs, lengths)):
            one = model.new_kv_cache(batch_size=1, max_len=n)
            model(s[None, :n], kv_cache=one, input_pos=0)
            for layer, source in zip(cache, one):
                layer.copy_row(row, source, 0, n)
        pos, rows = torch.tensor(lengths), [0, 1, 2]
        for step in range(14):
            if step == 7:  # row 0 leaves: the last row moves into its place
                for layer in cache:
                    layer.copy_row(0, layer, 2, int(pos[2]))
                pos, rows = pos[[2, 1]], [2, 1]
            tokens = torch.stack([seqs[r][p : p + 1] for r, p in zip(rows, pos.tolist())])  # (B, 1)
            logits = model(tokens, kv_cache=cache, input_pos=pos)[0]
            for b, (r, p) in enumerate(zip(rows, pos.tolist())):
                assert close(logits[b, 0], alone[r][p]), (r, p)
            pos = pos + 1
    assert cache[0].k.size(2) == WINDOW


@pytest.mark.parametrize("attention", PATHS)
def test_the_static_decode_step_over_a_ring_gives_the_growing_caches_logits(attention):
    """The CUDA graphs' static step (run eagerly here): a sliding layer's static cache is its ring of window slots."""
    model = swa_gpt("llama", 2, MIXED, attention)
    graphs = DecodeGraphs(model, rows=3, capacity=64)
    assert [layer.k.size(2) for layer in graphs.cache] == [WINDOW, 64]
    growing = model.new_kv_cache(2)
    seqs = random_ids(batch=2, length=40)
    lengths = [4, 11]
    with torch.inference_mode():
        for row, n in enumerate(lengths):
            one = model.new_kv_cache(1, max_len=n)
            model(seqs[row : row + 1, :n], kv_cache=one, input_pos=0)
            for layer, static_layer, source in zip(growing, graphs.cache, one):
                layer.copy_row(row, source, 0, n)
                static_layer.copy_row(row, source, 0, n)
        pos = torch.tensor(lengths)
        for _ in range(25):
            idx = torch.stack([seqs[r, p : p + 1] for r, p in enumerate(pos.tolist())])
            expected = model(idx, kv_cache=growing, input_pos=pos)[0][:, -1]
            assert close(graphs(idx, pos), expected)
            pos = pos + 1


@pytest.mark.parametrize("attention", PATHS)
def test_generate_gives_the_same_greedy_ids_with_and_without_the_cache(monkeypatch, attention):
    model = swa_gpt("llama", 2, MIXED, attention)
    idx = random_ids(batch=2, length=5)
    plain = generate(model, idx, 59, temperature=0, use_kv_cache=False)  # up to block_size: one function
    assert len(set(plain[0, 5:].tolist())) > 4
    assert torch.equal(generate(model, idx, 59, temperature=0), plain)
    cached = generate(model, idx, 150, temperature=0)  # past block_size: the cache is re-filled, ring and all
    monkeypatch.setattr(compiled, "uses_graphs", lambda model: True)  # the GPU's static step, eagerly
    assert torch.equal(generate(model, idx, 150, temperature=0, compile=True), cached)


def test_a_chat_past_the_window_replies_as_without_the_cache():
    tok = ChatTokenizer.for_base(CharTokenizer("abcdefghijklmnopqrstuvwxyz \n?0123456789"))
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=96, vocab_size=tok.vocab_size, sliding_window=12)
    model = GPT(config).eval()
    cached, plain = (
        ChatSession(model, tok, "be kind", max_new_tokens=8, temperature=0, use_kv_cache=c) for c in (True, False)
    )
    for turn in [f"turn {t} hello" for t in range(10)]:
        assert cached.reply(turn) == plain.reply(turn)
    assert cached.cache[0].k.size(2) == 12


def test_a_ring_goes_on_only_where_it_holds_what_the_next_query_needs():
    model = swa_gpt("llama", 2)
    idx = random_ids(batch=1, length=30)
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        model(idx[:, :20], kv_cache=cache, input_pos=0)
        assert [cache[0].resumable(p) for p in (0, 10, 18, 19, 20, 21)] == [True, False, False, True, True, False]
        with pytest.raises(ValueError, match="has dropped the positions a query at 10 needs; start again from"):
            model(idx[:, 10:12], kv_cache=cache, input_pos=10)
        with pytest.raises(ValueError, match="has dropped the positions a query at 10 needs"):  # one token too
            model(idx[:, 10:11], kv_cache=cache, input_pos=10)
        # going on from 19 (the last token again) and starting over from 0 both give the full forward's logits
        full = model(idx)[0]
        assert close(model(idx[:, 19:25], kv_cache=cache, input_pos=19)[0], full[:, 19:25])
        assert close(model(idx[:, :3], kv_cache=cache, input_pos=0)[0], full[:, :3])
        assert close(model(idx[:, 3:4], kv_cache=cache, input_pos=3)[0], full[:, 3:4])


def test_a_ring_refuses_a_rows_own_start_it_cannot_go_on_from():
    """input_pos (B,), one start per row, is checked as an int start is: a row rewound past what its ring kept is
    refused, not attended over a ring that has lost its window (wrong logits)."""
    model = swa_gpt("llama", 2, window=8)
    idx = random_ids(batch=2, length=25)
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        model(idx[:, :20], kv_cache=cache, input_pos=0)
        with pytest.raises(ValueError, match=r"has dropped the positions a query at \[10, 20\] needs"):
            model(idx[:, 10:11], kv_cache=cache, input_pos=torch.tensor([10, 20]))
        full = model(idx)[0]  # each row going on from where it stands is as the full forward
        assert close(model(idx[:, 20:21], kv_cache=cache, input_pos=torch.tensor([20, 20]))[0], full[:, 20:21])


def test_sliding_layers_rotate_with_their_own_base():
    """rope_local_base: the sliding layer's q and k rotate with it, the full layer's with rope_base (run by hand)."""
    model = swa_gpt("llama", 2, MIXED, window=64, rope_base=10000.0, rope_local_base=50.0)
    idx = random_ids(batch=2, length=30)
    with torch.no_grad():
        x = model.transformer.wte(idx)
        for block, base in zip(model.transformer.h, (50.0, 10000.0)):
            x = block(x, rope_cache(30, model.config.head_dim, base))
        by_hand = model.head(x)[0]
        assert (model(idx)[0] - by_hand).abs().max() <= 1e-5
        model.rope_local_cos, model.rope_local_sin = model.rope_cos, model.rope_sin  # one base for both: differs
        assert (model(idx)[0] - by_hand).abs().max() > 1e-3


def test_partial_rotary_rotates_the_first_dims_and_passes_the_rest():
    model = varied_gpt("llama", 2, partial_rotary_factor=0.5)  # head_dim 8: 4 rotated
    assert model.rope_cos.shape == (32, 4)
    x = torch.randn(1, 2, 5, 8)
    cos, sin = rope_cache(5, 4)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.allclose(out[..., :4], apply_rope(x[..., :4], cos, sin))
    for attention in ("manual", "einops"):  # every path
        idx = random_ids(batch=2, length=20)
        with torch.no_grad():
            ref = model(idx)[0]
            model.set_attention(attention)
            assert (model(idx)[0] - ref).abs().max() <= 1e-5
            model.set_attention("sdpa")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(sliding_window=0), r"model\.sliding_window: must be a positive integer, got 0"),
        (
            dict(sliding_window=8, layer_types=["sliding_attention"]),
            r"model\.layer_types: needs one entry per layer \(2\), got 1",
        ),
        (
            dict(sliding_window=8, layer_types=["sliding_attention", "local"]),
            r"model\.layer_types: unknown layer type\(s\) local",
        ),
        (dict(layer_types=MIXED), r"model\.layer_types: has sliding_attention layers but sliding_window is unset"),
        (dict(partial_rotary_factor=0.0), r"model\.partial_rotary_factor: must be in \(0, 1\], got 0.0"),
        (dict(partial_rotary_factor=1.5), r"model\.partial_rotary_factor: must be in \(0, 1\], got 1.5"),
        (dict(partial_rotary_factor=0.25, head_dim=12), r"rotates 3 of each head's 12 dims, but RoPE rotates pairs"),
        (dict(partial_rotary_factor=0.05), r"rotates 0 of each head's 8 dims, but RoPE rotates pairs"),
        (dict(arch="gpt", partial_rotary_factor=0.5), r"arch gpt has learned positions, not RoPE"),
        (dict(rope_local_base=1000.0), r"model\.rope_local_base: is the RoPE base of sliding layers"),
        (dict(sliding_window=8, sdpa_backend="flash"), r"model\.sdpa_backend: flash takes no attention mask"),
    ],
)
def test_bad_window_and_rotary_settings_are_one_line_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        GPTConfig(**{"arch": "llama", "n_layer": 2, "n_head": 4, "n_embd": 32, **kw})


@pytest.mark.slow  # torch.compile: tens of seconds on 2 cores
@pytest.mark.skipif(not compiled.compiler_available("cpu"), reason="no C++ compiler for torch.compile")
def test_compiled_decode_past_the_window_gives_the_plain_loops_greedy_ids_and_compiles_once():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = swa_gpt("llama", 2, MIXED)
    idx = random_ids(batch=1, length=5)
    plain = generate(model, idx, 100, temperature=0)  # past the window and block_size (refills)
    counters.clear()
    assert torch.equal(generate(model, idx, 100, temperature=0, compile=True), plain)
    # the ring's step is one graph for every position, as the full cache's is (and one for the step that fills it)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_flops_per_token_counts_a_sliding_layers_attention_over_its_window():
    """PaLM's count (GPT.flops_per_token and LoRA's training_flops_per_token): a query reads seq_len keys, on a
    sliding layer at most its window; the two sliding layers of three here save 12 * heads * head_dim per key."""
    from minigpt.core.lora import LoRAConfig, lora_model, training_flops_per_token

    full = GPT(GPTConfig(arch="llama", n_layer=3, n_head=4, n_kv_head=2, n_embd=64, block_size=64, vocab_size=100))
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    swa = GPT(GPTConfig(**{**full.config.to_dict(), "sliding_window": 8, "layer_types": types}))
    per_key = 12 * 4 * 16
    n_matmul = sum(m.weight.numel() for m in swa.modules() if isinstance(m, torch.nn.Linear))
    assert swa.flops_per_token(64) == 6 * n_matmul + per_key * (8 + 64 + 8)  # window, whole sequence, window
    for T in (4, 8, 40, 64):
        saved = 2 * per_key * max(0, T - 8)
        assert full.flops_per_token(T) - swa.flops_per_token(T) == saved
        lora = [lora_model(m, m.config, LoRAConfig(rank=2)) for m in (full, swa)]
        assert training_flops_per_token(lora[0], T) - training_flops_per_token(lora[1], T) == saved
