"""The LightningModule: the GPT's training and validation steps, and the optimizer from minigpt.training.optim.

Side jobs live elsewhere: compiling, text samples and the RNG state are callbacks (minigpt.training.callbacks); the
checkpoint's own section is written by minigpt.core.checkpoint.pack.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import grad_norm

from minigpt.core import checkpoint
from minigpt.core.config import GPTConfig
from minigpt.core.errors import ConfigError, UserError
from minigpt.core.limits import check_config_size
from minigpt.core.lora import training_flops_per_token
from minigpt.core.model import GPT, attention_flops_per_token
from minigpt.core.tokenizers import Tokenizer
from minigpt.training.finetune_lora import keep_trained, restore_frozen
from minigpt.training.optim import OptimConfig, build_optimizer, build_scheduler, trainer_schedule
from minigpt.training.sft import split_batch


class NonFiniteLossError(UserError):
    """The loss became NaN or infinite."""


def host_read_is_free(device: torch.device) -> bool:
    """Whether reading a value of `device` on the host costs nothing: on a CPU it does not; on a GPU (CUDA, Apple's
    MPS) it makes the host wait for every queued kernel."""
    return device.type == "cpu"


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout of `model` off (nn.Dropout's p, attention's dropout probability): TRL's disable_dropout."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        elif isinstance(getattr(m, "dropout", None), float):
            m.dropout = 0.0


def number_by_module_order(ckpt: dict[str, Any], module: torch.nn.Module, optimizers: list[Any]) -> None:
    """Number each saved AdamW state by its parameter's place in module.parameters(), as FSDP saves it.  torch's
    optimizer numbers them in its groups' order (decayed matrices first), and Lightning's FSDP, resuming, takes id i
    for the module's i-th parameter: a run resumed under FSDP from a DDP or one-device checkpoint gave parameters
    the moments of others (of other shapes: on a CPU, a corrupted heap).  Any numbering loads outside FSDP: torch
    pairs the saved groups' ids with the live groups' parameters by position."""
    place = {id(p): i for i, p in enumerate(module.parameters())}
    for saved, optimizer in zip(ckpt.get("optimizer_states", []), optimizers):
        if not isinstance(optimizer, torch.optim.AdamW):  # Muon keeps states of its own; FSDP refuses it anyway
            continue
        params = [p for group in optimizer.param_groups for p in group["params"]]  # in torch's numbering
        renumber = {i: place[id(p)] for i, p in enumerate(params)}
        saved["state"] = {renumber[i]: state for i, state in saved["state"].items()}
        for group in saved["param_groups"]:
            group["params"] = [renumber[i] for i in group["params"]]


class GPTLightningModule(L.LightningModule):
    def __init__(
        self,
        config: GPTConfig,
        optim: OptimConfig | None = None,
        tokenizer: Tokenizer | None = None,
        model: GPT | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.optim = optim or OptimConfig()
        self.tokenizer = tokenizer  # saved into every checkpoint, so sampling needs nothing else
        check_config_size(config, "the model config", ConfigError, cause="choose smaller sizes")
        if tokenizer is not None and any(checkpoint.pair_problems(config, tokenizer)):  # load_model would refuse it
            exactly = "exactly " if tokenizer.name == "char" else "at least "
            raise ConfigError(
                f"model.vocab_size: {config.vocab_size} does not fit the tokenizer's {tokenizer.vocab_size} tokens, "
                f"and load_model would refuse the checkpoints; set it to {exactly}{tokenizer.vocab_size}"
            )
        self.model = model if model is not None else GPT(config)  # model: a LoRA run's (finetune_lora)
        self.lora = lora  # a LoRA run's checkpoint entry: where its base is
        self.flops_per_batch: int | None = None  # the batch's; TrainingThroughput (callbacks.py) sums them: FLOP/s, MFU
        self._val_losses: list[torch.Tensor] = []
        self.validated_at: int | None = None  # the step of the last validation (its val_loss is the logged one)
        self._losses: list[torch.Tensor] = []  # this optimizer step's training loss, one per (micro-)batch
        # batch_loss's other metrics (DPO's), per batch, by stage: a validation may run between the micro-batches
        # of an optimizer step (val_check_interval counts batches), and neither's metrics may count in the other's
        self._batch_metrics: dict[str, list[dict[str, torch.Tensor]]] = {"train": [], "val": []}
        self._step_logs: dict[str, torch.Tensor] | None = None  # the optimizer step's train_loss (and grad_norm)
        self._clip_norm: torch.Tensor | None = None  # this step's norm before clipping, if clipping measured it
        # On a GPU, the step where the loss first became NaN/inf (-1: none yet), kept on the device: reading the
        # loss on the host every step would make the CPU wait for the GPU and stop it from queueing the next step
        self._first_nonfinite: torch.Tensor | None = None
        # zero the gradients in place instead of freeing them: set where CUDA graphs compute them (CompileModel under
        # reduce-overhead or cudagraphs), whose outputs a later replay overwrites unless added into buffers of their
        # own at once
        self.grads_in_place = False
        self.param_dims: dict[str, int] | None = None  # the parameters' dims before a strategy wraps the model
        self.weight_flops_per_token: int | None = None  # the matmul weights' training FLOPs per token, likewise

    def setup(self, stage: str) -> None:
        # before the strategy wraps the model (Lightning calls setup first): FSDP then flattens every parameter into
        # a 1-D view of its shard, and what is read from the shapes is read here: the optimizer's groups
        # (configure_optimizers) and the FLOPs of the weights (a shard's count would be a fraction of them)
        self.param_dims = {name: p.dim() for name, p in self.model.named_parameters()}
        self.weight_flops_per_token = self._weight_flops_per_token()
        # a LoRA checkpoint holds the adapters alone, which Lightning's FSDP loads (strictly, by default) before
        # on_load_checkpoint can add the frozen base: the base is this run's, read from init_from, as there
        self.strict_loading = self.lora is None or not self._sharded()
        # FSDP flattens the model into one tensor of one dtype: a LoRA base held in lora.base_dtype beside float32
        # adapters fails there (bf16-mixed), or Lightning casts the base back to float32 first (32-true)
        if self._sharded() and len({p.dtype for p in self.model.parameters()}) > 1:
            raise ConfigError(  # every rank refuses alike: one line
                "lora.base_dtype cannot hold the base under FSDP, which flattens the whole model into one dtype; "
                "use --trainer.strategy ddp, or leave lora.base_dtype unset"
            )

    def _weight_flops_per_token(self) -> int:
        flops = training_flops_per_token if self.lora is not None else GPT.flops_per_token
        return flops(self.model, 1) - attention_flops_per_token(self.model.config, 1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(idx, targets)

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        # every batch's own: a chat or preference batch is padded to its longest row, so its length varies (the
        # first batch's count, kept for all, put a chat run's FLOP/s and MFU 20-60% off)
        B, T = batch.size(0), batch.size(1) - 1
        if self.weight_flops_per_token is None:  # a loop of one's own, without setup
            self.weight_flops_per_token = self._weight_flops_per_token()
        self.flops_per_batch = (self.weight_flops_per_token + attention_flops_per_token(self.model.config, T)) * B * T

    def batch_loss(self, batch: torch.Tensor, stage: str) -> torch.Tensor:
        """The loss of a batch; an objective other than next-token prediction (DPO) overrides it and may append
        metrics of its own to _batch_metrics[stage], logged with the loss."""
        _, loss = self.model(*split_batch(batch))  # batch: (B, T + 1) windows (chat rows: ~id = not a target)
        return loss

    def pop_metrics(self, stage: str = "train") -> dict[str, torch.Tensor]:
        """The mean of each of batch_loss's metrics over the stage's batches since the last call (validation's: and
        every other rank's, each batch weighing alike, as the ranks may run unequal numbers of batches)."""
        batches, self._batch_metrics[stage] = self._batch_metrics[stage], []
        mean = self.mean_over_ranks if stage == "val" else torch.mean
        return {k: mean(torch.stack([m[k] for m in batches])) for k in (batches[0] if batches else {})}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.batch_loss(batch, "train")
        finite = torch.isfinite(loss.detach())
        if host_read_is_free(loss.device):  # stop before the bad step touches the weights
            if not finite:
                self._stop_nonfinite(self.global_step, str(loss.item()))
        else:  # read on the steps that log (the host waits for the loss there anyway) and before any save
            if self._first_nonfinite is None:
                self._first_nonfinite = torch.full((), -1, dtype=torch.long, device=loss.device)
            bad_now = ~finite & (self._first_nonfinite < 0)
            self._first_nonfinite = torch.where(bad_now, self.global_step, self._first_nonfinite)
            every = self.trainer.log_every_n_steps if self._trainer is not None else 1
            if every <= 1 or self.global_step % every == 0:
                self._check_finite()
        # logged at the step's end, on the steps Lightning writes; a copy: a CUDA graph's output is overwritten when
        # the next micro-batch replays it (--compile_mode reduce-overhead or cudagraphs)
        self._losses.append(loss.detach().clone())
        return loss

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=not self.grads_in_place)

    def on_validation_model_zero_grad(self) -> None:  # Lightning frees the gradients before validating
        self.zero_grad(set_to_none=not self.grads_in_place)

    def _check_finite(self) -> None:
        if self._first_nonfinite is not None and (step := int(self._first_nonfinite)) >= 0:
            self._stop_nonfinite(step)

    def _stop_nonfinite(self, step: int, value: str = "NaN or infinite") -> None:
        # on a GPU the weights may have taken a bad step since; no checkpoint is written with them (on_save_checkpoint)
        raise NonFiniteLossError(
            f"the training loss became {value} at step {step}; training stopped and the last good checkpoint "
            "is kept; lower the learning rate, raise warmup_steps or train in float32 (precision 32-true), then resume"
        )

    def on_validation_start(self) -> None:
        # validation, and the callbacks that run with it (text samples decode with a KV cache, attention images),
        # run eagerly: compiling graphs for them would cost more start-up than their few batches gain
        torch.compiler.set_stance("force_eager")

    def on_validation_end(self) -> None:
        torch.compiler.set_stance("default")
        if not self.trainer.sanity_checking:
            self.validated_at = self.global_step  # a SIGTERM stops the run without validating its last step

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self.batch_loss(batch, "val")
        self._val_losses.append(loss.detach())

    def on_validation_epoch_end(self) -> None:
        if not self._val_losses:
            return
        val_loss = self.mean_over_ranks(torch.stack(self._val_losses))
        self._val_losses.clear()
        self.log_validation({"val_loss": val_loss, "val_ppl": torch.exp(val_loss)})

    def log_validation(self, metrics: dict[str, torch.Tensor]) -> None:
        """A validation's metrics (over every rank already), for checkpoints, early stopping and the progress bar.
        In training they are written to the loggers here, at the step validated (that of its checkpoint, text sample
        and attention image): Lightning's writing put them one step early, its logger step counting an optimizer step
        only after the validation that follows it (a 30-step run's last val_loss showed at step 29).  A validate()
        of its own leaves them to Lightning, which returns them."""
        in_training = self.trainer.state.fn == "fit"
        for name, value in metrics.items():
            self.log(name, value, prog_bar=name == "val_loss", logger=not in_training, sync_dist=True)
        if in_training and not self.trainer.sanity_checking:
            for logger in self.loggers:
                logger.log_metrics({name: value.item() for name, value in metrics.items()}, step=self.global_step)

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of `values` (1-D) and every other rank's: each value weighs alike however the ranks split them
        (a mean of the ranks' means, sync_dist's, weighs the values of a rank that ran fewer batches more)."""
        sums = torch.stack((values.sum(), values.new_tensor(float(values.numel()))))
        sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        return sums[0] / sums[1]

    # train_loss and grad_norm are logged only on the steps Lightning writes to the loggers: every
    # log_every_n_steps, and the step where the run stops early (max_time).  The curves and progress bar are
    # unchanged, self.log's cost is saved on the other steps, and no point carries an earlier step's value.
    # Under gradient accumulation a step's loss is the mean over its micro-batches, as its gradient is.

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per optimizer step, after its last micro-batch's backward and before clipping."""
        losses, self._losses = self._losses, []
        self._step_logs = {"train_loss": torch.stack(losses).mean(), **self.pop_metrics()}
        every = self.trainer.log_every_n_steps
        if every > 0 and (self.global_step + 1) % every == 0:  # global_step counts this step once it is taken
            self._step_logs["grad_norm"] = self._total_grad_norm()

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        logs, self._step_logs = self._step_logs, None
        if logs is None:
            return  # a micro-batch whose gradient is still accumulating: no optimizer step, nothing written
        every = self.trainer.log_every_n_steps
        if every > 0 and (self.global_step % every == 0 or self.trainer.should_stop):
            if "grad_norm" not in logs:  # a stop off the grid: clipping's measure, or the gradients as they are
                logs["grad_norm"] = self._clip_norm if self._clip_norm is not None else self._total_grad_norm()
            self.log("train_loss", logs.pop("train_loss"), prog_bar=True, sync_dist=True)  # every rank's batches
            for name, value in logs.items():  # grad_norm (every rank's is the same), and batch_loss's metrics under
                self.log(name, value, sync_dist=name != "grad_norm")  # their own names, over every rank's batches

    def _total_grad_norm(self) -> torch.Tensor:
        norms = grad_norm(self.model, norm_type=2)  # per parameter, and their total
        norm = norms.get("grad_2.0_norm_total", torch.tensor(0.0)).to(self.device)
        if self._sharded():  # each rank holds a shard of every gradient: the norm spans all of them
            norm = self.trainer.strategy.reduce(norm.square(), reduce_op="sum").sqrt()
        return norm

    def _sharded(self) -> bool:
        return isinstance(getattr(self._trainer, "strategy", None), FSDPStrategy)  # no trainer: a loop of one's own

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip as Lightning would, keeping the norm before clipping if clipping measures it (the grad_norm of a
        step logged off the log_every_n_steps grid)."""
        self._clip_norm = None
        if not gradient_clip_val:
            return
        plugin = self.trainer.precision_plugin
        by_norm = gradient_clip_algorithm != "value"
        if by_norm and self._sharded():
            # Lightning's FSDP plugin refuses to clip by norm: the norm spans every rank's shard, which only the
            # FSDP root module computes (torch's FSDP docs, "Gradient Clipping")
            self._clip_norm = self.trainer.model.clip_grad_norm_(gradient_clip_val)
        elif by_norm and type(plugin).clip_grad_by_norm is Precision.clip_grad_by_norm:
            # what Lightning's plugin would call, minus one check: its mixed-precision plugin refuses any fused
            # optimizer, because under a gradient scaler such an optimizer unscales internally; minigpt never
            # fuses under a scaler, and bf16-mixed has none (gradients are at their true scale)
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self._clip_norm = torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
        else:  # by value, or a plugin that clips its own way: measure first
            self._clip_norm = self._total_grad_norm()
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        # fused: not under a gradient scaler (16-mixed), where a fused optimizer unscales inside step() and
        # Lightning could not clip before it
        trainer = self._trainer  # None outside a Trainer (benchmarks' bare loop)
        if trainer is not None and self.optim.optimizer == "muon" and self._sharded():
            raise ConfigError(  # every rank refuses alike: one line
                "optim.optimizer muon cannot train under FSDP: Muon orthogonalises whole matrices and FSDP "
                "shards them across devices; use --trainer.strategy ddp, or --optim.optimizer adamw"
            )
        scaler = getattr(trainer.precision_plugin, "scaler", None) if trainer is not None else None
        optimizer = build_optimizer(
            self.model, self.optim, fused=self.device.type in ("cuda", "cpu") and scaler is None, dims=self.param_dims
        )
        decay_end, clock = (
            trainer_schedule(trainer, self.optim) if trainer is not None else (self.optim.decay_steps, None)
        )
        scheduler = build_scheduler(optimizer, self.optim, decay_end, clock)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}

    def on_save_checkpoint(self, ckpt: dict[str, Any]) -> None:
        self._check_finite()  # never save weights that a NaN/inf loss has touched
        checkpoint.pack(ckpt, self, self.model, self.tokenizer)
        ckpt[checkpoint.SECTION]["optim"] = asdict(self.optim)  # what a resume may not change (check_optim_resumable)
        ckpt[checkpoint.SECTION]["world_size"] = self.trainer.world_size  # a resume on other devices is noted
        if self.lora is not None:  # the adapters only, and where their base is
            keep_trained(ckpt, self, self.lora)
        if not self._sharded():  # FSDP's own save numbers them so already
            number_by_module_order(ckpt, self, self.trainer.optimizers)

    def on_load_checkpoint(self, ckpt: dict[str, Any]) -> None:
        # the frozen base is this run's, read from init_from (Lightning's FSDP loaded the weights and took them out)
        if self.lora is not None and "state_dict" in ckpt:
            restore_frozen(ckpt, self)
