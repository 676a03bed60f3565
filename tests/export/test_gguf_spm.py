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
from gguf_models import ADDED, SPACES, TEXTS, random_model, spm_tokenizer
from llamacpp_server import LlamaCpp

pytest.importorskip("xllamacpp")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is as fast

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


def transformers_ids(tokenizer: HFTokenizer, text: str) -> list[int]:
    """The ids transformers gives (PreTrainedTokenizerFast over the same tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return fast(text, add_special_tokens=True)["input_ids"]


@pytest.mark.parametrize("spaces, converted", [*((s, False) for s in SPACES), ("gemma", True), ("llama2", True)])
def test_llama_cpp_tokenizes_a_sentencepiece_style_tokenizer_as_hugging_face(spaces, converted, tmp_path):
    """`converted`: merges as transformers converts a SentencePiece model (Llama 2's and Gemma's files); else as
    `tokenizers` trains them."""
    tokenizer = spm_tokenizer(spaces, converted=converted)
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


STRIPPED_TEXTS = [
    "<|user|>\n  hello there<|end|>\n<|assistant|>  \n\t x<|end|>",
    "<s> a</s>  b<|endoftext|>  c<unk> d",
    "<|system|>\r\n\x0bv\x0cf end",
]


def test_phi3s_added_tokens_take_in_the_whitespace_after_them_in_llama_cpp_too(tmp_path):
    """Phi-3's added tokens take in the whitespace after them (rstrip; not <unk>, <s>, <|endoftext|>), which
    llama.cpp does only for a model whose name says Phi-3: the export says so in the name, and names a model that
    does not strip otherwise, whatever it is called."""
    tokenizer = spm_tokenizer("llama2", post_bos=True, phi3=True)
    model = random_model(n_layer=1, n_embd=32, vocab_size=tokenizer.vocab_size)
    result = export_gguf(model, tokenizer, tmp_path / "phi3.gguf", name="tuned")
    assert result.vocab.phi3_rstrip and any("'tuned (phi3 tokenizer)'" in note for note in result.notes)
    with LlamaCpp(tmp_path / "phi3.gguf") as llama:
        for text in STRIPPED_TEXTS:
            ids = tokenizer.encode(text)
            assert llama.tokenize(text, add_special=True) == ids == transformers_ids(tokenizer, text), text
    gemma = spm_tokenizer("gemma")
    model = random_model(n_layer=1, n_embd=32, vocab_size=gemma.vocab_size)
    result = export_gguf(model, gemma, tmp_path / "gemma.gguf", name="my-Phi-3-tune")
    assert any("'my-Phi 3-tune'" in note for note in result.notes)
    with LlamaCpp(tmp_path / "gemma.gguf") as llama:
        text = "<start_of_turn>\n  spaced <end_of_turn>  two<eos> \n"
        assert llama.tokenize(text) == gemma.encode(text)


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


SPLIT_AT_SPACE = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
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
    (
        lambda: edited("gemma", lambda d: d["added_tokens"][-1].update(rstrip=True)),
        "after it (rstrip), and llama.cpp strips only after the tokens Phi-3's tokenizer strips after",
    ),
    (lambda: edited("gemma", lambda d: d["added_tokens"][-1].update(lstrip=True)), "the whitespace before it"),
    (
        lambda: edited("gemma", lambda d: d["added_tokens"][-1].update(content="a▁b", normalized=True)),
        "added token 'a▁b' is matched in the normalised text",
    ),
    (
        lambda: edited("gemma", lambda d: d.update(pre_tokenizer={**SPLIT_AT_SPACE, "pattern": {"String": "a"}})),
        "and pre-tokenizer Split",
    ),
    (lambda: edited("gemma", lambda d: d["model"]["vocab"].update({"a\0": 900})), "holds a NUL character"),
]


@pytest.mark.parametrize("build, message", REFUSED)
def test_a_sentencepiece_tokenizer_llama_cpp_would_encode_otherwise_is_refused_before_writing(build, message, tmp_path):
    tokenizer = build()
    model = random_model(n_layer=1, n_embd=32, vocab_size=max(tokenizer.vocab_size, 8))
    with pytest.raises(UserError) as e:
        export_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert message in str(e.value) and "llama.cpp would encode text to other ids" in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []
