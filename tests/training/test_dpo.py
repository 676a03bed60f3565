"""DPO end to end on tiny models (train.py --data.format preference): both of TRL's layouts rendered with the chat
template, the answer's tokens the only targets; the reference is the start (LoRA: adapters off, grown rows
included; full: a frozen copy; precomputed: the same numbers); TRL's metrics in TensorBoard; a resumed run is the
uninterrupted one; the end checkpoint samples and exports as any other."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from minigpt.cli.errors import run_cli
from minigpt.cli.export import main as export_main
from minigpt.cli.sample import main as sample_main
from minigpt.cli.train import main as train_main
from minigpt.core.chat_template import IM_END, ChatTokenizer
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError
from minigpt.core.lora import LoRAConfig, adapters_disabled, lora_model
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.data.preferences import read_preferences
from minigpt.loading import load_model
from minigpt.training.dpo import METRICS, encode_pair, reference_pairs_problem
from support import flags, scalars

STANDARD = [{"prompt": f"{a}+{a + 1}=", "chosen": str(2 * a + 1), "rejected": str(2 * a)} for a in range(24)]
CONVERSATIONAL = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{a}*2="}],
        "chosen": [{"role": "assistant", "content": str(2 * a)}],
        "rejected": [{"role": "assistant", "content": f"{a}?"}],
    }
    for a in range(1, 17)
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A byte-level llama base checkpoint and a preference file mixing both layouts."""
    root = tmp_path_factory.mktemp("dpo")
    torch.manual_seed(0)
    base = GPT(GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=64, vocab_size=256))
    save_file(model_checkpoint(base, ByteTokenizer()), root / "base.ckpt")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in STANDARD + CONVERSATIONAL))
    return root


def dpo_args(root, out, steps=6, **extra):
    args = {
        "init_from": root / "base.ckpt",
        "data.format": "preference",
        "data.source": root / "pairs.jsonl",
        "data.data_root": root / "data",
        "out_dir": root / out,
        "data.batch_size": 4,
        "data.val_batches": 2,
        "trainer.max_steps": steps,
        "trainer.val_check_interval": 3,
        "trainer.log_every_n_steps": 1,
        "trainer.enable_progress_bar": False,
        "sample_tokens": 0,
        "checkpoint_every": 3,
        "optim.warmup_steps": 0,
        "optim.learning_rate": 0.01,
        "optim.decay_steps": 8,  # the same schedule whether a run stops at step 4 or 8
        "eval_full": False,
        **extra,
    }
    return flags(args)


def test_both_layouts_render_with_the_chat_template_and_only_the_answer_is_a_target(setup):
    pairs = read_preferences(str(setup / "pairs.jsonl"))
    assert pairs[0].prompt == [{"role": "user", "content": "0+1="}] and pairs[0].chosen[0]["role"] == "assistant"
    chat = ChatTokenizer.for_base(ByteTokenizer())
    for pair, row in ((pairs[0], STANDARD[0]), (pairs[-1], CONVERSATIONAL[-1])):
        (chosen, rejected), n = encode_pair(chat, pair)
        prompt_text = chat.decode([~t for t in chosen[:n]])
        assert prompt_text.endswith("<|im_start|>assistant\n")
        assert (chosen[:n] < 0).all() and (chosen[n:] >= 0).all() and (rejected[n:] >= 0).all()
        answer = row["chosen"] if isinstance(row["chosen"], str) else row["chosen"][0]["content"]
        assert chat.decode(chosen[n:].tolist()).startswith(answer + IM_END)
        assert chat.decode([~t if t < 0 else t for t in rejected.tolist()]).startswith(prompt_text)


def test_lora_reference_is_the_start_with_adapters_and_new_rows_off():
    torch.manual_seed(0)
    base = GPT(GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=24, vocab_size=50))
    run = GPTConfig.from_dict({**base.config.to_dict(), "vocab_size": 53})  # three chat tokens added
    start = lora_model(base, run, LoRAConfig(rank=4))
    idx = torch.randint(0, 53, (2, 20))
    with torch.no_grad():
        before = start(idx)[0]
        for p in start.parameters():
            if p.requires_grad:  # "trained": adapters and the new rows moved
                p.add_(0.2 * torch.randn_like(p))
        moved = start(idx)[0]
        with adapters_disabled(start):
            off = start(idx)[0]
        again = start(idx)[0]
    assert (moved - before).abs().max() > 1e-2
    torch.testing.assert_close(off, before, atol=1e-6, rtol=0)
    torch.testing.assert_close(again, moved)  # switched back on


def test_full_dpo_logs_trls_metrics_learns_and_resumes_as_if_uninterrupted(setup):
    train_main(dpo_args(setup, "full", steps=8))
    logged = scalars(setup / "full")
    for name in METRICS:
        assert len(logged[name]) == 8 and len(logged[f"val_{name}"]) >= 2
    assert logged["rewards/chosen"][0] == 0.0 and logged["train_loss"][0] == pytest.approx(0.693147, abs=1e-5)
    assert logged["rewards/margins"][-1] > 0 and logged["train_loss"][-1] < 0.69  # it prefers the chosen answers

    train_main(dpo_args(setup, "resumed", steps=4))
    train_main(dpo_args(setup, "resumed", steps=8, resume="true"))
    whole = torch.load(setup / "full" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    resumed = torch.load(setup / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert whole.keys() == resumed.keys()  # the frozen copy is in neither: init_from rebuilds it
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], atol=1e-6, rtol=0)

    with pytest.raises(UserError, match="dpo.reference model; resume with --dpo.reference model"):
        train_main(dpo_args(setup, "resumed", steps=9, resume="true", **{"dpo.reference": "precomputed"}))
    with pytest.raises(UserError, match="is a DPO run; resume it with --data.format preference"):
        train_main(dpo_args(setup, "resumed", steps=9, resume="true", **{"data.format": "chat"}))
    torch.manual_seed(1)  # another model of the same shape: the frozen copy it would rebuild is not the start
    other = GPT(GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=64, vocab_size=256))
    save_file(model_checkpoint(other, ByteTokenizer()), setup / "other.ckpt")
    with pytest.raises(UserError, match="not the model this DPO run started from"):
        train_main(dpo_args(setup, "resumed", steps=9, resume="true", init_from=setup / "other.ckpt"))
    assert torch.load(setup / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8


def test_resume_with_init_from_of_another_shape_is_one_line_and_leaves_the_run(setup, capsys):
    """The frozen copy a resumed run rebuilds from init_from: a source of another architecture is refused in one
    line naming init_from (it was a load_state_dict traceback), the run's checkpoints untouched."""
    train_main(dpo_args(setup, "reshaped", steps=2))
    other = GPT(GPTConfig(arch="gpt", n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=256))
    save_file(model_checkpoint(other, ByteTokenizer()), setup / "gpt.ckpt")
    last = setup / "reshaped" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: train_main(dpo_args(setup, "reshaped", steps=4, resume="true", init_from=setup / "gpt.ckpt")))
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"error: init_from {setup / 'gpt.ckpt'} is not the model this run started from")
    assert last.read_bytes() == before


def test_precomputed_reference_trains_as_the_frozen_copy_and_survives_resume(setup):
    train_main(dpo_args(setup, "pre", steps=4, **{"dpo.reference": "precomputed"}))
    train_main(dpo_args(setup, "pre", steps=8, resume="true", **{"dpo.reference": "precomputed"}))
    ckpt = torch.load(setup / "pre" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["minigpt"]["dpo"]["ref_logps"].shape == (len(STANDARD) + len(CONVERSATIONAL), 2)
    if not (setup / "full").is_dir():
        train_main(dpo_args(setup, "full", steps=8))
    whole = torch.load(setup / "full" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for k in whole:  # (Adam divides by a gradient's own size: a last-digit difference in a tiny one shows)
        torch.testing.assert_close(ckpt["state_dict"][k], whole[k], atol=1e-4, rtol=0)
    for name in ("train_loss", "rewards/margins"):  # the same training, step by step
        assert scalars(setup / "pre")[name] == pytest.approx(scalars(setup / "full")[name], abs=1e-5)


def checkpoint_bytes(run) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted((run / "checkpoints").iterdir())}


@pytest.mark.parametrize(
    "change, words",
    [
        ("fewer", ["log-probs of 40 pairs", "this run has 20 pairs"]),  # silently trained on other pairs' log-probs
        ("more", ["log-probs of 40 pairs", "this run has 44 pairs"]),  # was an IndexError traceback mid-training
        ("edited", ["log-probs of 40 pairs", "this run has 40 other pairs (fingerprint "]),  # one answer changed
        ("split", ["log-probs of 40 pairs", "this run has 40 other pairs (fingerprint "]),  # another train/val split
    ],
)
def test_precomputed_resume_with_changed_pairs_is_one_line_and_leaves_the_run(setup, change, words, capsys):
    """The table is indexed by pair position: a resume whose pairs are not the ones it was computed for (the
    file, its order, the split) is refused where the table is restored, before a step, with one error line."""
    run = setup / f"pre_{change}"
    train_main(dpo_args(setup, run.name, steps=3, **{"dpo.reference": "precomputed"}))
    rows = STANDARD + CONVERSATIONAL
    changed = {
        "fewer": rows[:20],
        "more": rows + [{"prompt": f"{a}-1=", "chosen": str(a - 1), "rejected": str(a)} for a in range(4)],
        "edited": [*rows[:5], {**rows[5], "chosen": "eleven"}, *rows[6:]],
    }
    if change in changed:
        (setup / f"{change}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed[change]))
        extra = {"data.source": setup / f"{change}.jsonl"}
    else:  # the same file split otherwise: the table's positions are other pairs
        extra = {"data.val_fraction": 0.3}
    before, config = checkpoint_bytes(run), (run / "config.yaml").read_text()
    capsys.readouterr()
    resume = dpo_args(setup, run.name, steps=6, resume="true", **{"dpo.reference": "precomputed"}, **extra)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: train_main(resume))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 2 and "Traceback" not in err and len(errors) == 1, err
    for w in [f"{run}/checkpoints/last.ckpt holds the precomputed reference", *words, "start a new run"]:
        assert w in errors[0], (w, errors[0])
    assert checkpoint_bytes(run) == before
    assert (run / "config.yaml").read_text() == config  # the run's record keeps the data it was trained on
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["minigpt"]["dpo"]["pairs"]
    assert saved["pairs"] == len(rows) and len(saved["sha256"]) == 64  # the table's pairs: count and token hash


def test_lora_dpo_ends_in_a_checkpoint_that_samples_and_exports(setup, tmp_path, capsys):
    train_main(dpo_args(setup, "lora", steps=6, finetune="lora", **{"lora.rank": 4}))
    logged = scalars(setup / "lora")
    assert logged["rewards/margins"][-1] != 0.0
    model, tokenizer = load_model(setup / "lora")  # merged on load, as any LoRA run
    assert isinstance(tokenizer, ChatTokenizer) and model.config.vocab_size == tokenizer.vocab_size
    sample_main(["--ckpt", str(setup / "lora"), "--prompt", "1+2=", "--max_new_tokens", "4", "--num_samples", "1"])
    export_main(["--ckpt", str(setup / "lora"), "--format", "peft", "--out", str(tmp_path / "adapter")])
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_a_table_saved_without_its_pairs_fingerprint_is_checked_by_its_count():
    """Checkpoints written before the fingerprint was kept: the table's length still has to be the pairs' count."""
    found = {"pairs": 40, "sha256": "0" * 64}
    assert reference_pairs_problem(None, 40, found, "old/last.ckpt") is None
    assert "log-probs of 24 pairs, and this run has 40 pairs" in reference_pairs_problem(
        None, 24, found, "old/last.ckpt"
    )
    assert reference_pairs_problem({"pairs": 40, "sha256": "0" * 64}, 40, found, "run/last.ckpt") is None
    assert "40 other pairs" in reference_pairs_problem({"pairs": 40, "sha256": "1" * 64}, 40, found, "run/last.ckpt")


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_dropout_is_off_as_trls_default_so_step_0_is_log_2(setup, finetune):
    """A source trained with dropout (or --lora.dropout) would make the policy's log-probs noisy against the
    reference's (eval mode): TRL's DPOTrainer disables dropout by default, and so does minigpt's DPO."""
    extra = {"model.dropout": 0.3, "finetune": finetune} | ({"lora.dropout": 0.3} if finetune == "lora" else {})
    train_main(dpo_args(setup, f"dropout-{finetune}", steps=1, **extra))
    logged = scalars(setup / f"dropout-{finetune}")
    assert logged["train_loss"][0] == pytest.approx(0.693147, abs=1e-6)
    assert logged["rewards/chosen"][0] == 0.0 and logged["rewards/rejected"][0] == 0.0


def test_a_validation_between_a_steps_micro_batches_logs_only_validations_metrics(setup):
    """val_check_interval counts batches: with accumulate_grad_batches 2 and an interval of 3 the first validation
    runs after the first micro-batch of step 2.  Its val_rewards/* are the validation pair's alone (not averaged
    with that training micro-batch's), so with one validation pair val_loss is -logsigmoid(val_rewards/margins)."""
    extra = {"trainer.accumulate_grad_batches": 2, "data.val_fraction": 0.02}  # 40 pairs: 1 for validation
    train_main(dpo_args(setup, "accumulated", steps=2, **extra))
    logged = scalars(setup / "accumulated")
    assert len(logged["val_loss"]) == 2 and logged["rewards/margins"][-1] != 0  # the mid-step one and the end's
    for loss, margin in zip(logged["val_loss"], logged["val_rewards/margins"]):
        assert loss == pytest.approx(torch.nn.functional.softplus(torch.tensor(-margin)).item(), abs=1e-6)
