"""Any tokenizer.json of Hugging Face `tokenizers` (say, one a user trained on their own language) is a
--data.tokenizer file: it prepares the data, trains, and the checkpoint samples with it."""

from __future__ import annotations

import json

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from minigpt.cli.sample import main as sample_main
from minigpt.cli.train import main as train_main
from minigpt.core.errors import DataError
from minigpt.core.tokenizers import HFTokenizer, get_tokenizer


@pytest.fixture(scope="module")
def trained_bpe(corpus, tmp_path_factory):
    """A byte-level BPE trained by the `tokenizers` library itself on the test corpus."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(corpus)], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_a_tokenizers_library_file_is_read_with_its_end_of_text(trained_bpe, corpus):
    tok = get_tokenizer(trained_bpe)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 300
    assert tok.eot_id == tok.backend.token_to_id("<|endoftext|>") == 0
    text = corpus.read_text()[:500]
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text) == tokenizers.Tokenizer.from_file(str(trained_bpe)).encode(text).ids


def test_a_damaged_tokenizers_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}))
    with pytest.raises(DataError, match=f"tokenizer file {path}: not a Hugging Face tokenizer.json"):
        get_tokenizer(path)


def test_training_and_sampling_with_a_user_trained_tokenizer(
    trained_bpe, tiny_run_args, corpus, data_root, tmp_path, capsys
):
    trainer = train_main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=6, data__tokenizer=trained_bpe))
    assert trainer.lightning_module.config.vocab_size == 300
    capsys.readouterr()
    sample_main(["--ckpt", str(tmp_path / "run"), "--prompt", "the quick", "--max_new_tokens", "8", "--seed", "1"])
    assert capsys.readouterr().out.startswith("the quick")
