"""Training end to end through train.py's entry point: loss falls, checkpoints load, seeds, configs, resume."""

import math
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy

REPO = Path(__file__).resolve().parents[2]  # the repository root
from minigpt.cli.train import main
from minigpt.core import checkpoint
from minigpt.core.checkpoint import build_model, checkpoint_tokenizer, model_state_dict, read_checkpoint
from minigpt.core.config import GPTConfig
from minigpt.core.errors import ConfigError, UserError
from minigpt.core.lora import LoRAConfig, adapter_names, lora_model
from minigpt.core.model import GPT
from minigpt.training.callbacks import CompileModel
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.optim import OptimConfig


def weights(ckpt_path) -> dict[str, torch.Tensor]:
    return model_state_dict(read_checkpoint(ckpt_path))


def test_tiny_run_learns_and_writes_a_loadable_checkpoint(tiny_run_args, corpus, data_root, tmp_path, capsys):
    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=40))
    assert trainer.global_step == 40
    vocab = trainer.lightning_module.config.vocab_size
    val_loss = trainer.callback_metrics["val_loss"].item()
    assert val_loss < math.log(vocab) - 0.7  # well below the uniform guess ln(vocab)
    out = capsys.readouterr().out
    assert (
        f"estimated val loss {val_loss:.4f} (2 batches of 8) after 40 steps; checkpoint: "
        f"{tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}"
    ) in out
    assert "stopped by max_time" not in out  # max_steps ended it

    run = tmp_path / "run"
    for name in ("checkpoints/last.ckpt", "checkpoints/best.ckpt", "config.yaml"):
        assert (run / name).is_file(), name
    assert list(run.glob("events.out.tfevents.*")), "TensorBoard logs"
    ckpt = read_checkpoint(run / "checkpoints" / "last.ckpt")
    model = build_model(ckpt).eval()
    tok = checkpoint_tokenizer(ckpt)
    idx = torch.tensor([tok.encode("the quick brown fox jumps")])
    with torch.no_grad():
        _, loss = model(idx[:, :-1], idx[:, 1:])
    assert loss.item() < math.log(vocab)


def test_tensorboard_gets_losses_lr_grad_norm_throughput_and_samples(tiny_run_args, corpus, data_root, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=20))
    events = EventAccumulator(str(tmp_path / "run")).Reload()
    scalars = set(events.Tags()["scalars"])
    for tag in ("train_loss", "val_loss", "val_ppl", "lr/pg1", "grad_norm"):
        assert tag in scalars, (tag, scalars)
    assert "train/device/items_per_sec" in scalars, scalars  # tokens/s (Lightning calls tokens items)
    # items are the batch's tokens, not one row's: every sample (window) is block_size predicted tokens
    tokens, samples = (events.Scalars(f"train/device/{rate}_per_sec")[-1].value for rate in ("items", "samples"))
    assert tokens == pytest.approx(samples * trainer.lightning_module.config.block_size, rel=1e-4)
    assert any("sample" in t for t in events.Tags()["tensors"]), events.Tags()


def test_tensorboard_train_loss_is_the_logged_steps_own_loss(
    tiny_run_args, record_training_losses, corpus, data_root, tmp_path, monkeypatch
):
    """train_loss and grad_norm are logged only on the steps Lightning writes (every log_every_n_steps = 5):
    each written point is that step's own value, not one left over from an earlier step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = record_training_losses(monkeypatch)
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=20))
    events = EventAccumulator(str(tmp_path / "run")).Reload()
    written = {e.step: e.value for e in events.Scalars("train_loss")}
    assert sorted(written) == [4, 9, 14, 19]
    assert all(written[step] == pytest.approx(seen[step][1]) for step in written), (written, [s[1] for s in seen])
    assert sorted(e.step for e in events.Scalars("grad_norm")) == [4, 9, 14, 19]


def test_a_run_stopped_early_writes_its_last_steps_own_loss_and_grad_norm(
    tiny_run_args, record_training_losses, corpus, data_root, tmp_path, monkeypatch
):
    """A max_time stop makes Lightning write the stopping step's metrics off the log_every_n_steps grid: that point
    holds the stopping step's own loss and gradient norm (before clipping), not those of the last logged step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = record_training_losses(monkeypatch)
    norms = []
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(
        torch.nn.utils, "clip_grad_norm_", lambda *a, **k: norms.append(real_clip(*a, **k)) or norms[-1]
    )
    real_end = GPTLightningModule.on_train_batch_end

    def stop_after_12_steps(self, outputs, batch, batch_idx):  # as Lightning's Timer does, in its callback hook
        self.trainer.should_stop = self.trainer.should_stop or self.global_step == 12
        return real_end(self, outputs, batch, batch_idx)

    monkeypatch.setattr(GPTLightningModule, "on_train_batch_end", stop_after_12_steps)
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=40))
    events = EventAccumulator(str(tmp_path / "run")).Reload()
    loss = {e.step: e.value for e in events.Scalars("train_loss")}
    grad_norm = {e.step: e.value for e in events.Scalars("grad_norm")}
    assert sorted(loss) == sorted(grad_norm) == [4, 9, 11]
    assert all(loss[step] == pytest.approx(seen[step][1]) for step in loss), (loss, [s[1] for s in seen])
    assert all(grad_norm[step] == pytest.approx(norms[step].item()) for step in grad_norm), (grad_norm, norms)


def test_under_gradient_accumulation_train_loss_is_the_mean_over_the_steps_micro_batches(
    tiny_run_args, record_training_losses, corpus, data_root, tmp_path, monkeypatch
):
    """With accumulate_grad_batches=2 an optimizer step's gradient is the mean over two micro-batches: the written
    train_loss is the mean of their two losses, at each logged step (every 3), not the last micro-batch's loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = record_training_losses(monkeypatch)
    main(
        tiny_run_args(
            corpus,
            data_root,
            tmp_path / "run",
            steps=12,
            trainer__accumulate_grad_batches=2,
            trainer__log_every_n_steps=3,
        )
    )
    assert len(seen) == 24
    step_loss = [(seen[2 * s][1] + seen[2 * s + 1][1]) / 2 for s in range(12)]
    events = EventAccumulator(str(tmp_path / "run")).Reload()
    written = {e.step: e.value for e in events.Scalars("train_loss")}
    assert sorted(written) == sorted(e.step for e in events.Scalars("grad_norm")) == [2, 5, 8, 11]
    assert all(written[step] == pytest.approx(step_loss[step]) for step in written), (written, step_loss)


def under_fsdp(module: GPTLightningModule, **trainer_attrs) -> GPTLightningModule:
    """FSDP itself needs a GPU: Lightning's own FSDP strategy and precision objects stand in for a trainer running
    it."""
    module._trainer = SimpleNamespace(
        strategy=FSDPStrategy(), precision_plugin=FSDPPrecision("32-true"), **trainer_attrs
    )
    return module


def test_fsdp_clips_by_the_norm_over_every_shard():
    """Lightning's FSDP plugin refuses to clip by norm (a sharded model's norm spans all ranks): the module clips
    through the FSDP root module instead, and logs the norm it returns."""
    clipped = []
    root = SimpleNamespace(clip_grad_norm_=lambda max_norm: clipped.append(max_norm) or torch.tensor(3.0))
    module = under_fsdp(GPTLightningModule(GPTConfig.from_name("tiny")), model=root)
    module.configure_gradient_clipping(torch.optim.SGD(module.parameters()), 0.5, "norm")
    assert clipped == [0.5] and module._clip_norm.item() == 3.0


def test_muon_under_fsdp_is_refused_with_the_fix():
    """Muon needs whole matrices; FSDP shards them.  Every rank refuses alike: a ConfigError, which only the first
    rank prints (a UserError was one line per rank)."""
    module = under_fsdp(GPTLightningModule(GPTConfig.from_name("tiny"), OptimConfig(optimizer="muon")))
    with pytest.raises(ConfigError, match="muon cannot train under FSDP.*--trainer.strategy ddp"):
        module.configure_optimizers()


@pytest.mark.parametrize("base_dtype", [None, "bfloat16"])
def test_a_lora_base_in_its_own_dtype_under_fsdp_is_one_line_before_the_wrap(base_dtype):
    """FSDP flattens the model into one dtype: a bf16 base beside float32 adapters failed to wrap under bf16-mixed
    (a traceback from every rank), and under 32-true Lightning held the base in float32 again, unasked.  Refused in
    setup, before the wrap; a float32 base trains (adapters and base flatten together)."""
    config = GPTConfig.from_name("tiny")
    model = lora_model(GPT(config), config, LoRAConfig(rank=4, base_dtype=base_dtype))
    module = under_fsdp(GPTLightningModule(config, model=model))
    if base_dtype is None:
        module.setup("fit")
        return
    with pytest.raises(ConfigError, match="lora.base_dtype cannot hold the base under FSDP.*--trainer.strategy ddp"):
        module.setup("fit")


def test_a_lora_checkpoint_loads_as_lightnings_fsdp_loads_it():
    """Lightning's FSDP loads a checkpoint's state_dict into the module (strictly unless the module says otherwise)
    and takes it out before on_load_checkpoint: a LoRA run's, which holds the adapters alone, failed there (missing
    keys: the frozen base), and on_load_checkpoint then failed for the state_dict it had taken out."""
    config = GPTConfig.from_name("tiny")
    torch.manual_seed(0)
    saved = GPTLightningModule(config, model=lora_model(GPT(config), config, LoRAConfig(rank=4)), lora={})
    trained = adapter_names(saved)
    for name, value in saved.state_dict().items():
        if name in trained:
            value.normal_()  # adapters away from their start (B is zero there)
    ckpt = {"state_dict": {k: v.clone() for k, v in saved.state_dict().items() if k in trained}}
    torch.manual_seed(0)  # the same base, as init_from reads it again
    module = under_fsdp(GPTLightningModule(config, model=lora_model(GPT(config), config, LoRAConfig(rank=4)), lora={}))
    module.setup("fit")
    module.load_state_dict(ckpt.pop("state_dict"), strict=module.strict_loading)  # in the strategy's load_checkpoint
    module.on_load_checkpoint(ckpt)
    for name, value in saved.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


def test_a_checkpoint_numbers_its_optimizer_state_as_fsdp_reads_it(tiny_run_args, corpus, data_root, tmp_path):
    """Lightning's FSDP, resuming, takes a saved state's id i for the module's i-th parameter, as its own saves number
    them; torch's optimizer numbers its groups' parameters in turn (decayed matrices first).  A one-device or DDP
    run resumed under FSDP gave parameters the moments of others, of other shapes (on the CPU, a heap corruption)."""
    run = tmp_path / "run"
    main(tiny_run_args(corpus, data_root, run, steps=2))
    ckpt = read_checkpoint(run / "checkpoints" / "last.ckpt")
    params = list(GPTLightningModule(GPTConfig(**ckpt["minigpt"]["model_config"])).parameters())
    (optimizer,) = ckpt["optimizer_states"]
    assert sorted(optimizer["state"]) == sorted(i for g in optimizer["param_groups"] for i in g["params"])
    assert len(optimizer["state"]) == len(params)
    for i, state in optimizer["state"].items():
        assert state["exp_avg"].shape == params[i].shape, i


def test_same_seed_same_run_other_seed_other_run(tiny_run_args, corpus, data_root, tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        main(tiny_run_args(corpus, data_root, tmp_path / name, steps=12, seed=seed))
    a, b, c = (weights(tmp_path / n / "checkpoints" / "last.ckpt") for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize(
    "arch,attention,n_kv_head",
    [
        ("gpt", "sdpa", 2),
        ("gpt", "manual", 2),
        ("gpt", "einops", 2),
        ("llama", "sdpa", 1),
        ("llama", "manual", 1),
        ("llama", "einops", 2),
    ],
)
def test_every_attention_path_and_block_trains(tiny_run_args, corpus, data_root, tmp_path, arch, attention, n_kv_head):
    trainer = main(
        tiny_run_args(
            corpus,
            data_root,
            tmp_path / "run",
            steps=10,
            model__arch=arch,
            model__attention=attention,
            model__n_kv_head=n_kv_head,
        )
    )
    cfg = trainer.lightning_module.config
    assert (cfg.arch, cfg.attention, cfg.n_kv_head) == (arch, attention, n_kv_head)
    assert math.isfinite(trainer.callback_metrics["val_loss"].item())


def test_bf16_mixed_trains_with_gradient_clipping(tiny_run_args, corpus, data_root, tmp_path, monkeypatch):
    """Lightning refuses to clip gradients of a fused optimizer under mixed precision; bf16 has no gradient
    scaler, so the module clips itself.  The clip must really happen: record the norms clip_grad_norm_ sees."""
    seen = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(
        torch.nn.utils,
        "clip_grad_norm_",
        lambda params, max_norm, *a, **k: seen.append((max_norm, real(params, max_norm, *a, **k))),
    )
    trainer = main(
        tiny_run_args(
            corpus,
            data_root,
            tmp_path / "run",
            steps=10,
            trainer__precision="bf16-mixed",
            trainer__gradient_clip_val=0.5,
        )
    )
    assert trainer.global_step == 10 and math.isfinite(trainer.callback_metrics["val_loss"].item())
    assert len(seen) == 10 and all(max_norm == 0.5 for max_norm, _ in seen)


def test_paths_give_the_same_training(tiny_run_args, corpus, data_root, tmp_path):
    """Same seed, same data: the sdpa and manual paths train to the same weights (up to float rounding)."""
    for attention in ("sdpa", "manual"):
        main(tiny_run_args(corpus, data_root, tmp_path / attention, steps=10, model__attention=attention))
    a, b = (weights(tmp_path / n / "checkpoints" / "last.ckpt") for n in ("sdpa", "manual"))
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_exactly(tiny_run_args, corpus, data_root, tmp_path, optimizer, monkeypatch):
    # the first part stops at step 10 of a 20-step schedule, as a run killed there would
    def args(out, steps):
        return tiny_run_args(
            corpus,
            data_root,
            tmp_path / out,
            steps=steps,
            optim__decay_steps=20,
            optim__optimizer=optimizer,
            model__dropout=0.1,
        )

    main(args("straight", 20))
    main(args("resumed", 10))
    reads = []
    load_torch_file = checkpoint.load_torch_file
    monkeypatch.setattr(
        checkpoint, "load_torch_file", lambda path, *a, **k: reads.append(path) or load_torch_file(path, *a, **k)
    )
    trainer = main(args("resumed", 20) + ["--resume", "true"])
    assert trainer.global_step == 20
    assert len(reads) == 1, "minigpt's resume checks and Lightning's restore share one read of last.ckpt"
    a = weights(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    b = weights(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert all(torch.equal(a[k], b[k]) for k in a), "a resumed run must match an uninterrupted one bitwise"
    # and its logs sit at the same steps: the first part ended on a validation step (10 of val_check_interval 10),
    # whose end-of-run checkpoint Lightning read as one made before that step was counted (every point was 1 late)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def points(run: str, tag: str) -> list[tuple[int, float]]:
        events = EventAccumulator(str(tmp_path / run), size_guidance={"scalars": 0}).Reload()
        return sorted({(e.step, round(e.value, 5)) for e in events.Scalars(tag)})

    for tag in ("train_loss", "val_loss", "lr/pg1"):
        assert points("resumed", tag) == points("straight", tag), tag


@pytest.mark.parametrize("before,after", [(2, 1), (1, 3)])
def test_a_resume_with_another_accumulate_grad_batches_goes_on_with_the_next_batch(
    tiny_run_args, corpus, data_root, tmp_path, monkeypatch, record_training_losses, before, after
):
    """The loader's position was the step times the new accumulate_grad_batches: fewer trained again on the run's
    last batches, more skipped batches it had never seen.  The resume takes the batches an uninterrupted run of the
    new setting draws after those the run read."""
    seen = record_training_losses(monkeypatch)

    def argv(out, steps, accumulate):
        return tiny_run_args(corpus, data_root, tmp_path / out, steps, trainer__accumulate_grad_batches=accumulate)

    main(argv("straight", 3 * before + 2 * after, 1))  # every batch of the run, one a step
    drawn = [batch for batch, _ in seen]
    main(argv("run", 3, before))
    main(argv("run", 5, after) + ["--resume", "true"])
    read = [batch for batch, _ in seen[len(drawn) :]]
    assert len(read) == len(drawn) and all(torch.equal(a, b) for a, b in zip(read, drawn, strict=True))


def test_existing_run_is_not_overwritten_by_accident(tiny_run_args, corpus, data_root, tmp_path):
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=5))
    before = (tmp_path / "run" / "checkpoints" / "last.ckpt").read_bytes()
    with pytest.raises(UserError, match="already holds a run; continue it with --resume"):
        main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=5))
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").read_bytes() == before
    with pytest.raises(UserError, match="--resume: no checkpoint at"):
        main(tiny_run_args(corpus, data_root, tmp_path / "empty", steps=5) + ["--resume", "true"])
    # both refused before the data is prepared (a large corpus's BPE takes minutes): a new corpus is not read
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    prepared = sorted(Path(data_root).iterdir())
    with pytest.raises(UserError, match="already holds a run"):
        main(tiny_run_args(other, data_root, tmp_path / "run", steps=5))
    with pytest.raises(UserError, match="--resume: no checkpoint at"):
        main(tiny_run_args(other, data_root, tmp_path / "empty", steps=5) + ["--resume", "true"])
    assert sorted(Path(data_root).iterdir()) == prepared


def test_a_resumed_or_overwriting_runs_config_yaml_starts_a_new_run_when_fed_back(
    tiny_run_args, corpus, data_root, tmp_path
):
    """config.yaml recorded the launch's one-off switches: fed back, `resume: true` was refused in a new out_dir, and
    `overwrite: true` would set the run itself aside when its out_dir was kept."""
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=2))
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=3) + ["--resume", "true"])
    main(tiny_run_args(corpus, data_root, tmp_path / "over", steps=3))
    main(tiny_run_args(corpus, data_root, tmp_path / "over", steps=3) + ["--overwrite", "true"])
    for run in ("run", "over"):
        recorded = (tmp_path / run / "config.yaml").read_text()
        assert "resume: false" in recorded and "overwrite: false" in recorded
        main(["--config", str(tmp_path / run / "config.yaml"), "--out_dir", str(tmp_path / f"{run}_again")])
        with pytest.raises(UserError, match="already holds a run"):  # its own out_dir: refused, not set aside
            main(["--config", str(tmp_path / run / "config.yaml")])


def test_resume_with_another_model_shape_is_refused(tiny_run_args, corpus, data_root, tmp_path):
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=5))
    with pytest.raises(UserError, match=r"was trained with n_embd=32 \(this run's config gives 64\)"):
        main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=10, model__n_embd=64) + ["--resume", "true"])


@pytest.mark.parametrize(
    "flag,value,match",
    [
        ("--model.n_layerz", "2", "unrecognized arguments: --model.n_layerz"),
        ("--model.n_layer", "two", 'Parser key "model.n_layer"'),
        ("--trainer.max_stepz", "2", "unrecognized arguments: --trainer.max_stepz"),
    ],
)
def test_unknown_key_or_wrong_type_names_the_key(
    tiny_run_args, corpus, data_root, tmp_path, capsys, flag, value, match
):
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_run_args(corpus, data_root, tmp_path / "run") + [flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


def test_overrides_and_config_files(tiny_run_args, corpus, data_root, tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text("model:\n  arch: llama\n  n_kv_head: 1\n  n_layer: 2\ndata:\n  tokenizer: byte\n")
    args = tiny_run_args(corpus, data_root, tmp_path / "run", steps=3)
    trainer = main(["--config", str(config)] + args + ["--model.n_layer", "1"])
    cfg = trainer.lightning_module.config
    assert (cfg.arch, cfg.n_kv_head, cfg.n_layer, cfg.vocab_size, cfg.block_size) == ("llama", 1, 1, 256, 32)
    assert trainer.datamodule.hparams.block_size == 32  # linked from model.block_size


def test_an_out_dir_written_with_a_tilde_is_one_folder(tiny_run_args, corpus, data_root, tmp_path, monkeypatch):
    """`out_dir: ~/runs/x` in a config, or --out_dir=~/runs/x (the shell leaves it as it is): the checkpoints and logs
    (Lightning expands "~") and the run's own files and checks (--resume, "already holds a run") were in two
    folders, $HOME/runs/x and ./~/runs/x."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    args = tiny_run_args(corpus, data_root, tmp_path / "unused", steps=2) + ["--out_dir=~/runs/x"]  # the last wins
    main(args + ["--data.data_root=~/prepared"])  # the prepared data went to ./~/prepared
    run = tmp_path / "home" / "runs" / "x"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()
    assert (tmp_path / "home" / "prepared").is_dir() and not (tmp_path / "~").exists()
    assert main(args + ["--resume", "true", "--trainer.max_steps", "3"]).global_step == 3  # the run is found
    # and where another command or run reads it (was "checkpoint not found: ~/runs/x")
    from minigpt.cli.sample import main as sample_main

    sample_main(["--ckpt=~/runs/x", "--prompt", "a", "--max_new_tokens", "2"])
    assert main(tiny_run_args(corpus, data_root, tmp_path / "tuned", steps=1) + ["--init_from=~/runs/x"])


def test_a_flag_nothing_reads_is_noted_once_and_a_config_files_is_not(corpus, data_root, tmp_path, capsys):
    """--compile_mode without --compile, --lora.rank without --finetune lora: the run goes on (a sweep may toggle
    the switch), and one note says the flag does nothing; the GPU recipe's compile_mode under --compile false is
    the recipe's, not noted."""
    from minigpt.cli.train import parse

    local = ["--data.source", str(corpus), "--data.data_root", str(data_root), "--out_dir", str(tmp_path)]
    parse(["--compile_mode", "reduce-overhead", "--lora.rank", "4", "--lora.rank", "8", *local])
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: --")]
    assert notes == [
        "note: --compile_mode is read only with --compile: it does nothing in this run",
        "note: --lora.rank is read only with --finetune lora: it does nothing in this run",
    ]
    recipe = ["--config", str(REPO / "configs" / "shakespeare_char_gpu.yaml"), "--compile", "false"]
    parse(recipe + ["--optim.cooldown_fraction", "0.3", *local])
    assert "note: --" not in capsys.readouterr().err


def test_train_py_help_and_print_config():
    result = subprocess.run(
        [sys.executable, "train.py", "--print_config"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for key in ("attention: sdpa", "arch: gpt", "source: stdlib", "tokenizer: char", "max_steps:", "out_dir:"):
        assert key in result.stdout, key


@pytest.mark.slow
def test_two_process_ddp_on_cpu_trains(tiny_run_args, corpus, tmp_path):
    """Two CPU processes train to the end and save, and the val loss is the mean over every batch, 3 split 2 + 1
    between the ranks (the ranks' means were averaged)."""
    from minigpt.cli.train import parse
    from support import scalars

    args = tiny_run_args(corpus, tmp_path / "data", tmp_path / "run", steps=10, data__val_batches=3)
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    result = subprocess.run(
        [sys.executable, "train.py", *args, *ddp], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "estimated val loss" in result.stdout
    assert result.stdout.count("full val loss: not computed under 2 processes (it runs in one process)") == 1
    assert result.stdout.count("data: prepared") == 1 and "data: using" not in result.stdout  # rank 1's said once
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert read_checkpoint(last)["global_step"] == 10
    model = build_model(read_checkpoint(last)).eval()
    data = parse(args + ["--out_dir", str(tmp_path / "scratch")]).datamodule
    data.prepare_data()
    with torch.no_grad():
        losses = [model(batch[:, :-1], batch[:, 1:])[1] for batch in data.val_dataloader()]
    assert len(losses) == 3
    assert scalars(tmp_path / "run")["val_loss"][-1] == pytest.approx(torch.stack(losses).mean().item(), abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, ranks",
    [
        ("SIGTERM", "{0: 3}"),  # to the launcher (a scheduler's kill of the main process)
        ("SIGTERM", "{0: 3, 1: 4}"),  # to every process, a step apart (a group kill): Lightning's handler hung
        ("SIGINT", "{0: 3}"),  # Ctrl-C to the launcher alone: it stopped, rank 1 trained on (a hang)
    ],
)
def test_a_signal_under_ddp_stops_every_rank_at_one_step_and_says_so_once(tiny_run_args, corpus, tmp_path, name, ranks):
    """Any rank's signal stops every rank at the same step, which is saved; the line is printed once, by rank 0."""
    script = tmp_path / "train_signal.py"  # the DDP workers run this script again, so it patches them too
    script.write_text(
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from minigpt.training.lightning_module import GPTLightningModule\n"
        "def on_train_batch_end(self, *args):\n"
        f"    if self.global_step == {ranks}.get(self.global_rank):\n"
        f"        os.kill(os.getpid(), signal.{name})\n"
        "GPTLightningModule.on_train_batch_end = on_train_batch_end\n"
        "from minigpt.cli.main import run_command\n"
        "run_command('train')\n"
    )
    run = tmp_path / "run"
    args = tiny_run_args(corpus, tmp_path / "data", run, steps=50, data__val_batches=2)
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    result = subprocess.run(
        [sys.executable, str(script), *args, *ddp], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 128 + getattr(signal, name), result.stderr[-3000:]
    last = run / "checkpoints" / "last.ckpt"
    step = read_checkpoint(last)["global_step"]
    assert step < 10  # stopped there, not trained on
    stops = [line for line in result.stderr.splitlines() if "stopped by" in line]
    what = "error: stopped by SIGTERM" if name == "SIGTERM" else "stopped by SIGINT (Ctrl-C)"
    assert stops == [f"{what} at step {step}; saved {last}; continue the run with --resume"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not {".train.lock", ".train.pid"} & {p.name for p in run.iterdir()}


@pytest.mark.slow
def test_an_error_on_one_ddp_rank_is_its_line_and_one_line_from_the_other(tiny_run_args, corpus, tmp_path):
    """A mistake only rank 1 meets (a GRPO reward that fails on its prompts) stops it with its line; rank 0 then
    lost its peer in the next collective, which was gloo's traceback."""
    script = tmp_path / "train_fail.py"  # the DDP workers run this script again, so it patches them too
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from minigpt.core.errors import UserError\n"
        "from minigpt.training.lightning_module import GPTLightningModule\n"
        "def on_train_batch_end(self, *args):\n"
        "    if self.global_rank == 1 and self.global_step == 2:\n"
        "        raise UserError('rank 1 met a mistake')\n"
        "GPTLightningModule.on_train_batch_end = on_train_batch_end\n"
        "from minigpt.cli.main import run_command\n"
        "run_command('train')\n"
    )
    args = tiny_run_args(corpus, tmp_path / "data", tmp_path / "run", steps=20, data__val_batches=2)
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    result = subprocess.run(
        [sys.executable, str(script), *args, *ddp], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: rank 1 met a mistake",
        "error: another process of this run stopped first (gloo: connection closed by peer); its error above says why",
    ], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_setting_every_ddp_rank_refuses_is_one_line(tiny_run_args, corpus, tmp_path):
    """Each rank runs train.py: a setting both refuse alike was printed once per rank."""
    args = tiny_run_args(corpus, tmp_path / "data", tmp_path / "run", steps=2, data__val_batches=1)
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    result = subprocess.run(
        [sys.executable, "train.py", *args, *ddp], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: data.val_batches: 1 validation batch(es) cannot be shared by 2 devices (each needs one); "
        "set data.val_batches to at least 2"
    ]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_parses_and_builds_its_model(config, capsys):
    """Parse each shipped config through train.py, then build its model and optimizer from the parsed
    sections as train.py does (the vocabulary comes from data we do not download here)."""
    import yaml

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(REPO / "configs" / config), "--print_config"])
    assert exit_info.value.code == 0
    parsed = yaml.safe_load(capsys.readouterr().out)
    vocab = 50257 if parsed["data"].get("tokenizer") == "gpt2" else 65  # a fine-tune's is its source's: not printed
    model_section = {k: v for k, v in (parsed.get("model") or {}).items() if k != "vocab_size"}
    module = GPTLightningModule(GPTConfig(**model_section, vocab_size=vocab), OptimConfig(**parsed["optim"]))
    assert module.model.num_params() > 0
    module.configure_optimizers()


def test_the_gpu_recipe_trains_a_few_steps_on_a_cpu(corpus, data_root, tmp_path):
    """configs/shakespeare_char_gpu.yaml on a machine without a GPU (its shape cut down): its CUDA-graph compile
    mode says it needs a GPU and the run trains eagerly, Muon, WSD and all, to its best checkpoint."""
    argv = ["--config", str(REPO / "configs" / "shakespeare_char_gpu.yaml"), "--data.source", str(corpus)]
    argv += ["--data.data_root", str(data_root), "--out_dir", str(tmp_path / "run"), "--model.n_layer", "2"]
    argv += ["--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32", "--data.batch_size", "4"]
    argv += ["--data.val_batches", "2", "--trainer.max_time", "null", "--trainer.max_steps", "6"]
    argv += ["--trainer.val_check_interval", "3", "--eval_full", "false"]
    why = r"compile_mode cudagraphs needs a CUDA GPU \(this run is on cpu: --compile_mode default compiles there\)"
    with pytest.warns(UserWarning, match=why + "; training without compiling"):
        trainer = main(argv)
    assert trainer.global_step == 6
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "best.ckpt")["global_step"] in (3, 6)


def test_validation_in_larger_batches_leaves_training_and_the_full_split_loss_as_they_were(
    tiny_run_args, corpus, data_root, tmp_path, capsys
):
    """--data.val_batch_size: validation (and the full split at the end) in batches of its own size, for a GPU whose
    small model's batches cost launches more than compute.  Training is untouched, the full split's loss is the same
    figure, and the validation batches have the size asked for."""
    runs = {}
    for name, extra in (("default", {}), ("larger", {"data__val_batch_size": 24, "data__val_batches": 1})):
        trainer = main(tiny_run_args(corpus, data_root, tmp_path / name, steps=12, **extra))
        full = re.search(r"^full val loss ([\d.]+) over all", capsys.readouterr().out, re.M)[1]
        sizes = {len(batch) for batch in trainer.datamodule.val_dataloader()}
        runs[name] = weights(tmp_path / name / "checkpoints" / "last.ckpt"), full, sizes
    (a, full_a, sizes_a), (b, full_b, sizes_b) = runs["default"], runs["larger"]
    assert sizes_a == {8} and sizes_b == {24}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert full_a == full_b


@pytest.mark.slow
def test_compiled_training_matches_eager(tiny_run_args, corpus, data_root, tmp_path, monkeypatch):
    """--compile true compiles before the clock starts, on a dummy batch that must leave no trace: the compiled
    run ends where the eager one does (up to kernel rounding).  With dropout, so a warm-up that moved the RNG
    would show: inductor's fallback_random makes compiled dropout draw from torch's RNG as eager does.  The
    training steps compile nothing more (a recompile there would count in a time budget): they run with
    torch's fail_on_recompile stance."""
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    real_step = GPTLightningModule.training_step

    def training_step(self, batch, batch_idx):
        with torch.compiler.set_stance("fail_on_recompile"):
            return real_step(self, batch, batch_idx)

    monkeypatch.setattr(GPTLightningModule, "training_step", training_step)
    runs = {}
    # eager; the blocks and head compiled as regions (the default); the whole model as one graph; regions under
    # reduce-overhead (no CUDA graphs on a CPU: the gradients zeroed in place, which must train the same)
    for compile, regions, mode in (
        (False, True, "default"),
        (True, True, "default"),
        (True, False, "default"),
        (True, True, "reduce-overhead"),
    ):
        name = f"{compile}-{regions}-{mode}"
        trainer = main(
            tiny_run_args(
                corpus,
                data_root,
                tmp_path / name,
                steps=10,
                model__arch="llama",
                model__dropout=0.1,
                compile=compile,
                compile_regions=regions,
                compile_mode=mode,
            )
        )
        runs[name] = weights(tmp_path / name / "checkpoints" / "last.ckpt")
        assert trainer.global_step == 10
        compiled = [c for c in trainer.callbacks if isinstance(c, CompileModel)]
        assert (len(compiled) == 1 and compiled[0].seconds is not None) == compile
        model = trainer.lightning_module.model
        blocks_compiled = [getattr(b, "_compiled_call_impl", None) is not None for b in model.transformer.h]
        assert blocks_compiled == [compile and regions] * len(blocks_compiled)
        assert (getattr(model, "_compiled_call_impl", None) is not None) == (compile and not regions)
    eager = runs["False-True-default"]
    for name in ("True-True-default", "True-False-default", "True-True-reduce-overhead"):
        assert all(torch.allclose(eager[k], runs[name][k], atol=1e-4) for k in eager), name


def test_a_sliding_window_model_trains_and_its_checkpoint_loads_and_samples(tiny_run_args, corpus, data_root, tmp_path):
    """--model.sliding_window 16 (with per-layer types, a local RoPE base and partial rotary) trains through
    train.py; the checkpoint keeps the fields, loads, and sample.py prints the greedy text generate() gives,
    also past the window."""
    import io

    from minigpt.cli.sample import main as sample_main
    from minigpt.core.generation import generate

    window = dict(
        model__arch="llama",
        model__n_layer=2,
        model__sliding_window=16,
        model__layer_types="[sliding_attention, full_attention]",
        model__rope_local_base=1000.0,
        model__partial_rotary_factor=0.5,
    )
    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=10, **window))
    assert math.isfinite(trainer.callback_metrics["val_loss"].item())
    ckpt_path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt = read_checkpoint(ckpt_path)
    model = build_model(ckpt).eval()
    c = model.config
    assert (c.sliding_window, c.layer_types, c.rope_local_base, c.partial_rotary_factor) == (
        16,
        ["sliding_attention", "full_attention"],
        1000.0,
        0.5,
    )
    assert model.transformer.h[0].attn.window == 16 and model.transformer.h[1].attn.window is None
    tok = checkpoint_tokenizer(ckpt)
    prompt = "the quick brown fox"
    ids = torch.tensor([tok.encode(prompt)])
    n = 32 - ids.size(1)  # to block_size: with and without the cache the same function, well past the window
    want = tok.decode(generate(model, ids, n, temperature=0)[0, ids.size(1) :].tolist())
    assert want == tok.decode(generate(model, ids, n, temperature=0, use_kv_cache=False)[0, ids.size(1) :].tolist())
    out = io.StringIO()
    sample_main(
        ["--ckpt", str(ckpt_path), "--prompt", prompt, "--temperature", "0", "--max_new_tokens", str(n)], stdout=out
    )
    assert want in out.getvalue()
