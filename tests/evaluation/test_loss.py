"""Whole-split evaluation: every token predicted once, checked against a one-prediction-at-a-time reference."""

import math
import runpy
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]  # the repository root
from minigpt import GPT, GPTConfig
from minigpt.cli.eval import main as eval_main
from minigpt.cli.train import main
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.errors import UserError
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer
from minigpt.evaluation.loss import bits_per_char_and_byte, evaluate_tokens
from minigpt.loading import load_model


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
    for batch_size in (1, 100):  # the batch changes the speed, not the result
        assert math.isclose(evaluate_tokens(model, tokens, batch_size=batch_size)[0], nats, rel_tol=1e-5)
    for bad in (0, -1):
        with pytest.raises(UserError, match=f"batch_size must be an integer >= 1, got {bad}"):
            evaluate_tokens(model, tokens, batch_size=bad)
    with pytest.raises(UserError, match="nothing to evaluate"):
        evaluate_tokens(model, tokens[:1])


def test_evaluation_batches_within_the_memory_budget(monkeypatch):
    """However large the batch asked for, what a batch holds at once stays within the budget (a GPT-2 shape at
    batch 32 held 13 GB of logits); the result is the same."""
    from minigpt.evaluation import loss as evaluate

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=11)).eval()
    tokens = torch.randint(0, 11, (200,))
    reference, _ = evaluate_tokens(model, tokens, batch_size=1)
    monkeypatch.setattr(evaluate, "MEMORY_BUDGET", 3 * 16 * evaluate.bytes_per_token(model.config))  # 3 windows
    batches = []
    real_forward = model.forward
    monkeypatch.setattr(
        model, "forward", lambda idx, *a, **k: batches.append(idx.size(0)) or real_forward(idx, *a, **k)
    )
    for asked in (None, 1000):
        batches.clear()
        assert math.isclose(evaluate_tokens(model, tokens, batch_size=asked)[0], reference, rel_tol=1e-5)
        assert max(batches) == 3 and sum(batches) == 13  # 12 full windows and the rest


def test_a_small_vocabularys_batch_is_bounded_by_its_activations_too():
    """Counting the logits alone, a char model of GPT-2's width scored 2,016 windows of 1,024 at once: its MLP's
    hidden activations alone were 25 GB (a 5 MB text: 4 GB peak where 16 windows took 0.5 GB, and were faster)."""
    from minigpt.evaluation.loss import MEMORY_BUDGET, windows_per_batch

    for attention in ("sdpa", "manual"):
        config = GPTConfig.from_name("gpt2", vocab_size=65, attention=attention)
        with torch.device("meta"):
            model = GPT(config)
        windows = windows_per_batch(model)
        assert 1 <= windows and windows * config.block_size * config.mlp_hidden * 4 <= MEMORY_BUDGET
        if attention == "manual":  # every head's weights of a window: (n_head, T, T) floats
            assert windows * config.n_head * config.block_size**2 * 4 <= MEMORY_BUDGET


def test_a_gpus_budget_is_a_quarter_of_its_free_memory(monkeypatch):
    """The GPU recipe's full-split evaluation asks for 640 windows of its small char model: 512 MiB would cut it to
    115 at a time, and on a GPU a small model's batches are launches, not compute."""
    from minigpt.evaluation.loss import MEMORY_BUDGET, memory_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30, 140 * 2**30))
    assert memory_budget(torch.device("cuda", 0)) == 25 * 2**30
    assert memory_budget(torch.device("cpu")) == MEMORY_BUDGET
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 140 * 2**30))  # nearly full
    assert memory_budget(torch.device("cuda", 0)) == MEMORY_BUDGET


# --------------------------------------------------------------------------------------------------
# eval.py on a hand-made checkpoint (the train-then-eval test is below)

CHARS = "\n abcdefghijklmnopqrstuvwxyz."


@pytest.fixture(scope="module")
def char_run(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory with checkpoints/best.ckpt of a random char model, a text file it can read)."""
    root = tmp_path_factory.mktemp("evalrun")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=len(CHARS)))
    (root / "run" / "checkpoints").mkdir(parents=True)
    save_file(model_checkpoint(model, CharTokenizer(CHARS)), root / "run" / "checkpoints" / "best.ckpt")
    text = root / "text.txt"
    text.write_text("the cat sat on the mat.\n" * 7, encoding="utf-8")  # 168 characters: 10 windows and a bit
    return root / "run", text


def test_bits_per_char_and_byte_count_the_predicted_text_only():
    # a byte tokenizer on Russian text: 2 bytes (tokens) per letter; the first token is never predicted
    tokenizer, text = ByteTokenizer(), "да нет"
    ids = tokenizer.encode(text)
    per_char, per_byte = bits_per_char_and_byte(10 * math.log(2), tokenizer, ids)  # 10 bits in all
    assert len(ids) == 11
    assert math.isclose(per_byte, 10 / 10) and math.isclose(per_char, 10 / 6)  # "д" is partly predicted
    # end-of-text tokens are predicted but stand for no text
    char = CharTokenizer("ab")
    char.eot_id = 2
    per_char, per_byte = bits_per_char_and_byte(3 * math.log(2), char, [0, 1, 2, 0])
    assert per_char == per_byte == 3 / 2
    # a byte model's bytes are its ids, UTF-8 or not: Latin-1 text, or a split that starts inside a character
    # (decoded, each bad byte would be U+FFFD, 3 bytes)
    for data in ("Café résumé ".encode("latin-1") * 5, "😀😀abc".encode()[1:]):
        ids = list(data)
        assert bits_per_char_and_byte((len(ids) - 1) * math.log(2), tokenizer, ids)[1] == 1.0  # 1 bit a byte


def run_eval_py(monkeypatch, *args: str) -> None:
    """eval.py as its entry script runs it (in-process: no interpreter start-up)."""
    monkeypatch.setattr(sys, "argv", ["eval.py", *args])
    runpy.run_path(str(REPO / "eval.py"), run_name="__main__")


def test_eval_py_prints_nats_per_token_and_bits_per_char_of_evaluate_tokens(char_run, monkeypatch, capsys, tmp_path):
    run, text = char_run
    run_eval_py(monkeypatch, "--ckpt", str(run), "--text", str(text), "--batch_size", "3")
    line = capsys.readouterr().out.strip()
    model, tokenizer = load_model(run)
    content = text.read_text(encoding="utf-8")
    nats, n = evaluate_tokens(model, tokenizer.encode(content))
    assert n == len(content) - 1
    # char-level: every character after the first is one predicted token
    assert line == (
        f"{text}: {n:,} tokens, {nats / n:.4f} nats/token, "
        f"{nats / math.log(2) / n:.4f} bits/char, {nats / math.log(2) / n:.4f} bits/byte"
    )  # ASCII
    assert 0 < nats / n < 2 * math.log(len(CHARS))  # a random model: about uniform over the vocabulary
    config = tmp_path / "eval.yaml"  # the same from a YAML file
    config.write_text(f"ckpt: {run / 'checkpoints' / 'best.ckpt'}\ntext: {text}\nbatch_size: 1\n", encoding="utf-8")
    eval_main(["--config", str(config)])
    assert capsys.readouterr().out.strip() == line


def test_eval_py_help_exits_0(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run_eval_py(monkeypatch, "--help")
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    for flag in ("--ckpt", "--text", "--batch_size", "--device", "--config", "--print_config"):
        assert flag in out, flag


def eval_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        eval_main(argv)
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    err = captured.err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("batch_size", ["-1", "0"])
def test_eval_py_batch_size_below_1_is_one_error_line(char_run, capsys, batch_size):
    run, text = char_run
    err = eval_error(capsys, ["--ckpt", str(run), "--text", str(text), "--batch_size", batch_size])
    assert f"--batch_size must be >= 1, got {batch_size}" in err


@pytest.mark.parametrize(
    "case,needle",
    [
        ("no_text_flag", "text"),
        ("missing_text", "text file not found"),
        ("not_utf8", "is not UTF-8 text"),
        ("unknown_chars", "2 character(s) outside the model's char vocabulary: '!', 'Z'"),
        ("one_char", "nothing to evaluate"),
        ("missing_ckpt", "checkpoint not found"),
        ("device", "device cuda:3: CUDA is not available here"),
        ("batch_size_type", "batch_size"),
    ],
)
def test_eval_py_bad_input_is_one_error_line(char_run, capsys, tmp_path, case, needle):
    run, text = char_run
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    (tmp_path / "shout.txt").write_text("Zap!\n", encoding="utf-8")
    (tmp_path / "one.txt").write_text("a", encoding="utf-8")
    argv = {
        "no_text_flag": ["--ckpt", str(run)],
        "missing_text": ["--ckpt", str(run), "--text", str(tmp_path / "nope.txt")],
        "not_utf8": ["--ckpt", str(run), "--text", str(tmp_path / "latin1.txt")],
        "unknown_chars": ["--ckpt", str(run), "--text", str(tmp_path / "shout.txt")],
        "one_char": ["--ckpt", str(run), "--text", str(tmp_path / "one.txt")],
        "missing_ckpt": ["--ckpt", str(tmp_path / "nope.ckpt"), "--text", str(text)],
        "device": ["--ckpt", str(run), "--text", str(text), "--device", "cuda:3"],
        "batch_size_type": ["--ckpt", str(run), "--text", str(text), "--batch_size", "lots"],
    }[case]
    if case == "device" and torch.cuda.device_count() > 3:
        pytest.skip("cuda:3 exists here")
    assert needle in eval_error(capsys, argv)


def test_train_reports_full_val_loss_and_eval_py_scores_a_text(tiny_run_args, corpus, data_root, tmp_path, capsys):
    trainer = main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=20))
    out = capsys.readouterr().out
    full = trainer.callback_metrics["full_val_loss"].item()
    assert f"full val loss {full:.4f} over all" in out
    # char-level on ASCII text: a predicted token is a character and a byte
    per_text = f"validation tokens, {full / math.log(2):.4f} bits/char, {full / math.log(2):.4f} bits/byte ("
    assert per_text in out
    text = tmp_path / "held_out.txt"
    text.write_text("the lazy dog sings while the quick cats sit on warm mats\n" * 20)
    eval_main(["--ckpt", str(tmp_path / "run"), "--text", str(text)])
    line = capsys.readouterr().out.strip()
    nats = float(line.split(" nats/token")[0].split(", ")[-1])
    bits = float(line.split(" bits/char")[0].split(", ")[-1])
    assert 0 < nats < math.log(trainer.lightning_module.config.vocab_size)
    assert math.isclose(bits, nats / math.log(2), rel_tol=0.01)  # char-level: one token per character


def test_bits_per_char_leave_out_the_start_token_a_tokenizer_json_puts_before_each_document():
    # a Llama-style tokenizer.json: its post-processor writes <s> before each text, which stands for no text; the
    # full val split holds one per document, and each counted as 3 characters made bits/char too low
    import tokenizers as t

    from minigpt.core.hf_tokenizer import HFTokenizer

    alphabet = sorted(t.pre_tokenizers.ByteLevel.alphabet())
    backend = t.Tokenizer(t.models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = t.decoders.ByteLevel()
    backend.add_special_tokens([t.AddedToken(s, special=True, normalized=False) for s in ("<s>", "</s>")])
    bos, eos = backend.token_to_id("<s>"), backend.token_to_id("</s>")
    backend.post_processor = t.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer = HFTokenizer(backend.to_str(), eos_id=eos)
    docs = ["hello", "big world"]
    ids = [i for doc in docs for i in tokenizer.encode(doc) + [eos]]
    assert ids.count(bos) == 2
    per_char, per_byte = bits_per_char_and_byte(13 * math.log(2), tokenizer, ids)  # 13 bits in all
    assert per_char == per_byte == 13 / len("hellobig world")  # the first <s> is not predicted; the rest is text


def test_bits_per_char_of_a_char_chat_models_export_count_its_newlines(tmp_path):
    """A char chat model's Hugging Face export is read back as a tokenizer.json whose start token, the newline, is
    special: decode_text left the newlines out, and eval.py on the export gave a higher bits/char than on its
    checkpoint (5.4960 against 5.2321 on 2,000 characters of Shakespeare with 96 newlines)."""
    from minigpt.core.chat_template import ChatTokenizer
    from minigpt.hf.tokenizer_files import load_hf_tokenizer, save_hf_tokenizer

    chat = ChatTokenizer.for_base(CharTokenizer("ab\n"), conversations=[[{"role": "user", "content": "1+1"}]])
    save_hf_tokenizer(chat, tmp_path)
    exported = load_hf_tokenizer(tmp_path, {})
    ids = exported.encode("ab\nba\n1+1\n")
    assert ids == chat.encode("ab\nba\n1+1\n") and exported.token(exported.bos_id) == "\n"
    per_char, per_byte = bits_per_char_and_byte(9 * math.log(2), exported, ids)  # 9 bits in all
    assert per_char == per_byte == 1.0  # 9 characters after the first
    assert exported.decode_text(exported.encode("<|im_start|>a\n<|im_end|>")) == "a\n"  # the markers stand for none
