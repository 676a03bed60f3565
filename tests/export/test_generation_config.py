"""The generation_config.json of an export (issue 40): transformers generates from it without a max_length warning."""

from __future__ import annotations

import json
import logging

import pytest

from minigpt.cli import export as export_cli
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.tokenizers import CharTokenizer
from support import varied_gpt

pytestmark = pytest.mark.usefixtures("one_thread")
CHARS = "\n !',.:;?abcdefghijklmnopqrstuvwxyz0123456789"


def write_run(run, tokenizer, vocab_size: int):
    (run / "checkpoints").mkdir(parents=True)
    save_file(
        model_checkpoint(varied_gpt("gpt", vocab_size=vocab_size, block_size=64), tokenizer),
        run / "checkpoints" / "last.ckpt",
    )
    return run


def test_transformers_generates_from_an_export_without_a_max_length_warning(tmp_path):
    transformers = pytest.importorskip("transformers")
    run = write_run(tmp_path / "run", CharTokenizer(CHARS), len(CHARS))
    export_cli.main(["--ckpt", str(run), "--out", str(tmp_path / "hf")])
    assert "max_length" not in json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # transformers' own logger does not propagate to pytest's
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model.generate(
            transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("the", return_tensors="pt")["input_ids"],
            max_new_tokens=3,
            do_sample=False,
        )
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "max_length" in r.getMessage()], [r.getMessage() for r in records]
