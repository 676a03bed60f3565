"""Tokenizers: char (nanoGPT shakespeare_char), byte (UTF-8 bytes) and tiktoken BPE (gpt2, cl100k_base, ...);
a Hugging Face model's own tokenizer.json is HFTokenizer ("hf" in the dicts below).

Every tokenizer serializes to a plain, self-contained dict (`to_dict`) that a checkpoint stores, so sampling
needs nothing else: no vocabulary file, no download. `tokenizer_from_dict` is the inverse.

A tokenizer setting is a built-in name ("char", "byte", a tiktoken encoding name) or the path of a tokenizer
file: that dict as JSON (a prepared data directory's tokenizer.json, or a BPE built elsewhere), to reuse a
vocabulary as it is. A char tokenizer read from a file is fixed: it is not rebuilt from the corpus.
"""

from __future__ import annotations

import base64
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import CheckpointError, DataError, UnknownCharactersError, UserError, first_line, shown_chars
from minigpt.core.hf_tokenizer import EOS_TOKENS, HFTokenizer, hf_tokenizer_file, tokenizers_library
from minigpt.core.tokenizer_base import ENDOFTEXT, Tokenizer
from minigpt.core.user_files import DOCUMENT_BYTES, loads, read_user_text

__all__ = [
    "Tokenizer",
    "CharTokenizer",
    "ByteTokenizer",
    "TiktokenTokenizer",
    "HFTokenizer",
    "UnknownCharactersError",
    "tokenizer_from_dict",
    "tokenizer_names",
    "resolve_tokenizer",
    "read_tokenizer_file",
    "get_tokenizer",
    "tiktoken_cache_dir",
    "encoding_parts",
    "EOS_TOKENS",
    "tokenizers_library",
]


class CharTokenizer(Tokenizer):
    """One token per character; the vocabulary is the sorted set of the corpus's characters."""

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars)))
        self.name = "char"
        self.vocab_size = len(self.chars)
        self.eot_id = None
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        # Code point -> id lookup table (-1 = unknown): encode_array maps a whole text with one numpy gather.
        self._lut = np.full(max(map(ord, self.chars), default=0) + 1, -1, dtype=np.int64)
        self._lut[[ord(c) for c in self.chars]] = np.arange(len(self.chars))

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return cls("".join(chars))

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        # utf-32 gives one uint32 per code point; surrogatepass so lone surrogates reach the unknown check
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = self._lut[np.minimum(cps, len(self._lut) - 1)]
        bad = (ids < 0) | (cps >= len(self._lut))
        if bad.any():
            raise UnknownCharactersError(sorted({chr(c) for c in cps[bad].tolist()}))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if (low := min(ids, default=0)) < 0:  # a list index would wrap round to the last characters
            raise ValueError(f"token id {low} is negative; this vocabulary's ids are 0 to {len(self.chars) - 1}")
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "char", "name": self.name, "chars": self.chars}


class ByteTokenizer(Tokenizer):
    """The 256 UTF-8 byte values: encodes any text (and any file), decodes with U+FFFD for broken sequences."""

    def __init__(self) -> None:
        self.name = "byte"
        self.vocab_size = 256
        self.eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogatepass"))  # surrogatepass: never fails, even on lone surrogates

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:
        return {"type": "byte", "name": self.name}


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE encoding. Text is encoded with encode_ordinary: '<|endoftext|>' in a document is plain text,
    only the data pipeline inserts the real end-of-text token (between documents)."""

    def __init__(self, encoding: tiktoken.Encoding):
        self.encoding = encoding
        self.name = encoding.name
        self.vocab_size = encoding.n_vocab
        self.eot_id = encoding.eot_token if ENDOFTEXT in encoding.special_tokens_set else None

    def encode(self, text: str) -> list[int]:
        # encode_ordinary's tokens: with no special token allowed or disallowed, encode gives the same ids, and where
        # a checkpoint's pat_str backtracks past fancy-regex's limit it raises ValueError (encode_ordinary panics)
        try:
            return self.encoding.encode(text, allowed_special=set(), disallowed_special=())
        except ValueError as e:
            raise self._regex_failure(e) from None

    def encode_array(self, text: str) -> np.ndarray:
        # straight into an array (no list of Python ints: a quarter of the time at tiktoken's speed)
        try:
            return self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        except ValueError as e:
            raise self._regex_failure(e) from None

    def _regex_failure(self, e: ValueError) -> DataError:
        return DataError(
            f"the tokenizer {self.name} cannot encode this text: its pre-tokenizer regular expression gave up on it "
            f"({first_line(e, 100)}), as one that backtracks catastrophically does; use a checkpoint whose "
            "tokenizer minigpt wrote (a GPT-2 or BPE one), not a crafted one"
        )

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[np.ndarray]:
        # tiktoken's Rust core releases the GIL, so threads encode in parallel (as its encode_ordinary_batch does)
        with ThreadPoolExecutor(num_threads or os.cpu_count() or 1) as pool:
            return list(pool.map(self.encode_array, texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))

    def to_dict(self) -> dict[str, Any]:
        pat_str, ranks, specials = encoding_parts(self.encoding)
        return {
            "type": "tiktoken",
            "name": self.encoding.name,
            "pat_str": pat_str,
            # JSON keys must be str: each token's bytes as base64 (the .tiktoken file format)
            "mergeable_ranks": {base64.b64encode(token).decode("ascii"): rank for token, rank in ranks.items()},
            "special_tokens": specials,
        }


def encoding_parts(enc: tiktoken.Encoding) -> tuple[str, dict[bytes, int], dict[str, int]]:
    """(pat_str, mergeable_ranks, special_tokens): what `tiktoken.Encoding(name, pat_str=..., ...)` was built from,
    so an encoding can be written out (tokenizer dicts, Hugging Face tokenizer.json) and rebuilt exactly.

    Ranks and special tokens come from tiktoken's public API. The split pattern has no public accessor, so it is
    read from the private attribute here, and nowhere else (tests/core/test_tokenizers.py fails if that changes).
    """
    ranks: dict[bytes, int] = {}
    specials: dict[str, int] = {}
    for i in range(enc.n_vocab):  # by id, not by special_tokens_set: a special's text may also be a ranked token
        try:
            token = enc.decode_single_token_bytes(i)
        except KeyError:  # an id that names no token: cl100k_base and o200k_base leave gaps before their specials
            continue
        if enc.is_special_token(i):
            specials[token.decode("utf-8")] = i
        else:
            ranks[token] = i
    return enc._pat_str, ranks, specials


NOT_OURS = "the checkpoint or tokenizer.json was not written by minigpt or is damaged"


def tokenizer_from_dict(d: Any) -> Tokenizer:
    """Rebuild a tokenizer from its to_dict(); needs no file and no network.

    A dict that is not one raises CheckpointError: most dicts come from checkpoints; the data code, which reads
    them from tokenizer files, re-raises it as DataError naming the file.
    """
    kind = d.get("type") if isinstance(d, dict) else None
    try:
        problem = next(dict_problems(kind, d), None)
        if problem is None:
            return BUILDERS[kind](d)
    # the builders only read the dict: these mean a field is missing or of the wrong type or shape (binascii.Error
    # and a bad pat_str regex are ValueErrors; a tokenizer.json the `tokenizers` library refuses, a DataError)
    except (KeyError, AttributeError, TypeError, ValueError, DataError) as e:
        problem = f"{type(e).__name__}: {first_line(e)}"
    what = f"{kind} tokenizer dict" if kind in BUILDERS else "tokenizer dict"
    raise CheckpointError(f"damaged {what} ({problem}); {NOT_OURS}")


def _tiktoken_from_dict(d: dict[str, Any]) -> TiktokenTokenizer:
    ranks = {base64.b64decode(token, validate=True): int(rank) for token, rank in d["mergeable_ranks"].items()}
    specials = {str(k): int(v) for k, v in d["special_tokens"].items()}
    return TiktokenTokenizer(
        tiktoken.Encoding(str(d["name"]), pat_str=str(d["pat_str"]), mergeable_ranks=ranks, special_tokens=specials)
    )


BUILDERS = {
    "char": lambda d: CharTokenizer(d["chars"]),
    "byte": lambda d: ByteTokenizer(),
    "tiktoken": _tiktoken_from_dict,
    "hf": HFTokenizer.from_dict,
    "chat": lambda d: ChatTokenizer.from_dict(d, tokenizer_from_dict),
}  # (chat: a base and its markup)


def dict_problems(kind: Any, d: Any) -> Iterator[str]:
    """What a tokenizer dict holds that to_dict never writes and its builder would take silently (a missing field
    or one of the wrong type the builder trips over itself)."""
    if kind not in BUILDERS:
        yield f"unknown tokenizer type {kind!r}; expected {', '.join(BUILDERS)}"
    elif kind == "char":
        chars = d.get("chars")
        if not isinstance(chars, str):
            yield "its 'chars' is not a string"
        # minigpt writes each character once, sorted; a repeat would silently shrink the vocabulary (and shift ids)
        elif len(set(chars)) != len(chars):
            yield f"character(s) listed twice: {shown_chars(sorted({c for c in chars if chars.count(c) > 1}))}"
        # text is decoded strictly, so no corpus yields half a UTF-16 pair; one would break the exports' writers
        elif any("\ud800" <= c <= "\udfff" for c in chars):
            yield "a lone surrogate among its characters, which no UTF-8 text holds"
    elif kind == "tiktoken":
        # every id names one token: two tokens on one rank would decode wrongly (tiktoken does not check); two
        # base64 spellings of one token would be one token
        ranks = d["mergeable_ranks"]
        ids = [int(i) for i in (*ranks.values(), *d["special_tokens"].values())]
        if len(set(ids)) != len(ids) or len({base64.b64decode(t, validate=True) for t in ranks}) != len(ranks):
            yield "two tokens share an id"
    elif kind == "hf":
        if not isinstance(d["tokenizer_json"], str):
            yield "'tokenizer_json' is not a string"
        ids = [d.get(k) for k in ("vocab_size", "bos_id", "eos_id")]
        if any(i is not None and (not isinstance(i, int) or isinstance(i, bool)) for i in ids):
            yield "'vocab_size', 'bos_id' and 'eos_id' must be integers or null"
        ends = d.get("end_ids", [])
        if not isinstance(ends, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in ends):
            yield "'end_ids' must be a list of integers"
    elif kind == "chat":
        if not all(
            isinstance(x, str) for x in (d["chat_template"], d["end_of_turn"], *d["added_tokens"], *d["special_tokens"])
        ):
            yield "its template, end-of-turn and added tokens must be strings"
        if d["base"].get("type") == "chat":
            yield "a chat tokenizer's base is a chat tokenizer"


def tokenizer_names() -> list[str]:
    """Every built-in name get_tokenizer accepts; it also takes the path of a tokenizer file."""
    return ["char", "byte", *tiktoken.list_encoding_names()]


# `bpe:VOCAB` (minigpt.data.bpe): a byte-level BPE trained on the corpus, with these special tokens
BPE_PREFIX = "bpe:"
BPE_SPECIALS = (ENDOFTEXT,)
BPE_MIN_VOCAB = 256 + len(BPE_SPECIALS) + 1  # the byte alphabet, the specials, and at least one merge
BPE_MAX_VOCAB = 1 << 22
BPE_VOCAB = re.compile(r"[0-9]+")  # the VOCAB of bpe:VOCAB (its underscores, as in 4_096, dropped first)


def bpe_vocab_size(spec: str) -> int:
    """VOCAB of a "bpe:VOCAB" setting, checked: one line naming the problem for bpe:0, bpe:100, bpe:lots."""
    text = spec[len(BPE_PREFIX) :].strip().replace("_", "")
    number = BPE_VOCAB.fullmatch(text)  # ASCII digits: str.isdigit() also takes '²⁵⁸', which int() refuses
    if not (number and BPE_MIN_VOCAB <= int(text) <= BPE_MAX_VOCAB):
        raise DataError(
            f"tokenizer {spec!r}: "
            + (
                f"a byte-level BPE needs a vocabulary of at least {BPE_MIN_VOCAB} (256 bytes, "
                f"{len(BPE_SPECIALS)} special token, one merge) and at most {BPE_MAX_VOCAB:,}; e.g. bpe:4096"
                if number
                else "VOCAB must be a whole number of tokens, e.g. bpe:4096 (in the digits 0-9)"
            )
        )
    return int(text)


def resolve_tokenizer(name: str | Path) -> str | Path:
    """A tokenizer setting as get_tokenizer reads it: a built-in name as is ("bpe:VOCAB" normalised), else the
    absolute Path of a tokenizer file. Built-in names win over files of the same name. Raises DataError for an
    unknown name, a bad bpe:VOCAB or a missing file."""
    name = str(name)
    if name in tokenizer_names():
        return name
    if name.startswith(BPE_PREFIX):
        return f"{BPE_PREFIX}{bpe_vocab_size(name)}"
    path = Path(name).expanduser()
    if path.is_file():
        return path.resolve()
    meant_as_path = name.endswith(".json") or "/" in name or os.sep in name
    raise DataError(
        f"tokenizer file not found: {name}; give the path of a tokenizer JSON file (a prepared data "
        "directory's tokenizer.json, or one made by Hugging Face tokenizers)"
        if meant_as_path
        else f"unknown tokenizer {name!r}; choose one of: {', '.join(tokenizer_names())}, bpe:VOCAB (trained "
        "on the corpus, e.g. bpe:4096), or give the path of a tokenizer JSON file (e.g. a prepared data "
        "directory's tokenizer.json)"
    )


def read_tokenizer_file(path: str | Path) -> Tokenizer:
    """The tokenizer a tokenizer file holds: minigpt's (JSON of Tokenizer.to_dict()) or any tokenizer.json the
    Hugging Face `tokenizers` library reads.  Raises DataError naming the file."""
    try:
        text = read_user_text(path, DOCUMENT_BYTES)
        d = loads(text)
        if isinstance(d, dict) and isinstance(d.get("model"), dict) and "type" not in d:  # the `tokenizers` library's
            return hf_tokenizer_file(text, d)
        return tokenizer_from_dict(d)
    # one line naming the file, whichever step failed: reading it, parsing it (ValueError: JSONDecodeError,
    # UnicodeDecodeError, nested past MAX_JSON_DEPTH, a device, too large), or what it holds
    except (OSError, ValueError, UserError) as e:
        if isinstance(e, OSError):
            what = f" cannot be read ({e.strerror or type(e).__name__})"
        elif isinstance(e, ValueError):
            what = f" is not JSON ({first_line(e)}); give a tokenizer.json written by minigpt"
        elif isinstance(e, CheckpointError):
            what = f" does not hold a minigpt tokenizer ({first_line(e)})"
        else:  # the `tokenizers` library's refusal
            what = f": {first_line(e)}"
        raise DataError(f"tokenizer file {path}{what}") from None


def tiktoken_cache_dir() -> str:
    """Where tiktoken looks for (and stores) its downloaded encoding files (same rule as tiktoken.load)."""
    return (
        os.environ.get("TIKTOKEN_CACHE_DIR")
        or os.environ.get("DATA_GYM_CACHE_DIR")
        or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    )


def get_tokenizer(name: str | Path, texts: Iterable[str] | None = None) -> Tokenizer:
    """ "char" (vocabulary from `texts`), "byte", a tiktoken encoding name ("gpt2", "cl100k_base", ...), or the path
    of a tokenizer file (a char tokenizer from a file keeps its vocabulary; `texts` is not needed).
    Raises DataError for a setting that cannot work: unknown name, missing or damaged file, encoding not fetchable."""
    spec = resolve_tokenizer(name)
    if isinstance(spec, Path):
        return read_tokenizer_file(spec)
    if spec == "char":
        if texts is None:  # a caller's mistake, not the user's
            raise ValueError("the char tokenizer builds its vocabulary from the corpus; pass texts=...")
        return CharTokenizer.from_texts(texts)
    if spec == "byte":
        return ByteTokenizer()
    # (bpe:VOCAB is trained while data is prepared: its callers, minigpt.data and the chat data, never pass it here)
    try:
        encoding = tiktoken.get_encoding(spec)
    # requests/urllib/socket errors all derive from OSError; a corrupted download is tiktoken's ValueError "hash
    # mismatch"; any other error (a programming error) passes through
    except (OSError, ValueError) as e:
        if isinstance(e, ValueError) and "hash mismatch" not in str(e).lower():
            raise
        raise DataError(
            f"could not fetch the tiktoken encoding {spec!r} ({type(e).__name__}: no network?); run once with "
            f"internet access so tiktoken caches it, or copy its files (named by the sha1 of their URL) into the "
            f"TIKTOKEN_CACHE_DIR directory (now {tiktoken_cache_dir()}), or use the char/byte tokenizer"
            if isinstance(e, OSError)
            else f"the download of tiktoken encoding {spec!r} was corrupted; delete the "
            f"cached files in {tiktoken_cache_dir()} and try again"
        ) from None
    return TiktokenTokenizer(encoding)
