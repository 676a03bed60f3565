"""--compile_mode reduce-overhead, cudagraphs and graphed on a GPU: the step replays as CUDA graphs, and training
ends where the default mode's does (the same computation, replayed), also under gradient accumulation, where a
graph's gradient outputs would be overwritten by the next micro-batch's replay were they not added into buffers of
their own.  Beside them --optim.cuda_graph, the optimizer's update replayed as a CUDA graph.
The GPU recipe's settings (Muon, WSD, bf16-mixed, clipping), without dropout so both runs draw nothing random.
Skipped without CUDA (tests/training/test_callbacks.py checks the in-place gradients on the CPU)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters  # inductor counts the graphs it could not run as CUDA graphs here

from minigpt.cli.train import main as train_main
from minigpt.core.checkpoint import model_state_dict, read_checkpoint
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.training.model_graphs import record_training_graphs
from minigpt.training.optim import OptimConfig, build_optimizer
from minigpt.training.sft import split_batch
from support import keep_training_graphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "shakespeare_char_gpu.yaml"


def tiny_recipe(tmp_path: Path, out: str, steps: int, mode: str) -> list[str]:
    """train.py's arguments: the GPU recipe at a tiny size on a small corpus, `steps` steps under `mode`."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    argv = ["--config", str(RECIPE), "--data.source", str(corpus), "--data.data_root", str(tmp_path / "data")]
    argv += ["--out_dir", str(tmp_path / out), "--model.n_layer", "2", "--model.n_embd", "64", "--model.n_head", "2"]
    argv += ["--model.block_size", "64", "--data.batch_size", "8", "--data.val_batches", "2"]
    argv += ["--trainer.max_time", "null", "--trainer.max_steps", str(steps), "--trainer.val_check_interval"]
    return argv + [str(steps // 2), "--compile_mode", mode, "--eval_full", "false"]


@pytest.mark.parametrize("regions,accumulate", [(True, 2), (False, 1)], ids=["regions-accumulate2", "whole"])
def test_the_cuda_graph_modes_train_as_the_default_mode(regions, accumulate, tmp_path):
    weights = {}
    for mode in ("default", "reduce-overhead", "cudagraphs"):
        argv = tiny_recipe(tmp_path, mode, 12, mode) + ["--model.dropout", "0.0", "--trainer.log_every_n_steps", "3"]
        argv += ["--trainer.accumulate_grad_batches", str(accumulate), "--compile_regions", str(regions).lower()]
        argv += ["--optim.learning_rate", "0.001", "--checkpoint_every", "12"]
        counters.clear()
        trainer = train_main(argv)
        assert trainer.global_step == 12
        assert counters["inductor"]["cudagraph_skips"] == 0  # under the CUDA-graph modes every graph replayed as one
        weights[mode] = model_state_dict(read_checkpoint(tmp_path / mode / "checkpoints" / "last.ckpt"))
    for mode in ("reduce-overhead", "cudagraphs"):
        for name, value in weights["default"].items():
            assert torch.allclose(value.float(), weights[mode][name].float(), atol=2e-3, rtol=1e-2), (mode, name)


@pytest.mark.parametrize("mode", ["reduce-overhead", "cudagraphs"])
def test_the_recipe_with_dropout_records_its_graphs(mode, tmp_path):
    """The recipe's dropout (0.2) inside the recorded graphs: every graph recorded (a random op that CUDA graphs
    refuse would leave its graph unrecorded, slower but silent), and the loss falls."""
    counters.clear()
    trainer = train_main(tiny_recipe(tmp_path, "run", 30, mode) + ["--compile_regions", "false"])
    assert trainer.global_step == 30
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] > 0  # graphs were recorded, not only run
    assert trainer.callback_metrics["val_loss"] < 3.0  # from ln(vocab) ~ 3.6 for the corpus's characters


# --compile_mode graphed: the uncompiled model's training step recorded by torch.cuda.make_graphed_callables
# (tests/training/test_model_graphs.py checks on the CPU which forwards replay)


def graphed_runs(tmp_path, monkeypatch, modes: list[str], *extra: str) -> tuple[list, dict]:
    """12 steps of the tiny GPU recipe for each of `modes` (run names; "eager": not compiled, any other:
    --compile_mode graphed): the graphs each graphed run recorded, and each run's weights."""
    recorded = keep_training_graphs(monkeypatch)
    weights = {}
    for name in modes:
        argv = tiny_recipe(tmp_path, name, 12, "graphed") + ["--compile", str(name != "eager").lower()]
        argv += ["--optim.learning_rate", "0.001", "--checkpoint_every", "12", *extra]
        assert train_main(argv).global_step == 12
        weights[name] = model_state_dict(read_checkpoint(tmp_path / name / "checkpoints" / "last.ckpt"))
    return recorded, weights


@pytest.mark.parametrize("accumulate", [1, 2])
def test_graphed_trains_as_the_eager_model_replaying_every_training_forward(accumulate, tmp_path, monkeypatch):
    extra = ["--model.dropout", "0.0", "--trainer.accumulate_grad_batches", str(accumulate)]
    recorded, weights = graphed_runs(tmp_path, monkeypatch, ["eager", "graphed"], *extra)
    [graphs] = recorded
    assert graphs.replays == 12 * accumulate  # every micro-batch; validation ran the eager forward
    for name, value in weights["eager"].items():
        assert torch.allclose(value.float(), weights["graphed"][name].float(), atol=2e-3, rtol=1e-2), name


def test_a_graphed_replay_gives_the_eager_loss_and_gradients_and_draws_new_dropout_masks():
    """The recorded graphs directly: without dropout a replay's loss and gradients are the eager model's, and it
    returns the loss alone (the graphs record no logits); with dropout each replay draws its own masks."""
    torch.manual_seed(0)
    for dropout in (0.0, 0.2):
        model = GPT(replace(GPTConfig.from_name("tiny"), dropout=dropout)).cuda().train()
        batch = torch.randint(0, model.config.vocab_size, (4, model.config.block_size + 1), device="cuda")
        _, loss = model(*split_batch(batch))
        loss.backward()
        eager = (loss.item(), [p.grad.clone() for p in model.parameters()])
        for p in model.parameters():  # buffers of their own, as CompileModel makes them
            p.grad.zero_()
        graphs = record_training_graphs(model, batch, contextlib.nullcontext)
        logits, loss = model(*split_batch(batch))
        first = loss.item()  # a copy: the next replay overwrites the graph's output
        loss.backward()
        second = model(*split_batch(batch))[1].item()
        assert logits is None and graphs.replays == 2
        if dropout == 0:
            assert first == pytest.approx(second, rel=1e-6) and first == pytest.approx(eager[0], rel=1e-5)
            for p, grad in zip(model.parameters(), eager[1]):
                torch.testing.assert_close(p.grad, grad, rtol=1e-4, atol=1e-5)
        else:
            assert first != second  # masks frozen at the recording would repeat the same loss


def test_graphed_with_the_recipes_dropout_learns_and_repeats_under_a_seed(tmp_path, monkeypatch):
    """Dropout's masks are drawn inside the replayed graphs (each replay advances the generator): the loss falls,
    and the same seed gives the same weights."""
    recorded, weights = graphed_runs(tmp_path, monkeypatch, ["graphed", "again"])
    assert [g.replays for g in recorded] == [12, 12]
    for name, value in weights["graphed"].items():
        assert torch.equal(value, weights["again"][name]), name
    argv = tiny_recipe(tmp_path, "longer", 30, "graphed")
    assert train_main(argv).callback_metrics["val_loss"] < 3.0  # from ln(vocab) ~ 3.6 for the corpus's characters


# --optim.cuda_graph: the optimizer's update captured once as a CUDA graph and replayed (tests/training/test_optim.py
# checks the eager path and the learning rate as a tensor on the CPU)


def run_optimizer_graph(tmp_path, name: str, mode: str, optimizer: str, graphed: bool):
    """12 steps of the tiny GPU recipe under compile mode `mode` ("eager": not compiled); (trainer, weights)."""
    argv = tiny_recipe(tmp_path, name, 12, "default" if mode == "eager" else mode)
    argv += ["--compile", str(mode != "eager").lower(), "--model.dropout", "0.0", "--optim.learning_rate", "0.001"]
    argv += ["--optim.optimizer", optimizer, "--optim.cuda_graph", str(graphed).lower(), "--checkpoint_every", "12"]
    argv += ["--optim.warmup_steps", "4", "--optim.lr_schedule", "cosine", "--compile_regions", "false"]
    trainer = train_main(argv)
    assert trainer.global_step == 12
    return trainer, model_state_dict(read_checkpoint(tmp_path / name / "checkpoints" / "last.ckpt"))


@pytest.mark.parametrize("optimizer,mode", [("muon", "cudagraphs"), ("adamw", "cudagraphs"), ("muon", "graphed")])
def test_the_replayed_update_trains_as_the_eager_one(optimizer, mode, tmp_path):
    """Under either mode that keeps the gradients in place: torch.compile's CUDA graphs, or the step recorded by
    make_graphed_callables (graphed + --optim.cuda_graph: the recipe's candidate, two graphs a step)."""
    _, eager = run_optimizer_graph(tmp_path, "eager", mode, optimizer, graphed=False)
    trainer, graphed = run_optimizer_graph(tmp_path, "graphed", mode, optimizer, graphed=True)
    optim = trainer.optimizers[0]
    assert optim._graph is not None  # captured, and still in use at the end
    assert int(optim.state[optim.param_groups[-1]["params"][0]]["step"]) == 12  # AdamW's: each replay counted
    for name, value in eager.items():
        assert torch.allclose(value.float(), graphed[name].float(), atol=2e-3, rtol=1e-2), name


def test_gradients_that_move_make_the_update_eager_again(tmp_path):
    """Uncompiled, zero_grad frees the gradients: the graph would read the old ones."""
    _, eager = run_optimizer_graph(tmp_path, "eager", "eager", "muon", graphed=False)
    with pytest.warns(UserWarning, match="gradients moved between steps"):
        trainer, graphed = run_optimizer_graph(tmp_path, "graphed", "eager", "muon", graphed=True)
    assert trainer.optimizers[0]._graph is None
    for name, value in eager.items():
        assert torch.allclose(value.float(), graphed[name].float(), atol=2e-3, rtol=1e-2), name


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_replayed_update_is_the_eager_update_step_by_step(optimizer):
    """Outside Lightning, on the same gradients (kept in place) and a learning rate that changes every step: the
    replayed update follows the eager one closely (Muon's rate-times-update is one multiply more in the graph)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny")).cuda()
    twin = copy.deepcopy(model)
    cfg = OptimConfig(optimizer=optimizer, learning_rate=0.01)
    eager = build_optimizer(model, cfg, fused=True)
    graphed = build_optimizer(twin, replace(cfg, cuda_graph=True), fused=True)
    for p in [*model.parameters(), *twin.parameters()]:
        p.grad = torch.zeros_like(p)
    for step in range(8):
        for p, q in zip(model.parameters(), twin.parameters()):
            gradient = torch.randn_like(p)
            p.grad.copy_(gradient), q.grad.copy_(gradient)
        for optim in (eager, graphed):
            for group in optim.param_groups:
                group["lr"] = 0.01 * (1 - step / 8)
            optim.step()
    assert graphed._graph is not None
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)
