"""The LightningModule: GPT + AdamW + warmup/cosine schedule, loss/perplexity/grad-norm logging, samples at eval."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info

from minigpt.config import GPTConfig
from minigpt.errors import UserError
from minigpt.model import GPT

SCHEDULES = ("cosine", "linear", "constant", "wsd")


OPTIMIZERS = ("adamw", "muon")


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the blocks' 2-D weights, AdamW for everything else, as one optimizer: Lightning's automatic
    optimization (clipping, accumulation, LR schedulers, checkpoints) then drives both unchanged.

    The two inner optimizers share this optimizer's param_groups and state dicts, so state_dict(),
    load_state_dict() and an LR scheduler see all groups at once.
    """

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], lr: float, betas: tuple[float, float],
                 fused: bool) -> None:
        # match_rms_adamw scales Muon's update to AdamW's size, so one learning rate serves both
        self.muon = torch.optim.Muon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, fused=fused)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, defaults={"lr": lr})
        self._share()

    def _share(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces the group and state dicts: share the new ones
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


class NonFiniteLossError(UserError):
    """The loss became NaN or infinite."""


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float,
                  cooldown_frac: float = 0.2) -> float:
    """Learning rate at `step` as a fraction of the peak: linear warmup, then the chosen decay to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear":
        decay = 1.0 - progress
    else:  # "wsd": warmup, stable at the peak, then a linear cooldown over the last cooldown_frac of training
        decay = min(1.0, (1.0 - progress) / cooldown_frac)
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


class GPTLightningModule(L.LightningModule):
    def __init__(
        self,
        arch: str = "gpt",
        attention: str = "sdpa",
        n_layer: int = 4,
        n_head: int = 4,
        n_kv_head: int | None = None,
        n_embd: int = 128,
        block_size: int = 128,
        vocab_size: int = 256,
        dropout: float = 0.0,
        bias: bool | None = None,
        mlp: str | None = None,
        mlp_hidden: int | None = None,
        rope_base: float = 10000.0,
        tie_embeddings: bool = True,
        qk_norm: bool = False,
        zero_init_proj: bool = False,
        sdpa_backend: str | None = None,
        learning_rate: float = 1e-3,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.95,
        warmup_steps: int = 100,
        lr_schedule: str = "cosine",
        optimizer: str = "adamw",
        decay_steps: int | None = None,
        compile: bool = False,
        sample_tokens: int = 200,
    ) -> None:
        """
        Args:
            arch: block type: gpt (LayerNorm, learned positions, GELU) or llama (RMSNorm, RoPE, SwiGLU)
            attention: attention implementation: sdpa, manual or einops (same function)
            n_layer: transformer blocks
            n_head: query heads
            n_kv_head: key/value heads (GQA); unset = n_head, 1 = multi-query
            n_embd: model width
            block_size: context length in tokens
            vocab_size: set from the data's tokenizer
            dropout: dropout probability
            bias: biases in linear layers and LayerNorm; unset = true for gpt, false for llama
            mlp: gelu, swiglu or relu2 (squared ReLU); unset = gelu for gpt, swiglu for llama
            mlp_hidden: MLP hidden width; unset = 4*n_embd (gelu, relu2) or ~8/3*n_embd (swiglu)
            rope_base: RoPE frequency base (llama)
            tie_embeddings: share the input embedding with the output head
            qk_norm: RMS-normalise queries and keys per head
            zero_init_proj: start residual output projections at zero
            sdpa_backend: restrict SDPA to one kernel: flash, efficient, math or cudnn
            learning_rate: peak learning rate
            min_lr_ratio: final learning rate as a fraction of the peak
            weight_decay: AdamW weight decay, applied to matrices and embeddings only
            beta1: AdamW beta1
            beta2: AdamW beta2
            warmup_steps: linear warmup optimizer steps
            lr_schedule: after warmup: cosine, linear, constant or wsd (stable then a linear cooldown)
            optimizer: adamw, or muon (Muon for the blocks' matrices, AdamW for embeddings, head and gains)
            decay_steps: steps over which the learning rate decays; unset = trainer.max_steps
            compile: torch.compile the model
            sample_tokens: tokens generated and logged as text at each validation (0 = none)
        """
        super().__init__()
        self.save_hyperparameters()
        if lr_schedule not in SCHEDULES:
            raise UserError(f"model.lr_schedule: unknown value {lr_schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if optimizer not in OPTIMIZERS:
            raise UserError(f"model.optimizer: unknown value {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        self.config = GPTConfig.from_dict(dict(self.hparams))  # the model fields above, checked there
        self.model = GPT(self.config)
        self.tokenizer = None  # taken from the datamodule in setup(); saved into every checkpoint
        # read by Lightning's ThroughputMonitor to report FLOPs/s and MFU
        self.flops_per_batch: int | None = None
        self._val_losses: list[torch.Tensor] = []

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            self.tokenizer = datamodule.tokenizer
            batch = datamodule.hparams.batch_size
            self.flops_per_batch = self.model.flops_per_token(self.config.block_size) * batch * self.config.block_size
        if self.hparams.compile:
            self.model.compile()  # in place: parameter names (and checkpoints) stay the same

    def on_fit_start(self) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if self.hparams.compile and self.trainer.world_size == 1 and datamodule is not None:
            self._compile_now(datamodule.hparams.batch_size)

    def _compile_now(self, batch_size: int) -> None:
        """Run one training and one validation step's worth of forward/backward on a dummy batch, so that
        torch.compile compiles before the training clock (and --trainer.max_time) starts; the weights, the
        gradients and the RNG state are left as they were.  Under DDP (or with plain dataloaders instead of our
        datamodule) the first real step compiles instead."""
        start = time.perf_counter()
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        batch = torch.zeros(batch_size, self.config.block_size + 1,
                            dtype=torch.long, device=self.device)
        context = self.trainer.precision_plugin.forward_context  # autocast under mixed precision
        with context():
            _, loss = self.model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        self.model.eval()
        with torch.no_grad(), context():
            self.model(batch[:, :-1], batch[:, 1:])
        self.model.train()
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, self.device)
        self.compile_seconds = time.perf_counter() - start
        rank_zero_info(f"torch.compile: compiled in {self.compile_seconds:.1f}s (not counted in training time)")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(idx, targets)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        _, loss = self.model(batch[:, :-1], batch[:, 1:])  # batch: (B, T + 1) windows
        if not torch.isfinite(loss):  # stop before the bad step touches the weights; checkpoints stay good
            raise NonFiniteLossError(
                f"the training loss became {loss.item()} at step {self.global_step}; training stopped and the last "
                "good checkpoint is kept; lower --model.learning_rate, raise --model.warmup_steps or use "
                "--trainer.precision 32-true, then --resume")
        self.log("train_loss", loss, prog_bar=True)
        return loss

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
        if self.hparams.sample_tokens and self.tokenizer is not None and not self.trainer.sanity_checking:
            self._log_sample()

    def _log_sample(self) -> None:
        from minigpt.sampling import generate  # imported late: only needed at evaluation

        tok = self.tokenizer
        start = [tok.eot_id] if tok.eot_id is not None else tok.encode("\n")
        idx = torch.tensor([start], dtype=torch.long, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(0)
        with torch.compiler.set_stance("force_eager"):  # growing shapes: compiling them would cost more than it saves
            out = generate(self.model, idx, self.hparams.sample_tokens, temperature=0.8, top_k=200, generator=g)
        text = tok.decode(out[0, len(start):].tolist())
        experiment = getattr(self.logger, "experiment", None)
        if self.global_rank == 0 and hasattr(experiment, "add_text"):
            experiment.add_text("sample", "```\n" + text + "\n```", self.global_step)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.global_step % self.trainer.log_every_n_steps == 0:  # before clipping: the norm the data produced
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            self.log("grad_norm", norm)

    def _grad_scaler(self) -> Any:
        trainer = self._trainer  # None when configure_optimizers is called outside a Trainer (benchmarks)
        return getattr(trainer.precision_plugin, "scaler", None) if trainer is not None else None

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
        hp = self.hparams
        # weight decay on matrices and embeddings only; never on biases and norm gains
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        decay = [p for _, p in named if p.dim() >= 2]
        no_decay = [p for _, p in named if p.dim() < 2]
        # fused: one kernel for all parameters instead of a loop; not under a gradient scaler (16-mixed),
        # where a fused optimizer unscales inside step() and Lightning could not clip before it
        fused = self.device.type in ("cuda", "cpu") and self._grad_scaler() is None
        betas = (hp.beta1, hp.beta2)
        if hp.optimizer == "muon":
            # Muon orthogonalises updates of hidden matrices; embeddings and the head stay with AdamW
            hidden = [p for n, p in named if p.dim() == 2 and n.startswith("transformer.h.")]
            ids = {id(p) for p in hidden}
            optimizer = MuonWithAdamW(
                [{"params": hidden, "weight_decay": hp.weight_decay}],
                [{"params": [p for p in decay if id(p) not in ids], "weight_decay": hp.weight_decay},
                 {"params": no_decay, "weight_decay": 0.0}],
                lr=hp.learning_rate, betas=betas, fused=fused)
        else:
            optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                           {"params": no_decay, "weight_decay": 0.0}],
                                          lr=hp.learning_rate, betas=betas, fused=fused)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, hp.warmup_steps, self._schedule_steps(step), hp.lr_schedule,
                                                  hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}

    def _schedule_steps(self, step: int) -> int:
        """The step at which the learning rate reaches its minimum: decay_steps, else max_steps; with only
        --trainer.max_time, the step count projected from the speed so far, so the decay ends on time."""
        if self.hparams.decay_steps:
            return self.hparams.decay_steps
        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
        max_steps = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None
        if timer is not None and timer.time_remaining("train") is not None:
            elapsed = timer.time_elapsed("train")
            if step > self.hparams.warmup_steps and elapsed > 0:
                projected = int(step * (elapsed + timer.time_remaining("train")) / elapsed)
                return min(projected, max_steps) if max_steps else projected
            return max_steps or 10**9  # too early to project: hold the peak
        return max_steps or self.hparams.warmup_steps  # no known end: hold the peak after warmup

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # everything sampling needs, as plain data (loadable with weights_only=True), and the RNG state so
        # that dropout after --resume draws what an uninterrupted run would have drawn
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        checkpoint["minigpt"] = {"model_config": self.config.to_dict(),
                                 "tokenizer": self.tokenizer.to_dict() if self.tokenizer is not None else None,
                                 "rng": rng}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        rng = checkpoint.get("minigpt", {}).get("rng")
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"], self.device if self.device.type == "cuda" else None)
