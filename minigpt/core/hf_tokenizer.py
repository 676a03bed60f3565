"""A Hugging Face tokenizer.json (a model's, or one trained with the `tokenizers` library, e.g. bpe:VOCAB), applied by
that library exactly as transformers applies it, behind minigpt's Tokenizer interface."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from minigpt.core.errors import DataError, UnknownCharactersError, UserError, first_line
from minigpt.core.tokenizer_base import Tokenizer

__all__ = ["EOS_TOKENS", "HFTokenizer", "hf_tokenizer_file", "rust_panics_as_errors", "tokenizers_library"]


def tokenizers_library():
    """The `tokenizers` library, imported on first use (only HF sources and exports need it)."""
    try:
        import tokenizers
    except ImportError:
        raise UserError(
            "Hugging Face tokenizers need the `tokenizers` package; install it with `python3 -m pip install tokenizers`"
        ) from None
    return tokenizers


@contextmanager
def rust_panics_as_errors(name: str, failed: str = "cannot encode this text") -> Iterator[None]:
    """A tokenizer.json the library cannot apply (a pre-tokenizer regex that backtracks past Oniguruma's retry
    limit on this text) makes its Rust code panic: a PanicException, which derives from BaseException, after the
    panic's message and backtrace on the process's stderr.  That is the file's fault, not the user's text's: one
    DataError line naming it, the Rust report held back (anything else written to stderr meanwhile goes through)."""
    saved, held = os.dup(2), tempfile.TemporaryFile()
    os.dup2(held.fileno(), 2)
    panic = None
    try:
        yield
    except BaseException as e:  # noqa: B036 - pyo3's PanicException is a BaseException and cannot be imported
        if type(e).__name__ != "PanicException":
            raise
        panic = e
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        with held:
            held.seek(0)
            report = held.read()
        if panic is None and report:
            os.write(2, report)
    if panic is not None:
        raise DataError(
            f"the tokenizer {name} {failed}: the tokenizers library gave up inside it "
            f"({first_line(panic, 100)}), as a pre-tokenizer regular expression that backtracks "
            "catastrophically does; use a well-formed tokenizer.json (e.g. the model's original)"
        )


# pre-tokenizer regexes that never match across a newline between a non-space and a letter or digit, so a text cut
# there encodes piece by piece as it does whole: Llama 3's (transformers' tiktoken conversion), Qwen2's, Qwen3.5's
_CONTRACTIONS, _SPACES = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|", r"|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLIT_REGEXES = (
    _CONTRACTIONS + r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _SPACES,
    _CONTRACTIONS + r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _SPACES,
    _CONTRACTIONS + r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*" + _SPACES,
)


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json, applied by the `tokenizers` library exactly as transformers applies it
    (a BOS is prepended where the source's post-processor does so)."""

    def __init__(
        self,
        tokenizer_json: str,
        name: str = "hf",
        vocab_size: int | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        library = tokenizers_library()
        with rust_panics_as_errors(name, "cannot be read"):  # a panic is a BaseException: it passes the except
            try:
                self.backend = library.Tokenizer.from_str(tokenizer_json)
            except Exception as e:  # the library raises its own Exception type for a bad tokenizer.json
                raise DataError(
                    f"not a Hugging Face tokenizer.json ({first_line(e)}); give the tokenizer.json saved with the model"
                ) from None
        self.tokenizer_json = tokenizer_json
        self.name = name
        self.vocab_size = int(vocab_size or self.backend.get_vocab_size(with_added_tokens=True))
        self.bos_id, self.eos_id = bos_id, eos_id
        self.eot_id = eos_id
        self.end_ids = () if eos_id is None else (eos_id,)  # with the folder's other ends (load_hf_tokenizer)
        # special tokens past the model's rows (Gemma 3's <image_soft_token>, for its vision tower): a text that
        # writes one is refused, as the model has no embedding for it
        self.beyond_model = self.backend.get_vocab_size(with_added_tokens=True) > self.vocab_size

    def _within_model(self, ids: list[int]) -> list[int]:
        if self.beyond_model and (past := [i for i in ids if i >= self.vocab_size]):
            raise UserError(
                f"the text writes the special token {self.backend.id_to_token(past[0])!r} (id {past[0]}), "
                f"which this model has no embedding for (its vocabulary ends at {self.vocab_size}); remove it "
                "from the text"
            )
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encoding(text).ids

    def encoding(self, text: str, add_special_tokens: bool = True):
        """The library's Encoding of `text` (ids and character offsets), its failures as one-line errors."""
        with rust_panics_as_errors(self.name):
            try:
                encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
            except Exception:  # the library's own type: a vocabulary without an unknown token (a char-level export)
                unknown = sorted({c for c in text if not self._encodes(c)})
                if not unknown:
                    raise
                raise UnknownCharactersError(unknown) from None
        self._within_model(encoding.ids)
        return encoding

    def _encodes(self, char: str) -> bool:
        with rust_panics_as_errors(self.name):
            try:
                self.backend.encode(char)
            except Exception:
                return False
        return True

    @functools.cached_property
    def frame(self) -> tuple[list[int], list[int]]:
        """The ids its post-processor writes before and after a text (Llama's <s>; BERT's [CLS] and [SEP])."""
        try:
            plain, framed = self.encoding("a", add_special_tokens=False).ids, self.encoding("a").ids
        except UserError:  # a vocabulary without "a": what it writes around nothing, taken as the start
            return self.encoding("").ids, []
        at = next((i for i in range(len(framed) - len(plain) + 1) if framed[i : i + len(plain)] == plain), 0)
        return framed[:at], framed[at + len(plain) :]

    @functools.cached_property
    def cuts_as_tiktoken(self) -> bool:
        """Whether it splits text as GPT-2's, Llama 3's or Qwen's regex does, byte-level and with nothing before it
        that crosses a newline (bpe:VOCAB, those models' tokenizer.json): then a text cut where tiktoken's never
        merge across (minigpt.data.encoding) encodes, piece by piece, to the whole text's ids."""
        d = json.loads(self.tokenizer_json)
        normalizer, pre = d.get("normalizer") or {"type": "NFC"}, d.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        if len(steps) not in (1, 2):
            return False
        split, byte_level = steps if len(steps) == 2 else (None, steps[0])
        return (
            normalizer.get("type") == "NFC"  # (or none): it composes characters, never across a newline
            and (byte_level or {}).get("type") == "ByteLevel"
            and not byte_level.get("add_prefix_space")  # a space before every piece
            and (
                byte_level.get("use_regex", True)  # GPT-2's own regex
                if split is None
                else split.get("type") == "Split"
                and split.get("pattern", {}).get("Regex") in SPLIT_REGEXES
                and split.get("behavior") == "Isolated"
                and not split.get("invert")
                and not byte_level.get("use_regex", True)
            )
        )

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    @functools.cached_property
    def documents(self):
        """A copy of the backend that reads a special token's text as text: a document's '<|endoftext|>' is its
        characters, not the separator the data layer puts after each document (as TiktokenTokenizer reads one)."""
        backend = type(self.backend).from_str(self.tokenizer_json)
        backend.encode_special_tokens = True
        return backend

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[np.ndarray]:
        """Documents' ids (the data layer's): their special tokens' text is text (`documents`)."""
        # the Rust core encodes a batch in parallel (its thread pool: TOKENIZERS_PARALLELISM / RAYON_NUM_THREADS)
        with rust_panics_as_errors(self.name):
            try:
                # _fast: the ids without the character offsets, which cost as much as the encoding itself
                return [
                    np.asarray(self._within_model(e.ids), dtype=np.int64)
                    for e in self.documents.encode_batch_fast(texts)
                ]
            except UserError:
                raise
            except Exception:  # one text the vocabulary cannot encode: find and name its characters
                return [self.encode_array(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    @functools.cached_property
    def textless(self) -> frozenset[int]:
        """The special tokens that stand for no text, as skip_special_tokens skips them: all but those of one
        character, which are characters (a char chat model's export registers the newline as its start token, and
        its text, the bits per character eval.py counts, keeps the newlines)."""
        added = self.backend.get_added_tokens_decoder().items()
        return frozenset(i for i, t in added if t.special and len(t.content) != 1)

    def token(self, i: int | None) -> str | None:
        return None if i is None else self.backend.id_to_token(i)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "hf",
            "name": self.name,
            "tokenizer_json": self.tokenizer_json,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "end_ids": list(self.end_ids),  # the folder's other ends (generation_config.json's), kept by its runs
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HFTokenizer:
        """The inverse of to_dict (tokenizer_from_dict calls it, once it has checked the dict)."""
        tokenizer = cls(
            d["tokenizer_json"],
            name=str(d.get("name", "hf")),
            vocab_size=d.get("vocab_size"),
            bos_id=d.get("bos_id"),
            eos_id=d.get("eos_id"),
        )
        if d.get("end_ids") is not None:  # older checkpoints: the EOS alone
            tokenizer.end_ids = tuple(d["end_ids"])
        return tokenizer


# end-of-text tokens of common Hugging Face tokenizers, in the order they are looked for
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


def hf_tokenizer_file(text: str, d: dict[str, Any]) -> HFTokenizer:
    """A tokenizer.json made by Hugging Face `tokenizers` (trained by the user, or a model's): its end-of-text id is
    the first special token of EOS_TOKENS it registers."""
    specials = {
        t.get("content"): t.get("id") for t in d.get("added_tokens") or [] if isinstance(t, dict) and t.get("special")
    }
    eos = next((specials[t] for t in EOS_TOKENS if isinstance(specials.get(t), int)), None)
    return HFTokenizer(text, name="hf", eos_id=eos)
