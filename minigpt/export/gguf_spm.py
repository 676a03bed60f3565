"""A SentencePiece-style tokenizer.json (a BPE over "▁"-pieces with <0xNN> byte fallback: Llama 2's, Mistral's,
Gemma's, Phi-3's) in a GGUF: whether llama.cpp's SentencePiece tokenizer can apply it as Hugging Face does
(spm_problems, refused in one line otherwise), its add_space_prefix (space_prefix), and the general.name that makes
llama.cpp strip whitespace after special tokens exactly where the tokenizer does (phi3_name).
minigpt.export.gguf_vocab writes the vocabulary."""

from __future__ import annotations

import re
from collections.abc import Iterator

__all__ = ["BYTE_PIECES", "phi3_name", "sentencepiece_style", "space_prefix", "spm_problems"]

SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space
BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]


def sentencepiece_style(doc: dict) -> bool:
    """A SentencePiece BPE as a tokenizer.json (Llama 2's, Gemma's, Phi-3's): byte fallback, not byte-level."""
    model = doc.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and _decoder(doc) != "ByteLevel"


def _decoder(doc: dict) -> str | None:
    return (doc.get("decoder") or {}).get("type")


def space_prefix(doc: dict) -> bool | None:
    """Whether a SentencePiece-style tokenizer.json writes "▁" before the text and after each added token, as
    llama.cpp's add_space_prefix does; None if it maps text to pieces otherwise than llama.cpp (which only turns
    each space into "▁")."""
    normalizer, pre = doc.get("normalizer"), doc.get("pre_tokenizer")
    steps = (
        (normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer])
        if normalizer
        else []
    )
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    prepend = {"type": "Prepend", "prepend": SPACE}
    # Gemma's (transformers' converter adds a Split at " ", which finds none once the normaliser replaced them);
    # Llama 2's ("legacy" files)
    split_at_space = {"type": "Split", "pattern": {"String": " "}, "invert": False}
    no_op = pre is None or {k: v for k, v in pre.items() if k != "behavior"} == split_at_space
    if no_op and steps in ([replace], [prepend, replace]):
        return len(steps) == 2  # a normaliser runs on each text between added tokens: as llama.cpp prefixes
    if not steps and _metaspace(pre) and pre.get("prepend_scheme") == "never":  # spaces as "▁", nothing prepended
        return False
    return None


def _metaspace(pre: dict | None) -> bool:
    """A Metaspace pre-tokenizer that only turns spaces into "▁" (and may prepend one): it does not split."""
    return bool(pre) and pre.get("type") == "Metaspace" and pre.get("replacement") == SPACE and not pre.get("split")


def spm_problems(doc: dict, model: dict) -> Iterator[str]:
    """What llama.cpp's SentencePiece tokenizer cannot do as this SentencePiece-style tokenizer.json does."""
    pre = doc.get("pre_tokenizer") or {}
    if space_prefix(doc) is None:
        if _metaspace(pre) and not doc.get("normalizer"):  # prepends "▁" only where a text starts without one
            yield (
                f"the tokenizer puts '▁' before a text only where it starts with no space (Metaspace "
                f"prepend_scheme {pre.get('prepend_scheme')}), and llama.cpp before every text"
                + (" and after each special token" if pre.get("prepend_scheme") == "first" else "")
            )
        else:
            yield (
                f"the SentencePiece-style tokenizer maps text to pieces with normaliser "
                f"{(doc.get('normalizer') or {}).get('type')} and pre-tokenizer {pre.get('type')}, and llama.cpp "
                "only replaces spaces by '▁' (and may prepend one)"
            )
        return
    vocab = model.get("vocab") or {}
    odd = [k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges") if model.get(k)]
    missing = next((b for b in BYTE_PIECES if b not in vocab), None)
    added = doc.get("added_tokens") or []
    stripped = next((a for a in added if a.get("lstrip") or a.get("single_word")), None)
    spaced = next((a for a in added if a.get("normalized") and {" ", SPACE} & set(a["content"])), None)
    rstripped = {a["content"] for a in added if a.get("rstrip")}
    nul = next((p for p in vocab if "\0" in p), None)
    if odd:
        yield f"the tokenizer's BPE has {odd[0]}={model[odd[0]]!r}, which llama.cpp's SentencePiece tokenizer has not"
    elif missing is not None:
        yield f"the tokenizer falls back to bytes but has no {missing} piece, which llama.cpp would need"
    elif nul is not None:  # BPE's byte-level spelling has no NUL; here a piece holds the character itself
        yield f"piece {nul!r} holds a NUL character, and llama.cpp reads a token's text only up to one"
    elif stripped is not None:
        yield (
            f"added token {stripped['content']!r} takes in the whitespace before it or around a word "
            f"({'lstrip' if stripped.get('lstrip') else 'single_word'}), which llama.cpp does not"
        )
    elif spaced is not None:
        yield (
            f"added token {spaced['content']!r} is matched in the normalised text (normalized true), where spaces are "
            "'▁', and llama.cpp matches added tokens in the text as it is"
        )
    elif rstripped and rstripped != (phi3 := _phi3_rstripped(added, vocab)):
        odd = sorted(rstripped ^ phi3)[0]
        yield (
            f"added token {odd!r} {'takes' if odd in rstripped else 'does not take'} in the whitespace after it "
            "(rstrip), and llama.cpp strips only after the tokens Phi-3's tokenizer strips after"
        )


# llama.cpp strips the whitespace after special tokens (rstrip) only for a model whose general.name says Phi-3: after
# each control or user-defined token and </s>, but <unk>, <s> and <|endoftext|>
PHI3_NAMES = re.compile(r"phi-?3", re.IGNORECASE)
PHI3_KEPT = ("<unk>", "<s>", "<|endoftext|>")
PHI3_LOOKED_UP = ("</s>", *PHI3_KEPT)  # read by name (llama.cpp's token_to_id.at) in a model named Phi-3


def _phi3_rstripped(added: list[dict], vocab: dict[str, int]) -> set[str]:
    """The tokens llama.cpp strips the whitespace after in a model named Phi-3 (added ones are control or
    user-defined)."""
    return ({a["content"] for a in added} | ({"</s>"} if "</s>" in vocab else set())) - set(PHI3_KEPT)


def phi3_name(name: str, phi3_rstrip: bool, tokens: set[str]) -> tuple[str, str | None]:
    """The general.name to write and a note if it is not `name`: llama.cpp strips whitespace after special tokens
    exactly when that name says Phi-3 (PHI3_NAMES), so it must say so where the tokenizer strips as Phi-3's does
    (`phi3_rstrip`), and must not elsewhere; and under that name it looks up PHI3_LOOKED_UP in the vocabulary
    (`tokens`), failing to load a model that lacks one (a run folder named my-phi3-run, a char vocabulary)."""
    missing = [t for t in PHI3_LOOKED_UP if t not in tokens]
    if phi3_rstrip and not missing and not PHI3_NAMES.search(name):
        new, why = f"{name} (phi3 tokenizer)", "and this tokenizer does"
    elif (missing or not phi3_rstrip) and PHI3_NAMES.search(name):
        new = PHI3_NAMES.sub(lambda m: m[0].replace("-", "").replace("3", " 3"), name)
        why = (
            f"and looks up {', '.join(missing)}, which this vocabulary lacks"
            if missing
            else "and this tokenizer does not"
        )
    else:
        return name, None
    return new, (
        f"the GGUF name is {new!r}, not {name!r}: llama.cpp strips the whitespace after special tokens exactly when "
        f"a model's name says Phi-3, {why}"
    )
