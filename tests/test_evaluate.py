"""Whole-split evaluation: every token predicted once, checked against a one-prediction-at-a-time reference."""

import math

import torch

from conftest import tiny_run_args
from minigpt import GPT, GPTConfig
from minigpt.cli import main
from minigpt.evaluate import evaluate_tokens
from minigpt.evaluate import main as eval_main


def test_evaluate_tokens_matches_token_by_token_reference():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=11)).eval()
    tokens = torch.randint(0, 11, (53,))  # 52 predictions: 3 full windows and a partial one of 4
    nats, n = evaluate_tokens(model, tokens, batch_size=2)
    expected = 0.0
    with torch.no_grad():
        for j in range(1, len(tokens)):
            start = ((j - 1) // 16) * 16  # the window this prediction falls in
            logits, _ = model(tokens[start:j][None])
            expected -= torch.log_softmax(logits[0, -1], -1)[tokens[j]].item()
    assert n == 52
    assert math.isclose(nats, expected, rel_tol=1e-5)


def test_train_reports_full_val_loss_and_eval_py_scores_a_text(corpus, data_root, tmp_path, capsys):
    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=20))
    out = capsys.readouterr().out
    full = trainer.callback_metrics["full_val_loss"].item()
    assert f"full val loss {full:.4f} over all" in out
    text = tmp_path / "held_out.txt"
    text.write_text("the lazy dog sings while the quick cats sit on warm mats\n" * 20)
    eval_main(["--ckpt", str(tmp_path / "run"), "--text", str(text)])
    line = capsys.readouterr().out.strip()
    nats = float(line.split(" nats/token")[0].split(", ")[-1])
    bits = float(line.split(" bits/char")[0].split(", ")[-1])
    assert 0 < nats < math.log(trainer.lightning_module.config.vocab_size)
    assert math.isclose(bits, nats / math.log(2), rel_tol=0.01)  # char-level: one token per character
