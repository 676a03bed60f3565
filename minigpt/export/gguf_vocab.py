"""The tokenizer inside a GGUF file, written so that llama.cpp's own tokenizer gives minigpt's ids.

llama.cpp does not run a tokenizer.json: it applies byte-level BPE ("gpt2" model) with merges ranked by their
order, after a pre-tokenizer it picks by name from the regular expressions it hard-codes.  So the GGUF vocabulary
is derived, as llama.cpp's convert_hf_to_gguf.py derives it, from the tokenizer.json that the Hugging Face export
writes (minigpt.hf.tokenizer_files): tokens in id order, added tokens as control (special) or user-defined tokens,
the merges, and the pre-tokenizer's name, found from the tokenizer.json's split pattern (PRE_TOKENIZERS).

    tiktoken / HF byte-level BPE: the byte-level vocabulary and merges as they are, the pattern's llama.cpp name.
    byte: the 256 byte tokens in GPT-2's byte alphabet, at their byte values, and no merge that can ever apply.
    char: each character as the bytes of its UTF-8 spelling, with merges that join exactly those bytes again (a
          character is never split by the pre-tokenizer, and a merge never crosses two characters).

    spm:  a SentencePiece-style BPE (Llama 2, Mistral v0.1-v0.3, Gemma, Phi-3: "▁" for spaces, <0xNN> byte
          fallback) becomes llama.cpp's SentencePiece tokenizer ("llama" model, _spm_vocab; what it cannot
          apply: minigpt.export.gguf_spm).

A tokenizer llama.cpp cannot reproduce is refused in one line (_unreproducible): a split pattern it has no
name for, a normaliser, a model that is neither byte-level nor SentencePiece-style BPE (Unigram, WordPiece), a
vocabulary larger than the model's.  llama.cpp always has an end-of-sequence token; for vocabularies without one
see gguf_specials.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import UserError
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer
from minigpt.export.gguf_spm import BYTE_PIECES, phi3_name, sentencepiece_style, space_prefix, spm_problems
from minigpt.hf.families import FAMILIES
from minigpt.hf.tokenizer_files import bytes_to_unicode, save_hf_tokenizer

__all__ = ["GGUFVocab", "PRE_TOKENIZERS", "gguf_vocab", "gguf_chat_template", "gguf_name", "pre_tokenizer_name"]

NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6  # gguf.TokenType
BYTE_LEVEL = bytes_to_unicode()
ALPHABET = set(BYTE_LEVEL.values())
NEVER_MERGED = f"{BYTE_LEVEL[0xFF]} {BYTE_LEVEL[0xFF]}"  # two 0xFF bytes: never adjacent in UTF-8 text
NO_MERGE_SCORE = -1e9  # a SentencePiece piece no merge makes: llama.cpp merges into it last

# split patterns (tokenizer.json's Split regex, or a tiktoken pat_str) -> the llama.cpp pre-tokenizer that splits
# text the same way: each family's own tokenizer's (minigpt.hf.families), then tiktoken's encodings; each is proven
# on llama.cpp by tests/export/test_gguf_vocab.py
PRE_TOKENIZERS = {
    **dict(f.gguf_pre_tokenizer for f in FAMILIES.values() if f.gguf_pre_tokenizer is not None),
    # tiktoken's gpt2 / r50k_base / p50k_base (the GPT-2 pattern, written faster)
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""": "gpt-2",
    # tiktoken's cl100k_base: Llama 3's pattern (possessive forms)
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]"""
    r"""|\s+(?!\S)|\s""": "llama-bpe",
    # tiktoken's o200k_base
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""": "gpt-4o",
}
REFUSED = (
    "llama.cpp would encode text to other ids than minigpt, so the GGUF could not be run as trained; export with "
    "--format hf instead (transformers applies the tokenizer.json as it is)"
)


@dataclass
class GGUFVocab:
    """What a GGUF file says about its tokenizer (the tokenizer.ggml.* keys)."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    bos: int | None
    eos: int | None
    add_bos: bool = False
    add_eos: bool = False
    end_of_turn: int | None = None
    end_of_message: int | None = None  # another end the model stops at (Phi-3's <|assistant|>): llama.cpp's EOM
    chat_template: str | None = None
    kind: str = ""  # "char", "bpe" or "spm": how a character added by a chat tokenizer is spelled
    nfc: bool = False  # the tokenizer NFC-normalises text first (Qwen's), which llama.cpp does not
    scores: list[float] | None = None  # SentencePiece ("spm"): each piece's merge priority, highest first
    add_space_prefix: bool = False  # SentencePiece: a "▁" before the text and after each added token
    unk: int | None = None
    pad: int | None = None
    phi3_rstrip: bool = False  # the added tokens take in the whitespace after them as Phi-3's do (gguf_name)

    def write(self, writer: Any) -> None:
        """Add the tokenizer keys to a gguf.GGUFWriter."""
        writer.add_tokenizer_model("llama" if self.kind == "spm" else "gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.kind == "spm":
            writer.add_token_scores(self.scores)
            writer.add_add_space_prefix(self.add_space_prefix)
        else:  # llama.cpp requires the key; gguf-py drops empty arrays
            writer.add_token_merges(self.merges or [NEVER_MERGED])
        specials = ("bos", self.bos), ("eos", self.eos), ("eot", self.end_of_turn), ("eom", self.end_of_message)
        specials += ("unk", self.unk), ("pad", self.pad)
        for key, value in specials:
            if value is not None:
                getattr(writer, f"add_{key}_token_id")(value)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


# ------------------------------------------------------------------------------------------------- entry points


def gguf_vocab(
    tokenizer: Tokenizer | None, vocab_size: int, chat_template: str | None = None, char_eos: int | None = None
) -> GGUFVocab:
    """The GGUF vocabulary of `tokenizer` for a model with `vocab_size` logits (padded with unused tokens to it);
    UserError, before anything is written, if llama.cpp cannot reproduce its ids.  `char_eos`: the end-of-sequence
    id to name for a char vocabulary, which has none (see _set_specials)."""
    if tokenizer is None:
        raise UserError(
            "the checkpoint holds no tokenizer, and a GGUF file must carry one (llama.cpp tokenizes the "
            "prompt itself); export a checkpoint saved with its tokenizer"
        )
    with tempfile.TemporaryDirectory(prefix="minigpt-gguf-") as tmp:  # the HF export's files, as llama.cpp converts
        save_hf_tokenizer(tokenizer, Path(tmp))
        doc = json.loads((Path(tmp) / "tokenizer.json").read_text(encoding="utf-8"))
        config = json.loads((Path(tmp) / "tokenizer_config.json").read_text(encoding="utf-8"))
    model = doc.get("model") or {}
    base = tokenizer.base if isinstance(tokenizer, ChatTokenizer) else tokenizer
    for problem in _unreproducible(doc, base):
        raise UserError(f"{problem}; {REFUSED}")
    if model["type"] == "WordLevel":
        vocab = _char_vocab(model["vocab"])
    elif sentencepiece_style(doc):
        vocab = _spm_vocab(doc, model)
    else:
        vocab = _bpe_vocab(doc, model, isinstance(base, ByteTokenizer))
    _add_tokens(vocab, doc.get("added_tokens") or [])
    vocab.nfc = (doc.get("normalizer") or {}).get("type") == "NFC"
    while len(vocab.tokens) > vocab_size and vocab.types[-1] == CONTROL:  # another model's (Gemma 3's image token)
        del vocab.tokens[-1], vocab.types[-1]
    if len(vocab.tokens) > vocab_size:
        raise UserError(
            f"the tokenizer has {len(vocab.tokens)} tokens but the model only {vocab_size} logits; the "
            "tokenizer is not this model's"
        )
    vocab.tokens += [f"[PAD{i}]" for i in range(len(vocab.tokens), vocab_size)]  # as convert_hf_to_gguf pads
    vocab.types += [UNUSED] * (vocab_size - len(vocab.types))
    if vocab.scores is not None:  # added and padding tokens: made by no merge
        vocab.scores += [NO_MERGE_SCORE] * (len(vocab.tokens) - len(vocab.scores))
    _check_unique(vocab.tokens)
    _set_specials(vocab, tokenizer, base, config, char_eos)
    template = chat_template if chat_template is not None else config.get("chat_template")
    vocab.chat_template = gguf_chat_template(template) if template else None
    return vocab


# ------------------------------------------------------------------------------------------------- vocabularies


def _unreproducible(doc: dict, base: Tokenizer) -> Iterator[str]:
    """Why llama.cpp's tokenizer would split or spell text otherwise than tokenizer.json `doc` (the first reason
    only): a model that is neither byte-level nor SentencePiece-style BPE, a normaliser, a pre-tokenizer llama.cpp
    has no name for (gguf_spm.spm_problems: what a SentencePiece-style one may not have)."""
    model = doc.get("model") or {}
    if model.get("type") == "WordLevel" and isinstance(base, CharTokenizer):
        return
    if model.get("type") != "BPE":
        yield (
            f"the tokenizer ({base.name}) is a {model.get('type')} model; llama.cpp reads byte-level BPE and "
            "SentencePiece-style BPE vocabularies from a GGUF file"
        )
        return
    if sentencepiece_style(doc):
        yield from spm_problems(doc, model)
        return
    by_id = sorted((model.get("vocab") or {}).items(), key=lambda kv: kv[1])
    not_byte_level = next((t for t, _ in by_id if not set(t) <= ALPHABET), None)
    decoder = (doc.get("decoder") or {}).get("type")
    if not_byte_level is not None or decoder != "ByteLevel":
        yield (
            f"the tokenizer is neither a byte-level BPE (token {not_byte_level!r}, decoder {decoder}) nor a "
            "SentencePiece-style one (pieces with '▁' for spaces and byte_fallback to <0xNN> pieces)"
        )
    elif doc.get("normalizer") and doc["normalizer"].get("type") != "NFC":  # NFC: a note (export.gguf's NFC_NOTE)
        yield f"the tokenizer normalises text first ({doc['normalizer'].get('type')}), which llama.cpp's BPE does not"
    elif not isinstance(base, ByteTokenizer) and pre_tokenizer_name(pre := doc.get("pre_tokenizer")) is None:
        parts = _pre_parts(pre)
        kinds, byte_level = [p.get("type") for p in parts], parts[-1] if parts else {}
        if kinds[-1:] == ["ByteLevel"] and byte_level.get("add_prefix_space"):
            yield (
                "the tokenizer adds a space before each text (ByteLevel add_prefix_space), which llama.cpp's BPE "
                "does not"
            )
        elif kinds == ["Split", "ByteLevel"] and not byte_level.get("use_regex", True):
            pattern = (parts[0].get("pattern") or {}).get("Regex")
            yield (
                f"the tokenizer splits text with a pattern llama.cpp has no pre-tokenizer for "
                f"({str(pattern)[:60]!r}...; llama.cpp hard-codes its patterns by name)"
            )
        else:
            yield (
                f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}) has no llama.cpp counterpart"
            )


def _spm_vocab(doc: dict, model: dict) -> GGUFVocab:
    """A SentencePiece-style tokenizer.json as llama.cpp's SentencePiece ("llama") vocabulary.

    llama.cpp's SentencePiece tokenizer merges, of all adjacent pieces whose concatenation is a piece, the pair
    whose merged piece scores highest (the leftmost on a tie), where Hugging Face merges the pair with the
    earliest merge rule.  So a piece's score is minus the rank of the first merge rule that makes it: llama.cpp
    then makes pieces in the order of the rules.  (A SentencePiece model converted by transformers lists every
    split of a piece as a rule, in the order of the piece scores, so this keeps the model's own order; a BPE
    trained by `tokenizers` was not seen to leave two adjacent pieces that join into a piece by another rule:
    tests/export/test_gguf_spm.py.)"""
    pieces = model.get("vocab") or {}
    by_id = sorted(pieces.items(), key=lambda kv: kv[1])
    first_rank: dict[str, int] = {}
    for rank, merge in enumerate(model.get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        first_rank.setdefault(left + right, rank)
    n = (by_id[-1][1] + 1) if by_id else 0
    tokens, types, scores = [f"[PAD{i}]" for i in range(n)], [UNUSED] * n, [NO_MERGE_SCORE] * n
    byte_pieces = set(BYTE_PIECES)  # a set: a list would cost 256 comparisons for each of Gemma's 262k pieces
    for token, i in by_id:
        tokens[i], types[i] = token, BYTE if token in byte_pieces else NORMAL
        scores[i] = -float(first_rank[token]) if token in first_rank else NO_MERGE_SCORE
    vocab = GGUFVocab(tokens, types, [], pre="default", bos=None, eos=None, kind="spm", scores=scores)
    vocab.add_space_prefix = bool(space_prefix(doc))
    vocab.phi3_rstrip = any(a.get("rstrip") for a in doc.get("added_tokens") or [])  # as Phi-3's: spm_problems
    vocab.unk = pieces.get(model.get("unk_token"))
    return vocab


def gguf_name(name: str, vocab: GGUFVocab) -> tuple[str, str | None]:
    """The general.name to write for `vocab` and a note if it is not `name` (gguf_spm.phi3_name)."""
    return phi3_name(name, vocab.phi3_rstrip, set(vocab.tokens))


def _byte_level(text: str) -> str:
    return "".join(BYTE_LEVEL[b] for b in text.encode("utf-8"))


def _char_vocab(word_level: dict[str, int]) -> GGUFVocab:
    """Each character spelled in byte-level form (ids 0..N-1, as save_hf_tokenizer writes a char vocabulary), and
    the merges that join the bytes of each multi-byte character (every prefix with its next byte), so llama.cpp's
    BPE gives one token per character."""
    vocab = GGUFVocab([], [], [], pre="gpt-2", bos=None, eos=None, kind="char")
    for char, _ in sorted(word_level.items(), key=lambda kv: kv[1]):
        _add_char(vocab, char)
    return vocab


def _add_char(vocab: GGUFVocab, char: str) -> None:
    raw = char.encode("utf-8")  # tokenizer.json's text is UTF-8: a lone surrogate never gets here
    vocab.tokens.append(_byte_level(char))
    vocab.types.append(NORMAL)
    for k in range(1, len(raw)):
        merge = "".join(BYTE_LEVEL[b] for b in raw[:k]) + " " + BYTE_LEVEL[raw[k]]
        if merge not in vocab.merges:
            vocab.merges.append(merge)


def _bpe_vocab(doc: dict, model: dict, byte_vocab: bool) -> GGUFVocab:
    """A byte-level BPE tokenizer.json: its tokens, merges and the llama.cpp name of its pre-tokenizer."""
    by_id = sorted((model.get("vocab") or {}).items(), key=lambda kv: kv[1])
    n = (by_id[-1][1] + 1) if by_id else 0
    tokens, types = [f"[PAD{i}]" for i in range(n)], [UNUSED] * n
    for token, i in by_id:
        tokens[i], types[i] = token, NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    pre = "gpt-2" if byte_vocab else pre_tokenizer_name(doc.get("pre_tokenizer"))
    return GGUFVocab(tokens, types, merges, pre=pre, bos=None, eos=None, kind="bpe")


def _pre_parts(pre: dict | None) -> list[dict]:
    """A tokenizer.json pre-tokenizer as its list of steps."""
    return pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []


def pre_tokenizer_name(pre: dict | None) -> str | None:
    """llama.cpp's name for a tokenizer.json pre-tokenizer that splits text as it does; None if it has none."""
    parts = _pre_parts(pre)
    kinds = [p.get("type") for p in parts]
    if kinds[-1:] != ["ByteLevel"] or parts[-1].get("add_prefix_space"):
        return None
    regex = parts[-1].get("use_regex", True)
    if kinds == ["ByteLevel"] and regex:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and regex:
        return "smollm"
    split = parts[0]
    if (
        kinds == ["Split", "ByteLevel"]
        and not regex
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
    ):
        return PRE_TOKENIZERS.get((split.get("pattern") or {}).get("Regex"))
    return None


def _add_tokens(vocab: GGUFVocab, added: list[dict]) -> None:
    """Added tokens at their ids: special ones as control tokens (matched in a prompt only as markers), the others
    (a char chat model's new characters) as user-defined tokens, matched in any text as minigpt matches them."""
    for item in added:
        i, text, special = item["id"], item["content"], item.get("special", False)
        kind = CONTROL if special else USER_DEFINED
        if vocab.kind == "char" and i < len(vocab.tokens):  # the start token, a character: printed as text
            continue
        if vocab.kind == "char" and not special and i == len(vocab.tokens):  # one more character: spelled alike
            _add_char(vocab, text)
            continue
        if i > len(vocab.tokens):
            raise UserError(
                f"added token {text!r} has id {i}, past the vocabulary's {len(vocab.tokens)} tokens; the "
                "checkpoint's tokenizer is inconsistent"
            )
        if i == len(vocab.tokens):
            vocab.tokens.append(text)
            vocab.types.append(kind)
        else:
            vocab.tokens[i], vocab.types[i] = text, kind


def _check_unique(tokens: list[str]) -> None:
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in seen:
            raise UserError(
                f"tokens {seen[token]} and {i} have the same text {token!r} in llama.cpp's spelling, and "
                f"a GGUF vocabulary cannot hold a token twice; {REFUSED}"
            )
        seen[token] = i


# ------------------------------------------------------------------------------------------------- special tokens


def _set_specials(vocab: GGUFVocab, tokenizer: Tokenizer, base: Tokenizer, config: dict, char_eos: int | None) -> None:
    """BOS/EOS as the HF export names them; a chat model's end of turn is its EOS.  llama.cpp always has an EOS (the
    key's absence means id 11) and stops where it is sampled (its --ignore-eos bans it), so a vocabulary without
    one names a token the model does not write: 0xFF for bytes (no UTF-8 text holds it), `char_eos` for chars."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}

    def token_id(text: str | None) -> int | None:
        if text is None:
            return None
        return ids.get(_byte_level(text) if vocab.kind == "char" else text, ids.get(text))

    vocab.bos, vocab.eos = token_id(config.get("bos_token")), token_id(config.get("eos_token"))
    if vocab.kind == "spm":  # as convert_hf_to_gguf names a SentencePiece vocabulary's padding token
        vocab.pad = ids.get("<pad>")
    if isinstance(base, ByteTokenizer):
        vocab.bos = 10
        vocab.eos = vocab.eos if isinstance(tokenizer, ChatTokenizer) else 0xFF
    elif isinstance(base, CharTokenizer) and vocab.eos is None:
        vocab.eos = char_eos
    if isinstance(tokenizer, ChatTokenizer):  # the EOS, or where the template writes eos_token the base's (Phi-3)
        vocab.end_of_turn = token_id(tokenizer.end_of_turn)
    # llama.cpp stops at EOS, EOT and EOM (and at tokens it knows by their text): an end the source folder lists
    # besides those two (Phi-3's <|assistant|>, which minigpt and transformers stop at) is the EOM
    others = sorted(i for i in tokenizer.stop_ids if i not in (vocab.eos, vocab.end_of_turn) and i < len(vocab.tokens))
    vocab.end_of_message = others[0] if others else None
    if isinstance(base, HFTokenizer):  # the post-processor's BOS/EOS, as minigpt's encode adds them
        start, end = base.frame
        vocab.add_bos, vocab.add_eos = start[:1] == [base.bos_id], end[-1:] == [base.eos_id]
        if len(start) + len(end) != vocab.add_bos + vocab.add_eos:
            raise UserError(
                f"the tokenizer adds tokens around each text ({start} before, {end} after) that are not its "
                f"BOS/EOS; {REFUSED}"
            )


GENERATION_TAG = re.compile(r"\{%(-?)\s*(end)?generation\s*(-?)%\}")


def gguf_chat_template(template: str) -> str:
    """The chat template as llama.cpp's Jinja reads it: transformers' {% generation %} tags (they only mark the
    assistant's tokens for training) become an always-true block, keeping their whitespace control."""
    return GENERATION_TAG.sub(lambda m: "{%" + m[1] + (" endif " if m[2] else " if true ") + m[3] + "%}", template)
