"""Sliding-window attention and partial rotary against transformers' own models (issue 45): Mistral with a window
shorter than the sequence and Phi-3 with partial rotary (and a window), built from their configs with random weights
and copied into minigpt by hand, give the same float32 logits on every attention path, the same greedy ids as
transformers' generate past the window, and the same rotated q and k."""

from __future__ import annotations

import pytest
import torch

from minigpt import GPT, GPTConfig
from minigpt.core.generation import generate
from minigpt.core.model import apply_rope, rope_cache

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

PATHS = ["sdpa", "manual", "einops"]
VOCAB, WIDTH, HEADS, KV_HEADS, HIDDEN, LAYERS, CONTEXT = 256, 64, 4, 2, 96, 2, 64
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=WIDTH,
    intermediate_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=CONTEXT,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def random_hf(cls, config, std: float = 0.2):
    """transformers' model with every weight drawn at `std` (norm gains too): a tensor copied to the wrong place
    would change the logits far past the tolerance."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model


def ours_from(hf_model, **config) -> GPT:
    """A minigpt model holding hf_model's weights, mapped by hand: Llama names, with Phi-3's fused qkv_proj and
    gate_up_proj already in minigpt's layout (q, k, v rows; gate, up rows)."""
    c = hf_model.config
    model = GPT(
        GPTConfig(
            arch="llama",
            n_layer=LAYERS,
            n_head=HEADS,
            n_kv_head=KV_HEADS,
            n_embd=WIDTH,
            mlp_hidden=HIDDEN,
            block_size=CONTEXT,
            vocab_size=VOCAB,
            norm_eps=c.rms_norm_eps,
            rope_base=c.rope_parameters["rope_theta"],
            tie_embeddings=False,
            **config,
        )
    )
    hf = hf_model.state_dict()
    state = {
        "transformer.wte.weight": hf["model.embed_tokens.weight"],
        "transformer.ln_f.weight": hf["model.norm.weight"],
        "lm_head.weight": hf["lm_head.weight"],
    }
    for i in range(LAYERS):
        h, o = f"model.layers.{i}.", f"transformer.h.{i}."
        fused = h + "self_attn.qkv_proj.weight"
        state[o + "attn.c_attn.weight"] = (
            hf[fused] if fused in hf else torch.cat([hf[h + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        )
        fused = h + "mlp.gate_up_proj.weight"
        state[o + "mlp.c_fc.weight"] = (
            hf[fused] if fused in hf else torch.cat([hf[h + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])
        )
        state[o + "attn.c_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        state[o + "mlp.c_proj.weight"] = hf[h + "mlp.down_proj.weight"]
        state[o + "ln_1.weight"] = hf[h + "input_layernorm.weight"]
        state[o + "ln_2.weight"] = hf[h + "post_attention_layernorm.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def ids(batch: int = 2, length: int = 48) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def assert_same_logits_on_every_path(ours: GPT, hf_model, idx: torch.Tensor) -> None:
    with torch.no_grad():
        want = hf_model(idx).logits
        for attention in PATHS:
            ours.set_attention(attention)
            got = ours(idx)[0]
            assert (got - want).abs().max().item() < 1e-5, attention


def test_mistral_with_a_window_shorter_than_the_sequence_gives_transformers_logits_and_greedy_ids():
    hf_model = random_hf(transformers.MistralForCausalLM, transformers.MistralConfig(sliding_window=16, **SMALL))
    ours = ours_from(hf_model, sliding_window=16)
    idx = ids()
    assert_same_logits_on_every_path(ours, hf_model, idx)
    unwindowed = ours_from(hf_model)  # the same weights with full attention: the window is what made them equal
    with torch.no_grad():
        assert (unwindowed(idx)[0] - hf_model(idx).logits).abs().max().item() > 1e-2
    prompt = idx[:, :8]
    with torch.no_grad():  # 8 + 32 positions: decoding runs past the window through both libraries' caches
        want = hf_model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    got = generate(ours, prompt, 32, temperature=0)
    assert len(set(want[0, 8:].tolist())) > 4
    assert torch.equal(got, want)


def test_phi3_partial_rotary_rotates_q_and_k_as_transformers_does():
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = transformers.Phi3Config(partial_rotary_factor=0.5, rope_theta=500.0, **SMALL)  # head_dim 16: 8 rotate
    q, k = torch.randn(2, HEADS, 20, 16), torch.randn(2, KV_HEADS, 20, 16)
    position_ids = torch.arange(20)[None].expand(2, -1)
    cos, sin = Phi3RotaryEmbedding(config)(q, position_ids)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours = GPTConfig(arch="llama", n_head=HEADS, n_kv_head=KV_HEADS, n_embd=WIDTH, partial_rotary_factor=0.5)
    assert ours.rotary_dim == 8
    cos, sin = rope_cache(20, ours.rotary_dim, 500.0)
    assert (apply_rope(q, cos, sin) - want_q).abs().max().item() < 1e-6
    assert (apply_rope(k, cos, sin) - want_k).abs().max().item() < 1e-6
    assert torch.equal(apply_rope(q, cos, sin)[..., 8:], q[..., 8:])  # the rest passes through


@pytest.mark.parametrize("window", [None, 12])
def test_phi3_with_partial_rotary_gives_transformers_logits_and_greedy_ids(window):
    hf_model = random_hf(
        transformers.Phi3ForCausalLM,
        transformers.Phi3Config(partial_rotary_factor=0.5, sliding_window=window, **SMALL),
    )
    ours = ours_from(hf_model, partial_rotary_factor=0.5, sliding_window=window)
    idx = ids()
    assert_same_logits_on_every_path(ours, hf_model, idx)
    with torch.no_grad():
        want = hf_model.generate(idx[:, :8], max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert torch.equal(generate(ours, idx[:, :8], 32, temperature=0), want)
