"""The model: three attention paths compute one function; RoPE, GQA, KV cache, activation checkpointing and bad
configs."""

import math

import pytest
import torch

import minigpt.core.model as model_module
from minigpt import GPT, ConfigError, GPTConfig
from minigpt.core.compiled import compiler_available
from minigpt.core.model import Block, apply_rope, rope_cache

PATHS = ["sdpa", "manual", "einops"]
# (arch, n_kv_head): both blocks, GQA off (n_kv_head == n_head == 4), GQA on (2) and multi-query (1)
VARIANTS = [("gpt", 4), ("gpt", 2), ("llama", 4), ("llama", 2), ("llama", 1)]


def tiny(arch: str = "gpt", n_kv_head: int = 4, **kw) -> GPTConfig:
    return GPTConfig.from_name("tiny", arch=arch, n_kv_head=n_kv_head, **kw)


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    # biases start at zero; randomise them so the test also sees them flow through every path
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    return model.eval()


def run_path(model: GPT, attention: str, idx: torch.Tensor, targets: torch.Tensor):
    model.set_attention(attention)
    model.zero_grad()
    logits, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


@pytest.mark.parametrize("arch,n_kv_head", [("gpt", 4), ("llama", 2)])
def test_paths_agree_in_float64_to_float64s_precision(arch, n_kv_head):
    """The manual and einops softmax is float32 at least, not at most: a float64 model stays float64 throughout."""
    model = build(tiny(arch, n_kv_head)).double()
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    ref = model(idx)[0]
    for attention in ["manual", "einops"]:
        model.set_attention(attention)
        assert (model(idx)[0] - ref).abs().max().item() < 1e-12, attention


def test_a_float64_models_loss_is_float64():
    """The loss was taken in float32 whatever the logits: a float64 gradient check stopped at float32's precision."""
    model = build(tiny("llama", 2)).double()
    idx, targets = torch.randint(0, 256, (2, 2, 16), generator=torch.Generator().manual_seed(4))
    targets[0, :5] = -1  # not scored (a prompt's positions)
    logits, loss = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
    assert loss.dtype == torch.float64 and (loss - expected).abs().item() < 1e-14


def test_a_model_keeps_its_own_config():
    """Two models built from one config: switching one's attention path left the other's config naming the new path
    while its layers ran the old one (and a checkpoint of it recorded the wrong path)."""
    cfg = tiny()
    a, b = GPT(cfg), GPT(cfg)
    a.set_attention("manual")
    assert (a.config.attention, b.config.attention, cfg.attention) == ("manual", "sdpa", "sdpa")
    assert {block.attn.attention for block in b.transformer.h} == {"sdpa"}


@pytest.mark.parametrize("arch,n_kv_head", VARIANTS)
def test_paths_agree_forward_and_backward(arch, n_kv_head):
    model = build(tiny(arch, n_kv_head))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (3, 64), generator=g)
    targets = torch.randint(0, 256, (3, 64), generator=g)
    ref_logits, ref_grads = run_path(model, "sdpa", idx, targets)
    for attention in ["manual", "einops"]:
        logits, grads = run_path(model, attention, idx, targets)
        assert (logits - ref_logits).abs().max().item() <= 1e-5, attention
        for name, grad in grads.items():
            scale = ref_grads[name].abs().max().item()
            assert (grad - ref_grads[name]).abs().max().item() <= 1e-4 * scale + 1e-12, (attention, name)


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head", [("gpt", 4), ("llama", 2)])
def test_causal_future_tokens_never_change_the_past(attention, arch, n_kv_head):
    model = build(tiny(arch, n_kv_head, attention=attention))
    idx = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    t = 20
    changed[:, t + 1 :] = torch.randint(0, 256, changed[:, t + 1 :].shape)
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the test can see a change when there is one


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head", VARIANTS)
def test_kv_cache_matches_full_forward(attention, arch, n_kv_head):
    model = build(tiny(arch, n_kv_head, attention=attention))
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_kv_cache(batch_size=2)
        prompt = 17
        steps = [model(idx[:, :prompt], kv_cache=cache, input_pos=0)[0]]  # prefill
        steps += [model(idx[:, prompt : prompt + 5], kv_cache=cache, input_pos=prompt)[0]]  # a chunk mid-way
        for pos in range(prompt + 5, idx.size(1)):  # then one token at a time
            steps.append(model(idx[:, pos : pos + 1], kv_cache=cache, input_pos=pos)[0])
    incremental = torch.cat(steps, dim=1)
    assert (incremental - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head", VARIANTS)
def test_rows_at_their_own_positions_decode_as_each_would_alone(attention, arch, n_kv_head):
    """input_pos as a (B,) tensor: a server's batch, each row at its own length, prefilled one by one into a cache
    with more rows than the batch uses; every row's logits are those of its sequence run alone."""
    model = build(tiny(arch, n_kv_head, attention=attention))
    g = torch.Generator().manual_seed(4)
    lengths = [9, 3, 14]
    seqs = [torch.randint(0, 256, (n + 7,), generator=g) for n in lengths]
    with torch.no_grad():
        alone = [model(s[None])[0][0] for s in seqs]  # (T, vocab) each
        cache = model.new_kv_cache(batch_size=4)
        for row, (s, n) in enumerate(zip(seqs, lengths)):
            one = model.new_kv_cache(batch_size=1)
            model(s[None, :n], kv_cache=one, input_pos=0)
            for layer, source in zip(cache, one):
                layer.copy_row(row, source, 0, n)
        pos = torch.tensor(lengths)
        for width in (2, 1, 1, 1, 1, 1):  # two tokens per row, then one at a time
            idx = torch.stack([s[p : p + width] for s, p in zip(seqs, pos.tolist())])  # (B, width)
            logits = model(idx, kv_cache=cache, input_pos=pos)[0]
            for row, p in enumerate(pos.tolist()):
                assert (logits[row] - alone[row][p : p + width]).abs().max().item() <= 1e-5, (row, p)
            pos = pos + width


def test_kv_cache_holds_what_is_used_not_the_whole_context():
    """Eight positions of a long-context model cache eight positions' keys, growing by doubling up to block_size."""
    model = build(
        GPTConfig(arch="llama", n_layer=1, n_head=2, n_kv_head=1, n_embd=16, block_size=1 << 14, vocab_size=256)
    )
    cache = model.new_kv_cache(batch_size=1)
    assert cache[0].k.size(2) == 0
    idx = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        model(idx[:, :5], kv_cache=cache, input_pos=0)
        assert cache[0].k.size(2) == 5
        for pos in range(5, 8):
            model(idx[:, pos : pos + 1], kv_cache=cache, input_pos=pos)
    assert cache[0].k.size(2) == cache[0].v.size(2) == 10  # 5, then doubled once: not 16384
    small = model.new_kv_cache(batch_size=1, max_len=6)
    with torch.no_grad():
        model(idx[:, :5], kv_cache=small, input_pos=0)
        model(idx[:, 5:6], kv_cache=small, input_pos=5)
        assert small[0].k.size(2) == 6  # doubling stops at max_len
        with pytest.raises(ValueError, match="holds 6 positions"):
            model(idx[:, 6:7], kv_cache=small, input_pos=6)


def test_gqa_equals_mha_with_repeated_kv():
    """A GQA model equals a plain multi-head model whose K/V projections repeat each shared head."""
    gqa = build(tiny("llama", n_kv_head=2))
    mha = build(tiny("llama", n_kv_head=4), seed=123)
    hs, nh, nkv = gqa.config.head_dim, 4, 2
    state = gqa.state_dict()
    for i in range(gqa.config.n_layer):
        w = state[f"transformer.h.{i}.attn.c_attn.weight"]  # (nh*hs + 2*nkv*hs, C)
        q, k, v = w.split([nh * hs, nkv * hs, nkv * hs])
        rep = lambda t: t.view(nkv, hs, -1).repeat_interleave(nh // nkv, dim=0).reshape(nh * hs, -1)  # noqa: E731
        state[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([q, rep(k), rep(v)])
    mha.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 32))
    for attention in PATHS:
        gqa.set_attention(attention)
        mha.set_attention(attention)
        with torch.no_grad():
            assert (gqa(idx)[0] - mha(idx)[0]).abs().max().item() <= 1e-5


def test_the_efficient_kernel_gets_gqa_keys_and_values_copied_per_query_head(monkeypatch):
    """torch 2.11's memory-efficient SDPA kernel takes no GQA ("No available kernel" with enable_gqa): a model held
    to it gives the kernel one K/V head per query head, and the same outputs (the kernel itself needs CUDA: the
    call is checked here, run by the math kernel)."""
    model = build(tiny("llama", n_kv_head=2))
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = model(idx)[0]
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.size(1), k.size(1), v.size(1), kwargs["enable_gqa"]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setitem(model_module.SDPA_BACKEND, "efficient", model_module.SDPBackend.MATH)
    for block in model.transformer.h:
        block.attn.sdpa_backend = "efficient"
    with torch.no_grad():
        got = model(idx)[0]
    assert seen and all(s == (4, 4, 4, False) for s in seen)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_rope_matches_complex_rotation():
    T, hs, base = 12, 8, 500.0
    x = torch.randn(2, 3, T, hs)
    cos, sin = rope_cache(T, hs, base)
    ours = apply_rope(x, cos, sin)
    # independent formula: pair (x_j, x_{j+hs/2}) as the complex number x_j + i x_{j+hs/2}, times e^{i pos theta_j}
    half = hs // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / hs)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta[None, :]
    zr = z * torch.polar(torch.ones_like(angle), angle)
    expected = torch.cat([zr.real, zr.imag], dim=-1).float()
    assert (ours - expected).abs().max().item() < 1e-5
    # and what RoPE is for: q.k depends on the distance between positions only
    q, k = torch.randn(hs), torch.randn(hs)
    cos, sin = rope_cache(64, hs)
    rot = lambda v, p: apply_rope(v.view(1, 1, 1, hs), cos[p : p + 1], sin[p : p + 1]).flatten()  # noqa: E731
    assert torch.allclose(rot(q, 10) @ rot(k, 3), rot(q, 40) @ rot(k, 33), atol=1e-5)


def test_gpt2_preset_has_gpt2_parameter_count():
    assert GPT(GPTConfig.from_name("gpt2")).num_params() == 124_439_808


@pytest.mark.parametrize("arch,tie", [("gpt", True), ("gpt", False), ("llama", True), ("llama", False)])
def test_flops_per_token_matches_torch_flop_counter(arch, tie):
    """6N + 12*L*H*hs*T against what torch counts for one forward + backward (manual attention, whose two
    matmuls the counter sees; the causal half is not subtracted, as in PaLM / nanoGPT)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = GPTConfig(
        arch=arch,
        n_layer=2,
        n_head=4,
        n_kv_head=2 if arch == "llama" else None,
        n_embd=64,
        block_size=32,
        vocab_size=100,
        tie_embeddings=tie,
        attention="manual",
    )
    model = GPT(cfg)
    B, T = 3, cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    assert model.flops_per_token(T) * B * T == counter.get_total_flops()


def test_checkpoint_moves_between_paths_and_has_no_mask():
    a = build(tiny("llama", 2, attention="sdpa"))
    state = a.state_dict()
    assert not any("causal_mask" in k or "rope" in k for k in state)
    b = GPT(tiny("llama", 2, attention="einops")).eval()
    b.load_state_dict(state, strict=True)
    idx = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        assert (a(idx)[0] - b(idx)[0]).abs().max().item() <= 1e-5


def test_attention_weights_for_inspection():
    model = build(tiny("llama", 2))
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 10, model.config.n_embd)
    rope = (model.rope_cos[:10], model.rope_sin[:10])
    attn.attention = "manual"
    y_manual, w_manual = attn(x, rope, return_weights=True)
    attn.attention = "einops"
    y_einops, w_einops = attn(x, rope, return_weights=True)
    assert w_manual.shape == (2, 4, 10, 10)
    assert torch.allclose(w_manual, w_einops, atol=1e-6) and torch.allclose(y_manual, y_einops, atol=1e-6)
    assert torch.allclose(w_manual.sum(-1), torch.ones(2, 4, 10), atol=1e-6)
    assert torch.all(w_manual.triu(diagonal=1) == 0)  # causal: nothing above the diagonal
    attn.attention = "sdpa"
    with pytest.raises(ValueError, match="not available from the 'sdpa' path"):
        attn(x, rope, return_weights=True)


def test_model_attention_weights_from_any_path():
    """GPT.attention_weights forms every layer's weights through the manual path and leaves the model as it was."""
    model = build(tiny("llama", 2, attention="sdpa")).train()
    idx = torch.randint(0, 256, (2, 12))
    weights = model.attention_weights(idx)
    assert weights.shape == (2, 2, 4, 12, 12)  # (L, B, nh, T, T)
    assert model.config.attention == "sdpa" and model.transformer.h[0].attn.attention == "sdpa" and model.training
    # layer 0 by hand: its input is the token embedding (dropout is off in eval)
    with torch.no_grad():
        x = model.transformer.h[0].ln_1(model.transformer.wte(idx))
        attn = model.transformer.h[0].attn
        attn.attention = "manual"
        _, w0 = attn(x, (model.rope_cos[:12], model.rope_sin[:12]), return_weights=True)
        attn.attention = "sdpa"
    assert torch.allclose(weights[0], w0, atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 2, 4, 12), atol=1e-5)
    assert torch.all(weights.triu(diagonal=1) == 0)


@pytest.mark.parametrize("input_pos", [3, torch.tensor([3])])
def test_input_pos_without_a_cache_is_a_clear_error(input_pos):
    """Positions after a cached prefix mean nothing without the cache: the manual path's mask would let every query
    see idx's last token (and sdpa's would not)."""
    model = GPT(tiny(attention="manual"))
    with pytest.raises(ValueError, match="input_pos needs kv_cache"):
        model(torch.zeros(1, 4, dtype=torch.long), input_pos=input_pos)
    with pytest.raises(ValueError, match="input_pos must be >= 0, got -1"):
        model(torch.zeros(1, 1, dtype=torch.long), kv_cache=model.new_kv_cache(1), input_pos=-1)


def test_a_refused_attention_path_leaves_the_model_as_it_was():
    model = GPT(tiny())
    with pytest.raises(ConfigError, match="model.attention: unknown value 'flash'"):
        model.set_attention("flash")
    assert model.config.attention == "sdpa" and GPT(model.config).config.attention == "sdpa"


def test_sequence_longer_than_block_size_is_a_clear_error():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="longer than block_size=64; crop it"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(n_embd=66, n_head=4), r"model\.n_embd: 66 is not divisible by n_head=4"),
        (dict(n_head=6, n_kv_head=4, n_embd=48), r"model\.n_kv_head: n_head=6 is not divisible by n_kv_head=4"),
        (dict(arch="mamba"), r"model\.arch: unknown value 'mamba'; choose one of gpt, llama"),
        (dict(attention="flash2"), r"model\.attention: unknown value 'flash2'; choose one of sdpa, manual, einops"),
        (dict(arch="llama", n_embd=36, n_head=4), r"model\.head_dim: head size 9 is odd but RoPE"),
        (dict(n_layer=0), r"model\.n_layer: must be a positive integer"),
        (dict(dropout="0.1"), r"model\.dropout: must be a number, got '0\.1'; write it unquoted"),
        (dict(tie_embeddings="false"), r"model\.tie_embeddings: must be true or false, got 'false'"),
        (dict(bias=0), r"model\.bias: must be true or false, got 0"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), r"model\.rope_scaling: arch gpt has learned"),
    ],
)
def test_bad_config_names_field_and_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        GPTConfig(**kw)


def test_presets_build_and_overrides_rederive_defaults():
    cfg = GPTConfig.from_name("llama-small", n_head=8, n_kv_head=None, n_embd=256)
    assert cfg.n_kv_head == 8 and cfg.mlp == "swiglu" and cfg.bias is False
    assert cfg.mlp_hidden == math.ceil(8 * 256 / 3 / 64) * 64
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        GPTConfig.from_name("huge")


def test_llama3_rope_scaling_follows_its_three_bands():
    """Llama 3.1's scaling, checked frequency by frequency against the rule written out by hand."""
    hs, base = 64, 500000.0
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    cos, sin = rope_cache(3, hs, base, scaling)
    got = torch.atan2(sin[1, : hs // 2], cos[1, : hs // 2]).double()  # position 1: the angle is the frequency
    for j, freq in enumerate(base ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)):
        wavelen = 2 * math.pi / freq
        if wavelen < 64 / 4.0:  # short wavelengths: unchanged
            want = freq
        elif wavelen > 64 / 1.0:  # long ones: stretched by factor
            want = freq / 8.0
        else:  # in between: linear in context / wavelen
            s = (64 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - s) * freq / 8.0 + s * freq
        assert got[j].item() == pytest.approx(want.item(), rel=1e-5), j
    with pytest.raises(ConfigError, match="unsupported RoPE scaling 'yarn'"):
        tiny("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_rope_scaling_older_type_key_is_read_as_rope_type():
    """transformers' older `type` key names the kind as rope_type does: the same RoPE tables, for each kind."""
    longrope = dict(short_factor=[1.0, 2.0, 4.0, 8.0], long_factor=[2.0] * 4, original_max_position_embeddings=64)
    for kind, rest in (
        ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
        ("longrope", {**longrope, "attention_factor": 1.2}),
    ):
        old, new = (build(tiny("llama", head_dim=8, rope_scaling={key: kind, **rest})) for key in ("type", "rope_type"))
        assert old.config.rope_scaling == new.config.rope_scaling
        assert torch.equal(old.rope_cos, new.rope_cos) and torch.equal(old.rope_sin, new.rope_sin), kind


def test_explicit_head_dim_and_tanh_gelu_run_on_every_path():
    cfg = tiny("llama", 2, head_dim=24)  # 4 heads x 24 = 96, wider than n_embd=64 (as some imports are)
    model = build(cfg)
    assert model.transformer.h[0].attn.c_attn.weight.shape == ((4 + 2 * 2) * 24, 64)
    idx = torch.randint(0, 256, (2, 20))
    outs = []
    for attention in PATHS:
        model.set_attention(attention)
        with torch.no_grad():
            outs.append(model(idx)[0])
    assert all((o - outs[0]).abs().max().item() < 1e-5 for o in outs)
    gelu = build(tiny("gpt", gelu_approximate="tanh"))
    x = torch.randn(3, 64)
    h = gelu.transformer.h[0].mlp.c_fc(x)
    expected = gelu.transformer.h[0].mlp.c_proj(
        0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    )
    assert torch.allclose(gelu.transformer.h[0].mlp(x), expected, atol=1e-6)


def test_causal_mask_costs_nothing_per_layer_at_long_context():
    """A 131k-context import must not hold n_layer x block_size^2 mask bytes (it would be 17 GB per layer)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(arch="llama", n_layer=2, n_head=2, n_embd=16, block_size=131072, vocab_size=8))
    assert not [name for name, b in model.named_buffers() if b.dim() == 2 and b.size(0) == b.size(1)]


def train_step(model: GPT, idx: torch.Tensor, seed: int = 0):
    """One loss and backward; the seed fixes dropout's masks, so two runs draw the same ones."""
    model.zero_grad()
    torch.manual_seed(seed)
    _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head,dropout", [("gpt", 4, 0.0), ("llama", 2, 0.0), ("llama", 2, 0.1)])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(attention, arch, n_kv_head, dropout):
    """Recomputing the blocks in the backward changes memory, not the function: the same loss and every gradient
    (with dropout too: the recompute draws the masks the forward drew)."""
    model = build(tiny(arch, n_kv_head, attention=attention, dropout=dropout)).train()
    idx = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads = train_step(model, idx)
    model.config.activation_checkpointing = True
    loss, grads = train_step(model, idx)
    assert (loss - ref_loss).abs().item() <= 1e-6
    assert grads.keys() == ref_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        assert (grad - ref_grads[name]).abs().max().item() <= 1e-6 * scale + 1e-12, name


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_activation_checkpointing_recomputes_the_blocks_and_keeps_less_for_the_backward(arch, monkeypatch):
    """On: each block runs again in the backward, and autograd keeps a fraction of the tensors (only the blocks'
    inputs, the embeddings' and the head's). Off, in eval mode or without grad: each block runs once."""
    calls = []
    forward = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, *a, **kw: calls.append(1) or forward(self, *a, **kw))
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(4))

    def run(model: GPT) -> tuple[int, int, int]:
        """(block calls in the forward, in the backward, bytes autograd saved for the backward)"""
        saved = []
        calls.clear()
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            _, loss = model(idx, idx)
        forward_calls = len(calls)
        loss.backward()
        return forward_calls, len(calls) - forward_calls, sum(saved)

    model = build(tiny(arch, n_layer=3)).train()
    _, off_backward, off_bytes = run(model)
    model.config.activation_checkpointing = True
    on_forward, on_backward, on_bytes = run(model)
    assert (off_backward, on_forward, on_backward) == (0, 3, 3)
    assert on_bytes < off_bytes / 3, (on_bytes, off_bytes)
    assert run(model.eval())[1] == 0  # evaluation never recomputes (nor does a no-grad forward: nothing to save)
    with torch.no_grad():
        calls.clear()
        model.train()(idx)
    assert len(calls) == 3


@pytest.mark.slow  # torch.compile: tens of seconds on 2 cores
@pytest.mark.skipif(not compiler_available("cpu"), reason="no C++ compiler for torch.compile")
def test_activation_checkpointing_compiles_to_the_same_gradients():
    """--compile true with --model.activation_checkpointing true: torch.compile traces the recompute."""
    model = build(tiny("llama", 2, activation_checkpointing=True)).train()
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(6))
    ref_loss, ref_grads = train_step(model, idx)
    model.compile()
    loss, grads = train_step(model, idx)
    assert (loss - ref_loss).abs().item() <= 1e-5
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        assert (grad - ref_grads[name]).abs().max().item() <= 1e-4 * scale + 1e-12, name
