"""IncrementalDecoder and decode_after: the text of ids as they arrive, a piece per id, equal to decoding them all at
once, for every kind of tokenizer minigpt reads (SentencePiece's included: its decoder drops the space at the start of
what it decodes, which a piece-by-piece decode must not lose)."""

from __future__ import annotations

import random

import pytest

from minigpt.core.tokenizer_base import IncrementalDecoder, decode_after
from support import BASES, spm_bpe

TEXT = "Hello world, the café's naïve 🙂 ok\n\nthe end of the thing \u00e9t\u00e9 done. 東京 again and again"


TOKENIZERS = {**BASES, "spm-llama2": lambda: spm_bpe("llama2"), "spm-metaspace": lambda: spm_bpe("metaspace")}


def random_ids(tok, kind: str, rng: random.Random, n: int) -> list[int]:
    """n random ids of the tokenizer's first 400.  Byte fallback's <0xNN> pieces (ids 3 to 258) come as whole
    characters: a run of them that is not UTF-8 as a whole decodes to one U+FFFD per byte, the valid bytes at its
    start too, so a run that turns invalid late changes text already given out (no stream can take it back)."""
    if kind != "spm-llama2":
        return [rng.randrange(min(tok.vocab_size, 400)) for _ in range(n)]
    ids: list[int] = []
    while len(ids) < n:
        if rng.random() < 0.3:
            ids += [3 + b for b in chr(rng.choice([0xE9, 0x6771, 0x1F642, 0x41])).encode()]
        else:
            ids.append(rng.randrange(259, min(tok.vocab_size, 400)))
    return ids


def pieces(tok, ids, context=(), keep_special: bool = False) -> list[str]:
    decoder = IncrementalDecoder(tok, context, keep_special)
    return [decoder.push(i) for i in ids] + [decoder.finish()]


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_pieces_join_to_the_whole_decode_and_never_end_inside_a_character(kind):
    tok = TOKENIZERS[kind]()
    ids = tok.encode(TEXT if kind != "char" else "Hello world the end\n\nof the thing.")  # its letters only
    got = pieces(tok, ids)
    assert "".join(got) == tok.decode(ids)
    assert not any(p.endswith("\ufffd") for p in got[:-1])  # a split character waits for its last token
    # after a prompt: the text the ids add to it, the space they start with included
    prompt = tok.encode("Say")
    reply = tok.encode("Say hello world")[len(prompt) :]
    assert "".join(pieces(tok, reply, prompt)) == decode_after(tok, prompt, reply)
    assert tok.decode(prompt + reply)[len(tok.decode(prompt)) :] == decode_after(tok, prompt, reply)
    # random ids (bytes that never make a character, special tokens): the same text as decoding them at once, the
    # tokens that stand for no text (end-of-text) left out unless kept
    rng = random.Random(kind)
    for _ in range(30):
        ids = random_ids(tok, kind, rng, rng.randint(1, 40))
        context = random_ids(tok, kind, rng, rng.randint(0, 10))
        text = [i for i in ids if i not in tok.textless]
        assert "".join(pieces(tok, ids)) == tok.decode_text(ids)
        assert "".join(pieces(tok, ids, context)) == decode_after(tok, context, text)
        assert "".join(pieces(tok, ids, context, keep_special=True)) == decode_after(tok, context, ids)


def test_sentencepiece_pieces_keep_the_spaces_between_words():
    """Decoding each new token alone (what sample.py's streamer did) drops the space a SentencePiece token starts
    with: "Hello world" came out as "Helloworld"."""
    for kind in ("spm-llama2", "spm-metaspace"):
        tok = TOKENIZERS[kind]()
        ids = tok.encode("hello world and the end")
        assert "".join(tok.decode([i]) for i in ids) != "hello world and the end"  # the bug this guards against
        assert "".join(pieces(tok, ids)) == "hello world and the end"
        prompt = tok.encode("the end of")
        assert "".join(pieces(tok, tok.encode("the end of it all")[len(prompt) :], prompt)) == " it all"


def test_a_long_reply_decodes_a_few_ids_a_token():
    """Each push decodes a window of the last few ids, not the whole reply again."""
    tok = TOKENIZERS["spm-llama2"]()
    lengths = []
    tok_decode = tok.decode
    tok.decode = lambda ids: lengths.append(len(ids)) or tok_decode(ids)
    ids = tok.encode(TEXT * 20)
    assert "".join(pieces(tok, ids)) == tok_decode(ids)
    assert max(lengths) <= 8 < len(ids)
