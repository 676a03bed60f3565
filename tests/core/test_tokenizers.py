"""A tiktoken encoding read back into its parts (pattern, ranks, special tokens) and rebuilt: what tokenizer dicts in
checkpoints and exported tokenizer.json files rely on. Offline: the encoding is built here from made-up ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tiktoken

from minigpt.core.errors import DataError
from minigpt.core.tokenizers import TiktokenTokenizer, bpe_vocab_size, encoding_parts, tokenizer_from_dict

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MERGES = [b"th", b"the", b" t", b" the", b"in", b"ing", b"an", b"and", b" a", b"er", b"12", b"123", b"\n\n"]
# ids with gaps, as cl100k_base and o200k_base have: one unused id among the ranks, three before the specials
RANKS = {bytes([i]): i for i in range(256)} | {m: 257 + i for i, m in enumerate(MERGES)}
SPECIALS = {"<|endoftext|>": 273, "<|fim_prefix|>": 274, "<|endofprompt|>": 280}
SAMPLES = [
    "the thing and the other thing's 123 12\n\nin an ending",
    "  spaces\tand\ttabs  \n",
    "unicode: naïve café — 東京 🙂",
    "a document<|endoftext|>the next<|endofprompt|>",
    "",
]


def local_encoding(name: str = "local_bpe") -> tiktoken.Encoding:
    return tiktoken.Encoding(name, pat_str=GPT2_PAT, mergeable_ranks=RANKS, special_tokens=SPECIALS)


def test_encoding_parts_are_what_the_encoding_was_built_from():
    # exactly the constructor's arguments: a tiktoken release that renames or changes the private pattern
    # attribute, or the public lookups the ranks come from, fails here rather than in a user's export
    pat_str, ranks, specials = encoding_parts(local_encoding())
    assert pat_str == GPT2_PAT
    assert ranks == RANKS and list(ranks.values()) == sorted(ranks.values())  # in rank order, gap skipped
    assert specials == SPECIALS


def test_an_encoding_rebuilt_from_its_parts_encodes_and_decodes_the_same():
    enc = local_encoding()
    pat_str, ranks, specials = encoding_parts(enc)
    copy = tiktoken.Encoding("copy", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    assert copy.n_vocab == enc.n_vocab and copy.special_tokens_set == enc.special_tokens_set
    for text in SAMPLES:
        ids = enc.encode(text, allowed_special="all")
        assert copy.encode(text, allowed_special="all") == ids
        assert copy.encode_ordinary(text) == enc.encode_ordinary(text)
        assert copy.decode(ids) == enc.decode(ids) == text
    assert enc.encode(SAMPLES[0]) != list(SAMPLES[0].encode())  # (the merges are used: the test can tell)


def test_tiktoken_batches_give_encode_ordinarys_ids_special_token_text_included():
    """Preparation encodes batches straight into arrays (encode_to_numpy on threads): the ids must be those of
    encode_ordinary, '<|endoftext|>' written in a document included (plain text, not the special token)."""
    enc = local_encoding()
    tok = TiktokenTokenizer(enc)
    arrays = tok.encode_batch(SAMPLES * 3, num_threads=2)
    assert [a.tolist() for a in arrays] == [enc.encode_ordinary(text) for text in SAMPLES * 3]
    assert 273 not in arrays[3] and 280 not in arrays[3]  # the special tokens' text stays text
    assert tok.encode_array(SAMPLES[2]).tolist() == tok.encode(SAMPLES[2])


def test_tiktoken_tokenizer_dict_survives_json_and_rebuilds_the_same_tokenizer():
    tok = TiktokenTokenizer(local_encoding())
    d = json.loads(json.dumps(tok.to_dict()))  # as a checkpoint or tokenizer.json stores it
    back = tokenizer_from_dict(d)
    assert isinstance(back, TiktokenTokenizer) and back.name == "local_bpe"
    assert (back.vocab_size, back.eot_id) == (tok.vocab_size, tok.eot_id) == (281, 273)
    for text in SAMPLES:
        assert back.encode(text) == tok.encode(text)  # ('<|endoftext|>' in text is plain text: encode_ordinary)
    assert back.to_dict() == d


# --------------------------------------------------------------------------------- a tokenizer.json that panics

EVIL_TOKENIZER = """
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Split(Regex("(a|a)+$"), behavior="isolated")  # backtracks exponentially
"""


def evil_tokenizer_json() -> str:
    scope: dict = {}
    exec(EVIL_TOKENIZER, scope)
    return scope["tok"].to_str()


def test_a_tokenizer_whose_regex_gives_up_is_one_line_naming_it():
    """Oniguruma's retry limit makes the Rust core panic (a BaseException, PanicException): a DataError instead,
    for single texts and batches, while texts the regex handles still encode."""
    from minigpt.core.tokenizers import HFTokenizer

    tok = HFTokenizer(evil_tokenizer_json(), name="evil/tokenizer.json")
    assert tok.encode("ab") == [2]
    for encode in (lambda: tok.encode("a" * 40 + "b"), lambda: tok.encode_batch(["ab", "a" * 40 + "b"])):
        with pytest.raises(
            DataError,
            match=r"^the tokenizer evil/tokenizer.json cannot encode this text: the "
            r"tokenizers library gave up inside it \(Onig: Regex search error",
        ):
            encode()


def test_a_tiktoken_pat_str_that_gives_up_is_one_line_naming_it():
    """A checkpoint's tiktoken dict carries its pat_str: one that backtracks past fancy-regex's limit made
    encode_ordinary panic (a PanicException and a Rust backtrace); a DataError instead, the ids otherwise the same."""
    d = TiktokenTokenizer(local_encoding()).to_dict() | {"name": "crafted", "pat_str": r"(?:a|aa)+(?=c)|."}
    tok = tokenizer_from_dict(d)
    assert tok.encode("ab") == [97, 98]
    for encode in (tok.encode, tok.encode_array, lambda text: tok.encode_batch([text], num_threads=1)):
        with pytest.raises(DataError, match=r"^the tokenizer crafted cannot encode this text: its pre-tokenizer"):
            encode("a" * 40 + "b")
    enc = local_encoding()
    assert [TiktokenTokenizer(enc).encode(text) for text in SAMPLES] == [enc.encode_ordinary(t) for t in SAMPLES]


def test_the_rust_panic_report_is_held_back_and_other_stderr_goes_through():
    code = (
        EVIL_TOKENIZER + "import os, sys\nfrom minigpt.core.hf_tokenizer import HFTokenizer, rust_panics_as_errors\n"
        "h = HFTokenizer(tok.to_str(), name='evil')\n"
        "with rust_panics_as_errors('x'):\n    os.write(2, b'kept\\n')\n"
        "try:\n    h.encode('a' * 40 + 'b')\nexcept Exception as e:\n    print(type(e).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RUST_BACKTRACE": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "DataError\n"
    assert done.stderr == "kept\n"  # no 'panicked at', no stack backtrace


@pytest.mark.parametrize("spec", ["bpe:²⁵⁸", "bpe:٤٠٩٦", "bpe:4096\u0660"])
def test_bpe_vocab_in_unicode_digits_is_one_line(spec):
    """str.isdigit() takes superscripts and other scripts' digits; int() refuses some and reads others."""
    with pytest.raises(DataError, match="in the digits 0-9"):
        bpe_vocab_size(spec)
    assert bpe_vocab_size("bpe:4_096") == 4096


def test_a_negative_id_is_refused_by_the_char_tokenizer_not_read_from_the_end():
    from minigpt.core.tokenizers import CharTokenizer

    tokenizer = CharTokenizer("abc")
    assert tokenizer.decode([0, 2]) == "ac"
    with pytest.raises(ValueError, match=r"^token id -1 is negative; this vocabulary's ids are 0 to 2$"):
        tokenizer.decode([0, -1])  # a Python list index: it was "ac"
