"""GRPO's prompts and rollouts: the prompt data (train.py --data.format prompts) tokenized with the chat template,
and a group of completions sampled per prompt, all in one batch with the KV cache.

A prompt is its rendered ids with the generation prompt (`<|im_start|>assistant\\n` in ChatML), as DPO's prompt is
(minigpt.training.dpo); a completion is what the model samples after it, up to and including the chat template's
end-of-turn token, or grpo.max_new_tokens tokens (fewer where the context ends first).  A completion row for the
loss is the SFT layout (minigpt.training.sft): the prompt's ids stored as ~id (no target), the completion's as
targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import DataError, UserError, first_line
from minigpt.core.generation import sample_next
from minigpt.core.kv_cache import KVCache
from minigpt.core.model import GPT
from minigpt.data.prompts import PromptRow, read_prompts
from minigpt.training.sft import base_tokenizer, pad_rows, read_template

# ------------------------------------------------------------------------------------------------- data


@dataclass
class Prompt:
    ids: np.ndarray  # (n,) int64: the rendered prompt with the generation prompt
    row: PromptRow


@dataclass
class PromptData:
    tokenizer: ChatTokenizer
    train: list[Prompt]
    val: list[Prompt]
    counts: dict[str, int] = field(default_factory=dict)


def load_prompt_data(
    source: str, tokenizer: str, chat_template: str | None, val_fraction: float, block_size: int, seed: int
) -> PromptData:
    """Read, check, tokenize and split the prompts of `source`; a prompt must leave room for a completion."""
    rows = read_prompts(source)
    texts = [r.messages + [{"role": "assistant", "content": r.answer}] for r in rows]  # a char vocabulary's text
    base = base_tokenizer(tokenizer, texts)
    template = read_template(chat_template)
    if isinstance(base, ChatTokenizer) and template is not None and template != base.template:
        raise DataError(
            f"data.chat_template {chat_template}: the model already has a chat template; remove data.chat_template"
        )
    prompts: list[Prompt] = []
    where = f"data.chat_template {chat_template}" if template is not None else source
    try:
        chat = ChatTokenizer.for_base(base, template, texts)
        for row in rows:
            where = row.where
            ids, _ = chat.encode_chat(row.messages, add_generation_prompt=True)
            if len(ids) >= block_size:
                raise DataError(
                    f"the prompt takes {len(ids)} tokens and leaves no room for a completion in "
                    f"block_size={block_size}; shorten the prompt or drop the row, or train with a larger block_size"
                )
            prompts.append(Prompt(np.asarray(ids, dtype=np.int64), row))
    except UserError as e:  # the template's errors and a row's, named by where
        raise DataError(f"{where}: {first_line(e, 400)}") from None
    if len(prompts) < 2:
        raise DataError(f"{source}: {len(prompts)} prompt(s), too few to split into training and validation; add rows")
    order = np.random.default_rng([seed, 7]).permutation(len(prompts))
    n_val = min(len(prompts) - 1, max(1, round(len(prompts) * val_fraction)))
    val = [prompts[i] for i in sorted(order[:n_val])]
    train = [prompts[i] for i in sorted(order[n_val:])]
    counts = {"prompts": len(prompts), "train": len(train), "val": len(val)}
    rank_zero_info(f"prompt data {source}: {len(prompts):,} prompts ({len(train):,} train, {len(val):,} val)")
    return PromptData(chat, train, val, counts)


def prompt_batch(prompts: list[Prompt], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) prompt ids padded with -1, and the prompts' indices (B,): the module reads the rows by index."""
    return pad_rows([p.ids for p in prompts]), torch.tensor(ids, dtype=torch.long)


class RandomPrompts(Dataset):
    """Item i: batch_size prompts drawn by rng(seed, stream, i) (as RandomConversations)."""

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int, stream: int, length: int) -> None:
        self.prompts, self.batch_size, self.seed, self.stream, self.length = prompts, batch_size, seed, stream, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.stream, i])
        picks = rng.choice(len(self.prompts), size=self.batch_size, replace=len(self.prompts) < self.batch_size)
        return prompt_batch([self.prompts[j] for j in picks], picks.tolist())


class FixedPrompts(Dataset):
    """Item j: prompts j * batch_size .. (j + 1) * batch_size - 1 (the validation prompts)."""

    def __init__(self, prompts: list[Prompt], batch_size: int) -> None:
        self.prompts, self.batch_size = prompts, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.prompts) / self.batch_size)

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = range(j * self.batch_size, min((j + 1) * self.batch_size, len(self.prompts)))
        return prompt_batch([self.prompts[i] for i in ids], list(ids))


# ------------------------------------------------------------------------------------------------- sampling


@torch.no_grad()
def sample_groups(
    model: GPT,
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    stop_token: int,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> list[list[int]]:
    """group_size completions of each prompt (prompt i's are rows i * G .. i * G + G - 1), sampled in one batch
    with the KV cache: the prompts, right-padded, are prefilled together (causal attention: a row never sees its
    padding, which its own completion then overwrites in the cache), then each step runs one token of every row at
    the row's own position.  A completion ends with stop_token (kept) or after max_new_tokens, or where the
    context ends.  The model is used as it is (the caller sets eval mode)."""
    device = model.lm_head.weight.device
    block_size = model.config.block_size
    G = group_size
    lengths = torch.tensor([len(p) for p in prompts], device=device).repeat_interleave(G)  # (BG,)
    batch = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = torch.as_tensor(p)
    batch = batch.to(device).repeat_interleave(G, dim=0)  # (BG, P)
    budget = (block_size - lengths).clamp(max=max_new_tokens)  # (BG,) tokens each row may add
    rows = batch.size(0)
    # the cache in the dtype the layers compute in: bf16 under autocast (a GPU's bf16-mixed), else the weights'
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    p = model.transformer.ln_f.weight
    cache = [
        KVCache(rows, block_size, model.config.n_kv_head, model.config.head_dim, p.device, dtype or p.dtype)
        for _ in range(model.config.n_layer)
    ]
    logits = model(batch, kv_cache=cache, input_pos=0)[0]  # (BG, P, V)
    logits = logits[torch.arange(rows, device=device), lengths - 1]  # (BG, V): each row's last prompt token
    out = torch.full((rows, max_new_tokens), -1, dtype=torch.long, device=device)
    pos = lengths.clone()  # where each row's next token goes
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        next_ids = sample_next(logits, temperature, generator=generator)  # (BG,)
        out[:, step] = next_ids.masked_fill(finished, -1)
        finished |= (next_ids == stop_token) | (step + 1 >= budget)
        if bool(finished.all()):
            break
        logits = model(next_ids[:, None], kv_cache=cache, input_pos=pos)[0][:, -1]
        pos = torch.where(finished, pos, pos + 1)  # a finished row stays put (its writes are never read)
    return [row[row >= 0].tolist() for row in out.cpu()]


def completion_rows(prompts: list[list[int]], completions: list[list[int]], group_size: int) -> torch.Tensor:
    """(BG, L) rows of the SFT layout: prompt i's ids as ~id (no target), then completion r's ids (targets)."""
    rows = [
        np.concatenate([~np.asarray(prompts[r // group_size], dtype=np.int64), np.asarray(c, dtype=np.int64)])
        for r, c in enumerate(completions)
    ]
    return pad_rows(rows)
