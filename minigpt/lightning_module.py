"""The LightningModule: the GPT's training and validation steps, and the optimizer from minigpt.optim.

Side jobs live elsewhere: compiling, text samples and the RNG state are callbacks (minigpt.callbacks); the
checkpoint's own section is written by minigpt.checkpoint.pack.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from minigpt import checkpoint
from minigpt.config import GPTConfig
from minigpt.errors import UserError
from minigpt.model import GPT
from minigpt.optim import OptimConfig, build_optimizer, build_scheduler, trainer_decay_end
from minigpt.tokenizers import Tokenizer


class NonFiniteLossError(UserError):
    """The loss became NaN or infinite."""


class GPTLightningModule(L.LightningModule):
    def __init__(self, config: GPTConfig, optim: OptimConfig | None = None, tokenizer: Tokenizer | None = None) -> None:
        super().__init__()
        self.config = config
        self.optim = optim or OptimConfig()
        self.tokenizer = tokenizer  # saved into every checkpoint, so sampling needs nothing else
        self.model = GPT(config)
        self.flops_per_batch: int | None = None  # read by Lightning's ThroughputMonitor for FLOP/s and MFU
        self._val_losses: list[torch.Tensor] = []

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(idx, targets)

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.flops_per_batch is None:
            B, T = batch.size(0), batch.size(1) - 1
            self.flops_per_batch = self.model.flops_per_token(T) * B * T

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        _, loss = self.model(batch[:, :-1], batch[:, 1:])  # batch: (B, T + 1) windows
        if not torch.isfinite(loss):  # stop before the bad step touches the weights; checkpoints stay good
            raise NonFiniteLossError(
                f"the training loss became {loss.item()} at step {self.global_step}; training stopped and the last "
                "good checkpoint is kept; lower the learning rate, raise warmup_steps or train in float32 "
                "(precision 32-true), then resume")
        if self._logs_this_step():
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def _logs_this_step(self) -> bool:
        """Whether Lightning writes this step's metrics (every log_every_n_steps, counted from 1): logging only
        then keeps the TensorBoard curves and progress bar unchanged and saves self.log's cost on the other steps."""
        every = self.trainer.log_every_n_steps
        return every > 0 and (self.global_step + 1) % every == 0

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        _, loss = self.model(batch[:, :-1], batch[:, 1:])
        self._val_losses.append(loss.detach())

    def on_validation_epoch_end(self) -> None:
        if not self._val_losses:
            return
        val_loss = torch.stack(self._val_losses).mean()
        self._val_losses.clear()
        self.log("val_loss", val_loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", torch.exp(val_loss), sync_dist=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._logs_this_step():  # before clipping: the norm the data produced
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.log("grad_norm", torch.nn.utils.get_total_norm(grads))

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        # Lightning's mixed-precision plugin refuses to clip for any fused optimizer, because under a gradient
        # scaler such an optimizer unscales internally.  bf16-mixed has no scaler: gradients are already at
        # their true scale, so clip them exactly as 32-true would.
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        # fused: not under a gradient scaler (16-mixed), where a fused optimizer unscales inside step() and
        # Lightning could not clip before it
        trainer = self._trainer  # None outside a Trainer (benchmarks' bare loop)
        scaler = getattr(trainer.precision_plugin, "scaler", None) if trainer is not None else None
        optimizer = build_optimizer(self.model, self.optim, fused=self.device.type in ("cuda", "cpu") and scaler is None)
        decay_end = trainer_decay_end(trainer, self.optim) if trainer is not None else (lambda step: self.optim.decay_steps)
        scheduler = build_scheduler(optimizer, self.optim, decay_end)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}

    def on_save_checkpoint(self, ckpt: dict[str, Any]) -> None:
        checkpoint.pack(ckpt, self, self.model, self.tokenizer)
