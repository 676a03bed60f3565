"""The tokenizer bridge to Hugging Face: read a model's own tokenizer.json, and write ours in the HF format.

    tok = load_hf_tokenizer(Path("gpt2-dir"), hf_config)   # the source's tokenizer.json (or tiktoken gpt2)
    save_hf_tokenizer(tok, Path("export-dir"))              # AutoTokenizer.from_pretrained("export-dir") works

An HFTokenizer (minigpt.core.tokenizers) wraps a `tokenizers.Tokenizer` (the "fast" tokenizer format of Hugging
Face). Its whole JSON travels in to_dict(), so a checkpoint of a fine-tuned model needs no other file. Going the
other way, each minigpt tokenizer is written as a tokenizer.json giving the same ids: char as a WordLevel model over
single characters, byte as a byte-level BPE without merges, and a tiktoken BPE converted as transformers converts
tiktoken files (its byte-level vocabulary and the merges read back from the ranks, see encoding_parts).

A text's start token (BOS) is what the lm-evaluation-harness puts before a text it scores from its first token:
a tokenizer with end-of-text uses it (GPT-2's way); a char tokenizer registers the character minigpt's sampler
starts from, the newline (minigpt.core.generation.prompt_ids), which precedes most documents of a corpus read as
one stream.  No id is added: a new one would need an embedding row the model never trained, and a row of the
softmax that changes every other token's probability.  A byte tokenizer registers none: transformers matches a
special token's text in the raw input, and every text that names a byte in a byte-level vocabulary ("Ċ" for the
newline) is also a character a text can hold, so it would be read as that byte.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import DataError, UserError, first_line
from minigpt.core.fsutil import write_json
from minigpt.core.generation import prompt_ids
from minigpt.core.tokenizers import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    encoding_parts,
    get_tokenizer,
    tokenizers_library,
)
from minigpt.hf.chat_files import chat_tokenizer_json
from minigpt.hf.families import family_of_hf
from minigpt.hf.files import read_json_object

__all__ = ["load_hf_tokenizer", "save_hf_tokenizer", "NO_LENGTH"]


# ------------------------------------------------------------------------------------------------- reading


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of the model folder, or {} when the folder has none (checked whole: minigpt.hf.files)."""
    return read_json_object(path) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_hf_tokenizer(model_dir: Path, hf_config: dict) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory: its tokenizer.json (through `tokenizers`), or for a GPT-2
    model without tokenizer files, tiktoken's gpt2 encoding (the same ids). vocab_size is the model's (its config
    may pad the vocabulary); BOS/EOS are those tokenizer_config.json names, else config.json's ids."""
    model_dir = Path(model_dir)
    model_vocab = hf_config.get("vocab_size")
    model_vocab = model_vocab if isinstance(model_vocab, int) and not isinstance(model_vocab, bool) else None
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        family = family_of_hf(hf_config)
        encoding = family.tiktoken_fallback if family is not None else None
        if encoding is None:
            raise DataError(
                f"{model_dir} has no tokenizer.json; minigpt reads a Hugging Face model's tokenizer from "
                "its tokenizer.json: save one there with "
                "transformers.AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
            )
        tokenizer = get_tokenizer(encoding)  # e.g. GPT-2's vocab.json + merges.txt are tiktoken's gpt2
        if model_vocab is not None and model_vocab < tokenizer.vocab_size:
            raise DataError(
                f"{model_dir} is a GPT-2 model with vocab_size {model_vocab} and no tokenizer files, so "
                f"its tokenizer would be {encoding} ({tokenizer.vocab_size} tokens, more than the model has); "
                "save the model's own tokenizer.json in the directory"
            )
        return tokenizer
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path} ({first_line(e)}); download the model again") from None
    if (chars := exported_chars(text)) is not None and len(chars) == (model_vocab or len(chars)):
        return CharTokenizer(chars)  # minigpt's own char export: read back as the char tokenizer it was
    settings = {**_read_json(model_dir / "special_tokens_map.json"), **_read_json(model_dir / "tokenizer_config.json")}
    tokenizer = HFTokenizer(
        text, name=str(hf_config.get("_name_or_path") or model_dir.name or "hf"), vocab_size=model_vocab
    )
    ids = {}
    for kind in ("bos", "eos"):
        token = _token_text(settings.get(f"{kind}_token"))
        found = tokenizer.backend.token_to_id(token) if token is not None else None
        from_config = hf_config.get(f"{kind}_token_id")
        if isinstance(from_config, list):  # some configs list several EOS ids: the first is the main one
            from_config = from_config[0] if from_config else None
        # config.json's ids are class defaults as often as facts (GPT2Config says 50256 for any vocabulary):
        # one outside this tokenizer's vocabulary is not its BOS/EOS
        known = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        if not isinstance(from_config, int) or not 0 <= from_config < known:
            from_config = None
        ids[kind] = found if found is not None else from_config
    tokenizer.bos_id, tokenizer.eos_id = ids["bos"], ids["eos"]
    tokenizer.eot_id = ids["eos"]
    tokenizer.end_ids = end_ids(model_dir, hf_config, tokenizer)
    # special tokens past the model's rows are another model's (Gemma 3's <image_soft_token> is its vision
    # tower's): kept, and refused in a text (HFTokenizer._within_model); any other token there is a mismatch
    past = range(tokenizer.vocab_size, tokenizer.backend.get_vocab_size(with_added_tokens=True))
    added = tokenizer.backend.get_added_tokens_decoder() if past else {}
    if any(i not in added or not added[i].special for i in past):
        raise DataError(
            f"{path} has {tokenizer.backend.get_vocab_size(with_added_tokens=True)} tokens but the "
            f"model's vocab_size is {tokenizer.vocab_size}; the tokenizer is not this model's"
        )
    return tokenizer


def exported_chars(tokenizer_json: str) -> str | None:
    """The characters of a tokenizer.json that save_hf_tokenizer wrote for a char tokenizer (the _char_backend
    layout, ids in sorted order, no token added past them), else None."""
    try:
        doc = json.loads(tokenizer_json)
    except ValueError:
        return None  # HFTokenizer names the problem
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict) or model.get("type") != "WordLevel" or not isinstance(model.get("vocab"), dict):
        return None
    keys = sorted(model["vocab"])
    layout = (
        doc.get("pre_tokenizer")
        == {"type": "Split", "pattern": {"Regex": r"[\s\S]"}, "behavior": "Isolated", "invert": False}
        and doc.get("decoder") == {"type": "Fuse"}
        and not doc.get("normalizer")
        and not doc.get("post_processor")
    )
    in_order = all(len(c) == 1 and model["vocab"][c] == i for i, c in enumerate(keys))
    added = doc.get("added_tokens") or []
    if not (layout and in_order and all(isinstance(a, dict) and a.get("content") in model["vocab"] for a in added)):
        return None
    return "".join(keys)


def end_ids(model_dir: Path, hf_config: dict, tokenizer: HFTokenizer) -> tuple[int, ...]:
    """Every id the folder names as an end of sequence: the EOS, then generation_config.json's and config.json's
    eos_token_id (an id or a list: Gemma 3 IT lists <eos> and <end_of_turn>, Llama 3 Instruct <|eot_id|> too)."""
    found = [tokenizer.eos_id]
    for source in (_read_json(model_dir / "generation_config.json"), hf_config):
        value = source.get("eos_token_id")
        found += value if isinstance(value, list) else [value]
    known = range(tokenizer.vocab_size)
    return tuple(dict.fromkeys(i for i in found if isinstance(i, int) and not isinstance(i, bool) and i in known))


# ------------------------------------------------------------------------------------------------- writing


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _char_backend(tok: CharTokenizer):
    """One WordLevel token per character: every character is its own pre-token, decoded by plain joining."""
    t = tokenizers_library()
    backend = t.Tokenizer(t.models.WordLevel({c: i for i, c in enumerate(tok.chars)}, unk_token="[UNK]"))
    backend.pre_tokenizer = t.pre_tokenizers.Split(t.Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = t.decoders.Fuse()
    return backend


def _byte_level_bpe(ranks: dict[bytes, int], pattern: str | None):
    """A byte-level BPE from tiktoken ranks, as transformers' TikTokenConverter builds it: vocabulary in GPT-2's
    byte alphabet, merges = every split of a token into two tokens, in the order of the merged token's rank."""
    t = tokenizers_library()
    alphabet = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges.extend((ranks[a], ranks[b], rank, a, b) for a, b in splits)
    merges.sort(key=lambda m: (m[2], m[0], m[1]))
    backend = t.Tokenizer(
        t.models.BPE(
            {text(b): r for b, r in ranks.items()},
            [(text(a), text(b)) for *_, a, b in merges],
            fuse_unk=False,
            ignore_merges=True,
        )
    )  # tiktoken takes a whole word that is a token as is
    byte_level = t.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pattern is None)
    backend.pre_tokenizer = (
        byte_level
        if pattern is None
        else t.pre_tokenizers.Sequence([t.pre_tokenizers.Split(t.Regex(pattern), behavior="isolated"), byte_level])
    )
    backend.decoder = t.decoders.ByteLevel()
    backend.post_processor = t.processors.ByteLevel(trim_offsets=False)
    return backend


def _backend_for(tokenizer: Tokenizer) -> tuple[str, str | None, str | None]:
    """(tokenizer.json text, bos token, eos token) for one of our tokenizers."""
    t = tokenizers_library()
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.tokenizer_json, tokenizer.token(tokenizer.bos_id), tokenizer.token(tokenizer.eos_id)
    if isinstance(tokenizer, CharTokenizer):
        backend = _char_backend(tokenizer)
        bos = tokenizer.chars[prompt_ids(tokenizer, "")[0]]  # the newline, else the first character
        # registered at its own id (it is in the vocabulary): the same ids, and a start token for the harness
        backend.add_special_tokens([t.AddedToken(bos, special=True, normalized=False)])
        return backend.to_str(), bos, None  # no end-of-text: generation would stop at every newline
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_level_bpe({bytes([i]): i for i in range(256)}, None).to_str(), None, None
    if isinstance(tokenizer, TiktokenTokenizer):
        enc = tokenizer.encoding
        pat_str, ranks, special_tokens = encoding_parts(enc)
        backend = _byte_level_bpe(ranks, pat_str)
        specials = sorted(special_tokens.items(), key=lambda kv: kv[1])
        for token, i in specials:  # added at their own ids (they follow the ranks in every tiktoken encoding)
            if backend.get_vocab_size(with_added_tokens=True) != i:
                raise UserError(
                    f"the tiktoken encoding {enc.name!r} has special token {token!r} at id {i}, not "
                    "right after the other tokens, which a Hugging Face tokenizer.json cannot express"
                )
            backend.add_special_tokens([t.AddedToken(token, special=True, normalized=False)])
        eot = tokenizer.eot_id
        eos = next((s for s, i in specials if i == eot), None) if eot is not None else None
        return backend.to_str(), eos, eos  # GPT-2's convention: <|endoftext|> is BOS and EOS, never added
    raise UserError(
        f"the {tokenizer.name} tokenizer ({type(tokenizer).__name__}) cannot be written as a Hugging "
        "Face tokenizer.json; only char, byte, tiktoken BPE and Hugging Face tokenizers can"
    )


NO_LENGTH = 1 << 30  # model_max_length when the context is unknown: transformers' "no limit" is as large


def model_context(out_dir: Path) -> int | None:
    """The context of the model saved in out_dir (config.json's n_positions or max_position_embeddings), if any."""
    config = _read_json(out_dir / "config.json")
    length = config.get("n_positions", config.get("max_position_embeddings"))
    return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir, so that
    transformers.AutoTokenizer.from_pretrained(out_dir) gives the same ids (and decodes to the same text).

    model_max_length: the model's context (block_size); by default that of the model already saved in out_dir
    (an export writes config.json first), else unlimited.  Tools such as the lm-evaluation-harness cut inputs to it.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chat = tokenizer if isinstance(tokenizer, ChatTokenizer) else None
    tokenizer_json, bos, eos = _backend_for(chat.base if chat else tokenizer)
    if chat is not None:  # its added tokens registered, its end-of-turn the EOS, its template in the config; unless
        # the template writes eos_token, which minigpt renders as the base's (Phi-3 ends a conversation with it)
        tokenizer_json = chat_tokenizer_json(chat, tokenizer_json)
        eos = eos if eos is not None and re.search(r"\beos_token\b", chat.template) else chat.end_of_turn
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,  # decode gives the text back as it was
            "model_max_length": model_max_length or model_context(out_dir) or NO_LENGTH,
            **specials,
            **({"chat_template": chat.template} if chat is not None else {}),
        },
    )
    write_json(out_dir / "special_tokens_map.json", specials)
