"""`--data.tokenizer bpe:VOCAB`: a byte-level BPE trained on the corpus's training documents only, deterministic,
cached, and read by transformers with the same ids once exported."""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest

from minigpt.core.errors import DataError
from minigpt.data.prepare import load_prepared, prepare_data

VOCAB = "bpe:330"


def word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(6))


@pytest.fixture
def folder_corpus(tmp_path) -> tuple[Path, dict[str, str]]:
    """12 documents, each repeating its own 6-letter word (and sharing some filler): a BPE trained on a document
    learns its word as one token, one that never saw it cannot."""
    rng = random.Random(0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    words = {}
    for i in range(12):
        words[f"doc{i:02d}.txt"] = w = word(rng)
        (folder / f"doc{i:02d}.txt").write_text(" ".join([w, "and the sea"] * 60) + "\n")
    return folder, words


def test_the_tokenizer_never_sees_a_validation_document(folder_corpus, tmp_path, capsys):
    folder, words = folder_corpus
    data = load_prepared(prepare_data(str(folder), VOCAB, data_root=tmp_path / "data"))
    assert f"data: trained {VOCAB} on" in capsys.readouterr().out
    tok = data.tokenizer
    assert tok.vocab_size == 330 and tok.name == VOCAB
    val_text, train_text = tok.decode(data.val.tolist()), tok.decode(data.train.tolist())
    val_words = {w for w in words.values() if w in val_text}
    assert val_words and len(val_words) < len(words)  # both sides hold documents
    for w in words.values():
        pieces = tok.encode(" " + w)
        if w in val_words:
            assert w not in train_text and len(pieces) > 1, w  # never merged whole: never seen
        else:
            assert len(pieces) == 1, w  # seen 60 times in training: one token


def test_a_single_document_is_trained_on_its_training_prefix_only(tmp_path):
    rng = random.Random(1)
    seen, unseen = word(rng), word(rng)
    filler = [word(rng) for _ in range(20)] * 5  # rarer than `unseen`: had it been trained on, it would merge first
    text = " ".join([seen] * 900 + filler) + "\n" + " ".join([unseen] * 100) + "\n"
    (tmp_path / "one.txt").write_text(text)
    data = load_prepared(
        prepare_data(str(tmp_path / "one.txt"), "bpe:300", data_root=tmp_path / "data", val_fraction=0.1)
    )
    tok = data.tokenizer
    assert len(tok.encode(" " + seen)) == 1 and len(tok.encode(" " + unseen)) > 1
    train, val = tok.decode(data.train.tolist()), tok.decode(data.val.tolist())
    assert unseen not in train and seen not in val
    assert (train + val).replace("<|endoftext|>", "") == text  # the split is exact: no text lost or doubled
    assert len(train) == int(len(text) * 0.9)  # at the planned character, not at a token count


def test_training_is_deterministic_and_cached(folder_corpus, tmp_path, capsys):
    folder, _ = folder_corpus
    first = prepare_data(str(folder), VOCAB, data_root=tmp_path / "a")
    second = prepare_data(str(folder), VOCAB, data_root=tmp_path / "b")
    for name in ("tokenizer.json", "train.bin", "val.bin"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    capsys.readouterr()
    assert prepare_data(str(folder), VOCAB, data_root=tmp_path / "a") == first
    assert "prepared earlier from the same source and tokenizer" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec,message",
    [
        ("bpe:0", "a byte-level BPE needs a vocabulary of at least 258"),
        ("bpe:100", "a byte-level BPE needs a vocabulary of at least 258"),
        ("bpe:", "VOCAB must be a whole number of tokens, e.g. bpe:4096"),
        ("bpe:lots", "VOCAB must be a whole number of tokens"),
        ("bpe:-5", "VOCAB must be a whole number of tokens"),
        (
            "bpe:²⁵⁸",
            "VOCAB must be a whole number of tokens, e.g. bpe:4096 .in the digits 0-9.",
        ),  # isdigit(), not int()
        ("bpe:٤٠٩٦", "in the digits 0-9"),
    ],
)
def test_a_bad_vocabulary_size_is_one_line_before_any_reading(tmp_path, spec, message):
    with pytest.raises(DataError, match=message) as e:
        prepare_data(str(tmp_path / "absent.txt"), spec, data_root=tmp_path / "data")
    assert "\n" not in str(e.value) and spec in str(e.value)


def test_a_vocabulary_the_corpus_cannot_fill_says_what_it_got_and_leaves_nothing(tmp_path):
    (tmp_path / "small.txt").write_text("abc abc abd " * 50)
    with pytest.raises(
        DataError,
        match=r"^bpe:5000: the training text \(\d+ characters\) fills only (\d+) tokens "
        r"\(\d+ merges\); ask for bpe:\1 or fewer, or give more text$",
    ):
        prepare_data(str(tmp_path / "small.txt"), "bpe:5000", data_root=tmp_path / "data")
    assert [p.name for p in (tmp_path / "data").iterdir()] == []  # no cache, no temporary folder


def test_train_py_takes_bpe_and_refuses_bad_sizes_in_one_line(tiny_run_args, corpus, data_root, tmp_path, capsys):
    from minigpt.cli.errors import run_cli
    from minigpt.cli.train import main

    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(tiny_run_args(corpus, data_root, tmp_path / "bad", data__tokenizer="bpe:100")))
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("INFO: Seed set")]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: tokenizer 'bpe:100': a byte-level BPE")
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=4, data__tokenizer="bpe:300"))
    from minigpt.loading import load_model

    model, tok = load_model(tmp_path / "run")
    assert tok.name == "bpe:300" and model.config.vocab_size >= 300


def test_an_exported_bpe_gives_transformers_the_same_ids(folder_corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from minigpt.core.config import GPTConfig
    from minigpt.core.model import GPT
    from minigpt.export.hf import export_hf

    folder, words = folder_corpus
    tok = load_prepared(prepare_data(str(folder), VOCAB, data_root=tmp_path / "data")).tokenizer
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=tok.vocab_size))
    export_hf(model, tok, tmp_path / "export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    for text in ["and the sea", " ".join(words.values()), "naïve café — 東京 🙂\n\n  x", "a<|endoftext|>b"]:
        assert hf_tok(text)["input_ids"] == tok.encode(text), text


def test_an_end_of_text_written_in_a_document_is_its_text_not_a_document_boundary(folder_corpus, tmp_path):
    """A document that writes '<|endoftext|>' (code about tokenizers) was cut in two there: the text became the
    separator id.  It is text, as the tiktoken encodings read it; the separator follows each document alone."""
    folder, _ = folder_corpus
    (folder / "doc00.txt").write_text("the <|endoftext|> token and the sea\n" * 30)
    data = load_prepared(prepare_data(str(folder), VOCAB, data_root=tmp_path / "data", val_fraction=0.0001))
    tok = data.tokenizer
    ids = data.train.tolist() + data.val.tolist()
    assert ids.count(tok.eot_id) == 12  # one after each document, none inside doc00
    assert tok.decode(ids).count("<|endoftext|>") == 12 + 30
