"""Chat fine-tuning (SFT) data: conversations -> token rows whose loss is on what the assistant says.

One conversation is one row of token ids, rendered by its tokenizer's chat template (minigpt.core.chat_template).
A row stores a token the model is not trained to predict (the prompt's tokens, unless train_on_prompt) as ~id, a
negative number, so a batch stays one (B, T + 1) tensor as in pretraining: inputs are the ids, and targets are -1
(GPT.forward's ignore_index) where the stored value is negative (GPTLightningModule.split_batch).

Rows are padded, not packed: a batch holds one conversation per row, padded on the right with -1 (input id 0,
never a target).  Causal attention never lets a token see a later position, so the padding cannot reach a
conversation; packing several conversations into one window would need a block-diagonal mask that the sdpa path's
is_causal kernel and the KV cache do not take, or one conversation would attend into another.

A conversation longer than block_size + 1 tokens is cut to its first block_size + 1; one with no assistant token
left is skipped; both are counted in one line.  Batches are drawn as in pretraining (minigpt.training.datamodule):
batch i from a generator seeded with (seed, rank, i), so a resumed run sees the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from minigpt.core.chat_template import ROLES, ChatTokenizer
from minigpt.core.checkpoint import SECTION
from minigpt.core.errors import DataError, UserError, first_line
from minigpt.core.model import GPT
from minigpt.core.tokenizers import CharTokenizer, Tokenizer, get_tokenizer, resolve_tokenizer
from minigpt.core.user_files import TEMPLATE_BYTES, read_user_text
from minigpt.data.conversations import read_conversations

PAD = -1  # ~0: input id 0, no target


@dataclass
class ChatData:
    """Tokenized conversations: each row int64 (n,), ~id where the token is not a target."""

    tokenizer: ChatTokenizer
    train: list[np.ndarray]
    val: list[np.ndarray]
    counts: dict[str, int] = field(default_factory=dict)


def base_tokenizer(spec: str, conversations: list[list[dict[str, str]]]) -> Tokenizer:
    """The tokenizer a chat run starts from: a tokenizer file (init_from's, maybe already a chat tokenizer), or a
    built-in name; "char" takes its vocabulary from the conversations."""
    resolved = resolve_tokenizer(spec)
    if resolved == "char":
        return CharTokenizer.from_texts([*ROLES, "\n"] + [m["content"] for c in conversations for m in c])
    if str(resolved).startswith("bpe:"):
        raise DataError(
            f"data.tokenizer {spec}: a BPE is trained on a text corpus, not on chat data; pretrain a "
            "base with it first and fine-tune that with --init_from"
        )
    return get_tokenizer(resolved)


def read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return read_user_text(Path(path).expanduser(), TEMPLATE_BYTES)
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, too large, a device (/dev/zero)
        raise DataError(
            f"data.chat_template: cannot read {path} ({first_line(e)}); give a Jinja template file"
        ) from None


def encode_row(tokenizer: ChatTokenizer, messages: list[dict[str, str]], train_on_prompt: bool) -> np.ndarray:
    ids, mask = tokenizer.encode_chat(messages, train_on_prompt=train_on_prompt)
    row = np.asarray(ids, dtype=np.int64)
    return np.where(np.asarray(mask, dtype=bool), row, ~row)


def load_chat_data(
    source: str,
    tokenizer: str,
    chat_template: str | None,
    val_fraction: float,
    block_size: int,
    seed: int,
    train_on_prompt: bool = False,
) -> ChatData:
    """Read, check, tokenize and split the conversations of `source` (see the module docstring)."""
    conversations = read_conversations(source)
    if not conversations:  # not a block_size matter
        raise DataError(f"{source} holds no conversations; give a file with at least 2")
    base = base_tokenizer(tokenizer, conversations)
    template = read_template(chat_template)
    if isinstance(base, ChatTokenizer) and template is not None and template != base.template:
        raise DataError(
            f"data.chat_template {chat_template}: the model already has a chat template (its source's, "
            "or the one this run was trained with), and a model answers in the format it was trained in; "
            "remove data.chat_template"
        )
    rows, truncated, skipped = [], 0, 0
    where = f"data.chat_template {chat_template}" if template is not None else source  # named in an error
    try:
        chat = ChatTokenizer.for_base(base, template, conversations)
        for i, messages in enumerate(conversations, 1):
            where = f"{source} conversation {i}"
            row = encode_row(chat, messages, train_on_prompt)
            if len(row) > block_size + 1:
                row, truncated = row[: block_size + 1], truncated + 1
            if not (row[1:] >= 0).any():
                skipped += 1
                continue
            rows.append(row)
    except UserError as e:  # the template's errors (render budget, a bad template) and a row's, named by where
        raise DataError(f"{where}: {first_line(e, 400)}") from None
    if len(rows) < 2:
        raise DataError(
            f"{source}: {len(rows)} conversation(s) fit block_size={block_size} with an assistant token "
            "to learn, too few to split into training and validation; add conversations or raise "
            "block_size"
        )
    order = np.random.default_rng([seed, 7]).permutation(len(rows))
    n_val = min(len(rows) - 1, max(1, round(len(rows) * val_fraction)))
    val = [rows[i] for i in sorted(order[:n_val])]
    train = [rows[i] for i in sorted(order[n_val:])]
    counts = {
        "conversations": len(conversations),
        "train": len(train),
        "val": len(val),
        "truncated": truncated,
        "skipped": skipped,
        "tokens": int(sum(len(r) for r in rows)),
    }
    rank_zero_info(
        f"chat data {source}: {len(conversations):,} conversations ({len(train):,} train, {len(val):,} val, "
        f"{counts['tokens']:,} tokens); {truncated} longer than block_size + 1 = {block_size + 1} tokens "
        f"truncated, {skipped} skipped (no assistant token left)"
    )
    return ChatData(chat, train, val, counts)


def pad_rows(rows: list[np.ndarray]) -> torch.Tensor:
    """(B, L) int64, L the longest row, padded with PAD on the right."""
    batch = np.full((len(rows), max(len(r) for r in rows)), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = r
    return torch.from_numpy(batch)


def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T + 1) rows -> inputs (B, T) and targets (B, T), -1 where there is nothing to learn."""
    inputs = batch[:, :-1]
    return torch.where(inputs < 0, ~inputs, inputs), batch[:, 1:].clamp(min=-1)


class RandomConversations(Dataset):
    """Item i: batch_size conversations drawn by rng(seed, stream, i), padded into one tensor."""

    def __init__(self, rows: list[np.ndarray], batch_size: int, seed: int, stream: int, length: int) -> None:
        self.rows, self.batch_size, self.seed, self.stream, self.length = rows, batch_size, seed, stream, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, self.stream, i])
        picks = rng.choice(len(self.rows), size=self.batch_size, replace=len(self.rows) < self.batch_size)
        return pad_rows([self.rows[j] for j in picks])


class FixedConversations(Dataset):
    """Item j: conversations j * batch_size .. (j + 1) * batch_size - 1, padded (the validation set)."""

    def __init__(self, rows: list[np.ndarray], batch_size: int) -> None:
        self.rows, self.batch_size = rows, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.rows) / self.batch_size)

    def __getitem__(self, j: int) -> torch.Tensor:
        return pad_rows(self.rows[j * self.batch_size : (j + 1) * self.batch_size])


@torch.no_grad()
def chat_loss(model: GPT, rows: list[np.ndarray], batch_size: int) -> tuple[float, int]:
    """(summed nats, target tokens) over every row: the loss on what the assistant says, exactly."""
    was_training = model.training
    model.eval()
    nats, n = 0.0, 0
    device = model.lm_head.weight.device
    try:
        batches = FixedConversations(rows, batch_size)
        for j in range(len(batches)):
            inputs, targets = split_batch(batches[j].to(device))
            logits, _ = model(inputs)
            nats += F.cross_entropy(
                logits.float().flatten(0, 1), targets.reshape(-1), ignore_index=-1, reduction="sum"
            ).item()
            n += int((targets >= 0).sum())
    finally:
        model.train(was_training)
    return nats, n


def check_chat_resumable(ckpt: dict, tokenizer: Tokenizer | None, path: Path) -> None:
    """A chat run resumes with the chat template it was trained with: one line naming the option otherwise."""
    saved = ckpt[SECTION].get("tokenizer") or {}
    if (
        isinstance(tokenizer, ChatTokenizer)
        and saved.get("type") == "chat"
        and saved.get("chat_template") != tokenizer.template
    ):
        raise UserError(
            f"{path} was trained with another chat template than this run's (data.chat_template); "
            "resume with the template it was trained with, or start a new run in another out_dir"
        )


def grow_vocabulary(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """A source's weights with the embedding and head grown to `vocab_size` rows: a new token starts at the mean
    of the existing rows (a neutral start: its logit is about the average one, not a random spike)."""
    grown = dict(state)
    for name in ("transformer.wte.weight", "lm_head.weight"):
        old = state.get(name)
        if old is not None and old.size(0) < vocab_size:
            extra = old.mean(dim=0, keepdim=True).expand(vocab_size - old.size(0), -1)
            grown[name] = torch.cat((old, extra.to(old.dtype)))
    return grown
