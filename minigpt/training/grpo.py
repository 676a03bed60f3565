"""Group Relative Policy Optimization (GRPO, Shao et al. 2024): reinforcement learning on prompts whose answer a
program checks.

train.py --data.format prompts trains with GRPO (docs/grpo.md); --finetune full|lora and any --init_from compose
with it, as with DPO.  Each step, for each of the batch's prompts, a group of G = grpo.group_size completions is
sampled (minigpt.training.rollouts) and scored by the reward (minigpt.training.rewards); then, as TRL's GRPOTrainer
computes it (trl 1.16, its default loss_type "dapo", one generation per optimizer step):

    advantage  A_i = (r_i - mean(group)) / (std(group) + 1e-4)   (std with Bessel's correction; without it when
                                                                 grpo.scale_rewards is false, as Dr. GRPO)
    ratio      rho_t = exp(logp_t - old_logp_t)                 (old_logp = logp.detach(): 1, with its gradient)
    per token  l_t = -min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps) A_i) + beta * kl_t
               kl_t = (exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1) * rho_t   (k3, only when beta > 0;
               times the ratio as TRL's default use_bias_correction_kl: 1 in value, not in gradient)
    loss       sum of l_t over every completion token of the batch / number of those tokens

logp_t is the log-probability of completion token t at the sampling temperature (logits / temperature), as TRL
computes it.  The reference (beta > 0) is the starting model, as DPO's: with LoRA the adapters switched off, with
full fine-tuning a frozen copy, rebuilt from init_from on resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jsonargparse.typing import NonNegativeFloat, PositiveFloat, PositiveInt, restricted_number_type

from minigpt.core.checkpoint import SECTION
from minigpt.core.errors import UserError
from minigpt.core.lora import adapters_disabled, fingerprint
from minigpt.core.model import GPT
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.rewards import exact_match, load_reward, score
from minigpt.training.rollouts import FixedPrompts, Prompt, completion_rows, sample_groups
from minigpt.training.sft import split_batch

GroupSize = restricted_number_type("GroupSize", int, (">=", 2))
SECTION_KEY = "grpo"  # ckpt["minigpt"]["grpo"]: {"beta", "fingerprint" (a full run's frozen reference)}
VAL_STREAM = 1 << 20  # validation's sampling seeds, apart from training's


@dataclass
class GRPOConfig:
    """GRPO's settings, read with --data.format prompts only (docs/grpo.md)."""

    group_size: GroupSize = 8  # type: ignore[assignment]
    """Completions sampled per prompt (G, >= 2): each is scored against the others of its group."""
    max_new_tokens: PositiveInt = 64  # type: ignore[assignment]
    """Most tokens in a completion (fewer where the context ends first); it stops at the end-of-turn token."""
    temperature: PositiveFloat = 1.0  # type: ignore[assignment]
    """Sampling temperature (> 0); the log-probabilities of the loss are taken at it too, as TRL does."""
    epsilon: PositiveFloat = 0.2  # type: ignore[assignment]
    """Clipping of the probability ratio to [1 - epsilon, 1 + epsilon] (TRL's epsilon)."""
    beta: NonNegativeFloat = 0.0  # type: ignore[assignment]
    """Weight of the per-token KL to the starting model (>= 0; 0: no reference needed, TRL's default)."""
    scale_rewards: bool = True
    """Divide each advantage by its group's reward std (false: only subtract the mean, as Dr. GRPO and nanochat)."""
    reward: str = "exact_match"
    """exact_match (the completion's last number, or last line, equals the row's answer), or
    path/to/file.py:function, a Python function read from that file: it is code and runs, as a task file's hooks
    do; called as function(prompt=, completion=, answer=) -> float."""


# ------------------------------------------------------------------------------------------------- the loss


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """(N * G,) rewards, groups consecutive -> (N * G,) advantages: minus the group's mean, over its std + 1e-4
    (unbiased std, TRL's) when `scale`."""
    grouped = rewards.float().view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + 1e-4)
    return advantages.flatten()


def token_logps(model: GPT, rows: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T + 1) rows of the SFT layout -> the log-probability of each target token at `temperature` (N, T), and
    the mask of target tokens (N, T) float."""
    inputs, targets = split_batch(rows)
    logits, _ = model(inputs)  # (N, T, V)
    logps = (logits.float() / temperature).log_softmax(-1)
    logps = torch.gather(logps, 2, targets.clamp(min=0)[..., None]).squeeze(-1)
    return logps, (targets >= 0).float()


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token log-probs (N, T) of the policy, of the policy that sampled (old) and of the reference (beta > 0),
    advantages (N,), mask (N, T) -> (loss, per-token loss (N, T), metrics): TRL's clipped surrogate, normalised
    over the tokens (see the module docstring)."""
    A = advantages[:, None]  # (N, 1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    per_token = -torch.min(ratio * A, clipped * A)
    tokens = mask.sum().clamp(min=1.0)
    metrics = {}
    if beta != 0.0:
        # k3, times the ratio (TRL 1.16's use_bias_correction_kl, its default: the unbiased reverse-KL gradient,
        # DeepSeek-V3.2); the ratio's value is 1 here, its gradient is not 0
        kl = (torch.exp(ref_logps - logps) - (ref_logps - logps) - 1) * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = (kl.detach() * mask).sum() / tokens
    loss = (per_token * mask).sum() / tokens
    region = ((ratio < 1 - epsilon) & (A < 0)) | ((ratio > 1 + epsilon) & (A > 0))
    metrics["clip_ratio/region_mean"] = (region.float() * mask).sum() / tokens
    return loss, per_token, metrics


# ------------------------------------------------------------------------------------------------- the module


def seeded(device: torch.device, *key: int) -> torch.Generator:
    """A generator for sampling seeded from `key` (the run's seed, the rank, the step, the micro-batch): a resumed
    run samples the completions an uninterrupted one did."""
    seed = int(np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0] >> 1)
    return torch.Generator(device=device).manual_seed(seed)


class GRPOLightningModule(GPTLightningModule):
    """GPTLightningModule whose loss is GRPO's; the reference (beta > 0): a full run's frozen copy (use_reference)
    or the LoRA run's own model with its adapters off."""

    def __init__(self, *args: Any, grpo: GRPOConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grpo = grpo
        self.reward = load_reward(grpo.reward)
        self._reference: list[GPT] = []
        self.ref_fingerprint: str | None = None
        self._val: list[dict[str, torch.Tensor]] = []

    def use_reference(self, reference: GPT) -> None:
        """A full run's frozen reference, kept out of the module tree (as DPO's)."""
        self._reference = [reference.eval().requires_grad_(False)]
        self.ref_fingerprint = fingerprint(reference)

    def on_fit_start(self) -> None:
        for ref in self._reference:
            ref.to(self.device)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass  # (a batch is prompts; its completions are sampled in the step: no FLOPs count up front)

    def _prompts(self, ids: torch.Tensor, stage: str) -> list[Prompt]:
        data = self.trainer.datamodule.prepared
        return [(data.train if stage == "train" else data.val)[i] for i in ids.tolist()]

    @torch.no_grad()
    def rollout(self, prompts: list[Prompt], generator: torch.Generator) -> tuple[list[list[int]], list[str]]:
        """G completions of each prompt (ids, the end-of-turn token included where sampled) and their texts."""
        G, tokenizer = self.grpo.group_size, self.tokenizer
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.compiler.set_stance("force_eager"):  # a compiled training step: decoding runs eagerly
                completions = sample_groups(
                    self.model,
                    [p.ids.tolist() for p in prompts],
                    G,
                    self.grpo.max_new_tokens,
                    self.grpo.temperature,
                    tokenizer.eot_id,
                    generator,
                    vocab_size=min(tokenizer.vocab_size, self.model.config.vocab_size),
                )
        finally:
            self.model.train(was_training)
        texts = [tokenizer.decode_text(c) for c in completions]  # no special token, as TRL's skip_special_tokens
        return completions, texts

    def rewards(self, prompts: list[Prompt], texts: list[str], reward: Any = None) -> torch.Tensor:
        G = self.grpo.group_size
        rows = [prompts[r // G].row for r in range(len(texts))]
        return score(
            reward or self.reward, [r.prompt for r in rows], texts, [r.answer for r in rows], [r.where for r in rows]
        ).to(self.device)

    @torch.no_grad()
    def reference_logps(self, rows: torch.Tensor) -> torch.Tensor:
        if self._reference:
            return token_logps(self._reference[0], rows, self.grpo.temperature)[0]
        was_training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                return token_logps(self.model, rows, self.grpo.temperature)[0]
        finally:
            self.model.train(was_training)

    def batch_loss(self, batch: Any, stage: str) -> torch.Tensor:
        _, ids = batch
        prompts = self._prompts(ids, stage)
        micro = len(self._losses)  # this optimizer step's micro-batches so far
        generator = seeded(self.device, self.trainer.datamodule.hparams.seed, self.global_rank, self.global_step, micro)
        completions, texts = self.rollout(prompts, generator)
        rewards = self.rewards(prompts, texts)
        advantages = group_advantages(rewards, self.grpo.group_size, self.grpo.scale_rewards)
        rows = completion_rows([p.ids.tolist() for p in prompts], completions, self.grpo.group_size).to(self.device)
        logps, mask = token_logps(self.model, rows, self.grpo.temperature)
        ref_logps = self.reference_logps(rows) if self.grpo.beta != 0.0 else None
        loss, _, metrics = grpo_loss(
            logps, logps.detach(), ref_logps, advantages, mask, self.grpo.epsilon, self.grpo.beta
        )
        metrics |= {
            "reward": rewards.mean(),
            "reward_std": rewards.std(),
            "completions/mean_length": mask.sum(1).mean(),
        }
        self._batch_metrics[stage].append(metrics)
        return loss

    # validation: pass@1 and pass@G of the held-out prompts (exact match of the final answer, whatever the reward)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, ids = batch
        prompts = self._prompts(ids, "val")
        # seeded by the batch (validation's batches are fixed): every validation samples alike, on any number of
        # devices (rank r's batch_idx i is the split's batch i * world + r: TokenDataModule.val_dataloader)
        batch = batch_idx * self.trainer.world_size + self.global_rank
        generator = seeded(self.device, self.trainer.datamodule.hparams.seed, VAL_STREAM, batch)
        _, texts = self.rollout(prompts, generator)
        correct = self.rewards(prompts, texts, exact_match).view(len(prompts), -1)  # (B, G)
        rewards = self.rewards(prompts, texts).view(len(prompts), -1)
        self._val.append({"pass@1": correct.mean(1), "pass@G": correct.amax(1), "reward": rewards.mean(1)})

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        found = {k: self.mean_over_ranks(torch.cat([v[k] for v in self._val])) for k in self._val[0]}
        self._val.clear()
        # val_loss (what best.ckpt and early stopping watch): the share of wrong held-out samples
        self.log_validation({"val_loss": 1.0 - found["pass@1"]} | {f"val_{k}": v for k, v in found.items()})

    def on_load_checkpoint(self, ckpt: dict[str, Any]) -> None:
        super().on_load_checkpoint(ckpt)
        if self.ref_fingerprint is None:  # resumed with grpo.beta 0: the start the run recorded stays recorded
            self.ref_fingerprint = (ckpt[SECTION].get(SECTION_KEY) or {}).get("fingerprint")

    def on_save_checkpoint(self, ckpt: dict[str, Any]) -> None:
        super().on_save_checkpoint(ckpt)
        ckpt[SECTION][SECTION_KEY] = {"beta": float(self.grpo.beta), "fingerprint": self.ref_fingerprint}


def check_grpo_resumable(ckpt: dict[str, Any], grpo: GRPOConfig | None, path: Any) -> None:
    """A GRPO run resumes as one; another run not as GRPO."""
    entry = ckpt[SECTION].get(SECTION_KEY)
    if entry is None and grpo is not None:
        raise UserError(
            f"{path} is not a GRPO run; resume it without --data.format prompts, or start a GRPO run in another out_dir"
        )
    if entry is not None and grpo is None:
        raise UserError(
            f"{path} is a GRPO run; resume it with --data.format prompts, or start a new run in another out_dir"
        )


@torch.no_grad()
def grpo_val_pass(module: GRPOLightningModule, prompts: list[Prompt], batch_size: int) -> dict[str, float]:
    """pass@1, pass@G and the mean reward over every validation prompt (eval_full), sampled as validation does."""
    module._val.clear()
    batches = FixedPrompts(prompts, batch_size)
    for j in range(len(batches)):
        module.validation_step(batches[j], j)
    found = {k: torch.cat([v[k] for v in module._val]).mean().item() for k in module._val[0]}
    module._val.clear()
    return found
