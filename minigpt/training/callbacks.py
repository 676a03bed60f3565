"""Training's side jobs, as Lightning callbacks: compiling before the clock, text samples, attention images,
lm-evaluation-harness tasks, RNG state."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng

from minigpt import core
from minigpt.core.checkpoint import RNG_STATE_KEY
from minigpt.core.compiled import compiler_available, no_cpp_compiler
from minigpt.core.errors import ConfigError, UnknownCharactersError, UserError, first_line
from minigpt.core.generation import generate, prompt_ids
from minigpt.core.model import GPT
from minigpt.training.model_graphs import TrainingGraphs, record_training_graphs
from minigpt.training.sft import split_batch


def seconds_since_launch() -> float:
    """Seconds since this process started: from /proc on Linux (the kernel's start time of the process, so the
    interpreter's own start counts), else since minigpt was first imported."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - core.IMPORTED_AT


class StartupTimes(Callback):
    """Says, once the first optimizer step is done, how long it took from launch and where the time went:
    imports (until the command's modules were loaded), config and model (parsing, data, building the model),
    Lightning's setup (devices, strategy, optimizer), compiling (CompileModel's warm-up), the first step."""

    def __init__(self, imported: float) -> None:
        self.stamps = {"imports": imported}
        self.compile: CompileModel | None = None
        self.report: str | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stamps.setdefault("config and model", seconds_since_launch())
        self.compile = next((c for c in trainer.callbacks if isinstance(c, CompileModel)), None)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stamps.setdefault("Lightning setup", seconds_since_launch())  # runs before CompileModel's warm-up

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.report is not None or trainer.global_step < 1:
            return  # an accumulating micro-batch: the optimizer step comes later
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # once: the step is done, not only queued
        now, parts, previous = seconds_since_launch(), [], 0.0
        compiled = self.compile.seconds if self.compile is not None and self.compile.seconds else 0.0
        for name, at in self.stamps.items():
            parts.append(f"{name} {at - previous:.1f}s")
            previous = at
        if compiled:
            parts.append(f"compile {compiled:.1f}s")
        parts.append(f"first step {now - previous - compiled:.1f}s")
        self.report = f"first optimizer step {now:.1f}s after launch: " + ", ".join(parts)
        rank_zero_info(self.report)


class TrainingThroughput(Callback):
    """Tokens, samples and FLOPs per second, and MFU where Lightning knows the device's peak, over the last
    `window_size` logged steps (2: the steps since the previous logged one): Lightning's ThroughputMonitor,
    measured only at the steps that are logged.  ThroughputMonitor synchronizes CUDA after every batch to time
    it, so the host cannot queue the next step while the GPU runs this one; here the host waits for the GPU only
    when the rates are logged.  Time spent validating is left out, as ThroughputMonitor leaves it out."""

    def __init__(self, window_size: int = 2) -> None:
        self.window_size = window_size
        self.throughput: Throughput | None = None
        self.restored: dict[str, float] = {}  # a resumed run's totals so far: its curves go on from them

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        precision = str(trainer.precision)
        dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
        peak = get_available_flops(trainer.strategy.root_device, dtype)
        self.throughput = Throughput(available_flops=peak, world_size=trainer.world_size, window_size=self.window_size)
        self.batches, self.samples, self.tokens = (
            int(self.restored.get(k, 0)) for k in ("batches", "samples", "tokens")
        )
        self.flops = self.logged_flops = 0  # this run's; only the rates over the window are logged
        self.logged_step = trainer.global_step  # a resumed run's first logged step is after it
        self.start, self.paused = time.perf_counter() - self.restored.get("time", 0.0), 0.0

    def state_dict(self) -> dict[str, float]:
        """The totals (this rank's, as Lightning's Throughput counts them), saved in the checkpoint."""
        if self.throughput is None:
            return dict(self.restored)
        elapsed = time.perf_counter() - self.start - self.paused
        return {"batches": self.batches, "samples": self.samples, "tokens": self.tokens, "time": elapsed}

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        self.restored = dict(state_dict)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        batch = batch[0] if isinstance(batch, (tuple, list)) else batch  # DPO: (rows, pair indices)
        self.batches += 1
        self.samples += batch.size(0)
        self.tokens += batch[:, 1:].numel()
        self.flops += getattr(pl_module, "flops_per_batch", None) or 0  # this batch's (their lengths may differ)
        every, step = trainer.log_every_n_steps, trainer.global_step
        # once per logged optimizer step: under gradient accumulation its micro-batches all end at the same step
        if (
            self.throughput is None
            or not trainer.is_global_zero
            or every < 1
            or step % every
            or step == self.logged_step
        ):
            return
        self.logged_step = step
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # the steps so far are done, not only queued
        self.throughput.update(
            time=time.perf_counter() - self.start - self.paused,
            batches=self.batches,
            samples=self.samples,
            lengths=self.tokens,
            # the FLOPs since the previous update, which Throughput sums over its window (not the running total)
            flops=self.flops - self.logged_flops if self.flops else None,
        )
        self.logged_flops = self.flops
        rates = {f"train/{k}": v for k, v in self.throughput.compute().items()}
        for logger in trainer.loggers if rates else []:  # every logger: trainer.logger is only the first of several
            logger.log_metrics(rates, step=trainer.global_step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validation_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.throughput is not None and trainer.state.fn == "fit":
            self.paused += time.perf_counter() - self.validation_start


# How minigpt compiles (--compile_mode): torch.compile's modes for Inductor, whose reduce-overhead replays its
# generated kernels as CUDA graphs; or torch.compile's cudagraphs backend, which records the traced graph's own ATen
# kernels as CUDA graphs with no kernels generated: a compile of seconds, the step one launch, the kernels unfused;
# or graphed: no compile at all, the eager model's training step recorded as CUDA graphs (training/model_graphs.py)
CompileMode = Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs", "cudagraphs", "graphed"]
COMPILED_GRAPH_MODES = ("reduce-overhead", "cudagraphs")  # torch.compile's CUDA graph trees
CUDA_GRAPH_MODES = (*COMPILED_GRAPH_MODES, "graphed")  # the gradients come out of a replayed graph
CUDA_ONLY_MODES = ("cudagraphs", "graphed")  # on a CPU nothing is recorded: the step would only be slower


def compile_options(mode: CompileMode) -> dict[str, str]:
    """torch.compile's keyword arguments for a --compile_mode."""
    return {"backend": "cudagraphs"} if mode == "cudagraphs" else {"mode": mode}


def compile_regions(model: GPT, mode: CompileMode = "default") -> None:
    """Regional compilation: each block is compiled, and since the blocks run the same code on their own weights
    (torch.compile takes module parameters as inputs), the first block's graph serves every layer; the head and
    loss are one more region.  A fraction of compiling the whole model as one graph, which traces and optimises
    every layer again; the embedding lookups between the regions stay eager."""
    for block in model.transformer.h:
        block.compile(**compile_options(mode))
    # this instance's head: the method, compiled (an attribute)
    model.head = torch.compile(model.head, **compile_options(mode))


class CompileModel(Callback):
    """torch.compile the model in place (parameter names, and so checkpoints, stay the same), and run one
    training step's forward/backward on a dummy batch before the training clock (and max_time) starts, leaving the
    weights, gradients and RNG state as they were.  Only the training step runs compiled: validation and what
    runs with it (text samples, attention images) run eagerly (GPTLightningModule.on_validation_start), so no
    graph is compiled for them.  Under DDP the first real step compiles instead.  regions: compile the repeated
    block and the head (compile_regions) instead of the whole model as one graph.  mode: CompileMode; under the
    modes that replay CUDA graphs each training batch begins a new CUDA-graph step and the gradients are zeroed in
    place: a graph's outputs are overwritten by its next replay.  Under graphed nothing is compiled: the dummy step
    records the whole model's training step (record_training_graphs; regions do not apply)."""

    def __init__(self, batch_size: int, regions: bool = True, mode: CompileMode = "default") -> None:
        self.batch_size = batch_size
        self.regions = regions
        self.mode = mode
        self.enabled = True
        self.seconds: float | None = None
        self.graphs: TrainingGraphs | None = None  # under graphed, once recorded
        self.graphs_checked = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = pl_module.device.type
        if self.mode in CUDA_ONLY_MODES and device != "cuda":  # not recorded, the step would only be slower
            fix = "--compile_mode default compiles there"
            return self.disable(f"compile_mode {self.mode} needs a CUDA GPU (this run is on {device}: {fix})")
        if self.mode == "graphed":  # recorded at fit start, on the step's precision
            if pl_module.model.config.activation_checkpointing:  # it reads and sets the RNG state: refused in a capture
                return self.disable("compile_mode graphed cannot record activation checkpointing's recomputation")
            return
        if device == "cpu" and not compiler_available("cpu"):  # inductor's CPU kernels are C++: it would die mid-run
            return self.disable(no_cpp_compiler())
        if self.regions:
            compile_regions(pl_module.model, self.mode)
        else:
            pl_module.model.compile(**compile_options(self.mode))

    def disable(self, why: str) -> None:
        self.enabled = False
        rank_zero_warn(f"{why}; training without compiling")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size > 1 or not self.enabled:
            return
        model, start = pl_module.model, time.perf_counter()
        batch = torch.zeros(self.batch_size, model.config.block_size + 1, dtype=torch.long, device=pl_module.device)
        autocast = trainer.precision_plugin.forward_context  # the step's precision
        if self.mode == "graphed":
            try:
                with isolate_rng(include_cuda=True):  # its eager warm-up steps draw dropout masks
                    self.graphs = record_training_graphs(model, batch, autocast)
            except Exception as error:  # noqa: BLE001 -- an op the capture refuses: the run still trains, eagerly
                return self.disable(f"compile_mode graphed could not record the training step ({first_line(error)})")
            self.seconds = time.perf_counter() - start
            return rank_zero_info(f"CUDA graphs: recorded the training step in {self.seconds:.1f}s (not compiled)")
        if self.mode in COMPILED_GRAPH_MODES:  # as before each training batch: no graph here waits on an earlier one
            torch.compiler.cudagraph_mark_step_begin()
        with isolate_rng(include_cuda=True):
            with autocast():  # split as the training step splits: the same strides, so its first step compiles nothing
                _, loss = model(*split_batch(batch))
            loss.backward()
            model.zero_grad(set_to_none=True)
        self.seconds = time.perf_counter() - start
        rank_zero_info(f"torch.compile: compiled in {self.seconds:.1f}s (not counted in training time)")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not (self.enabled and self.mode in CUDA_GRAPH_MODES):
            return
        if trainer.world_size > 1:
            raise UserError(
                f"compile_mode {self.mode} runs on one device (its gradient buffers are not set up for DDP or "
                "FSDP); use the default compile_mode with several devices"
            )
        # gradients in buffers of their own, zeroed in place, made before any graph is recorded (after the fit loop's
        # own zero_grad): a graph's outputs are overwritten by its next replay, the next micro-batch's backward under
        # gradient accumulation
        pl_module.grads_in_place = True
        for p in pl_module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.enabled and self.mode in COMPILED_GRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.graphs is None or self.graphs_checked:
            return
        self.graphs_checked = True  # after the first batch: said once, not every batch
        if self.graphs.replays == 0:
            rank_zero_warn(
                f"compile_mode graphed recorded batches of shape {tuple(self.graphs.shape)} but this run's are "
                "not: its steps run eagerly; use compile_mode cudagraphs for batches whose shape changes"
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.graphs is not None:  # the eager forward again; the graphs' memory goes with them
            del pl_module.model.forward
            self.graphs = None
        if pl_module.grads_in_place:  # the buffers go: the final evaluation and sampling need none
            pl_module.grads_in_place = False
            pl_module.zero_grad(set_to_none=True)


def runs_whole_model(trainer: L.Trainer) -> bool:
    """False under a sharding strategy (FSDP): there a forward pass on rank 0 alone would wait for the other
    ranks' shards, so the side jobs that run the model outside the training step skip it."""
    from lightning.pytorch.strategies import FSDPStrategy

    return not isinstance(trainer.strategy, FSDPStrategy)


class TextSamples(Callback):
    """At each validation, generate `tokens` tokens from the start of a document and log them as text, drawn with
    `seed` (the run's): the same text the checkpoint of that step gives with that seed."""

    def __init__(self, tokens: int = 200, seed: int = 0) -> None:
        self.tokens = tokens
        self.seed = seed

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tokenizer = getattr(pl_module, "tokenizer", None)
        # the first logger that takes text (TensorBoard's), of however many: trainer.logger is only the first
        experiment = next((lg.experiment for lg in trainer.loggers if hasattr(lg.experiment, "add_text")), None)
        if (
            not self.tokens
            or tokenizer is None
            or trainer.sanity_checking
            or not trainer.is_global_zero
            or experiment is None
            or not runs_whole_model(trainer)
        ):
            return
        start = prompt_ids(tokenizer, "")
        idx = torch.tensor([start], dtype=torch.long, device=pl_module.device)
        g = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        # eager: generation's growing shapes would each trigger a recompile; isolated: training's RNG is untouched
        with torch.compiler.set_stance("force_eager"), isolate_rng(include_cuda=True):
            out = generate(pl_module.model, idx, self.tokens, temperature=0.8, top_k=200, generator=g)
        text = tokenizer.decode(out[0, len(start) :].tolist())
        experiment.add_text("sample", "```\n" + text + "\n```", trainer.global_step)


class AttentionImages(Callback):
    """At each validation, log the layers x heads grid of attention maps of a fixed probe text as a TensorBoard
    image ("attention"; row = layer, column = head, colour = sqrt(weight), see minigpt.lab.figures).
    `enabled`: True, False, or "auto" = only for models of at most AUTO_MAX_HEADS heads in all.  Skipped quietly
    when no TensorBoard logger is attached."""

    AUTO_MAX_HEADS = 64
    # a repeated line, so induction heads (attending to what followed the earlier copy) show up
    PROBE = "def forward(self, x):\n    return self.proj(x) + x\ndef forward(self, x):\n    return self.proj(x) + x\n"

    def __init__(self, enabled: bool | str = "auto", probe: str | None = None) -> None:
        self.enabled = enabled
        self.probe = self.PROBE if probe is None else probe

    def active_for(self, n_layer: int, n_head: int) -> bool:
        return self.enabled is True or (self.enabled == "auto" and n_layer * n_head <= self.AUTO_MAX_HEADS)

    def probe_ids(self, tokenizer: Any, block_size: int) -> list[int]:
        """The probe's ids, up to block_size; characters a char vocabulary lacks are left out (minigpt's own char
        tokenizer or a char-level tokenizer.json imported with a Hugging Face model)."""
        chars = getattr(tokenizer, "stoi", None)
        text = "".join(c for c in self.probe if c in chars) if chars is not None else self.probe
        try:
            ids = tokenizer.encode(text) if text else []
        except UnknownCharactersError as e:
            text = "".join(c for c in text if c not in e.chars)
            ids = tokenizer.encode(text) if text else []
        return (ids or prompt_ids(tokenizer, ""))[:block_size]

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        from minigpt.lab.figures import grid_image  # matplotlib: imported only when images are made

        model, tokenizer = pl_module.model, getattr(pl_module, "tokenizer", None)
        logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if (
            logger is None
            or tokenizer is None
            or trainer.sanity_checking
            or not trainer.is_global_zero
            or not runs_whole_model(trainer)
            or not self.active_for(model.config.n_layer, model.config.n_head)
        ):
            return
        ids = self.probe_ids(tokenizer, model.config.block_size)
        idx = torch.tensor([ids], dtype=torch.long, device=pl_module.device)
        raw = getattr(model, "_orig_mod", model)  # a compiled model's own module: no recompile for this shape
        with torch.compiler.set_stance("force_eager"), isolate_rng(include_cuda=True):
            weights = raw.attention_weights(idx)[:, 0]  # (L, H, T, T)
        logger.experiment.add_image(
            "attention", grid_image(weights.cpu().numpy()), trainer.global_step, dataformats="HWC"
        )


class HarnessTasks(Callback):
    """At each validation, lm-evaluation-harness tasks (minigpt.evaluation.harness) on the model being trained, at
    most `limit` examples each, logged as eval/<task>/<metric> at the step.  Under DDP every rank scores its share
    of each task's examples (the harness splits them and gathers the scores over torch.distributed) and rank 0 logs;
    FSDP is refused: its model is whole only inside a forward pass of the wrapped module, which generation does not use.
    Tasks are checked when the callback is made, so a misspelt task stops the run before training starts; one that
    fails at a validation stops it after that validation, saved (`failed`: train.py says why)."""

    def __init__(self, tasks: list[str], limit: int | None = 100, batch_size: int = 8) -> None:
        from minigpt.evaluation.harness import resolve_tasks  # one line naming the eval extra when lm-eval is missing

        self.tasks = resolve_tasks(tasks)
        self.limit, self.batch_size = limit, batch_size
        self.failed: UserError | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not runs_whole_model(trainer):
            raise UserError(
                "--eval_tasks cannot run under FSDP (the harness's generation runs the model outside "
                "the wrapped forward); train with ddp or one device, or run eval.py --tasks on the "
                "checkpoints"
            )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tokenizer = getattr(pl_module, "tokenizer", None)
        if trainer.sanity_checking or tokenizer is None or self.failed:
            return
        from minigpt.evaluation.harness import MiniGPTLM, evaluate_tasks, flat_metrics

        start = time.perf_counter()
        lm = MiniGPTLM(pl_module.model, tokenizer, self.batch_size, distributed=trainer.world_size > 1)
        try:  # eager: the harness's shapes would each recompile; isolated: the harness seeds every RNG, training's stay
            with torch.compiler.set_stance("force_eager"), isolate_rng(include_cuda=True):
                results = evaluate_tasks(lm, self.tasks, limit=self.limit, bootstrap_iters=0)
        except UserError as e:  # a hook, a data file gone, an answer longer than the context: known only when scored
            # raised, it ended the run before this validation's best.ckpt and last.ckpt (checkpoint callbacks run
            # after this one), losing the steps since the last save; stopped, the run saves them as after Ctrl-C
            self.failed, trainer.should_stop = e, True
            return
        if results is None or not trainer.is_global_zero:  # the harness gathers the results on rank 0
            return
        metrics = {f"eval/{name}": value for name, value in flat_metrics(results).items()}
        for logger in pl_module.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        # what the tasks cost each validation (training time counts it): the figure to size --eval_limit by
        took = f"harness at step {trainer.global_step} ({time.perf_counter() - start:.1f}s): "
        rank_zero_info(took + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))


def harness_callbacks(config: Any) -> list[Callback]:
    """[HarnessTasks] when the run's config names --eval_tasks (comma-separated), else []."""
    tasks, limit = config.get("eval_tasks"), config.get("eval_limit")
    if tasks and limit is not None and limit < 1:
        raise ConfigError(f"eval_limit: must be >= 1 or null (every example), got {limit}; use e.g. 100")
    return [HarnessTasks(tasks.split(","), limit)] if tasks else []


class RNGState(Callback):
    """Saves and restores the torch RNG state with each checkpoint, so that dropout after a resume draws what
    an uninterrupted run would have drawn."""

    @property
    def state_key(self) -> str:
        return RNG_STATE_KEY

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])
