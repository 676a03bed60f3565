"""Sliding-window attention on the GPU (issue 45): the three paths equal in float32 with a window shorter than the
sequence (sdpa through its masked kernels: efficient and math), KV-cache decoding past the window equal to the full
forward, and CUDA-graph decoding over a sliding layer's static ring giving the eager loop's greedy ids; each also
with Gemma 3's block options (GeGLU, post norms, scaled embeddings, attn_scale_dim, q/k norms, a local RoPE base).
Skipped without CUDA (tests/core/test_sliding_window.py runs the same checks on the CPU)."""

from __future__ import annotations

import pytest
import torch

import minigpt.core.compiled as compiled
from minigpt import GPT, GPTConfig
from minigpt.core.generation import generate
from support import random_ids, varied_gpt

PATHS = ("sdpa", "manual", "einops")
MIXED = ["sliding_attention", "full_attention"]
GEMMA = dict(mlp="geglu", gelu_approximate="tanh", post_norms=True, scale_embeddings=True, qk_norm=True)
VARIANTS = {"llama": {}, "gemma": GEMMA | dict(attn_scale_dim=20, rope_local_base=100.0)}


def gpu_model(device: torch.device, **config) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        arch="llama",
        n_kv_head=2,
        n_layer=2,
        n_head=8,
        n_embd=256,
        block_size=256,
        vocab_size=512,
        sliding_window=32,
        layer_types=MIXED,
        **config,
    )
    return GPT(cfg).to(device).eval()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("sdpa_backend", [None, "efficient", "math"])
def test_the_three_paths_agree_with_a_window_in_float32(cuda, sdpa_backend, variant):
    model = gpu_model(cuda, sdpa_backend=sdpa_backend, **VARIANTS[variant])
    ids = torch.randint(0, 512, (4, 257), generator=torch.Generator().manual_seed(1)).to(cuda)
    idx, targets = ids[:, :-1], ids[:, 1:]
    out = {}
    for path in PATHS:
        model.set_attention(path)
        model.zero_grad(set_to_none=True)
        logits, loss = model(idx, targets)
        loss.backward()
        out[path] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    ref, ref_grads = out["sdpa"]
    for path in ("manual", "einops"):
        logits, grads = out[path]
        assert (logits - ref).abs().max().item() <= 1e-5, path
        for name, g in ref_grads.items():
            assert (grads[name] - g).abs().max().item() <= 1e-4 * (g.abs().max().item() + 1e-12), (path, name)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", PATHS)
def test_kv_cache_decoding_past_the_window_equals_the_full_forward(cuda, path, variant):
    model = gpu_model(cuda, attention=path, **VARIANTS[variant])
    idx = torch.randint(0, 512, (2, 120), generator=torch.Generator().manual_seed(2)).to(cuda)
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_kv_cache(2)
        steps = [model(idx[:, :40], kv_cache=cache, input_pos=0)[0]]  # a prefill longer than the window
        steps += [model(idx[:, p : p + 1], kv_cache=cache, input_pos=p)[0] for p in range(40, 120)]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5 * max(1.0, full.abs().max().item())
    assert [layer.k.size(2) for layer in cache] == [32, 160]  # the ring holds its window; the full layer grows


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attention", PATHS)
def test_graph_replays_over_a_ring_give_the_eager_loops_greedy_ids(monkeypatch, attention, variant):
    """The eager step captured over the static cache (a ring of 8 slots for the sliding layer), past the window and
    past block_size (refills)."""
    monkeypatch.setattr(compiled, "compiler_available", lambda device_type="cpu": False)
    # Gemma's: untied and its gains drawn, so that greedy text varies (its normalised sublayers and scaled embedding
    # otherwise repeat one token)
    extra = dict(tie_embeddings=False) if variant == "gemma" else {}
    model = varied_gpt("llama", 2, attention, sliding_window=8, layer_types=MIXED, **VARIANTS[variant], **extra)
    if variant == "gemma":
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.normal_(1, 0.5, generator=torch.Generator().manual_seed(3))
    model = model.cuda()
    idx = random_ids().cuda()
    eager = generate(model, idx, 64, temperature=0)
    assert len(set(eager[0, 5:].tolist())) > 4
    assert torch.equal(generate(model, idx, 64, temperature=0, compile=True), eager)
    graphs = compiled.decode_graphs(model, 2, 32)
    assert list(graphs.graphs) == [2]  # captured, not fallen back to eager
    assert [layer.k.size(2) for layer in graphs.cache] == [8, 32]
