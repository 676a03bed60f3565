"""The Hugging Face tokenizer bridge: ours written as tokenizer.json give the same ids through transformers, and an
HF tokenizer.json read back travels inside checkpoints as plain data. Offline: every vocabulary is built here."""

import io
import json

import pytest
import tiktoken
import torch

from minigpt.core.errors import CheckpointError, DataError, UserError
from minigpt.core.tokenizers import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    tokenizer_from_dict,
)
from minigpt.hf.tokenizer_files import load_hf_tokenizer, save_hf_tokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n  héllo wörld ☃ 日本語 'tis 12345\tdone  \n"
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MERGES = [
    b"th",
    b"the",
    b" t",
    b" the",
    b"in",
    b"ing",
    b"er",
    b"\n\n",
    b"Ci",
    b"Cit",
    b"\xc3\xa9",
    b"h\xc3\xa9",
    b"\xe2\x98",
    b"\xe2\x98\x83",
    b"pe",
    b"spe",
    b" spe",
    b"ea",
    b" w",
    b"12",
    b"123",
]


def small_bpe(name: str = "small_bpe") -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(MERGES)}
    return tiktoken.Encoding(
        name=name, pat_str=GPT2_PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)}
    )


@pytest.mark.parametrize("kind", ["char", "byte", "tiktoken"])
def test_saved_tokenizer_gives_the_same_ids_through_transformers(kind, tmp_path):
    tok = {
        "char": lambda: CharTokenizer(SAMPLE + "xyz"),
        "byte": ByteTokenizer,
        "tiktoken": lambda: TiktokenTokenizer(small_bpe()),
    }[kind]()
    save_hf_tokenizer(tok, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tok.encode(SAMPLE)
    if kind == "tiktoken":
        assert any(i >= 256 for i in ids), "the sample must exercise merges"
    assert hf(SAMPLE)["input_ids"] == ids
    assert hf.decode(ids) == tok.decode(ids) == SAMPLE
    if kind == "tiktoken":  # <|endoftext|> is EOS, as in GPT-2
        assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == tok.eot_id


def test_a_char_export_reads_back_as_the_char_tokenizer_and_exports_to_gguf_again(tmp_path):
    """An exported char model's folder is a char model again (its vocabulary, its one-line refusal of a character
    it lacks), so the folder, and any fine-tune of it, exports to GGUF as the run did; a WordLevel tokenizer.json of
    another layout stays a Hugging Face tokenizer."""
    from minigpt.core.config import GPTConfig
    from minigpt.core.errors import UnknownCharactersError
    from minigpt.core.model import GPT
    from minigpt.export.hf import export_hf
    from minigpt.loading import load_model

    tok = CharTokenizer(SAMPLE)
    export_hf(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=tok.vocab_size)), tok, tmp_path)
    back = load_model(tmp_path)[1]
    assert isinstance(back, CharTokenizer) and back.chars == tok.chars
    with pytest.raises(UnknownCharactersError):
        back.encode("Zq")
    pytest.importorskip("gguf")
    from minigpt.export.gguf import export_gguf

    assert export_gguf(load_model(tmp_path)[0], back, tmp_path / "again.gguf").vocab.kind == "char"
    doc = json.loads((tmp_path / "tokenizer.json").read_text())
    doc["decoder"] = None  # not save_hf_tokenizer's char layout
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    assert isinstance(load_hf_tokenizer(tmp_path, {"vocab_size": tok.vocab_size}), HFTokenizer)


def test_a_chat_on_a_word_level_vocabulary_names_the_characters_it_lacks(tmp_path):
    """A chat char model's export keeps its chat tokens (a Hugging Face tokenizer then); a message with a character
    its vocabulary lacks is the one-line refusal, not the tokenizers library's exception."""
    from minigpt.core.chat_template import ChatTokenizer
    from minigpt.core.config import GPTConfig
    from minigpt.core.errors import UnknownCharactersError
    from minigpt.core.model import GPT
    from minigpt.export.hf import export_hf
    from minigpt.loading import load_chat_model

    conversation = [{"role": "user", "content": "What is 2?"}, {"role": "assistant", "content": "2"}]
    tok = ChatTokenizer.for_base(CharTokenizer(SAMPLE), conversations=[conversation])
    export_hf(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=tok.vocab_size)), tok, tmp_path)
    chat_tok = load_chat_model(tmp_path)[1]
    assert chat_tok.encode_chat(conversation) == tok.encode_chat(conversation)
    with pytest.raises(UnknownCharactersError, match="'Z'"):
        chat_tok.encode_chat([{"role": "user", "content": "What is Z?"}], add_generation_prompt=True)


def test_byte_tokenizer_export_round_trips_any_utf8_text(tmp_path):
    save_hf_tokenizer(ByteTokenizer(), tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "".join(chr(c) for c in (*range(1, 600), 0x1F600, 0x10FFFF))
    assert hf(text)["input_ids"] == list(text.encode("utf-8"))
    assert hf.decode(list(text.encode("utf-8"))) == text


class OddTokenizer(Tokenizer):
    name, vocab_size, eot_id = "odd", 3, None

    def encode(self, text):
        return [0]

    def decode(self, ids):
        return ""

    def to_dict(self):
        return {"type": "odd"}


def test_a_kind_that_cannot_be_written_is_one_line(tmp_path):
    with pytest.raises(
        UserError,
        match=r"^the odd tokenizer \(OddTokenizer\) cannot be written as a Hugging Face "
        r"tokenizer.json; only char, byte, tiktoken BPE and Hugging Face",
    ):
        save_hf_tokenizer(OddTokenizer(), tmp_path)


def llama_style_dir(path):
    """A model directory with a tokenizer.json whose post-processor prepends <s> (as Llama's does), special tokens
    named in tokenizer_config.json and a config.json that pads the vocabulary."""
    t = tokenizers
    words = ["<unk>", "<s>", "</s>", *sorted(set(SAMPLE.split()))]
    backend = t.Tokenizer(t.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = t.pre_tokenizers.WhitespaceSplit()
    backend.decoder = t.decoders.WordPiece()  # joins words with spaces
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = t.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
                "unk_token": "<unk>",
            }
        )
    )
    config = {"model_type": "llama", "vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    return config


def test_hf_tokenizer_follows_its_source_and_round_trips_as_plain_data(tmp_path):
    config = llama_style_dir(tmp_path / "model")
    tok = load_hf_tokenizer(tmp_path / "model", config)
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.eot_id) == (64, 1, 2, 2)
    ids = tok.encode("hear me speak.")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    assert ids[0] == 1 and hf("hear me speak.")["input_ids"] == ids  # BOS from the source's post-processor

    # plain data: survives JSON, and torch.save / torch.load(weights_only=True)
    d = tok.to_dict()
    assert d["type"] == "hf" and isinstance(d["tokenizer_json"], str)
    assert json.loads(json.dumps(d)) == d
    buffer = io.BytesIO()
    torch.save({"tokenizer": d}, buffer)
    buffer.seek(0)
    back = tokenizer_from_dict(torch.load(buffer, weights_only=True)["tokenizer"])
    assert back.to_dict() == d and back.encode("hear me speak.") == ids
    assert back.decode(ids[1:]) == "hear me speak."

    # and written back out as it came
    save_hf_tokenizer(back, tmp_path / "export")
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert again("hear me speak.")["input_ids"] == ids
    assert (again.bos_token, again.eos_token) == ("<s>", "</s>")


def test_a_damaged_hf_dict_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="damaged hf tokenizer dict"):
        tokenizer_from_dict({"type": "hf", "tokenizer_json": "{not json"})
    with pytest.raises(CheckpointError, match="damaged hf tokenizer dict"):
        tokenizer_from_dict({"type": "hf"})


def test_gpt2_without_tokenizer_files_is_tiktoken_gpt2(tmp_path, monkeypatch):
    asked = []
    gpt2 = TiktokenTokenizer(small_bpe("gpt2"))
    monkeypatch.setattr("minigpt.hf.tokenizer_files.get_tokenizer", lambda name: asked.append(name) or gpt2)
    tok = load_hf_tokenizer(tmp_path, {"model_type": "gpt2", "vocab_size": 50257})
    assert asked == ["gpt2"] and tok is gpt2
    with pytest.raises(DataError, match="is a GPT-2 model with vocab_size 100 and no tokenizer files"):
        load_hf_tokenizer(tmp_path, {"model_type": "gpt2", "vocab_size": 100})


def test_other_models_without_a_tokenizer_json_are_one_line(tmp_path):
    with pytest.raises(
        DataError,
        match=r"has no tokenizer.json; minigpt reads a Hugging Face model's tokenizer from "
        r"its tokenizer.json",
    ):
        load_hf_tokenizer(tmp_path, {"model_type": "llama", "vocab_size": 100})


def test_an_hf_tokenizer_file_prepares_data(tmp_path):
    from minigpt.data.prepare import load_prepared, prepare_data

    tok = HFTokenizer(tokenizers.Tokenizer.from_file(str(_byte_bpe(tmp_path))).to_str(), name="bpe", eos_id=None)
    (tmp_path / "tok.json").write_text(json.dumps(tok.to_dict()))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE * 50)
    data = load_prepared(prepare_data(str(corpus), str(tmp_path / "tok.json"), data_root=tmp_path / "data"))
    assert data.tokenizer.to_dict() == tok.to_dict()
    assert list(data.train[:20]) == tok.encode(SAMPLE)[:20]


def _byte_bpe(tmp_path):
    save_hf_tokenizer(TiktokenTokenizer(small_bpe()), tmp_path / "bpe")
    return tmp_path / "bpe" / "tokenizer.json"
