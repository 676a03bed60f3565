"""The three attention paths on the GPU: equal in float32 (logits, gradients, KV-cache decoding), close under bf16
autocast, and the training step inside the flash kernel, GQA included (the CPU's float32 checks are
tests/core/test_model.py's)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from minigpt import GPT, GPTConfig

PATHS = ("sdpa", "manual", "einops")
# (arch, n_kv_head) over 8 heads of 32: multi-head, grouped-query, and one key/value head
BLOCKS = [("gpt", 8), ("gpt", 2), ("llama", 2), ("llama", 1)]


def gpu_model(arch: str, n_kv_head: int, device: torch.device, **config) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        arch=arch, n_kv_head=n_kv_head, n_layer=2, n_head=8, n_embd=256, block_size=256, vocab_size=512, **config
    )
    model = GPT(cfg)
    with torch.no_grad():  # biases start at zero; randomise them so they flow through every path too
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    return model.to(device).eval()


def batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (4, 257), generator=torch.Generator().manual_seed(1)).to(device)
    return ids[:, :-1], ids[:, 1:]  # (B, T) inputs and targets


def forward_backward(model: GPT, attention: str, idx, targets, autocast: torch.dtype | None = None):
    """(logits as float32, {name: gradient}) of one training step's forward and backward through `attention`."""
    model.set_attention(attention)
    model.zero_grad(set_to_none=True)
    with torch.autocast(idx.device.type, dtype=autocast, enabled=autocast is not None):
        logits, loss = model(idx, targets)
    loss.backward()
    return logits.detach().float(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch, n_kv_head", BLOCKS)
def test_the_three_paths_give_the_same_logits_and_gradients_in_float32(cuda, arch, n_kv_head):
    model = gpu_model(arch, n_kv_head, cuda)
    idx, targets = batch(cuda)
    ref, ref_grads = forward_backward(model, "sdpa", idx, targets)
    for path in ("manual", "einops"):
        logits, grads = forward_backward(model, path, idx, targets)
        assert (logits - ref).abs().max().item() <= 1e-5, path
        for name, g in ref_grads.items():  # relative to the gradient's scale, as tests/core/test_model.py
            assert (grads[name] - g).abs().max().item() <= 1e-4 * (g.abs().max().item() + 1e-12), (path, name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch, n_kv_head", [("gpt", 8), ("llama", 2)])
def test_kv_cache_decoding_equals_the_full_forward(cuda, arch, n_kv_head, path):
    model = gpu_model(arch, n_kv_head, cuda, attention=path)
    idx, _ = batch(cuda)
    with torch.no_grad():
        full = model(idx[:2])[0]  # (2, T, vocab)
        cache = model.new_kv_cache(2)
        steps = [model(idx[:2, :17], kv_cache=cache, input_pos=0)[0]]  # a 17-token prefill, then one at a time
        steps += [model(idx[:2, p : p + 1], kv_cache=cache, input_pos=p)[0] for p in range(17, 40)]
    assert (torch.cat(steps, 1) - full[:, :40]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch, n_kv_head", BLOCKS)
def test_every_path_under_bf16_autocast_stays_close_to_float32(cuda, arch, n_kv_head):
    model = gpu_model(arch, n_kv_head, cuda)
    idx, targets = batch(cuda)
    ref32, _ = forward_backward(model, "sdpa", idx, targets)
    scale = ref32.abs().max().item()
    out = {p: forward_backward(model, p, idx, targets, torch.bfloat16)[0] for p in PATHS}
    for path, logits in out.items():  # bf16 keeps 8 bits of mantissa, through two layers: 5 % of the scale
        assert (logits - ref32).abs().max().item() <= 0.05 * scale, path
        assert (logits - out["sdpa"]).abs().max().item() <= 0.05 * scale, path


@pytest.mark.parametrize("arch, n_kv_head", BLOCKS)
def test_the_training_step_runs_in_the_flash_kernel(cuda, arch, n_kv_head):
    """Forward (is_causal, no mask) and backward with sdpa restricted to FLASH_ATTENTION, GQA included, and the
    config's own switch sdpa_backend="flash"."""
    model = gpu_model(arch, n_kv_head, cuda)
    idx, targets = batch(cuda)
    ref, _ = forward_backward(model, "manual", idx, targets, torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        logits, _ = forward_backward(model, "sdpa", idx, targets, torch.bfloat16)
    assert (logits - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    flash = gpu_model(arch, n_kv_head, cuda, sdpa_backend="flash")
    logits, grads = forward_backward(flash, "sdpa", idx, targets, torch.bfloat16)
    assert torch.isfinite(logits).all() and all(torch.isfinite(g).all() for g in grads.values())
