"""data/make_preference_pairs.py: DPO pairs from a chat model's own answers, the right answer chosen and the model's
own wrong one rejected; its batched decoding gives the replies sample.py --chat gives."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.core.chat import chat
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.data.preferences import read_preferences

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "data" / "make_preference_pairs.py"


def script():
    spec = importlib.util.spec_from_file_location("make_preference_pairs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model():
    """A random byte-level chat model: its replies are arbitrary, which is all the pairs need."""
    torch.manual_seed(0)
    tokenizer = ChatTokenizer.for_base(ByteTokenizer())
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=96, vocab_size=tokenizer.vocab_size)
    return GPT(config).eval(), tokenizer


# prompts of several lengths (batched by length) and a conversation of more than one turn
PROMPTS = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(1, 2), (30, 4), (5, 60), (70, 80)]]
PROMPTS += [[{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 9 + 9?"}]]
PROMPTS += [[{"role": "user", "content": f"What is {a} + 7?"}] for a in (11, 22, 33)]


def test_greedy_answers_are_the_replies_sample_py_chat_gives(model):
    model, tokenizer = model
    batched = script().own_answers(model, tokenizer, PROMPTS, max_new_tokens=6, batch_size=2)
    assert batched == [[chat(model, tokenizer, p, max_new_tokens=6)] for p in PROMPTS]


def test_pairs_are_the_right_answer_against_the_models_own_wrong_ones(model):
    model, tokenizer = model
    replies = [chat(model, tokenizer, p, max_new_tokens=6) for p in PROMPTS]
    # the odd questions' expected answer is the model's own reply: answered right, so they give no pair
    questions = [(p, r if i % 2 else f"{i}0") for i, (p, r) in enumerate(zip(PROMPTS, replies))]
    pairs, counts = script().make_pairs(model, tokenizer, questions, max_new_tokens=6)
    assert counts == {"questions": 8, "greedy_right": 4, "pairs": 4}
    expected = [
        {"prompt": p[0]["content"], "chosen": a, "rejected": r}
        for i, ((p, a), r) in enumerate(zip(questions, replies))
        if i % 2 == 0 and len(p) == 1
    ]
    assert [x for x in pairs if isinstance(x["prompt"], str)] == expected
    (conversational,) = [x for x in pairs if isinstance(x["prompt"], list)]  # the system + user question
    assert conversational == {
        "prompt": PROMPTS[4],
        "chosen": [{"role": "assistant", "content": "40"}],
        "rejected": [{"role": "assistant", "content": replies[4]}],
    }


def test_sampled_answers_add_distinct_wrong_ones_after_the_greedy_one(model):
    model, tokenizer = model
    pairs_script = script()
    questions = [(p, "no such reply") for p in PROMPTS[:4]]
    make = dict(samples=3, temperature=1.0, pairs_per_question=4, max_new_tokens=6, seed=1)
    pairs, counts = pairs_script.make_pairs(model, tokenizer, questions, **make)
    assert pairs == pairs_script.make_pairs(model, tokenizer, questions, **make)[0]  # seeded: the same pairs
    assert counts["greedy_right"] == 0 and len(pairs) > len(questions)  # sampling found more wrong answers
    for prompt, _ in questions:
        rejected = [x["rejected"] for x in pairs if x["prompt"] == prompt[0]["content"]]
        assert rejected[0] == chat(model, tokenizer, prompt, max_new_tokens=6)  # the greedy one first
        assert len(set(rejected)) == len(rejected) <= 4


def test_answers_match_as_numbers():
    same = script().same_answer
    assert same(" 136", "136") and same("136.0", "136") and same("1e2", "100")
    assert not same("13", "136") and not same("1 36", "136") and not same("", "0")


def test_the_cli_writes_pairs_that_train_py_reads(model, tmp_path):
    model, tokenizer = model
    save_file(model_checkpoint(model, tokenizer), tmp_path / "chat.ckpt")
    rows = [{"messages": [*p, {"role": "assistant", "content": "12345"}]} for p in PROMPTS[:3]]
    rows.append({"prompt": "What is 2 + 2?", "answer": "4"})  # the prompts layout too
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "pairs" / "p.jsonl"  # the folder does not exist yet
    args = ["--ckpt", tmp_path / "chat.ckpt", "--source", tmp_path / "q.jsonl", "--out", out, "--max_new_tokens", "4"]
    done = subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "wrote 4 pairs" in done.stdout and "--data.format preference" in done.stdout
    pairs = read_preferences(str(out))  # DPO's own reader takes them
    assert [p.chosen[0]["content"] for p in pairs] == ["12345"] * 3 + ["4"]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "What is 2 + 2?"}, 'a question needs {"messages"'),
        ({"messages": [{"role": "user", "content": "hi"}]}, 'a question needs {"messages"'),
        ({"prompt": [{"role": "assistant", "content": "4"}], "answer": "4"}, "must end with a user turn"),
        ({"prompt": 4, "answer": "4"}, '"prompt" must be text or a list of messages'),
    ],
)
def test_a_bad_question_is_one_line_and_nothing_is_written(row, message, model, tmp_path):
    model, tokenizer = model
    save_file(model_checkpoint(model, tokenizer), tmp_path / "chat.ckpt")
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n" + json.dumps(row))
    (tmp_path / "p.jsonl").write_text("kept\n")
    args = ["--ckpt", tmp_path / "chat.ckpt", "--source", tmp_path / "q.jsonl", "--out", tmp_path / "p.jsonl"]
    done = subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "q.jsonl line 2" in done.stderr and message in done.stderr
    assert (tmp_path / "p.jsonl").read_text() == "kept\n"


def test_a_model_without_a_chat_template_is_refused_in_one_line(tmp_path):
    base = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=256))
    save_file(model_checkpoint(base, ByteTokenizer()), tmp_path / "base.ckpt")
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    args = ["--ckpt", tmp_path / "base.ckpt", "--source", tmp_path / "q.jsonl", "--out", tmp_path / "p.jsonl"]
    done = subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "has no chat template" in done.stderr
    assert not (tmp_path / "p.jsonl").exists()
