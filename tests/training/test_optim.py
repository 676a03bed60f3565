"""The learning-rate schedule against its definition (warmup, then cosine / linear / constant / wsd to min_lr), and
minigpt's Muon against torch.optim.Muon."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minigpt.core.precision
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.muon import Muon, newton_schulz
from minigpt.training.optim import OptimConfig, build_optimizer, lr_multiplier
from minigpt.training.step_graph import GraphedAdamW, GraphedMuonWithAdamW, GraphedStep


def test_warmup_is_linear_up_to_the_peak():
    cfg = OptimConfig(warmup_steps=10, lr_schedule="cosine")
    assert [lr_multiplier(s, cfg, 100) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]


@pytest.mark.parametrize("schedule,midpoint", [("cosine", 0.5), ("linear", 0.5), ("constant", 1.0)])
def test_decay_ends_at_min_lr(schedule, midpoint):
    cfg = OptimConfig(warmup_steps=10, lr_schedule=schedule, min_lr_ratio=0.1)
    assert lr_multiplier(10, cfg, 110) == pytest.approx(1.0)
    assert lr_multiplier(60, cfg, 110) == pytest.approx(0.1 + 0.9 * midpoint)
    assert lr_multiplier(110, cfg, 110) == pytest.approx(1.0 if schedule == "constant" else 0.1)
    assert lr_multiplier(500, cfg, 110) == pytest.approx(1.0 if schedule == "constant" else 0.1)


@pytest.mark.parametrize("fraction", [0.2, 0.4, 1.0])
def test_wsd_holds_the_peak_then_cools_down_over_its_fraction(fraction):
    """Decay from step 10 to 110: the peak is held until 110 - 100 * fraction, then falls linearly to min_lr."""
    cfg = OptimConfig(warmup_steps=10, lr_schedule="wsd", min_lr_ratio=0.0, cooldown_fraction=fraction)
    start = 110 - round(100 * fraction)
    for step in range(10, 111):
        expected = 1.0 if step <= start else (110 - step) / (110 - start)
        assert lr_multiplier(step, cfg, 110) == pytest.approx(expected), step


def test_a_warmup_as_long_as_the_run_is_noted(capsys):
    """warmup_steps >= max_steps: the peak is never reached and nothing decays (a short smoke run of a recipe);
    said in one note, with the highest rate the run reaches."""
    from types import SimpleNamespace

    from minigpt.training.optim import trainer_schedule

    trainer = SimpleNamespace(max_steps=40, max_epochs=None, callbacks=[], is_global_zero=True)
    assert trainer_schedule(trainer, OptimConfig(learning_rate=2e-3, warmup_steps=100))[0] == 40
    assert capsys.readouterr().err.strip() == (
        "note: optim.warmup_steps 100 is not below the run's 40 steps: the learning rate rises to 0.0008 at most "
        "(its peak is 0.002) and never decays; lower warmup_steps"
    )
    assert lr_multiplier(39, OptimConfig(warmup_steps=100), 40) == 0.4  # the figure the note says
    trainer_schedule(trainer, OptimConfig(warmup_steps=39))
    assert capsys.readouterr().err == ""


def test_no_known_end_holds_the_peak():
    cfg = OptimConfig(warmup_steps=10, lr_schedule="cosine")
    assert lr_multiplier(10_000, cfg, None) == 1.0


def _muon_pair(adjust_lr_fn, nesterov):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(*shape)) for shape in [(64, 32), (32, 64), (48, 48)]]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn, nesterov=nesterov)
    return ours, Muon(ours, **kwargs), theirs, torch.optim.Muon(theirs, **kwargs)


def _steps(ours, opt, theirs, ref, n=3):
    for _ in range(n):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_is_torchs_muon_when_bf16_is_native(monkeypatch, adjust_lr_fn, nesterov):
    monkeypatch.setattr(minigpt.core.precision, "cpu_has_native_bf16", lambda: (True, "faked"))
    ours, opt, theirs, ref = _muon_pair(adjust_lr_fn, nesterov)
    _steps(ours, opt, theirs, ref)
    assert opt.ns_dtype == torch.bfloat16
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()
    assert all(
        torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"]) for p, q in zip(ours, theirs)
    )


def test_muon_on_bf16_weights_is_torchs_muon(monkeypatch):
    """bf16 weights (--trainer.precision bf16-true) take the same steps as under torch's Muon, bit for bit."""
    monkeypatch.setattr(minigpt.core.precision, "cpu_has_native_bf16", lambda: (True, "faked"))
    ours, opt, theirs, ref = _muon_pair("match_rms_adamw", True)
    for p in ours + theirs:
        p.data = p.data.bfloat16()
    _steps(ours, opt, theirs, ref)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, q) for p, q in zip(ours, theirs))


def test_muon_iterates_in_float32_where_bf16_is_not_native(monkeypatch):
    """On a CPU without native bf16 the same update is computed in float32: equal to torch's up to bf16 rounding."""
    monkeypatch.setattr(minigpt.core.precision, "cpu_has_native_bf16", lambda: (False, "faked"))
    ours, opt, theirs, ref = _muon_pair("match_rms_adamw", True)
    start = [p.detach().clone() for p in ours]
    _steps(ours, opt, theirs, ref, n=1)
    assert opt.ns_dtype == torch.float32
    for p, q, p0 in zip(ours, theirs, start):
        ours_update, torch_update = p - p0, q - p0
        assert not torch.equal(ours_update, torch_update)  # float32 really ran, not torch's bf16
        assert (ours_update - torch_update).norm() < 0.02 * torch_update.norm()


def test_newton_schulz_orthogonalises():
    """Five quintic iterations leave a random matrix's singular values within Muon's (0.5, 1.5) band."""
    g = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32))
    assert s.min() > 0.5 and s.max() < 1.5


def test_muon_ns_steps_reaches_the_optimizer():
    model = GPT(GPTConfig.from_name("tiny"))
    optimizer = build_optimizer(model, OptimConfig(optimizer="muon", muon_ns_steps=3), fused=False)
    assert {group["ns_steps"] for group in optimizer.muon.param_groups} == {3}


def test_muon_orthogonalises_each_stacked_projection_on_its_own(monkeypatch):
    """A weight stacking three projections (q/k/v) with row_splits moves exactly as three separate weights would
    under torch's Muon: each piece orthogonalised, and its learning rate scaled, as the matrix it is."""
    monkeypatch.setattr(minigpt.core.precision, "cpu_has_native_bf16", lambda: (True, "faked"))
    torch.manual_seed(0)
    stacked = torch.nn.Parameter(torch.randn(32 + 16 + 16, 32))
    pieces = [torch.nn.Parameter(w.detach().clone()) for w in stacked.split([32, 16, 16])]
    kwargs = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    opt = Muon([stacked], row_splits={stacked: [32, 16, 16]}, **kwargs)
    ref = torch.optim.Muon(pieces, **kwargs)
    whole = Muon([torch.nn.Parameter(stacked.detach().clone())], **kwargs)  # the same weight, not split
    for _ in range(3):
        stacked.grad = torch.randn_like(stacked)
        for p, g in zip(pieces, stacked.grad.split([32, 16, 16])):
            p.grad = g.clone()
        whole.param_groups[0]["params"][0].grad = stacked.grad.clone()
        opt.step(), ref.step(), whole.step()
    torch.testing.assert_close(stacked.detach(), torch.cat([p.detach() for p in pieces]))
    assert not torch.allclose(stacked, whole.param_groups[0]["params"][0], atol=1e-3)  # splitting changes Muon
    assert opt.state[stacked]["momentum_buffer"].shape == stacked.shape  # state stays per parameter


def test_newton_schulz_of_a_stack_is_each_matrix_s():
    g = torch.randn(4, 48, 24, generator=torch.Generator().manual_seed(0))
    batched = newton_schulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
    single = torch.stack([newton_schulz(m, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32) for m in g])
    torch.testing.assert_close(batched, single)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_build_optimizer_splits_fused_projections_for_muon(arch):
    """q/k/v (with fewer key/value heads) and SwiGLU's gate/up reach Muon as separate projections."""
    config = GPTConfig(
        arch=arch,
        n_layer=2,
        n_head=4,
        n_kv_head=2 if arch == "llama" else 4,
        n_embd=32,
        mlp_hidden=48,
        vocab_size=50,
        block_size=16,
    )
    model = GPT(config)
    splits = build_optimizer(model, OptimConfig(optimizer="muon"), fused=False).muon.row_splits
    block = model.transformer.h[1]
    kv_rows = 16 if arch == "llama" else 32
    assert splits[block.attn.c_attn.weight] == [32, kv_rows, kv_rows]
    if arch == "llama":
        assert splits[block.mlp.c_fc.weight] == [48, 48]
    else:
        assert block.mlp.c_fc.weight not in splits  # one GELU projection: nothing stacked
    assert block.attn.c_proj.weight not in splits


def _trained_copies(n: int, cfg: OptimConfig, steps: int, lr_as_tensor: bool = False) -> list[dict]:
    """Each of n copies of one tiny model after `steps` steps of build_optimizer(cfg) on the same gradients, with a
    learning rate that changes every step (as a schedule moves it)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny"))
    grads = [{k: torch.randn_like(p) for k, p in model.named_parameters()} for _ in range(steps)]
    states = []
    for _ in range(n):
        copy = GPT(GPTConfig.from_name("tiny"))
        copy.load_state_dict(model.state_dict())
        opt = build_optimizer(copy, cfg, fused=True)
        for step, grad in enumerate(grads):
            for group in opt.param_groups:
                lr = cfg.learning_rate * (1 - step / steps)
                group["lr"] = torch.tensor(lr) if lr_as_tensor else lr
            for k, p in copy.named_parameters():
                p.grad = grad[k].clone()
            opt.step()
        states.append({k: v.clone() for k, v in copy.state_dict().items()})
    return states


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_the_cuda_graph_option_runs_eagerly_on_a_cpu_as_the_plain_optimizer(optimizer):
    """optim.cuda_graph picks the graphed classes; on a CPU their update is the plain optimizer's, to the bit
    (tests/gpu/test_gpu_compile_modes.py checks the replayed update on a GPU)."""
    cfg = OptimConfig(optimizer=optimizer, learning_rate=0.01)
    graphed_cfg = OptimConfig(optimizer=optimizer, learning_rate=0.01, cuda_graph=True)
    model = GPT(GPTConfig.from_name("tiny"))
    expected = GraphedMuonWithAdamW if optimizer == "muon" else GraphedAdamW
    assert type(build_optimizer(model, graphed_cfg, fused=True)) is expected
    assert not isinstance(build_optimizer(model, cfg, fused=True), GraphedStep)
    plain, graphed = _trained_copies(1, cfg, 5) + _trained_copies(1, graphed_cfg, 5)
    for name, value in plain.items():
        assert torch.equal(value, graphed[name]), name


def test_muon_takes_its_learning_rate_as_a_tensor_as_the_graph_reads_it():
    """The captured update reads each group's learning rate from a tensor on the device: Muon's weight decay and
    update follow it as they follow a float (the same up to float32 rounding)."""
    cfg = OptimConfig(optimizer="muon", learning_rate=0.01)
    (floats,), (tensors,) = _trained_copies(1, cfg, 4), _trained_copies(1, cfg, 4, lr_as_tensor=True)
    for name, value in floats.items():
        torch.testing.assert_close(tensors[name], value, rtol=1e-5, atol=1e-6, msg=name)
    (untrained,) = _trained_copies(1, cfg, 0)
    assert any(not torch.equal(untrained[k], v) for k, v in tensors.items())  # the steps moved the weights


REPO = Path(__file__).resolve().parents[2]  # the ranks import this checkout's minigpt (the first entry of sys.path)

# One rank of a real FSDP wrap on the CPU (torch's FSDP runs there, over gloo, when device_id names the CPU; Lightning
# allows it only on GPUs): what the module reads from its parameters after the wrap, in Lightning's order (setup,
# the wrap, configure_optimizers, the first batch): the optimizer's groups by name, and the FLOPs of a batch
FSDP_RANK = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from minigpt.core.config import GPTConfig
from minigpt.training.lightning_module import GPTLightningModule
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
module = GPTLightningModule(GPTConfig.from_name("tiny"))
module.setup("fit")
FullyShardedDataParallel(module, device_id=torch.device("cpu"), use_orig_params=True)  # Lightning's FSDP default
names = {id(p): n for n, p in module.model.named_parameters()}
groups = module.configure_optimizers()["optimizer"].param_groups
module.on_train_batch_start(torch.zeros(2, 17, dtype=torch.long), 0)
groups = [[g["weight_decay"], sorted(names[id(p)] for p in g["params"])] for g in groups]
json.dump({"groups": groups, "flops_per_batch": module.flops_per_batch}, open(f"{out}{rank}.json", "w"))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def under_fsdp(tmp_path_factory):
    """What each of the two ranks read after the wrap, and what the unwrapped module reads."""
    tmp = tmp_path_factory.mktemp("fsdp")
    ranks = [
        subprocess.Popen([sys.executable, "-c", FSDP_RANK, str(rank), str(tmp / "store"), str(tmp / "rank")], cwd=REPO)
        for rank in (0, 1)
    ]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    module = GPTLightningModule(GPTConfig.from_name("tiny"))
    names = {id(p): n for n, p in module.model.named_parameters()}
    groups = module.configure_optimizers()["optimizer"].param_groups
    module.on_train_batch_start(torch.zeros(2, 17, dtype=torch.long), 0)
    groups = [[g["weight_decay"], sorted(names[id(p)] for p in g["params"])] for g in groups]
    whole = {"groups": groups, "flops_per_batch": module.flops_per_batch}
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in (0, 1)], whole


def test_fsdp_shards_keep_the_weight_decay_of_the_matrices_they_come_from(under_fsdp):
    """FSDP (use_orig_params, as Lightning wraps) turns every parameter into a 1-D view of its shard: the optimizer,
    built after the wrap, had put every matrix with the biases and gains, and the run trained without weight decay.
    The groups are those of the unwrapped model."""
    ranks, whole = under_fsdp
    assert whole["groups"][0][0] > 0 and whole["groups"][0][1]  # the matrices' group decays, and holds them
    assert [r["groups"] for r in ranks] == [whole["groups"]] * 2


def test_fsdp_counts_the_flops_of_whole_matrices_not_of_a_shard(under_fsdp):
    """Each rank computes with the whole weights (gathered for the forward and backward): its FLOP/s and MFU count
    them, where the count of its shard's 1-D views had logged a fraction of them."""
    ranks, whole = under_fsdp
    assert [r["flops_per_batch"] for r in ranks] == [whole["flops_per_batch"]] * 2
