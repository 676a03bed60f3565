"""LoRA adapters (minigpt.core.lora): a fresh adapter changes nothing, a trained one merges into the same function,
only adapters (and a grown vocabulary's new rows) ever train, the frozen base may be held in bfloat16, and a bad
setting is one line naming the option."""

import copy

import pytest
import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import ConfigError
from minigpt.core.lora import (
    TARGETS,
    LoRAConfig,
    LoRALinear,
    UpcastLinear,
    adapter_names,
    fingerprint,
    lora_model,
    merge_lora,
    training_flops_per_token,
)
from minigpt.core.model import GPT

SMALL = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=50)
MODELS = {
    "gpt": dict(arch="gpt"),
    "gpt-untied": dict(arch="gpt", tie_embeddings=False),
    "llama-gqa": dict(arch="llama", n_kv_head=2),
    "llama-untied-mqa": dict(arch="llama", n_kv_head=1, tie_embeddings=False),
}


def base_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SMALL, **overrides}))
    with torch.no_grad():
        for p in model.parameters():  # every weight at a normal scale, so a wrong layout cannot hide
            torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def with_trained_adapters(model: GPT, seed: int = 1) -> GPT:
    """Adapters (and new rows) as training might leave them: every trained tensor random, B no longer zero."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.2)
    return model


def train_steps(model: GPT, trained: list[torch.nn.Parameter], steps: int = 3) -> torch.Tensor:
    """A few AdamW steps on a batch of random tokens of the 52-token vocabulary; returns the batch."""
    optimizer = torch.optim.AdamW(trained, lr=0.1)
    idx = torch.randint(0, 52, (4, 17))
    for _ in range(steps):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return idx


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("attention", ["sdpa", "manual", "einops"])
def test_fresh_adapters_leave_the_logits_equal_to_the_base(name, attention):
    base = base_model(**MODELS[name], attention=attention)
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        expected, _ = base(idx)
    model = lora_model(copy.deepcopy(base), base.config, LoRAConfig(rank=4)).eval()
    with torch.no_grad():
        got, _ = model(idx)
    assert torch.equal(got, expected)  # B starts at zero: base + 0, bit for bit


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("base_dtype", [None, "bfloat16"])
def test_merged_weights_compute_what_base_plus_adapters_compute(name, base_dtype):
    base = base_model(**MODELS[name])
    run = GPTConfig.from_dict({**base.config.to_dict(), "vocab_size": 53, "block_size": 12})  # chat tokens, shorter
    model = with_trained_adapters(lora_model(base, run, LoRAConfig(rank=4, alpha=8, base_dtype=base_dtype)).eval())
    idx = torch.randint(0, 53, (2, 12))
    with torch.no_grad():
        unmerged, _ = model(idx)
        merged_model = merge_lora(model)
        merged, _ = merged_model(idx)
    assert not any(isinstance(m, LoRALinear) for m in merged_model.modules())
    assert merged_model.transformer.wte.weight.shape == (53, 32) and merged.shape == (2, 12, 53)
    assert (merged_model.lm_head.weight is merged_model.transformer.wte.weight) == run.tie_embeddings
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    # a plain GPT again: it loads into a fresh model of the run's config
    GPT(run).load_state_dict(merged_model.state_dict())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_in_another_dtype_gets_adapters_and_a_merge_in_its_dtype(dtype):
    """From Python a model may be float64 (gradient checks) or bfloat16: the adapters were float32 whatever the
    layer's dtype, and the first forward failed (BFloat16 != float); the merge left float32 weights in it."""
    base = base_model(arch="llama", n_kv_head=2).to(dtype)
    run = GPTConfig.from_dict({**base.config.to_dict(), "vocab_size": 53})  # grown rows too
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        expected, _ = base(idx)
        fresh, _ = lora_model(copy.deepcopy(base), run, LoRAConfig(rank=4)).eval()(idx)
    fresh_tolerance, merged_tolerance = (0, 1e-12) if dtype == torch.float64 else (0.05, 0.1)  # bf16: 8 bits
    torch.testing.assert_close(fresh[..., :50], expected, atol=fresh_tolerance, rtol=0)
    model = with_trained_adapters(lora_model(base, run, LoRAConfig(rank=4, alpha=8)).eval())
    with torch.no_grad():
        unmerged, _ = model(idx)
        merged, _ = merge_lora(model)(idx)
    assert {p.dtype for p in model.parameters()} == {dtype} and merged.dtype == dtype
    torch.testing.assert_close(merged, unmerged, atol=merged_tolerance, rtol=0)


def test_each_targeted_projection_has_its_own_adapter_over_its_rows():
    base = base_model(arch="llama", n_kv_head=2)
    model = lora_model(base, base.config, LoRAConfig(rank=4, alpha=8, targets=["q", "v", "down"]))
    c_attn, c_fc = model.transformer.h[0].attn.c_attn, model.transformer.h[0].mlp.c_fc
    assert dict(c_attn.pieces) == {"q": 32, "k": 16, "v": 16} and set(c_attn.lora_A) == {"q", "v"}
    assert c_attn.lora_B["q"].shape == (32, 4) and c_attn.lora_B["v"].shape == (16, 4)
    assert c_attn.lora_A["q"].shape == (4, 32) and not c_fc.lora_A  # gate and up are not targeted
    with_trained_adapters(model)
    delta = c_attn.delta()  # (out, in): k's rows untouched, q's and v's from their own adapters
    assert delta[32:48].abs().max() == 0
    torch.testing.assert_close(delta[:32], 2.0 * c_attn.lora_B["q"] @ c_attn.lora_A["q"])  # alpha 8 / rank 4
    torch.testing.assert_close(delta[48:], 2.0 * c_attn.lora_B["v"] @ c_attn.lora_A["v"])


def test_only_adapters_and_new_rows_train_and_the_base_bytes_stay():
    base = base_model(arch="llama", n_kv_head=2, tie_embeddings=False)
    run = GPTConfig.from_dict({**base.config.to_dict(), "vocab_size": 52})
    model = lora_model(base, run, LoRAConfig(rank=2)).train()
    frozen = {n: t.clone() for n, t in model.state_dict().items() if n not in set(adapter_names(model))}
    trained = [p for p in model.parameters() if p.requires_grad]
    names = set(adapter_names(model))
    assert {"transformer.wte.new_rows", "lm_head.new_rows"} <= names
    assert all(".lora_" in n or n.endswith("new_rows") for n in names)
    per_block = 2 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 3 * (32 + 128))  # rank 2: q, k, v, o, gate, up, down
    assert sum(p.numel() for p in trained) == 2 * per_block + 2 * 2 * 32  # 2 blocks; 2 new rows, embedding and head
    train_steps(model, trained)
    after = model.state_dict()
    for name, tensor in frozen.items():  # every frozen tensor, byte for byte
        assert torch.equal(after[name], tensor), name
    assert all(not torch.equal(after[n], torch.zeros_like(after[n])) for n in names if ".lora_B." in n)


@pytest.mark.parametrize("name", MODELS)
def test_train_embeddings_trains_every_token_row_and_the_positions_and_merges(name):
    base = base_model(**MODELS[name])
    run = GPTConfig.from_dict({**base.config.to_dict(), "vocab_size": 52})
    model = lora_model(copy.deepcopy(base), run, LoRAConfig(rank=2, train_embeddings=True)).train()
    names = set(adapter_names(model))
    positions = {"transformer.wpe.weight"} if base.config.arch == "gpt" else set()  # llama rotates q and k
    embeddings = {"transformer.wte.weight", "lm_head.weight"} | positions
    assert embeddings <= names  # both names of a tied embedding: one tensor
    assert all(".lora_" in n or n.endswith("new_rows") or n in embeddings for n in names)
    frozen = {n: t.clone() for n, t in model.state_dict().items() if n not in names}
    idx = train_steps(model, [p for p in model.parameters() if p.requires_grad])
    after = model.state_dict()
    for n, t in frozen.items():  # the blocks' weights, norms and biases, byte for byte
        assert torch.equal(after[n], t), n
    for n in embeddings:  # the base's rows trained too (not only the new ones)
        assert not torch.equal(after[n], base.state_dict()[n]), n
    model.eval()
    merged = merge_lora(copy.deepcopy(model)).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(idx[:, :-1])[0], model(idx[:, :-1])[0], atol=1e-5, rtol=0)


def test_a_bfloat16_base_halves_the_block_weights_and_keeps_float32_gradients():
    base = base_model(arch="llama", n_kv_head=2)
    reference = lora_model(copy.deepcopy(base), base.config, LoRAConfig(rank=4)).train()
    model = lora_model(base, base.config, LoRAConfig(rank=4, base_dtype="bfloat16")).train()
    with_trained_adapters(model)
    with torch.no_grad():  # the reference holds the same adapters, and the same rounded weights in float32
        for ref, held in zip(reference.parameters(), model.parameters()):
            ref.copy_(held.float())
    layer = model.transformer.h[0].attn.c_attn
    assert layer.weight.dtype == torch.bfloat16 and layer.lora_A["q"].dtype == torch.float32
    assert model.transformer.wte.weight.dtype == torch.float32  # embeddings, head and norms stay as loaded
    idx = torch.randint(0, 50, (2, 16))
    for m in (reference, model):
        _, loss = m(idx, idx)
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("name", ["gpt", "llama-gqa"])
@pytest.mark.parametrize("base_dtype", [None, "bfloat16"])
def test_activation_checkpointing_gives_the_adapters_the_same_gradients(name, base_dtype):
    """The frozen base makes the first block's input need no grad (the embedding is frozen): the recompute still
    reaches every adapter, with the gradients of the run without it."""
    base = base_model(**MODELS[name])
    model = with_trained_adapters(lora_model(base, base.config, LoRAConfig(rank=4, base_dtype=base_dtype))).train()
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(5))
    runs = []
    for on in (False, True):
        model.config.activation_checkpointing = on
        model.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        runs.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ref_loss, ref_grads), (loss, grads) = runs
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert grads.keys() == ref_grads.keys() == set(adapter_names(model))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_upcast_linear_gradient_is_the_float32_one():
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 8).to(torch.bfloat16)
    bias = torch.randn(6, dtype=torch.float64)
    torch.autograd.gradcheck(lambda x: UpcastLinear.apply(x, weight, bias), (x,))


def test_flops_count_frozen_weights_without_their_gradient():
    base = base_model()
    full = base.flops_per_token(16)
    model = lora_model(base, base.config, LoRAConfig(rank=1, targets=["q"]))
    assert 0.6 * full < training_flops_per_token(model, 16) < 0.7 * full  # ~4/6 of full fine-tuning's


def test_flops_count_no_embedding_lookups_however_they_train():
    """Trained embeddings of an untied model are lookups, not matmuls: they add nothing (they made a LoRA run with
    train_embeddings count more FLOPs than full fine-tuning); its untied head, trained, counts 6 per entry."""
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=1000, tie_embeddings=False)
    full = GPT(config).flops_per_token(16)
    frozen = lora_model(GPT(config), config, LoRAConfig(rank=1, targets=["q"]))
    embeddings = lora_model(GPT(config), config, LoRAConfig(rank=1, targets=["q"], train_embeddings=True))
    head = embeddings.lm_head.weight.numel()
    assert training_flops_per_token(embeddings, 16) - training_flops_per_token(frozen, 16) == 2 * head
    assert training_flops_per_token(embeddings, 16) < full


def test_the_fingerprint_names_the_weights_and_the_shape_not_the_attention_path():
    base = base_model()
    print_ = fingerprint(base)
    assert len(print_) == 64 and fingerprint(copy.deepcopy(base)) == print_
    other = copy.deepcopy(base)
    other.set_attention("manual")
    assert fingerprint(other) == print_
    with torch.no_grad():
        other.transformer.h[1].mlp.c_proj.weight[3, 4] += 1e-3
    assert fingerprint(other) != print_


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(rank=0), "lora.rank: must be a positive integer, got 0"),
        (dict(alpha=0.0), "lora.alpha: must be a positive number"),
        (dict(alpha=float("nan")), "lora.alpha: must be a positive number"),
        (dict(dropout=1.0), "lora.dropout: must be in [0, 1)"),
        (dict(targets=["q", "ffn"]), "lora.targets: unknown target 'ffn'; choose from " + ", ".join(TARGETS)),
        (dict(targets=[]), "lora.targets: is empty"),
        (dict(base_dtype="int4"), "lora.base_dtype: unknown value 'int4'"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(settings, message):
    with pytest.raises(ConfigError, match=None) as e:
        LoRAConfig(**settings)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_rank_larger_than_a_targeted_projection_is_refused_before_anything_changes():
    base = base_model(arch="llama", n_kv_head=1)  # k and v: 8 rows
    before = copy.deepcopy(base.state_dict())
    with pytest.raises(
        ConfigError,
        match=r"lora.rank: 9 is larger than the k projection \(8 x 32\); choose "
        r"lora.rank of at most 8",
    ):
        lora_model(base, base.config, LoRAConfig(rank=9))
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())  # the base is as it was
    assert lora_model(base, base.config, LoRAConfig(rank=9, targets=["q", "o"]))  # q and o are 32 x 32


def test_targets_must_be_projections_the_model_has_and_the_full_list_means_all_it_has():
    gelu, swiglu = base_model(arch="gpt").config, base_model(arch="llama").config
    for targets in (["gate"], ["q", "gate", "up"]):
        with pytest.raises(ConfigError) as e:
            LoRAConfig(targets=targets).check_targets(gelu)
        assert str(e.value) == (
            "lora.targets: this model has no gate projection (its MLP, mlp=gelu, is not gated); choose from its "
            "projections q, k, v, o, up, down"
        )
    LoRAConfig().check_targets(gelu)  # the default, every projection: all the model has
    LoRAConfig(targets=["down", "up", "v", "k", "q", "o", "gate"]).check_targets(gelu)  # the same, in any order
    LoRAConfig(targets=["gate"]).check_targets(swiglu)
