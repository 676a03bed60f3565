"""The tokenizer inside a GGUF export: llama.cpp's own tokenizer gives minigpt's ids, for every kind minigpt has
(char, byte, tiktoken with each split pattern llama.cpp knows, Hugging Face byte-level BPE with each pre-tokenizer,
minigpt's own bpe:N, chat tokenizers with their markers), on text with contractions, digit runs, whitespace runs,
non-ASCII letters, CJK, emoji, CRLF lines and control and space characters (a char vocabulary: every one Unicode
has).  A tokenizer llama.cpp would encode differently is refused in one line.

The BPE vocabularies hold every byte pair that occurs in the texts (bytes_pair_ranks): a merge then exists across
every place a pre-tokenizer may split, so any difference between llama.cpp's pre-tokenizer and minigpt's changes
the ids.  Offline: every vocabulary is built here."""

from __future__ import annotations

import sys
from pathlib import Path
from unicodedata import category

import pytest
import tiktoken
import tiktoken_ext.openai_public as openai_public

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import UserError
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, TiktokenTokenizer
from minigpt.export.gguf import export_gguf
from minigpt.export.gguf_vocab import gguf_vocab

sys.path.insert(0, str(Path(__file__).parent))
from gguf_models import (
    CL100K,
    CORPUS,
    GPT2,
    O200K,
    TEXTS,
    byte_pair_ranks,
    hf_tokenizer,
    random_model,
    words_text,
)
from llamacpp_server import LlamaCpp

pytest.importorskip("xllamacpp")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is as fast


def tiktoken_tokenizer(pattern: str) -> TiktokenTokenizer:
    ranks = byte_pair_ranks()
    return TiktokenTokenizer(
        tiktoken.Encoding(
            name="pairs", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)}
        )
    )


def own_bpe(tmp_path_factory) -> HFTokenizer:
    """minigpt's bpe:N, trained by `prepare_data` on the texts, as `--data.tokenizer bpe:N` trains it."""
    from minigpt.data.prepare import load_prepared, prepare_data

    folder = tmp_path_factory.mktemp("bpe")
    (folder / "corpus.txt").write_text(CORPUS * 20)
    return load_prepared(prepare_data(str(folder / "corpus.txt"), "bpe:400", data_root=folder / "data")).tokenizer


KINDS = {
    "char": lambda _: CharTokenizer(CORPUS),
    "byte": lambda _: ByteTokenizer(),
    "tiktoken-gpt2": lambda _: tiktoken_tokenizer(openai_public.r50k_pat_str),
    "tiktoken-gpt2-original": lambda _: tiktoken_tokenizer(GPT2),
    "tiktoken-cl100k": lambda _: tiktoken_tokenizer(CL100K),
    "tiktoken-o200k": lambda _: tiktoken_tokenizer(O200K),
    "hf-bytelevel": lambda _: hf_tokenizer("bytelevel"),
    "hf-llama3": lambda _: hf_tokenizer("llama3"),
    "hf-qwen2": lambda _: hf_tokenizer("qwen2"),
    "hf-smollm": lambda _: hf_tokenizer("smollm"),
    "own-bpe": own_bpe,
}
CONVERSATION = [
    {"role": "system", "content": "Réponds brièvement."},
    {"role": "user", "content": "2+2 ? ☃"},
    {"role": "assistant", "content": "4, naïvement."},
]
CHATS = {"chat-char": "char", "chat-byte": "byte", "chat-tiktoken": "tiktoken-gpt2", "chat-hf": "hf-llama3"}


def tokenizer_of(kind: str, tmp_path_factory):
    if kind in CHATS:
        return ChatTokenizer.for_base(KINDS[CHATS[kind]](tmp_path_factory), conversations=[CONVERSATION])
    return KINDS[kind](tmp_path_factory)


@pytest.mark.parametrize("kind", [*KINDS, *CHATS])
def test_llama_cpp_tokenizes_text_to_minigpts_ids(kind, tmp_path_factory, tmp_path):
    tokenizer = tokenizer_of(kind, tmp_path_factory)
    model = random_model(n_layer=1, n_embd=32, vocab_size=tokenizer.vocab_size)
    result = export_gguf(model, tokenizer, tmp_path / "model.gguf")
    texts = TEXTS
    if isinstance(tokenizer, ChatTokenizer):  # a rendered conversation, its markers parsed as llama.cpp parses them
        texts = [tokenizer.render(CONVERSATION)[0], tokenizer.render(CONVERSATION[:2], add_generation_prompt=True)[0]]
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        for text in texts:
            ids = tokenizer.encode(text)
            assert llama.tokenize(text, add_special=result.vocab.add_bos) == ids, text
    if kind.startswith(("tiktoken", "hf", "own")):
        assert max(tokenizer.encode(CORPUS)) >= 256  # the texts exercise merges
    assert result.vocab.pre == {
        "hf-llama3": "llama-bpe",
        "tiktoken-cl100k": "llama-bpe",
        "tiktoken-o200k": "gpt-4o",
        "hf-qwen2": "qwen2",
        "hf-smollm": "smollm",
        "chat-hf": "llama-bpe",
    }.get(kind, "gpt-2")


def control_and_space_characters() -> str:
    """Every C0 and C1 control character, DEL, every character Python or Unicode calls a space or separator, every
    format character (zero-width spaces and joiners, BOM, bidi marks), and noncharacters / private use."""
    cps = [*range(0x20), 0x7F, *range(0x80, 0xA0)]
    cps += [c for c in range(0x110000) if not 0xD800 <= c < 0xE000 and (chr(c).isspace() or category(chr(c)) in SPACE)]
    return "".join(dict.fromkeys(map(chr, cps + [0xE000, 0xFFFE, 0xFFFF, 0x10FFFF])))


SPACE = ("Zs", "Zl", "Zp", "Cf")


def test_a_char_vocabulary_of_control_and_space_characters_tokenizes_as_in_minigpt(tmp_path):
    """CRLF text, and each control or space character alone and between others (after a letter, around \\r\\n,
    doubled, after a space): one token per character, in llama.cpp as in minigpt."""
    crlf = words_text(60).replace("\n", "\r\n")
    tokenizer = CharTokenizer(crlf + control_and_space_characters())
    model = random_model(n_layer=1, n_embd=32, vocab_size=tokenizer.vocab_size)
    export_gguf(model, tokenizer, tmp_path / "model.gguf")
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        assert llama.tokenize(crlf) == tokenizer.encode(crlf)
        for c in control_and_space_characters():
            text = f"{c}a{c}\r\n{c}{c} b{c}\r{c}\n"
            assert llama.tokenize(text) == tokenizer.encode(text), repr(c)
        assert llama.tokenize(tokenizer.chars) == list(range(tokenizer.vocab_size))


def test_special_tokens_and_the_chat_template_travel_in_the_file(tmp_path_factory, tmp_path):
    chat = tokenizer_of("chat-tiktoken", tmp_path_factory)
    vocab = gguf_vocab(chat, chat.vocab_size)
    eot, im_end = chat.token_id("<|endoftext|>"), chat.token_id("<|im_end|>")
    assert (vocab.bos, vocab.eos, vocab.end_of_turn) == (eot, im_end, im_end) and not vocab.add_bos
    assert vocab.types[im_end] == vocab.types[eot] == 3  # control tokens: parsed in a prompt, never in plain text
    assert "{% generation %}" in chat.template and "{% generation %}" not in vocab.chat_template
    assert (
        chat.render(CONVERSATION)[0]
        == ChatTokenizer(chat.base, vocab.chat_template, chat.added, chat.specials, chat.end_of_turn).render(
            CONVERSATION
        )[0]
    )
    plain = gguf_vocab(tokenizer_of("tiktoken-gpt2", tmp_path_factory), chat.base.vocab_size)
    assert (plain.bos, plain.eos, plain.chat_template) == (eot, eot, None)
    byte = gguf_vocab(ByteTokenizer(), 300)  # a model vocabulary padded past the tokenizer's: unused tokens
    assert (byte.bos, byte.eos) == (10, 0xFF) and len(byte.tokens) == 300 and byte.types[256:] == [5] * 44


def test_a_char_vocabulary_ends_on_the_symbol_its_model_is_least_likely_to_write(tmp_path):
    """llama.cpp stops at the EOS a char GGUF names: never a letter where a symbol is there to take (an 'I' ended
    JULIET after its first letter), and of the symbols the one whose highest probability over the model's own
    greedy text is lowest."""
    tokenizer = CharTokenizer(CORPUS)
    model = random_model(n_layer=1, n_embd=32, vocab_size=tokenizer.vocab_size)
    result = export_gguf(model, tokenizer, tmp_path / "model.gguf")
    eos = result.vocab.eos
    assert eos is not None and any(repr(tokenizer.chars[eos]) in note for note in result.notes)
    import torch

    from minigpt.core.generation import generate

    with torch.no_grad():
        ids = generate(model, torch.tensor([tokenizer.encode("\n")]), max_new_tokens=64, temperature=0).clone()
        peak = model(ids)[0][0].softmax(-1).amax(0)
    symbols = [i for i, c in enumerate(tokenizer.chars) if not (c.isalnum() or c.isspace())]
    assert symbols and eos in symbols and peak[eos] == peak[symbols].min()


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: TiktokenTokenizer(
                tiktoken.Encoding(
                    name="odd",
                    pat_str=r"\S+|\s+",
                    mergeable_ranks={bytes([i]): i for i in range(256)},
                    special_tokens={},
                )
            ),
            "splits text with a pattern llama.cpp has no pre-tokenizer for",
        ),
        (lambda: sentencepiece_style(), "the SentencePiece-style tokenizer maps text to pieces with"),
        (lambda: hf_tokenizer("bytelevel").__class__(normalised()), "normalises text first (NFKC)"),
    ],
)
def test_a_tokenizer_llama_cpp_would_encode_otherwise_is_refused_before_writing(build, message, tmp_path):
    tokenizer = build()
    model = random_model(n_layer=1, n_embd=32, vocab_size=tokenizer.vocab_size)
    with pytest.raises(UserError) as e:
        export_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert message in str(e.value) and "llama.cpp would encode text to other ids" in str(e.value)
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def sentencepiece_style() -> HFTokenizer:
    """A SentencePiece-style tokenizer.json whose Metaspace pre-tokenizer splits text at each "▁" (llama.cpp does
    not; tests/export/test_gguf_spm.py has the ones it reproduces)."""
    import tokenizers as t

    vocab = {"<unk>": 0, **{f"<0x{i:02X}>": 1 + i for i in range(256)}, "▁": 257, "a": 258, "▁a": 259}
    backend = t.Tokenizer(t.models.BPE(vocab, [("▁", "a")], byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = t.pre_tokenizers.Metaspace()
    backend.decoder = t.decoders.Sequence([t.decoders.Replace("▁", " "), t.decoders.ByteFallback(), t.decoders.Fuse()])
    return HFTokenizer(backend.to_str())


def normalised() -> str:
    import json

    doc = json.loads(hf_tokenizer("bytelevel").tokenizer_json)
    doc["normalizer"] = {"type": "NFKC"}
    return json.dumps(doc)
