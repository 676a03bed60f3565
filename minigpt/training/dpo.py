"""Direct Preference Optimization (DPO, Rafailov et al. 2023): fine-tune on pairs of a chosen and a rejected answer.

train.py --data.format preference trains with DPO instead of SFT (docs/dpo.md); --finetune full|lora and any
--init_from compose with it.  The loss is TRL's default ("sigmoid"), per pair

    -logsigmoid(beta * ((logp(chosen) - ref_logp(chosen)) - (logp(rejected) - ref_logp(rejected))))

averaged over the batch, each logp summed over the answer's tokens only (the completion after the chat template's
generation prompt, as TRL splits a pair).  dpo.rpo_alpha adds RPO's term (Pang et al. 2024), alpha times the NLL of
the chosen answers, a mean over every chosen answer token of the batch: TRL's loss_type ["sigmoid", "sft"] with
loss_weights [1, alpha] (trl 1.16; its former rpo_alpha).  It keeps the chosen answer's likelihood up, where plain
DPO on near-identical pairs lowers both (likelihood displacement).
The reference is the starting model, frozen (dpo.reference):
  model        LoRA: the same model with its adapters switched off (no second copy); full: a frozen copy
  precomputed  the reference's log-probs of every pair, computed once before the first step and saved in the
               checkpoints (no second model in memory during training)

A pair is two padded rows of the SFT layout (minigpt.training.sft: ~id where a token is not a target), so a batch
of B pairs is (2B, T + 1): the chosen rows, then the rejected ones (TRL's order), with the pairs' indices (B,).
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from jsonargparse.typing import NonNegativeFloat, PositiveFloat
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import SECTION
from minigpt.core.errors import DataError, UserError, first_line
from minigpt.core.lora import adapters_disabled, fingerprint
from minigpt.core.model import GPT
from minigpt.data.preferences import Preference, read_preferences
from minigpt.training.lightning_module import GPTLightningModule, disable_dropout
from minigpt.training.sft import base_tokenizer, pad_rows, read_template, split_batch

Reference = Literal["model", "precomputed"]
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
RPO_METRIC = "nll_loss"  # the chosen answers' NLL, logged when dpo.rpo_alpha is set (TRL's name before 1.0)


@dataclass
class DPOConfig:
    """DPO's settings, read with --data.format preference only (docs/dpo.md)."""

    beta: PositiveFloat = 0.1  # type: ignore[assignment]
    """How far the model may move from the reference: larger keeps it closer (TRL's beta; > 0)."""
    reference: Reference = "model"
    """The frozen starting model: "model" (LoRA: adapters off; full: a frozen copy) or "precomputed" (its log-probs
    of every pair computed once before training: no second model in memory)."""
    rpo_alpha: NonNegativeFloat = 0.0  # type: ignore[assignment]
    """RPO: add rpo_alpha x the NLL of the chosen answers (mean over their tokens) to the loss; 0: plain DPO.
    TRL: loss_type ["sigmoid", "sft"], loss_weights [1, rpo_alpha] (>= 0)."""


# ------------------------------------------------------------------------------------------------- data

Pair = tuple[np.ndarray, np.ndarray]  # (chosen row, rejected row), int64, ~id where not a target


@dataclass
class PreferenceData:
    tokenizer: ChatTokenizer
    train: list[Pair]
    val: list[Pair]
    counts: dict[str, int] = field(default_factory=dict)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_pair(chat: ChatTokenizer, pair: Preference) -> tuple[Pair, int]:
    """The pair's two rows and its prompt's length.  The answer starts where the rendered prompt (with the
    generation prompt) and prompt + answer first differ (TRL's split: usually right after the prompt)."""
    prompt, _ = chat.encode_chat(pair.prompt, add_generation_prompt=True)
    chosen, _ = chat.encode_chat(pair.prompt + pair.chosen)
    rejected, _ = chat.encode_chat(pair.prompt + pair.rejected)
    n = min(common_prefix(prompt, chosen), common_prefix(prompt, rejected))
    rows = []
    for ids in (chosen, rejected):
        row = np.asarray(ids, dtype=np.int64)
        row[:n] = ~row[:n]
        rows.append(row)
    return (rows[0], rows[1]), n


SAME_TOKENS = (
    "chosen and rejected are the same tokens once rendered with the chat template, so the pair prefers nothing; "
    "give a worse answer as rejected or drop the row"
)


def same_after_cut(block_size: int) -> str:
    """The refusal of a pair whose answers differ only past the block_size + 1 tokens a row is cut to."""
    return (
        f"chosen and rejected differ only after the first block_size + 1 = {block_size + 1} tokens, where the pair "
        "is cut, so it prefers nothing; make the answers differ earlier or drop the row, or train with a larger "
        "block_size"
    )


def load_preference_data(
    source: str, tokenizer: str, chat_template: str | None, val_fraction: float, block_size: int, seed: int
) -> PreferenceData:
    """Read, check, tokenize and split the pairs of `source`; a pair longer than block_size + 1 tokens is cut."""
    pairs = read_preferences(source)
    base = base_tokenizer(tokenizer, [p.prompt + p.chosen + p.rejected for p in pairs])
    template = read_template(chat_template)
    if isinstance(base, ChatTokenizer) and template is not None and template != base.template:
        raise DataError(
            f"data.chat_template {chat_template}: the model already has a chat template; remove data.chat_template"
        )
    rows: list[Pair] = []
    truncated = 0
    where = f"data.chat_template {chat_template}" if template is not None else source
    try:
        chat = ChatTokenizer.for_base(base, template, [p.prompt + p.chosen + p.rejected for p in pairs])
        for i, pair in enumerate(pairs, 1):
            where = pair.where or f"{source} pair {i}"
            (chosen, rejected), n = encode_pair(chat, pair)
            if n >= block_size + 1 or n >= min(len(chosen), len(rejected)):
                raise DataError(
                    f"the prompt takes {n} tokens and leaves no room for an answer in block_size={block_size}; "
                    "shorten the prompt or drop the pair, or train with a larger block_size"
                )
            cut = max(len(chosen), len(rejected)) > block_size + 1
            truncated += int(cut)
            chosen, rejected = chosen[: block_size + 1], rejected[: block_size + 1]
            if np.array_equal(chosen, rejected):  # refused as preferences.py refuses chosen == rejected
                raise DataError(same_after_cut(block_size) if cut else SAME_TOKENS)
            rows.append((chosen, rejected))
    except UserError as e:  # the template's errors and a pair's, named by where
        raise DataError(f"{where}: {first_line(e, 400)}") from None
    if len(rows) < 2:
        raise DataError(f"{source}: {len(rows)} pair(s), too few to split into training and validation; add pairs")
    order = np.random.default_rng([seed, 7]).permutation(len(rows))
    n_val = min(len(rows) - 1, max(1, round(len(rows) * val_fraction)))
    val = [rows[i] for i in sorted(order[:n_val])]
    train = [rows[i] for i in sorted(order[n_val:])]
    counts = {"pairs": len(rows), "train": len(train), "val": len(val), "truncated": truncated}
    rank_zero_info(
        f"preference data {source}: {len(rows):,} pairs ({len(train):,} train, {len(val):,} val); {truncated} "
        f"longer than block_size + 1 = {block_size + 1} tokens truncated"
    )
    return PreferenceData(chat, train, val, counts)


def pair_batch(pairs: list[Pair], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(2B, L) rows, the chosen ones then the rejected ones, and the pairs' indices (B,)."""
    return pad_rows([c for c, _ in pairs] + [r for _, r in pairs]), torch.tensor(ids, dtype=torch.long)


class RandomPairs(Dataset):
    """Item i: batch_size pairs drawn by rng(seed, stream, i) (as RandomConversations)."""

    def __init__(self, pairs: list[Pair], batch_size: int, seed: int, stream: int, length: int) -> None:
        self.pairs, self.batch_size, self.seed, self.stream, self.length = pairs, batch_size, seed, stream, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.stream, i])
        picks = rng.choice(len(self.pairs), size=self.batch_size, replace=len(self.pairs) < self.batch_size)
        return pair_batch([self.pairs[j] for j in picks], picks.tolist())


class FixedPairs(Dataset):
    """Item j: pairs j * batch_size .. (j + 1) * batch_size - 1; their indices start at `offset` (the validation
    pairs follow the training ones in the precomputed reference's table)."""

    def __init__(self, pairs: list[Pair], batch_size: int, offset: int = 0) -> None:
        self.pairs, self.batch_size, self.offset = pairs, batch_size, offset

    def __len__(self) -> int:
        return math.ceil(len(self.pairs) / self.batch_size)

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = range(j * self.batch_size, min((j + 1) * self.batch_size, len(self.pairs)))
        return pair_batch([self.pairs[i] for i in ids], [self.offset + i for i in ids])


# ------------------------------------------------------------------------------------------------- the loss


def answer_tokens(rows: torch.Tensor) -> torch.Tensor:
    """(N, T + 1) rows -> (N,) how many target tokens (its answer) each row has."""
    return (split_batch(rows)[1] >= 0).sum(-1)


def sequence_logps(model: GPT, rows: torch.Tensor) -> torch.Tensor:
    """(N, T + 1) rows -> (N,) log-probability of each row's target tokens (its answer), summed."""
    inputs, targets = split_batch(rows)
    logits, _ = model(inputs)  # (N, T, V)
    logps = torch.gather(logits.float().log_softmax(-1), 2, targets.clamp(min=0)[..., None]).squeeze(-1)  # (N, T)
    return (logps * (targets >= 0)).sum(-1)


def dpo_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    beta: float,
    rpo_alpha: float = 0.0,
    tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logps, ref_logps (2B,): chosen then rejected -> TRL's sigmoid loss (mean over the pairs) and its metrics
    (TRL's names and definitions: each a mean over the batch's pairs).  rpo_alpha: plus rpo_alpha x the chosen
    answers' NLL per token, over the whole batch (tokens (2B,): each row's answer tokens), as TRL's "sft" term."""
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
    loss = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios)).mean()
    nll = None
    if rpo_alpha:  # TRL: -chosen_per_token_logps[chosen_mask].mean(), a mean over all the batch's chosen tokens
        nll = -chosen.sum() / tokens.chunk(2)[0].sum()
        loss = loss + rpo_alpha * nll
    chosen_rewards, rejected_rewards = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen.detach().mean(),
        "logps/rejected": rejected.detach().mean(),
    }
    if nll is not None:
        metrics[RPO_METRIC] = nll.detach()
    return loss, metrics


# ------------------------------------------------------------------------------------------------- the module

# ckpt["minigpt"]["dpo"]: {"reference", "fingerprint", "ref_logps" and "pairs" (precomputed only)}
SECTION_KEY = "dpo"


def pairs_fingerprint(data: PreferenceData) -> dict[str, Any]:
    """The prepared pairs in the precomputed reference's order (training, then validation): their count and the
    sha256 of their token ids.  Saved with the table; a resume checks its pairs against it, as a resumed run's
    tokenizer is checked against the one its checkpoint records (minigpt.core.checkpoint.resume_problems)."""
    digest = hashlib.sha256()
    for pair in data.train + data.val:
        for row in pair:
            digest.update(len(row).to_bytes(8, "little"))
            digest.update(np.ascontiguousarray(row, dtype="<i8").tobytes())
    return {"pairs": len(data.train) + len(data.val), "sha256": digest.hexdigest()}


def reference_pairs_problem(saved: dict[str, Any] | None, rows: int, found: dict[str, Any], path: Any) -> str | None:
    """Why a checkpoint's precomputed log-probs (`rows` pairs, `saved` their fingerprint; None in a checkpoint
    written before fingerprints were kept: the count alone is checked) are not those of this run's pairs `found`."""
    if rows == found["pairs"] and (saved is None or saved.get("sha256") == found["sha256"]):
        return None
    now = (
        f"{found['pairs']:,} pairs"
        if rows != found["pairs"]
        else f"{rows:,} other pairs (fingerprint {found['sha256'][:12]}, the run's {saved['sha256'][:12]})"
    )
    return (
        f"{path} holds the precomputed reference log-probs of {rows:,} pairs, and this run has {now}; the pairs "
        "changed since (data.source, the tokenizer, seed or data.val_fraction) and the log-probs are by position: "
        "resume with the data.source, seed and data.val_fraction the run started with, or start a new run in "
        "another out_dir"
    )


class DPOLightningModule(GPTLightningModule):
    """GPTLightningModule whose loss is DPO's.  The reference: a full run's frozen copy (use_reference), a LoRA
    run's own model with its adapters off, or precomputed log-probs (ref_table)."""

    def __init__(self, *args: Any, dpo: DPOConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # TRL's default: the policy's log-probs are taken as the reference's are (step 0: log 2)
        disable_dropout(self.model)
        self.dpo = dpo
        self._reference: list[GPT] = []  # a full run's frozen copy (dpo.reference model)
        self.ref_fingerprint: str | None = None
        self.ref_table: torch.Tensor | None = None  # precomputed: (n_pairs, 2) chosen / rejected log-probs
        self.ref_pairs: dict[str, Any] | None = None  # precomputed: the fingerprint of the pairs of ref_table

    def use_reference(self, reference: GPT) -> None:
        """A full run's frozen reference, kept out of the module tree: not trained, not in the state_dict (a
        resumed run rebuilds it from init_from, checked against the fingerprint its checkpoints record)."""
        self._reference = [reference.eval().requires_grad_(False)]
        self.ref_fingerprint = fingerprint(reference)

    def on_fit_start(self) -> None:
        for ref in self._reference:
            ref.to(self.device)
        if self.dpo.reference == "precomputed" and self.ref_table is None:  # not restored from a checkpoint
            data = self.trainer.datamodule.prepared
            with torch.compiler.set_stance("force_eager"):  # once, before training: no graph is compiled for it
                self.ref_table = self.precompute(data)
            self.ref_pairs = pairs_fingerprint(data)

    @torch.no_grad()
    def precompute(self, data: PreferenceData) -> torch.Tensor:
        """The starting model's log-probs of every pair (train, then val), in eval mode, in the run's precision."""
        was_training = self.model.training
        self.model.eval()
        table = []
        try:
            for pairs, offset in ((data.train, 0), (data.val, len(data.train))):
                batches = FixedPairs(pairs, self.trainer.datamodule.hparams.batch_size, offset)
                for j in range(len(batches)):
                    rows, _ = batches[j]
                    with self.trainer.precision_plugin.forward_context():
                        table.append(sequence_logps(self.model, rows.to(self.device)).view(2, -1).T)
        finally:
            self.model.train(was_training)
        return torch.cat(table).float()

    @torch.no_grad()
    def reference_logps(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.dpo.reference == "precomputed":
            table = self.ref_table.to(rows.device)[ids]  # (B, 2)
            return torch.cat([table[:, 0], table[:, 1]])
        if self._reference:
            return sequence_logps(self._reference[0], rows)
        was_training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                return sequence_logps(self.model, rows)
        finally:
            self.model.train(was_training)

    def batch_loss(self, batch: Any, stage: str) -> torch.Tensor:
        rows, ids = batch
        loss, metrics = dpo_loss(
            sequence_logps(self.model, rows),
            self.reference_logps(rows, ids),
            self.dpo.beta,
            self.dpo.rpo_alpha,
            answer_tokens(rows),
        )
        self._batch_metrics[stage].append(metrics)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch[0], batch_idx)

    def on_validation_epoch_end(self) -> None:
        if not self._val_losses:
            return
        val_loss = self.mean_over_ranks(torch.stack(self._val_losses))
        # each batch weighs alike, as in val_loss
        self.log_validation({"val_loss": val_loss} | {f"val_{k}": v for k, v in self.pop_metrics("val").items()})
        self._val_losses.clear()

    def on_save_checkpoint(self, ckpt: dict[str, Any]) -> None:
        super().on_save_checkpoint(ckpt)
        entry = {"reference": self.dpo.reference, "fingerprint": self.ref_fingerprint}
        if self.ref_table is not None:
            entry["ref_logps"], entry["pairs"] = self.ref_table.cpu(), self.ref_pairs
        ckpt[SECTION][SECTION_KEY] = entry

    def on_load_checkpoint(self, ckpt: dict[str, Any]) -> None:
        super().on_load_checkpoint(ckpt)
        entry = ckpt[SECTION].get(SECTION_KEY) or {}
        table = entry.get("ref_logps")
        data = getattr(self.trainer.datamodule, "prepared", None)
        if table is not None and isinstance(data, PreferenceData):  # the table's rows are these pairs, by position
            found = pairs_fingerprint(data)
            if problem := reference_pairs_problem(entry.get("pairs"), len(table), found, self.trainer.ckpt_path):
                raise UserError(problem)
            self.ref_pairs = found
        self.ref_table = table.float() if table is not None else None


@torch.no_grad()
def dpo_val_loss(module: DPOLightningModule, pairs: list[Pair], batch_size: int) -> tuple[float, int]:
    """(mean DPO loss, pairs) over every validation pair (eval_full); the precomputed table lists them after the
    training pairs."""
    was_training = module.model.training
    module.model.eval()
    total, device, n_train = 0.0, module.device, len(module.trainer.datamodule.prepared.train)
    try:
        batches = FixedPairs(pairs, batch_size, n_train)
        for j in range(len(batches)):
            rows, ids = batches[j]
            rows, ids = rows.to(device), ids.to(device)
            logps, ref_logps = sequence_logps(module.model, rows), module.reference_logps(rows, ids)
            loss, _ = dpo_loss(logps, ref_logps, module.dpo.beta, module.dpo.rpo_alpha, answer_tokens(rows))
            total += loss.item() * len(ids)
    finally:
        module.model.train(was_training)
    return total / len(pairs), len(pairs)


def check_dpo_resumable(ckpt: dict[str, Any], dpo: DPOConfig | None, path: Any) -> None:
    """A DPO run resumes as one, with the reference it started with; an SFT or pretraining run not as DPO."""
    entry = ckpt[SECTION].get(SECTION_KEY)
    problem = None
    if entry is None and dpo is not None:
        grpo = ckpt[SECTION].get("grpo") is not None
        fix = "with --data.format prompts" if grpo else "without --data.format preference"
        what = "a GRPO" if grpo else "not a DPO"
        problem = f"{path} is {what} run; resume it {fix}, or start a DPO run in another out_dir"
    elif entry is not None and dpo is None:
        problem = f"{path} is a DPO run; resume it with --data.format preference, or start a new run in another out_dir"
    elif entry is not None and entry["reference"] != dpo.reference:
        problem = (
            f"{path} was trained with dpo.reference {entry['reference']}; resume with --dpo.reference "
            f"{entry['reference']}, or start a new run in another out_dir"
        )
    if problem:
        raise UserError(problem)


def frozen_reference(model: GPT, ckpt: dict[str, Any] | None, source: str, key: str = SECTION_KEY) -> GPT:
    """The full run's frozen reference: a copy of `model` as it starts (a new run), or, on resume, `model` (rebuilt
    from init_from) checked against the fingerprint the run recorded."""
    reference = copy.deepcopy(model)
    if ckpt is not None:
        saved = (ckpt[SECTION].get(key) or {}).get("fingerprint")
        if saved is None and key == "grpo":  # started with grpo.beta 0: no start to check init_from against
            raise UserError(
                f"this GRPO run started without a reference (grpo.beta 0), so init_from {source} cannot be "
                "checked to be its start; resume it with --grpo.beta 0, or start a new run with a KL in another out_dir"
            )
        if saved is not None and fingerprint(reference) != saved:
            raise UserError(
                f"init_from {source} is not the model this {key.upper()} run started from (its reference); resume with "
                "the init_from it was started with, or start a new run in another out_dir"
            )
    return reference
