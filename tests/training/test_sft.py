"""Chat fine-tuning end to end on tiny models: a char base grows its vocabulary, the loss is on the assistant's
tokens only, resume is checked against the template, and sample.py --chat talks to the result turn by turn."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from minigpt.cli.sample import main as sample_main
from minigpt.cli.train import main as train_main
from minigpt.core.chat_template import IM_END, ChatTokenizer
from minigpt.core.config import GPTConfig
from minigpt.core.errors import DataError, UserError
from minigpt.core.model import GPT
from minigpt.loading import load_model
from minigpt.training.sft import grow_vocabulary, load_chat_data, split_batch
from support import flags


def write_chats(path, n: int = 60, long: int = 0):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} + {a + 1}?"},
                {"role": "assistant", "content": str(2 * a + 1)},
            ]
        }
        for a in range(n)
    ]
    rows += [{"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y"}]}] * long
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_args(chats, data_root, out_dir, steps=10, **extra):
    args = {
        "data.source": chats,
        "data.format": "chat",
        "data.data_root": data_root,
        "out_dir": out_dir,
        "data.batch_size": 4,
        "data.val_batches": 2,
        "trainer.max_steps": steps,
        "trainer.val_check_interval": 5,
        "trainer.enable_progress_bar": False,
        "sample_tokens": 4,
        "checkpoint_every": 5,
        **extra,
    }
    return flags(args)


@pytest.mark.slow  # about 20 s: a base, a fine-tune, a resume, a chat
def test_a_char_base_learns_to_chat_and_resumes_and_talks(
    tmp_path, corpus, data_root, tiny_run_args, record_training_losses, monkeypatch
):
    train_main(tiny_run_args(corpus, data_root, tmp_path / "base", steps=5, model__block_size=64))
    base_model, base_tok = load_model(tmp_path / "base")
    chats = write_chats(tmp_path / "chats.jsonl")
    seen = record_training_losses(monkeypatch)
    sft = dict(init_from=tmp_path / "base")
    train_main(sft_args(chats, data_root, tmp_path / "sft", **sft))

    model, tok = load_model(tmp_path / "sft")
    assert isinstance(tok, ChatTokenizer) and tok.base.chars == base_tok.chars  # the base's ids kept
    assert set("0123456789+?") <= set(tok.added) and model.config.vocab_size == tok.vocab_size
    inputs, targets = split_batch(seen[0][0])
    for row_in, row_t in zip(inputs.tolist(), targets.tolist()):  # the loss reads the assistant's tokens only
        learned = tok.decode([t for t in row_t if t >= 0])
        assert learned.endswith(IM_END) and learned[: -len(IM_END)].isdigit()
        assert tok.decode(row_in).startswith("<|im_start|>user\nWhat is ")

    train_main(sft_args(chats, data_root, tmp_path / "sft", steps=15, resume="true", **sft))
    assert torch.load(tmp_path / "sft" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 15
    other = tmp_path / "other.jinja"
    other.write_text("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(UserError, match="already has a chat template.*remove data.chat_template") as e:
        train_main(
            sft_args(
                chats, data_root, tmp_path / "sft", steps=20, resume="true", **sft, **{"data.chat_template": other}
            )
        )
    assert "\n" not in str(e.value)

    out = io.StringIO()
    sample_main(
        ["--ckpt", str(tmp_path / "sft"), "--chat", "--temperature", "0", "--max_new_tokens", "6", "--system", "add"],
        stdout=out,
        stdin=io.StringIO("What is 1 + 2?\n\nWhat is 3 + 4?\n"),
    )
    assert len(out.getvalue().splitlines()) == 2  # one reply line per user line (the blank line is no turn)


def test_a_chat_run_from_scratch_resumes_only_with_its_template(tmp_path, data_root, capsys):
    chats = write_chats(tmp_path / "chats.jsonl", n=20)
    small = {
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 16,
        "model.block_size": 48,
        "data.tokenizer": "char",
    }
    train_main(sft_args(chats, data_root, tmp_path / "run", steps=4, **small))
    # its one validation conversation is one batch, whatever data.val_batches (2) asks for
    assert re.search(r"^estimated val loss [\d.]+ \(1 batch of 4\) after 4 steps", capsys.readouterr().out, re.M)
    other = tmp_path / "other.jinja"
    other.write_text("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(UserError, match="another chat template than this run's .data.chat_template.") as e:
        train_main(
            sft_args(
                chats, data_root, tmp_path / "run", steps=8, resume="true", **small, **{"data.chat_template": other}
            )
        )
    assert "\n" not in str(e.value)
    train_main(sft_args(chats, data_root, tmp_path / "run", steps=8, resume="true", **small))
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8


def test_a_chat_runs_flops_per_second_count_each_batch_at_its_own_length(
    tmp_path, data_root, record_training_losses, monkeypatch
):
    """A chat batch is padded to its longest row: the first batch's FLOPs, counted for every batch, put the logged
    FLOP/s (and MFU) of a run of short and long conversations off (23% high at its first logged step here)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from minigpt.core.model import attention_flops_per_token

    chats = tmp_path / "chats.jsonl"  # one conversation in four 47 characters longer
    questions = ["x" * (50 if i % 4 == 0 else 3) for i in range(40)]
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "y"}]} for q in questions]
    chats.write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = record_training_losses(monkeypatch)
    small = {
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 16,
        "model.block_size": 96,
        "data.tokenizer": "char",
    }
    trainer = train_main(
        sft_args(chats, data_root, tmp_path / "run", steps=12, **small, **{"trainer.log_every_n_steps": 4})
    )
    module = trainer.lightning_module
    flops = [  # each batch's: rows x targets, per token the weights' and attention's over its T
        (module.weight_flops_per_token + attention_flops_per_token(module.config, b.size(1) - 1)) * b[:, 1:].numel()
        for b, _ in seen
    ]
    assert len({b.size(1) for b, _ in seen}) > 1, "the batches' lengths differ"
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0}).Reload()
    rates = zip(*(events.Scalars(f"train/device/{rate}_per_sec") for rate in ("flops", "batches")))
    for flop_rate, batch_rate in rates:  # per batch: the mean over the batches since the previous logged step
        window = flops[flop_rate.step - 4 : flop_rate.step]
        assert flop_rate.value / batch_rate.value == pytest.approx(sum(window) / len(window), rel=1e-5)


def test_a_plain_run_resumed_as_a_chat_run_is_refused_naming_the_chat_template(tmp_path, data_root):
    """The tokenizers were named by their base's name alone: "another tokenizer (char -> char)"."""
    chats = write_chats(tmp_path / "chats.jsonl", n=20)
    text = tmp_path / "text.txt"
    text.write_text("".join(f"What is {a} + {a + 1}? {2 * a + 1}\n" for a in range(200)))
    small = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 16, "model.block_size": 48, "sample_tokens": 0}
    train_main(sft_args(text, data_root, tmp_path / "run", steps=2, **small, **{"data.format": "text"}))
    with pytest.raises(UserError, match=r"another tokenizer \(char -> char with a chat template\)"):
        train_main(sft_args(chats, data_root, tmp_path / "run", steps=4, resume="true", **small))


def test_conversations_longer_than_the_block_are_cut_or_skipped_and_counted(tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", n=10, long=3)
    data = load_chat_data(str(chats), "char", None, 0.2, 48, seed=0)
    assert data.counts["truncated"] == 3 and data.counts["skipped"] == 3  # the reply is past the cut: no target
    assert data.counts["train"] + data.counts["val"] == 10 and all(len(r) <= 49 for r in data.train + data.val)
    whole = load_chat_data(str(chats), "char", None, 0.2, 48, seed=0, train_on_prompt=True)
    assert whole.counts["skipped"] == 0 and all((r >= 0).all() for r in whole.train)


def test_an_empty_chat_file_is_said_to_be_empty(tmp_path):
    (tmp_path / "chats.jsonl").write_text("")
    with pytest.raises(DataError, match=r"chats\.jsonl holds no conversations; give a file with at least 2$"):
        load_chat_data(str(tmp_path / "chats.jsonl"), "char", None, 0.2, 48, seed=0)


def test_bad_chat_data_in_train_py_is_one_line(tmp_path, data_root):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}\n'
    )
    with pytest.raises(DataError, match=r"chats.jsonl line 2: message 1 has the unknown role 'bot'"):
        train_main(sft_args(chats, data_root, tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_new_rows_start_at_the_mean_embedding():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=10, tie_embeddings=False))
    state = grow_vocabulary(model.state_dict(), 13)
    for name in ("transformer.wte.weight", "lm_head.weight"):
        old = model.state_dict()[name]
        assert torch.equal(state[name][:10], old) and torch.allclose(state[name][10:], old.mean(0).expand(3, -1))


@pytest.mark.slow  # about 10 s: the demo (data/sft_addition_demo.py) at toy size
def test_the_sft_demo_runs_at_toy_size(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "data" / "sft_addition_demo.py"
    spec = importlib.util.spec_from_file_location("sft_demo", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    result = demo.main(
        ["--smoke", "--base", str(tmp_path / "base"), "--out", str(tmp_path / "sft"), "--data", str(tmp_path / "data")]
    )
    assert result["steps"] == 4 and result["test_conversations"] == 10 and 0 <= result["after"] <= 1


@pytest.mark.slow  # about 30 s: the post-training demo (data/posttrain_addition_demo.py) at toy size, twice
def test_the_posttraining_demo_runs_its_stages_at_toy_size_and_alone(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "data" / "posttrain_addition_demo.py"
    spec = importlib.util.spec_from_file_location("posttrain_demo", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    dirs = ["--base", str(tmp_path / "base"), "--work", str(tmp_path / "work"), "--data", str(tmp_path / "data")]
    result = demo.main(["--smoke", "--stages", "sft,dpo,grpo", *dirs])
    out = capsys.readouterr().out
    assert result["sft"]["steps"] == 4 and result["dpo"]["steps"] == 4 and result["test_questions"] == 10
    assert 0 <= result["sft"]["exact_match"] <= 1 and 0 <= result["dpo"]["exact_match"] <= 1
    pairs = [json.loads(line) for line in (tmp_path / "work" / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == result["dpo"]["pairs"] > 0 and all(p["chosen"] != p["rejected"] for p in pairs)
    held_out = {json.loads(line)["messages"][0]["content"] for line in (tmp_path / "data" / "test.jsonl").open()}
    assert not held_out & {p["prompt"] for p in pairs}, "a pair was made from a held-out question"
    assert result["grpo"]["steps"] == 4 and 0 <= result["grpo"]["exact_match"] <= 1
    prompts = {json.loads(line)["prompt"] for line in (tmp_path / "data" / "prompts.jsonl").open()}
    assert prompts and not held_out & prompts, "GRPO trains on a held-out question"
    assert f"grpo: {result['grpo']['exact_match']:.1%} exact match" in out
    assert json.loads((tmp_path / "work" / "posttrain_addition.json").read_text()) == result
    assert result["cpu_capability"] and f"sft: {result['sft']['exact_match']:.1%} exact match" in out

    # one stage alone, from the SFT run left behind: its row changes, the start's is kept
    again = demo.main(["--smoke", "--stages", "dpo", "--dpo_steps", "2", *dirs])
    assert again["dpo"]["steps"] == 2 and again["sft"] == result["sft"]
    with pytest.raises(SystemExit) as e:
        demo.main(["--smoke", "--stages", "dpo,ppo", *dirs])
    assert e.value.code == 2 and "--stages takes" in capsys.readouterr().err
