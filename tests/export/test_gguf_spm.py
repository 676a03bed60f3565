"""A SentencePiece-style tokenizer.json (BPE over "▁"-pieces with <0xNN> byte fallback: Llama 2's, Mistral's, Gemma's,
Phi-3's) in a GGUF export: llama.cpp's own SentencePiece tokenizer gives the Hugging Face tokenizer's ids (the
`tokenizers` library, as transformers' PreTrainedTokenizerFast applies it) and decodes them to its text, for each
way such a file turns spaces into "▁" (Gemma's Replace normaliser, Llama 2's Prepend + Replace, a Metaspace
pre-tokenizer that prepends nothing), on text with space runs, newlines, digits, characters outside the vocabulary
(byte fallback) and special tokens.  What llama.cpp cannot reproduce is refused in one line.  Offline: each
tokenizer is trained here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from minigpt.core.errors import UserError
from minigpt.core.tokenizers import HFTokenizer
from minigpt.export.gguf import export_gguf

sys.path.insert(0, str(Path(__file__).parent))
from gguf_models import CORPUS, TEXTS, random_model, words_text
from llamacpp_server import LlamaCpp

pytest.importorskip("xllamacpp")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is as fast

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's first ids
ADDED = ["<start_of_turn>", "<end_of_turn>"]
# how each family's tokenizer.json writes spaces as "▁": (normaliser steps, pre-tokenizer) -> llama.cpp's prefix
SPACES = {
    "gemma": (["replace"], None, False),  # no dummy prefix
    "llama2": (["prepend", "replace"], None, True),  # the "legacy" files: "▁" before each text
    "metaspace-never": ([], "never", False),
}
SPM_TEXTS = [
    *TEXTS,
    "hello",
    " hello  world   ",
    "   leading and trailing spaces   ",
    "\n\nnew\nlines\n \n  \n",
    "digits 0 7 42 1999 3.14159 1,000,000",
    "unicode outside the vocabulary: ☃ 𝄞 🦙 ñ 猫 Ωμέγα",
    "<bos>hello<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn> spaced <end_of_turn>  two<eos>",
    "",
    " ",
    "▁ a literal ▁▁ mark",
]


def spm_tokenizer(spaces: str, vocab_size: int = 600, post_bos: bool = False) -> HFTokenizer:
    """A SentencePiece-style tokenizer.json trained with `tokenizers` on the texts: Gemma's first ids, the 256
    <0xNN> pieces, then the trained BPE (merges over "▁"-pieces, byte fallback for the rest); the specials and
    the chat markers as added special tokens; `post_bos`: a post-processor that writes <bos> first."""
    import tokenizers as t

    steps, metaspace, _ = SPACES[spaces]
    normalizers = {"replace": t.normalizers.Replace(" ", "▁"), "prepend": t.normalizers.Prepend("▁")}
    trainer = t.Tokenizer(t.models.BPE())
    if steps:
        trainer.normalizer = t.normalizers.Sequence([normalizers[s] for s in steps])
    if metaspace:
        trainer.pre_tokenizer = t.pre_tokenizers.Metaspace(prepend_scheme=metaspace, split=False)
    trainer.train_from_iterator(  # no NUL piece (refused: llama.cpp's token texts end at one): NUL falls back
        (words_text(200) + CORPUS.replace("\0", "")).splitlines(True),
        t.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False),
    )
    trained = json.loads(trainer.to_str())["model"]
    pieces = SPECIALS + [f"<0x{i:02X}>" for i in range(256)]
    pieces += [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m) for m in trained["merges"]]
    backend = t.Tokenizer(
        t.models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True, unk_token="<unk>")
    )
    backend.normalizer = trainer.normalizer
    backend.pre_tokenizer = trainer.pre_tokenizer
    strip = [t.decoders.Strip(" ", 1, 0)] if SPACES[spaces][2] else []  # Llama 2's: the prefix space goes again
    backend.decoder = t.decoders.Sequence(
        [t.decoders.Replace("▁", " "), t.decoders.ByteFallback(), t.decoders.Fuse(), *strip]
    )
    backend.add_special_tokens(SPECIALS + ADDED)
    if post_bos:
        backend.post_processor = t.processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    assert sum(len(p) > 1 and p not in pieces[:260] for p in pieces) > 150  # the texts exercise merges
    return HFTokenizer(backend.to_str(), bos_id=2, eos_id=1)


def transformers_ids(tokenizer: HFTokenizer, text: str) -> list[int]:
    """The ids transformers gives (PreTrainedTokenizerFast over the same tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return fast(text, add_special_tokens=True)["input_ids"]


@pytest.mark.parametrize("spaces", list(SPACES))
def test_llama_cpp_tokenizes_a_sentencepiece_style_tokenizer_as_hugging_face(spaces, tmp_path):
    tokenizer = spm_tokenizer(spaces)
    model = random_model(n_layer=1, n_embd=32, vocab_size=tokenizer.vocab_size + 3)  # padded past the tokenizer
    result = export_gguf(model, tokenizer, tmp_path / "model.gguf")
    vocab = result.vocab
    assert (vocab.kind, vocab.add_space_prefix, vocab.bos, vocab.eos, vocab.unk, vocab.pad) == (
        "spm",
        SPACES[spaces][2],
        2,
        1,
        3,
        0,
    )
    assert vocab.types[4 : 4 + 256] == [6] * 256 and vocab.types[:4] == [3] * 4  # BYTE pieces, CONTROL specials
    merged = 0
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        for text in SPM_TEXTS:
            ids = tokenizer.encode(text)
            assert ids == transformers_ids(tokenizer, text), text
            assert llama.tokenize(text) == ids, text
            # llama.cpp's server writes each token's piece: the prefix "▁" too, which its llama_detokenize drops
            # as Llama 2's Strip decoder does
            prefix = " " if SPACES[spaces][2] and text and not text.startswith("<") else ""
            assert llama.detokenize(ids) == prefix + tokenizer.decode(ids), text
            if "<" not in text and "▁" not in text:  # (a literal "▁" is a space to SentencePiece)
                assert tokenizer.decode(ids) == text, text  # a round trip, byte fallback included
            merged += sum(i >= 260 and i < len(tokenizer.backend.get_vocab()) - len(ADDED) for i in ids)
    assert merged > 100


def test_llama_cpp_adds_the_bos_the_post_processor_adds(tmp_path):
    tokenizer = spm_tokenizer("gemma", post_bos=True)
    model = random_model(n_layer=1, n_embd=32, vocab_size=tokenizer.vocab_size)
    result = export_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert result.vocab.add_bos and not result.vocab.add_eos
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        for text in ("hello world", "<start_of_turn>user\nhi<end_of_turn>\n"):
            ids = tokenizer.encode(text)
            assert ids[0] == 2 and ids == transformers_ids(tokenizer, text)
            assert llama.tokenize(text, add_special=True) == ids, text


def edited(spaces: str, edit) -> HFTokenizer:
    doc = json.loads(spm_tokenizer(spaces, vocab_size=300).tokenizer_json)
    edit(doc)
    return HFTokenizer(json.dumps(doc), bos_id=2, eos_id=1)


def unigram() -> HFTokenizer:
    import tokenizers as t

    return HFTokenizer(t.Tokenizer(t.models.Unigram([("<unk>", 0.0), ("▁", -1.0), ("a", -2.0)], 0)).to_str())


def metaspace(**options):
    return lambda doc: doc.update(
        normalizer=None,
        pre_tokenizer={"type": "Metaspace", "replacement": "▁", "split": False, "prepend_scheme": "always"} | options,
    )


REFUSED = [
    (unigram, "is a Unigram model"),
    (
        lambda: edited("gemma", lambda d: d.update(normalizer={"type": "NFKC"})),
        "maps text to pieces with normaliser NFKC",
    ),
    (
        lambda: edited("llama2", lambda d: d["normalizer"]["normalizers"].insert(0, {"type": "Lowercase"})),
        "maps text to pieces with normaliser Sequence",
    ),
    (
        lambda: edited("gemma", lambda d: d.update(pre_tokenizer={"type": "Whitespace"})),
        "and pre-tokenizer Whitespace",
    ),
    (lambda: edited("gemma", metaspace(split=True)), "pre-tokenizer Metaspace"),
    (lambda: edited("gemma", metaspace()), "(Metaspace prepend_scheme always), and llama.cpp before every text"),
    (lambda: edited("gemma", metaspace(prepend_scheme="first")), "prepend_scheme first), and llama.cpp before"),
    (lambda: edited("gemma", lambda d: d["model"]["vocab"].pop("<0x41>")), "has no <0x41> piece"),
    (lambda: edited("gemma", lambda d: d["model"].update(dropout=0.1)), "dropout=0.1"),
    (lambda: edited("gemma", lambda d: d["added_tokens"][-1].update(rstrip=True)), "'<end_of_turn>' takes in"),
]


@pytest.mark.parametrize("build, message", REFUSED)
def test_a_sentencepiece_tokenizer_llama_cpp_would_encode_otherwise_is_refused_before_writing(build, message, tmp_path):
    tokenizer = build()
    model = random_model(n_layer=1, n_embd=32, vocab_size=max(tokenizer.vocab_size, 8))
    with pytest.raises(UserError) as e:
        export_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert message in str(e.value) and "llama.cpp would encode text to other ids" in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []
