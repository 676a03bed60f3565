"""--compile_mode graphed on the CPU: what decides, around torch.cuda.make_graphed_callables, which forwards replay
the recorded graphs (a training forward of the recorded shape only: the graphs copy their inputs into buffers of
that shape, and a smaller batch would broadcast into them silently), and that the recording runs under the
training step's autocast without its cast cache, as make_graphed_callables requires.  The recording itself needs a
GPU: tests/gpu/test_gpu_compile_modes.py trains with it."""

from __future__ import annotations

import functools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.training.callbacks import CompileModel
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.model_graphs import TrainingGraphs
from minigpt.training.optim import OptimConfig
from support import keep_training_graphs

CONFIG = GPTConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=20, dropout=0.1)


def test_only_a_training_forward_of_the_recorded_shape_replays():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    replayed = []

    def replay(idx, targets):  # stands in for the graphs: what they would compute (the loss), and that they ran
        replayed.append(tuple(idx.shape))
        return type(model).forward(model, idx, targets)[1]

    graphs = TrainingGraphs(model, replay, model.forward, torch.Size((4, 8)))
    model.forward = graphs
    x, y = torch.randint(0, 20, (2, 4, 8))
    logits, loss = model(x, y)
    assert replayed == [(4, 8)] and graphs.replays == 1
    assert logits is None and loss.ndim == 0  # a replay gives the loss alone: the graphs record no logits
    model(x[:3], y[:3])  # a smaller last batch: eager, not broadcast into the graphs' buffers
    model(x)  # no targets (DPO's and GRPO's forwards)
    model(x[:, :1], kv_cache=model.new_kv_cache(4))  # generation
    with torch.no_grad():
        model(x, y)
    model.eval()  # validation
    model(x, y)
    assert graphs.replays == 1
    model.train()
    _, loss = model(x, y)
    loss.backward()  # the eager forward's gradients reach the weights as usual (the fake replay is eager too)
    assert graphs.replays == 2 and all(p.grad is not None for p in model.parameters())


class FakeRecorder:
    """make_graphed_callables' contract on a CPU: refuses autocast's cache, as the real one does; installs a forward."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, module, sample_args, allow_unused_input=False):
        if torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled():
            raise RuntimeError("make_graphed_callables does not support the autocast caching")
        torch.rand(3)  # its eager warm-up draws from the RNG (dropout)
        self.calls.append((torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu"), sample_args))
        eager = module.forward
        module.forward = lambda idx, targets: eager(idx, targets)  # what it installs: replays while training
        return module


def test_the_recording_runs_under_the_steps_autocast_without_its_cache_and_is_undone_at_the_end(monkeypatch):
    recorder = FakeRecorder()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", recorder)
    module = GPTLightningModule(CONFIG, OptimConfig())
    # as Lightning's 16-mixed makes it: the cache on; float16, not autocast's default on a CPU (bfloat16)
    mixed = functools.partial(torch.autocast, "cpu", dtype=torch.float16)
    trainer = SimpleNamespace(world_size=1, precision_plugin=SimpleNamespace(forward_context=mixed))
    callback = CompileModel(4, mode="graphed")
    with monkeypatch.context() as gpu:  # set up as on a GPU; then recorded on the CPU (by the fake)
        gpu.setattr(GPTLightningModule, "device", property(lambda self: torch.device("cuda")))
        callback.setup(trainer, module, "fit")  # nothing is compiled: regions do not apply
    assert callback.enabled
    assert getattr(module.model.transformer.h[0], "_compiled_call_impl", None) is None
    rng = torch.get_rng_state()
    callback.on_fit_start(trainer, module)
    assert torch.equal(torch.get_rng_state(), rng)  # the warm-up's draws leave training's RNG where it was
    [(dtype, enabled, (inputs, targets))] = recorder.calls
    assert dtype == torch.float16 and enabled
    assert inputs.shape == targets.shape == (4, CONFIG.block_size)  # a training batch's split: (B, T) each
    assert isinstance(module.model.forward, TrainingGraphs) and callback.seconds is not None

    callback.on_train_start(SimpleNamespace(world_size=1), module)
    assert module.grads_in_place  # the backward graph's outputs are added into buffers of their own
    with pytest.warns(UserWarning, match=r"recorded batches of shape \(4, 8\) but this run's are not") as said:
        callback.on_train_batch_end(trainer, module, None, None, 0)  # no forward replayed in the first batch
        callback.on_train_batch_end(trainer, module, None, None, 1)
    assert len(said) == 1
    callback.on_train_end(trainer, module)
    assert "forward" not in vars(module.model) and not module.grads_in_place  # the class's eager forward again


def test_graphed_leaves_activation_checkpointing_eager(monkeypatch):
    """Checkpointing reads the RNG state in the forward and sets it in the backward: both refused in a capture."""
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", FakeRecorder())
    module = GPTLightningModule(replace(CONFIG, activation_checkpointing=True), OptimConfig())
    monkeypatch.setattr(GPTLightningModule, "device", property(lambda self: torch.device("cuda")))  # as on a GPU
    callback = CompileModel(4, mode="graphed")
    with pytest.warns(UserWarning, match="cannot record activation checkpointing's recomputation; training without"):
        callback.setup(None, module, "fit")
    assert not callback.enabled


@pytest.mark.parametrize("accumulate", [1, 2])
def test_train_py_under_graphed_routes_every_training_forward_and_nothing_else(
    accumulate, tiny_run_args, corpus, data_root, tmp_path, monkeypatch
):
    """train.py end to end with the recording faked (its replay is the eager forward): every training micro-batch
    goes to the graphs, validation and text samples do not, the gradients stay in their buffers, and the weights
    are the uncompiled run's to the bit."""
    from minigpt.cli.train import main
    from minigpt.core.checkpoint import model_state_dict, read_checkpoint
    from minigpt.training import callbacks

    monkeypatch.setattr(callbacks, "CUDA_ONLY_MODES", ())  # recorded here as on a GPU
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", FakeRecorder())
    recorded = keep_training_graphs(monkeypatch)
    weights = []
    for name, compiled in [("eager", "false"), ("graphed", "true")]:
        argv = tiny_run_args(corpus, data_root, tmp_path / name, steps=12, trainer__accumulate_grad_batches=accumulate)
        trainer = main(argv + ["--compile", compiled, "--compile_mode", "graphed", "--model.dropout", "0.1"])
        assert trainer.global_step == 12
        weights.append(model_state_dict(read_checkpoint(tmp_path / name / "checkpoints" / "last.ckpt")))
    [graphs] = recorded
    assert graphs.replays == 12 * accumulate and graphs.shape == (8, 32)
    assert "forward" not in vars(graphs.model)  # undone at the end of training
    for key, value in weights[0].items():
        assert torch.equal(value, weights[1][key]), key


def test_a_recording_that_fails_leaves_the_run_training_eagerly(
    tiny_run_args, corpus, data_root, tmp_path, monkeypatch
):
    """A kernel the capture refuses (make_graphed_callables raises): one warning naming the error, and the run
    trains eagerly to the uncompiled run's weights."""
    from minigpt.cli.train import main
    from minigpt.core.checkpoint import model_state_dict, read_checkpoint
    from minigpt.training import callbacks

    def refuse(module, sample_args, allow_unused_input=False):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore lines")

    monkeypatch.setattr(callbacks, "CUDA_ONLY_MODES", ())  # recorded here as on a GPU
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", refuse)
    recorded = keep_training_graphs(monkeypatch)

    def run(name: str, compiled: str) -> dict:
        argv = tiny_run_args(corpus, data_root, tmp_path / name, steps=6) + ["--compile", compiled]
        assert main(argv + ["--compile_mode", "graphed", "--model.dropout", "0.1"]).global_step == 6
        return model_state_dict(read_checkpoint(tmp_path / name / "checkpoints" / "last.ckpt"))

    eager = run("eager", "false")
    why = r"compile_mode graphed could not record the training step \(CUDA error: operation not permitted when"
    with pytest.warns(UserWarning, match=why + r" stream is capturing\); training without compiling"):
        graphed = run("graphed", "true")
    assert recorded == []
    for key, value in eager.items():
        assert torch.equal(value, graphed[key]), key
