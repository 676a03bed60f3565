"""The training callbacks (minigpt.training.callbacks).  AttentionImages: the attention grid in TensorBoard at each
validation.  --eval_tasks: lm-evaluation-harness tasks at each validation of train.py, logged to TensorBoard as
eval/<task>/<metric>; the same figures eval.py --tasks gives on the checkpoint of that step, and training itself
untouched (the harness seeds every RNG)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.cli import eval as eval_cli
from minigpt.cli.train import main
from minigpt.core.checkpoint import read_checkpoint
from minigpt.core.tokenizers import CharTokenizer
from minigpt.training.callbacks import AttentionImages

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")

REPO = Path(__file__).resolve().parents[2]
WORDS = "the quick brown fox jumps over a lazy dog while cats sit on warm mats and birds sing".split()


@pytest.fixture(scope="module")
def task_files(tmp_path_factory) -> list[Path]:
    """A multiple-choice and a rolling-perplexity task in the corpus's characters (the conftest word corpus)."""
    folder = tmp_path_factory.mktemp("train_tasks")
    mc = [
        {"q": f"the {a} sit on", "choices": [" warm mats", " the dog", " birds sing"], "answer": i % 3}
        for i, a in enumerate(["fox", "dog", "cats", "birds", "a lazy dog"])
    ]
    ppl = [{"text": " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(30))} for i in range(4)]
    files = []
    for name, rows, body in [
        (
            "train_mc",
            mc,
            'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n',
        ),
        (
            "train_ppl",
            ppl,
            'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
            "metric_list:\n  - metric: bits_per_byte\n",
        ),
    ]:
        (folder / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {folder / f'{name}.jsonl'}\ntest_split: test\n{body}"
        )
        files.append(folder / f"{name}.yaml")
    return files


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run)).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def harness_on_checkpoint(ckpt: Path, task_files: list[Path], limit: int) -> dict[str, float]:
    results = eval_cli.run(["--ckpt", str(ckpt), "--tasks", ",".join(map(str, task_files)), "--limit", str(limit)])
    return {
        "eval/train_mc/acc": results["results"]["train_mc"]["acc,none"],
        "eval/train_ppl/bits_per_byte": results["results"]["train_ppl"]["bits_per_byte,none"],
    }


@needs_lm_eval
def test_eval_tasks_are_logged_at_each_validation_and_leave_training_as_it_was(
    tiny_run_args, corpus, data_root, tmp_path, task_files, caplog
):
    args = tiny_run_args(corpus, data_root, tmp_path / "run", steps=20)
    main([*args, "--eval_tasks", ",".join(map(str, task_files)), "--eval_limit", "4"])
    logged = scalars(tmp_path / "run")
    for tag in ("eval/train_mc/acc", "eval/train_ppl/bits_per_byte"):
        assert [step for step, _ in logged[tag]] == [10, 20], tag
    # the console line says what the tasks cost at each validation
    said = [re.match(r"harness at step (\d+) \([\d.]+s\): eval/train_mc/acc ", m) for m in caplog.messages]
    assert [int(m[1]) for m in said if m] == [10, 20], caplog.messages
    # the figures at step 20 are the harness's on the checkpoint of step 20
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert read_checkpoint(last)["global_step"] == 20
    for tag, value in harness_on_checkpoint(last, task_files, limit=4).items():
        assert abs(logged[tag][-1][1] - value) < 1e-5, tag
    assert logged["eval/train_ppl/bits_per_byte"][-1][1] < logged["eval/train_ppl/bits_per_byte"][0][1], (
        "the model learns"
    )
    # the same run without the harness trains to the same weights: its seeding did not reach training's RNG
    main(tiny_run_args(corpus, data_root, tmp_path / "plain", steps=20))
    ours, plain = (
        read_checkpoint(p / "checkpoints" / "last.ckpt")["state_dict"] for p in (tmp_path / "run", tmp_path / "plain")
    )
    assert all(torch.equal(ours[k], plain[k]) for k in plain)


@needs_lm_eval
def test_a_misspelt_eval_task_stops_the_run_before_training(tiny_run_args, corpus, data_root, tmp_path, capsys):
    from minigpt.cli.errors import run_cli

    with pytest.raises(SystemExit) as exit_info:
        run_cli(
            lambda: main(
                [*tiny_run_args(corpus, data_root, tmp_path / "run"), "--eval_tasks", str(tmp_path / "nope.yaml")]
            )
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: task file not found: {tmp_path / 'nope.yaml'}; give an existing task YAML file or a task name"
    ]
    assert not (tmp_path / "run" / "checkpoints").exists()


@needs_lm_eval
def test_a_task_that_fails_at_a_validation_stops_the_run_there_saved(
    tiny_run_args, corpus, data_root, tmp_path, capsys
):
    """Answers longer than the context are found only when scored: the run stops after that validation, with its
    best.ckpt and last.ckpt (the error had ended it before them, the steps since the last save lost), in one line."""
    rows = [{"q": "the fox", "choices": [" warm mats and birds sing while cats sit on a dog", " the dog"], "answer": 0}]
    (tmp_path / "long.jsonl").write_text(json.dumps(rows[0]) + "\n")
    task = tmp_path / "long.yaml"
    task.write_text(
        f"task: long\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'long.jsonl'}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    from minigpt.cli.errors import run_cli

    run = tmp_path / "run"
    args = tiny_run_args(corpus, data_root, run, steps=30, checkpoint_every=25)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main([*args, "--eval_tasks", str(task)]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    last = run / "checkpoints" / "last.ckpt"
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: a continuation of 50 tokens ('warm mats and birds sing while cats sit...') does not fit the "
        "model's context (block_size=32); use a task with "
        "shorter answers or a model with a longer context; the run stopped at that validation (step 10) and saved "
        f"{last}: continue it with --resume once the task works"
    ]
    assert read_checkpoint(last)["global_step"] == read_checkpoint(last.with_name("best.ckpt"))["global_step"] == 10


@needs_lm_eval
@pytest.mark.slow
def test_two_process_ddp_splits_the_examples_and_logs_what_one_process_gets(
    tiny_run_args, corpus, tmp_path, task_files
):
    """Each rank scores its share of the examples; rank 0 logs the gathered figures, which equal the harness's
    on the checkpoint in one process."""
    args = tiny_run_args(corpus, tmp_path / "data", tmp_path / "run", steps=10)
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            *args,
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ddp",
            "--eval_tasks",
            ",".join(map(str, task_files)),
            "--eval_limit",
            "5",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logged = scalars(tmp_path / "run")
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert read_checkpoint(last)["global_step"] == 10
    for tag, value in harness_on_checkpoint(last, task_files, limit=5).items():
        assert [step for step, _ in logged[tag]] == [10], tag
        assert abs(logged[tag][0][1] - value) < 1e-5, tag


# ---------------------------------------------------------------------------------------------------
# AttentionImages: a TensorBoard image at each validation


def test_training_logs_the_attention_grid_to_tensorboard(tiny_run_args, corpus, data_root, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from minigpt.cli.train import main as train_main

    train_main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=10))  # 1 layer x 2 heads: auto = on
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"images": 0}).Reload()
    assert "attention" in events.Tags()["images"], events.Tags()
    image = events.Images("attention")[-1]
    cell = image.height - 2 * 2  # one row (layer) of two heatmaps (heads), 2-pixel gaps
    assert image.step == 10 and cell >= 48 and image.width == 2 * cell + 3 * 2


def test_attention_images_switch():
    assert AttentionImages("auto").active_for(8, 8) and not AttentionImages("auto").active_for(12, 12)
    assert AttentionImages(True).active_for(12, 12) and not AttentionImages(False).active_for(1, 1)
    probe = AttentionImages().probe_ids(CharTokenizer("abcdef "), block_size=5)
    assert 0 < len(probe) <= 5  # characters outside the vocabulary are left out, the probe cropped


def test_the_logged_text_sample_is_what_the_checkpoint_draws_with_the_run_seed(
    tiny_run_args, corpus, data_root, tmp_path
):
    """TextSamples draws with --seed (it drew with 0 whatever the seed was), so a user gets the logged text back from
    the checkpoint of that step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from minigpt import generate, load_model
    from minigpt.core.generation import prompt_ids

    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=10) + ["--seed", "7"])
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"tensors": 0}).Reload()
    (logged,) = events.Tensors("sample/text_summary")
    model, tokenizer = load_model(tmp_path / "run" / "checkpoints" / "last.ckpt")
    start = prompt_ids(tokenizer, "")
    texts = {}
    for seed in (7, 0):
        g = torch.Generator().manual_seed(seed)
        out = generate(model, torch.tensor([start]), 8, temperature=0.8, top_k=200, generator=g)
        texts[seed] = "```\n" + tokenizer.decode(out[0, len(start) :].tolist()) + "\n```"
    assert logged.step == 10 and texts[7] != texts[0]
    assert logged.tensor_proto.string_val[0].decode() == texts[7]


def test_a_validations_metrics_are_logged_at_the_step_it_validated(tiny_run_args, corpus, data_root, tmp_path):
    """val_loss and val_ppl sat one step before their validation (Lightning's logger step counts an optimizer step
    only after the validation that follows it): a 20-step run's last val_loss showed at step 19, its text sample,
    attention image and best.ckpt at step 20.  The CSV logger's rows likewise."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=20))
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0, "tensors": 0, "images": 0}).Reload()
    validated = [e.step for e in events.Tensors("sample/text_summary")]
    assert validated == [e.step for e in events.Images("attention")] == [10, 20]
    for tag in ("val_loss", "val_ppl"):
        assert [e.step for e in events.Scalars(tag)] == validated, tag
    assert events.Scalars("val_loss")[-1].value == pytest.approx(trainer.callback_metrics["val_loss"].item())
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "best.ckpt")["global_step"] == 20

    csv = ["--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", str(tmp_path / "csv")]
    main(tiny_run_args(corpus, data_root, tmp_path / "csv-run", steps=20) + csv)
    (table,) = (tmp_path / "csv").rglob("metrics.csv")
    header, *rows = (line.split(",") for line in table.read_text().splitlines())
    assert [int(r[header.index("step")]) for r in rows if r[header.index("val_loss")]] == validated


def test_throughput_is_logged_at_the_logged_steps_with_the_tokens_trained(tiny_run_args, corpus, data_root, tmp_path):
    """TrainingThroughput: the rates of Lightning's Throughput, measured at the logged steps only (on a GPU, timing
    every batch would make the host wait for the GPU every step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = tiny_run_args(corpus, data_root, tmp_path / "run", steps=12) + ["--trainer.log_every_n_steps", "3"]
    trainer = main(args)
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0}).Reload()
    tokens = events.Scalars("train/device/items_per_sec")
    # the first logged step only opens the window: a rate needs two points
    assert [e.step for e in tokens] == [6, 9, 12]
    assert all(e.value > 0 for e in tokens)
    samples = events.Scalars("train/device/samples_per_sec")
    hp = trainer.datamodule.hparams
    for t, s in zip(tokens, samples):  # each sample is one window of block_size target tokens
        assert t.value == pytest.approx(s.value * hp.block_size, rel=1e-6)
    # FLOP/s: the model's FLOPs a batch times batches a second, at every logged step (a running total given as the
    # FLOPs since the previous update made it grow with the step)
    batches = events.Scalars("train/device/batches_per_sec")
    flops = events.Scalars("train/device/flops_per_sec")
    assert [e.step for e in flops] == [6, 9, 12]
    for f, b in zip(flops, batches):
        assert f.value == pytest.approx(b.value * trainer.lightning_module.flops_per_batch, rel=1e-5)
    # under gradient accumulation: one point per logged optimizer step (each of its micro-batches ended at it)
    accumulating = tiny_run_args(corpus, data_root, tmp_path / "acc", steps=12, trainer__accumulate_grad_batches=2)
    main(accumulating + ["--trainer.log_every_n_steps", "3"])
    events = EventAccumulator(str(tmp_path / "acc"), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("train/device/items_per_sec")] == [6, 9, 12]
    assert [e.step for e in events.Scalars("train/batches")] == [3, 6, 9, 12]


def test_with_several_loggers_each_gets_the_rates_and_tensorboard_the_text_sample(
    tiny_run_args, corpus, data_root, tmp_path
):
    """TrainingThroughput and TextSamples wrote to trainer.logger, the first of several loggers only: with a CSV
    logger given before TensorBoard's, TensorBoard had neither the train/* rates nor the text sample."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = [
        *("--trainer.logger+=CSVLogger", "--trainer.logger.save_dir", str(tmp_path / "csv")),
        *("--trainer.logger+=TensorBoardLogger", "--trainer.logger.save_dir", str(tmp_path / "tb")),
    ]
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=10) + loggers)
    (table,) = (tmp_path / "csv").rglob("metrics.csv")
    header, *rows = (line.split(",") for line in table.read_text().splitlines())
    assert [int(r[header.index("step")]) for r in rows if r[header.index("train/device/items_per_sec")]] == [10]
    (events,) = (tmp_path / "tb").rglob("events.out.tfevents.*")
    events = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    assert [e.step for e in events.Tensors("sample/text_summary")] == [10]
    assert [e.step for e in events.Scalars("train/device/items_per_sec")] == [10]


def test_the_throughput_totals_go_on_after_a_resume(tiny_run_args, corpus, data_root, tmp_path):
    """train/lengths, samples, batches and time count from the run's start, not from the resume (they fell to 0)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["--trainer.log_every_n_steps", "3", "--checkpoint_every", "6"]
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=6) + args)
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=12) + args + ["--resume", "true"])
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0}).Reload()
    for tag in ("train/lengths", "train/samples", "train/batches", "train/time"):
        values = [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.wall_time)]
        assert values == sorted(values) and len(values) >= 4, (tag, values)
    batches = {e.step: e.value for e in events.Scalars("train/batches")}
    assert batches[max(batches)] == 12


def test_the_start_up_report_names_each_part_and_adds_up(tiny_run_args, corpus, data_root, tmp_path):
    from minigpt.training.callbacks import StartupTimes

    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=2))
    report = next(c for c in trainer.callbacks if isinstance(c, StartupTimes)).report
    m = re.fullmatch(
        r"first optimizer step ([\d.]+)s after launch: imports ([\d.]+)s, config and model ([\d.]+)s, "
        r"Lightning setup ([\d.]+)s, first step ([\d.]+)s",
        report,
    )
    assert m, report
    total, parts = float(m[1]), [float(x) for x in m.groups()[1:]]
    assert sum(parts) == pytest.approx(total, abs=0.25)  # each part rounded to 0.1 s


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_gradients_zeroed_in_place_train_as_freed_ones_under_accumulation(optimizer):
    """--compile_mode reduce-overhead keeps the gradients in buffers of their own, zeroed in place (a CUDA graph's
    outputs are overwritten by its next replay), validations included; on the same batches, with two micro-batches
    per step, the weights end where freeing the gradients each step leaves them."""
    import lightning as L
    from lightning.pytorch.callbacks import LambdaCallback

    from minigpt.core.config import GPTConfig
    from minigpt.training.callbacks import CompileModel
    from minigpt.training.lightning_module import GPTLightningModule
    from minigpt.training.optim import OptimConfig

    batches = [torch.randint(0, 40, (2, 17), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    ends = []
    for in_place in (False, True):
        torch.manual_seed(0)
        config = GPTConfig(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40, dropout=0.0)
        module = GPTLightningModule(config, OptimConfig(optimizer=optimizer, learning_rate=1e-2, warmup_steps=0))
        # CompileModel's own set-up of the gradients under reduce-overhead, without compiling (CUDA graphs need a GPU)
        starts: list[int] = []
        hooks = [
            LambdaCallback(on_train_start=CompileModel(2, mode="reduce-overhead").on_train_start),
            LambdaCallback(on_train_start=lambda _, m, s=starts: s.extend(p.grad.data_ptr() for p in m.parameters())),
        ]
        trainer = L.Trainer(
            accelerator="cpu", max_steps=3, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, val_check_interval=2, limit_val_batches=1,
            num_sanity_val_steps=0, gradient_clip_val=1.0, callbacks=hooks if in_place else [],
        )  # fmt: skip
        loader = torch.utils.data.DataLoader(batches, batch_size=None)
        trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)  # validations between the steps
        assert trainer.global_step == 3
        if in_place:  # the buffers made at the start, added into in place (no reference is held to them here)
            assert module.grads_in_place and [p.grad.data_ptr() for p in module.parameters()] == starts
        ends.append({k: v.clone() for k, v in module.state_dict().items()})
    assert all(torch.allclose(ends[0][k], ends[1][k], atol=1e-6) for k in ends[0])


@pytest.mark.parametrize("regions", [True, False], ids=["regions", "whole"])
def test_the_cudagraphs_backend_traces_the_model_without_a_break_to_the_eager_step(regions):
    """--compile_mode cudagraphs compiles with torch.compile's cudagraphs backend, which records the traced ATen
    graph, forward and backward, as CUDA graphs: the model (llama block, dropout) traces in one graph per region or
    whole, and the traced step gives the eager loss and gradients (on the CPU the graph runs without recording)."""
    from torch._dynamo.utils import counters

    from minigpt.core.config import GPTConfig
    from minigpt.core.model import GPT
    from minigpt.training.callbacks import compile_options, compile_regions

    config = GPTConfig(
        arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, vocab_size=40, dropout=0.1
    )
    torch.manual_seed(0)
    model = GPT(config)
    x, y = torch.randint(0, 40, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    steps = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_regions(model, "cudagraphs") if regions else model.compile(**compile_options("cudagraphs"))
        torch.manual_seed(2)  # the same dropout masks
        _, loss = model(x, y)
        loss.backward()
        steps.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == (2 if regions else 1)  # one block's graph serves both; the head
    # each graph went to the cudagraphs backend, which on a CPU declines to record it (Inductor counts nothing here)
    assert counters["inductor"]["cudagraph_skips"] == counters["stats"]["unique_graphs"]
    assert torch.allclose(steps[0][0], steps[1][0])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(steps[0][1], steps[1][1]))


@pytest.mark.parametrize("mode", ["cudagraphs", "graphed"])
def test_compile_mode_cudagraphs_on_a_cpu_warns_and_trains_eagerly(mode):
    """CUDA graphs need a CUDA GPU: on a CPU the traced graph would run slower than eager, so training runs eagerly
    and says so (--compile_mode default compiles there)."""
    from minigpt.core.config import GPTConfig
    from minigpt.training.callbacks import CompileModel
    from minigpt.training.lightning_module import GPTLightningModule
    from minigpt.training.optim import OptimConfig

    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=20)
    module = GPTLightningModule(config, OptimConfig())
    callback = CompileModel(2, mode=mode)
    with pytest.warns(UserWarning, match=f"compile_mode {mode} needs a CUDA GPU .* training without compiling"):
        callback.setup(None, module, "fit")
    assert not callback.enabled
    assert getattr(module.model.transformer.h[0], "_compiled_call_impl", None) is None
    assert "forward" not in vars(module.model)  # nothing recorded or installed


@pytest.mark.parametrize("mode", ["reduce-overhead", "cudagraphs", "default"])
def test_the_dummy_compile_step_begins_a_cuda_graph_step_of_its_own(mode, monkeypatch):
    """Under the CUDA-graph modes the warm-up's forward begins a new CUDA-graph step, as each training batch does:
    without it torch warned on the GPU that its graphs waited on pending backwards ("Unable to hit fast path")."""
    import contextlib
    from types import SimpleNamespace

    from minigpt.core.config import GPTConfig
    from minigpt.training.callbacks import CompileModel
    from minigpt.training.lightning_module import GPTLightningModule
    from minigpt.training.optim import OptimConfig

    module = GPTLightningModule(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=20), OptimConfig())
    events: list[str] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("step begins"))
    module.model.register_forward_pre_hook(lambda *_: events.append("forward"))
    trainer = SimpleNamespace(world_size=1, precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext))
    CompileModel(2, mode=mode).on_fit_start(trainer, module)  # the model is not compiled here: only the order counts
    assert events == (["forward"] if mode == "default" else ["step begins", "forward"])
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_the_traced_training_step_holds_nothing_cuda_graphs_refuse(arch):
    """What the cudagraphs backend (and reduce-overhead) checks before recording a graph, run on the CPU: the
    forward and backward graphs of a training step (bf16 autocast, dropout) mutate no input but the parameters and
    hold no op a CUDA graph cannot record; were either false, a GPU would run that graph unrecorded."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.cudagraphs import check_for_mutation_ignore_cuda_graph_managed_tensor as mutations
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.utils import count_tangents, get_first_incompatible_cudagraph_node, num_fw_fixed_arguments

    from minigpt.core.config import GPTConfig
    from minigpt.core.model import GPT

    refusals: dict[str, list] = {}

    def backend(gm, inputs):  # the cudagraphs backend's own checks (forward_cudagraphs, backward_cudagraphs)
        def checked(name, fixed):
            def compiler(aot, aot_inputs):
                n = fixed(aot, aot_inputs)
                refusals[name] = [mutations(aot, n), get_first_incompatible_cudagraph_node(aot)]
                return boxed_nop(aot, aot_inputs)

            return compiler

        forward = checked("forward", lambda aot, aot_inputs: num_fw_fixed_arguments(len(inputs), len(aot_inputs)))
        backward = checked("backward", lambda aot, _: count_tangents(aot))
        return aot_autograd(fw_compiler=forward, bw_compiler=backward)(gm, inputs)

    model = GPT(GPTConfig(arch=arch, n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=40, dropout=0.2))
    model.compile(backend=backend)
    x, y = torch.randint(0, 40, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    assert refusals == {"forward": [None, None], "backward": [None, None]}
