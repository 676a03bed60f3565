"""LightningDataModule over prepared token files: seeded random training windows, fixed validation windows.

With format "chat" the source holds conversations instead (minigpt.training.sft): one padded conversation per
row, the loss on what the assistant says.

Training batch i is drawn by a generator seeded with (seed, rank, i), and a run resumed at optimizer step s
continues at batch i = s * accumulate_grad_batches: the data order after a resume is exactly the order
an uninterrupted run would have seen, and under DDP each rank draws its own windows.  Validation's windows are
drawn once, all together, from a generator seeded with (seed, VAL_STREAM): the same total number of windows is
the same windows however they are batched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from minigpt.core.errors import ConfigError, UserError
from minigpt.core.seed import MAX_SEED
from minigpt.core.tokenizers import Tokenizer
from minigpt.data.prepare import PreparedData, load_prepared, prepare_data
from minigpt.training.dpo import FixedPairs, RandomPairs, load_preference_data
from minigpt.training.rollouts import FixedPrompts, RandomPrompts, load_prompt_data
from minigpt.training.sft import FixedConversations, RandomConversations, load_chat_data

VAL_STREAM = 1 << 20  # keeps validation generators apart from training ones
ROWS = {"chat": "conversation(s)", "preference": "pair(s)", "prompts": "prompt(s)"}  # a split's rows, by format


class RandomWindows(Dataset):
    """Item i is a (batch_size, block_size + 1) batch of windows at offsets drawn from rng(seed, stream, i)."""

    def __init__(
        self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int, stream: int, length: int
    ) -> None:
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.stream, self.length = seed, stream, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        windows = np.stack([self.tokens[s : s + self.block_size + 1] for s in self.starts(i)])
        return torch.from_numpy(windows.astype(np.int64))  # (B, T + 1)

    def starts(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.stream, i])
        return rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)


class FixedWindows(RandomWindows):
    """The validation's windows: all length * batch_size offsets drawn at once from rng(seed, stream), item i the
    batch of offsets [i * batch_size, (i + 1) * batch_size).  The windows depend only on the seed and their number,
    not on how they are batched: 5 batches of 640 are the same 3,200 windows as 50 batches of 64."""

    def __init__(
        self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int, stream: int, length: int
    ) -> None:
        super().__init__(tokens, block_size, batch_size, seed, stream, length)
        rng = np.random.default_rng([seed, stream])
        self.all_starts = rng.integers(0, len(tokens) - block_size, size=length * batch_size)

    def starts(self, i: int) -> np.ndarray:
        if not 0 <= i < self.length:
            raise IndexError(f"batch {i} of {self.length}")
        return self.all_starts[i * self.batch_size : (i + 1) * self.batch_size]


class ResumableSampler(Sampler[int]):
    """Yields `length` consecutive batch indices starting where training stands (read at each epoch start): `start()`
    (the step times accumulate_grad_batches) plus `offset`, which a resume sets where the run's batches so far were
    counted with another accumulate_grad_batches."""

    def __init__(self, length: int, start: Callable[[], int]) -> None:
        self.length, self.start, self.offset = length, start, 0

    def __len__(self) -> int:
        return self.length

    def position(self) -> int:
        return self.start() + self.offset

    def __iter__(self) -> Iterator[int]:
        # read when the first index is asked for, not when the iterator is made: Lightning makes it before it
        # restores a checkpoint when the schedule asks for estimated_stepping_batches (a max_epochs run)
        first = self.position()
        yield from range(first, first + self.length)


class ResumableLoader(DataLoader):
    """The training DataLoader, resumable in Lightning's terms (the state_dict / load_state_dict pair it looks for
    before it warns, on a mid-epoch resume, that the loader is not): its state is the next batch's index, which
    the restored global_step gives back (ResumableSampler.start) unless accumulate_grad_batches changed."""

    def state_dict(self) -> dict[str, int]:
        if not isinstance(self.sampler, ResumableSampler):  # Lightning's own (overfit_batches: the first batches)
            return {}
        return {"next_batch": self.sampler.position()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        # read after the trainer's global_step is restored: the same position unless accumulate_grad_batches changed,
        # where the step's batches would be counted anew (fewer: batches trained on again; more: batches skipped)
        if isinstance(self.sampler, ResumableSampler) and "next_batch" in state_dict:
            self.sampler.offset = state_dict["next_batch"] - self.sampler.start()


def own_generator() -> torch.Generator:
    """A DataLoader draws a seed from the global RNG each time it starts iterating unless it has its own
    generator; that draw would make dropout after --resume differ from an uninterrupted run."""
    return torch.Generator().manual_seed(0)


class TokenDataModule(L.LightningDataModule):
    """The corpus, its tokenizer and the batches (prepared once under data_root)."""

    def __init__(
        self,
        source: str = "stdlib",
        tokenizer: str = "char",
        data_root: str = "data",
        val_fraction: float = 0.1,
        text_column: str = "text",
        block_size: int = 256,
        batch_size: int = 32,
        val_batches: int = 20,
        val_batch_size: int | None = None,
        seed: int = 1337,
        num_workers: int = 0,
        format: Literal["text", "chat", "preference", "prompts"] = "text",
        train_on_prompt: bool = False,
        chat_template: str | None = None,
    ) -> None:
        """
        Args:
            source: corpus: "stdlib" (built in: the Python standard library's source), a text file or folder,
                a URL, or a `datasets` name / local parquet, json or csv file / save_to_disk folder
            tokenizer: "char", "byte", a tiktoken encoding name (gpt2, cl100k_base, o200k_base, ...), bpe:VOCAB (a
                byte-level BPE of VOCAB tokens trained on the corpus's training documents), or the path
                of a tokenizer JSON file (another prepared data directory's tokenizer.json, or any tokenizer.json
                of Hugging Face `tokenizers`)
            data_root: where prepared token files are cached
            val_fraction: share of the corpus held out for validation
            text_column: the text column of a `datasets` source
            block_size: context length (in train.py: set from the model's block_size)
            batch_size: sequences per batch (per device)
            val_batches: batches in the fixed validation set (per evaluation, over all devices)
            val_batch_size: sequences per validation batch, and per batch of the full split's evaluation at the
                end (None: batch_size).  On a GPU whose small model's batches cost kernel launches, not compute,
                as many windows in fewer, larger batches validate in a fraction of the time; the windows are the
                same ones, for they depend only on the seed and val_batches x val_batch_size
            seed: fixes the training windows (in train.py: set from the run's seed)
            num_workers: DataLoader worker processes
            format: "text" (a corpus read as one stream) or "chat": source holds conversations, rows of
                {"messages": [{"role": "system"|"user"|"assistant", "content": ...}]} or Alpaca's
                instruction/input/output, in a .jsonl/.json/.parquet file or a datasets name; the loss is on the
                assistant's replies only (docs/chat.md); or "preference": source holds pairs for DPO, rows of
                {"prompt", "chosen", "rejected"} (text, or lists of messages), settings in the dpo section
                (docs/dpo.md); or "prompts": source holds prompts for GRPO, rows of {"prompt", "answer"}, settings
                in the grpo section (docs/grpo.md); batch_size counts prompts, each sampled grpo.group_size times
            train_on_prompt: chat: train on every token, the prompts too, not only the assistant's replies
            chat_template: chat, preference and prompts: a Jinja chat template file (default: the source model's
                own, else ChatML with <|im_start|>/<|im_end|> added as special tokens)
        """
        super().__init__()
        # checked here, where they are declared: each would otherwise fail deep inside numpy or Lightning, or
        # (val_fraction) only after minutes of reading the corpus
        for name, value, ok, need, example in (
            ("batch_size", batch_size, batch_size >= 1, "must be >= 1", "32"),
            ("val_batches", val_batches, val_batches >= 1, "must be >= 1", "20"),
            ("val_batch_size", val_batch_size, val_batch_size is None or val_batch_size >= 1, "must be >= 1", "256"),
            ("val_fraction", val_fraction, 0.0 < val_fraction < 1.0, "must be between 0 and 1 (exclusive)", "0.1"),
            ("num_workers", num_workers, num_workers >= 0, "must be >= 0 (0 = load in the main process)", "0"),
            ("block_size", block_size, block_size >= 1, "must be >= 1", "256"),
            ("seed", seed, 0 <= seed <= MAX_SEED, f"must be in [0, {MAX_SEED}]", "1337"),
        ):
            if not ok:  # (NaN fails every comparison, so it is refused too)
                raise ConfigError(f"data.{name}: {need}, got {value}; use e.g. {example}")
        self.save_hyperparameters()
        self.prepared: PreparedData | None = None

    # Preparation is needed before the model exists (it sets vocab_size), so it runs on first use.
    def _load(self) -> PreparedData:
        if self.prepared is None and self.hparams.format == "chat":
            hp = self.hparams
            self.prepared = load_chat_data(
                hp.source, hp.tokenizer, hp.chat_template, hp.val_fraction, hp.block_size, hp.seed, hp.train_on_prompt
            )
        if self.prepared is None and self.hparams.format == "preference":
            hp = self.hparams
            self.prepared = load_preference_data(
                hp.source, hp.tokenizer, hp.chat_template, hp.val_fraction, hp.block_size, hp.seed
            )
        if self.prepared is None and self.hparams.format == "prompts":
            hp = self.hparams
            self.prepared = load_prompt_data(
                hp.source, hp.tokenizer, hp.chat_template, hp.val_fraction, hp.block_size, hp.seed
            )
        if self.prepared is None:
            hp = self.hparams
            data_dir = prepare_data(
                hp.source,
                hp.tokenizer,
                data_root=hp.data_root,
                val_fraction=hp.val_fraction,
                text_column=hp.text_column,
            )
            self.data_dir = Path(data_dir)
            self.prepared = load_prepared(data_dir)
            for split in ("train", "val"):
                n = len(getattr(self.prepared, split))
                if n < hp.block_size + 1:
                    raise UserError(
                        f"the {split} split has {n:,} token{'s' * (n != 1)}, fewer than one window of block_size + 1 "
                        f"= {hp.block_size + 1}; use a longer corpus, a smaller block_size or a "
                        + ("larger" if split == "val" else "smaller")
                        + " val_fraction"
                    )
        return self.prepared

    def prepare_data(self) -> None:
        self._load()

    @property
    def vocab_size(self) -> int:
        return self._load().tokenizer.vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        return self._load().tokenizer

    def setup(self, stage: str | None = None) -> None:
        self._load()
        _, world = self._world()
        if self.hparams.val_batches < world:  # some device would get no validation batch: Lightning fails deep down
            raise ConfigError(
                f"data.val_batches: {self.hparams.val_batches} validation batch(es) cannot be shared "
                f"by {world} devices (each needs one); set data.val_batches to at least {world}"
            )
        if (batches := self.val_batches_run()[1]) < world:  # a split of few conversations, pairs or prompts
            rows, size = len(self._load().val), self.val_batch_size
            fix = f"data.val_batch_size {rows // world} or less, or a larger" if rows >= world else "a larger"
            raise ConfigError(
                f"the validation split's {rows} {ROWS[self.hparams.format]} make {batches} batch(es) of "
                f"{size}, fewer than the {world} devices (each needs one); set {fix} data.val_fraction"
            )

    @property
    def val_batch_size(self) -> int:
        """Sequences per batch of validation and of the full split's evaluation."""
        return self.hparams.val_batch_size or self.hparams.batch_size

    def _on_cuda(self) -> bool:
        # pinned batches copy to the GPU without the host waiting for the GPU's queued work (a pageable copy
        # waits): the next step is queued while this one runs
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        hp, data = self.hparams, self._load()
        rank, world = self._world()
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        # an "epoch" is about one pass over the training tokens, a whole number of optimizer steps (every rank's
        # batches make a step)
        per_step = hp.batch_size * accumulate * world
        if hp.format == "chat":  # an epoch is about one pass over the conversations
            steps = max(1, len(data.train) // per_step)
            windows = RandomConversations(data.train, hp.batch_size, hp.seed, stream=rank, length=1 << 62)
        elif hp.format == "preference":  # an epoch is about one pass over the pairs
            steps = max(1, len(data.train) // per_step)
            windows = RandomPairs(data.train, hp.batch_size, hp.seed, stream=rank, length=1 << 62)
        elif hp.format == "prompts":  # an epoch is about one pass over the prompts
            steps = max(1, len(data.train) // per_step)
            windows = RandomPrompts(data.train, hp.batch_size, hp.seed, stream=rank, length=1 << 62)
        else:
            steps = max(1, len(data.train) // (per_step * hp.block_size))
            windows = RandomWindows(data.train, hp.block_size, hp.batch_size, hp.seed, stream=rank, length=1 << 62)
        length = steps * accumulate
        start = (lambda: self.trainer.global_step * accumulate) if self.trainer is not None else (lambda: 0)
        return ResumableLoader(
            windows,
            batch_size=None,
            sampler=ResumableSampler(length, start),
            num_workers=hp.num_workers,
            persistent_workers=hp.num_workers > 0,
            generator=own_generator(),
            pin_memory=self._on_cuda(),
        )

    def val_batches_run(self) -> tuple[Dataset, int]:
        """The validation's batches, the same at every evaluation, and how many of them a validation runs: the
        val_batches, or all of a split of fewer conversations, pairs or prompts."""
        hp, data, size = self.hparams, self._load(), self.val_batch_size
        if hp.format == "chat":
            windows = FixedConversations(data.val, size)
        elif hp.format == "preference":
            windows = FixedPairs(data.val, size, offset=len(data.train))
        elif hp.format == "prompts":
            windows = FixedPrompts(data.val, size)
        else:
            windows = FixedWindows(data.val, hp.block_size, size, hp.seed, stream=VAL_STREAM, length=hp.val_batches)
        return windows, min(hp.val_batches, len(windows))

    def val_batches_read(self) -> int:
        """The batches a validation of the run read: val_batches_run's, or fewer where Lightning limits each rank's
        share (limit_val_batches, fast_dev_run, overfit_batches)."""
        (rank, world), total, limits = self._world(), self.val_batches_run()[1], self.trainer.num_val_batches
        share = len(range(rank, total, world))
        limited = int(limits[0]) if limits else share
        return total if limited >= share else limited * world

    def val_dataloader(self) -> DataLoader:
        hp = self.hparams
        rank, world = self._world()
        windows, n_batches = self.val_batches_run()  # each rank takes its share of the batches
        return DataLoader(
            windows,
            batch_size=None,
            sampler=list(range(rank, n_batches, world)),
            num_workers=hp.num_workers,
            generator=own_generator(),
        )


# data settings a resume may change, but not without a word: they redraw the training windows (seed) or the
# validation set, whose losses best.ckpt and early stopping then compare with the old set's
VALIDATION = "the validation set is"
REDRAWN_BY = {"seed": "the training windows and the validation set are", "batch_size": VALIDATION}
REDRAWN_BY |= {"val_batches": VALIDATION, "val_batch_size": VALIDATION, "val_fraction": VALIDATION}


def resume_data_notes(saved: dict[str, Any] | None, hparams: dict[str, Any]) -> list[str]:
    """One note per data setting a resume changed (`saved`: the checkpoint's datamodule hyperparameters)."""
    return [
        f"--resume with {'' if k == 'seed' else 'data.'}{k} {hparams[k]!r} (the run had {saved[k]!r}): {what} not "
        "the run's from here on; best.ckpt and early stopping compare val losses across the change"
        for k, what in REDRAWN_BY.items()
        if saved is not None and k in saved and k in hparams and saved[k] != hparams[k]
    ]
