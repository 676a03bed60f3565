"""GRPO end to end on tiny models (train.py --data.format prompts): the built-in exact-match reward, the batched
sampler against generate() on every block and attention path, the clipped surrogate with a ratio away from 1
against TRL's documented formula, a run that logs its metrics, learns a reward and resumes exactly, LoRA with the
KL to the adapters-off start, and an end checkpoint that samples and exports as any other."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from minigpt.cli.export import main as export_main
from minigpt.cli.sample import main as sample_main
from minigpt.cli.train import main as train_main
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError
from minigpt.core.generation import generate
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer
from minigpt.loading import load_model
from minigpt.training.grpo import group_advantages, grpo_loss, token_logps
from minigpt.training.rewards import exact_match, final_answer, score
from minigpt.training.rollouts import completion_rows, sample_groups
from support import flags, hf_base, scalars, small_bpe

ROWS = [{"prompt": f"{a}+{a + 2}=", "answer": str(2 * a + 2)} for a in range(12)] + [
    {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+1="}], "answer": a + 1}
    for a in range(8)
]
# a reward a random model can climb: the share of digits in what it says
DIGITS = (
    "def digits(prompt, completion, answer):\n"
    "    return sum(c.isdigit() for c in completion) / max(1, len(completion))\n"
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    torch.manual_seed(0)
    base = GPT(GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=48, vocab_size=256))
    save_file(model_checkpoint(base, ByteTokenizer()), root / "base.ckpt")
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "rewards.py").write_text(DIGITS)
    return root


def grpo_args(root, out, steps=6, **extra):
    args = {
        "init_from": root / "base.ckpt",
        "data.format": "prompts",
        "data.source": root / "prompts.jsonl",
        "data.data_root": root / "data",
        "out_dir": root / out,
        "data.batch_size": 2,
        "data.val_batches": 2,
        "data.val_fraction": 0.2,
        "grpo.group_size": 4,
        "grpo.max_new_tokens": 8,
        "grpo.reward": f"{root / 'rewards.py'}:digits",
        "trainer.max_steps": steps,
        "trainer.val_check_interval": 3,
        "trainer.log_every_n_steps": 1,
        "trainer.enable_progress_bar": False,
        "sample_tokens": 0,
        "checkpoint_every": 3,
        "optim.warmup_steps": 0,
        "optim.learning_rate": 0.01,
        "optim.decay_steps": 8,
        "eval_full": False,
        **extra,
    }
    return flags(args)


def test_exact_match_reads_the_final_answer_numbers_as_numbers():
    assert final_answer("47 + 89 = 136") == "136" and final_answer("so 1,234.") == "1234"
    assert final_answer("no digits\n  Paris \n") == "Paris"
    assert exact_match(completion="136", answer="136") == 1.0
    assert exact_match(completion="It is 136.0", answer=" 136 ") == 1.0  # numbers as numbers
    assert exact_match(completion="135", answer="136") == 0.0
    assert exact_match(completion="the answer is 136, not 137", answer="136") == 0.0  # the last number counts
    assert exact_match(completion="Paris", answer="Paris") == 1.0 and exact_match(completion="", answer="1") == 0.0
    # a fraction is one number (its denominator was the final answer, so "3/4" could never score)
    assert final_answer("half of 3/2 is 3/4.") == "3/4" and exact_match(completion="so 3/4", answer="3/4") == 1.0
    assert exact_match(completion="6/8", answer="0.75") == 1.0 and exact_match(completion="it is 4", answer="3/4") == 0
    assert exact_match(completion="1/0", answer="1/0") == 1.0  # no number: compared as text


def test_advantages_and_the_clipped_surrogate_follow_trls_formula():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4)
    assert adv[4:].abs().max() == 0  # a group that agrees teaches nothing
    assert adv[0] == pytest.approx(0.75 / (0.5 + 1e-4))  # (1 - 0.25) / (unbiased std 0.5 + 1e-4)
    assert group_advantages(rewards, 4, scale=False)[0] == pytest.approx(0.75)

    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(8, 5, generator=g)
    old = logps + 0.4 * (torch.rand(8, 5, generator=g) - 0.5)  # ratios up to e^0.2: some clipped
    ref = logps + 0.3 * torch.randn(8, 5, generator=g)
    mask = (torch.rand(8, 5, generator=g) > 0.2).float()
    A = torch.randn(8, generator=g)
    loss, per_token, metrics = grpo_loss(logps, old, ref, A, mask, 0.1, 0.05)
    # TRL's documented formula, term by term
    ratio = (logps - old).exp()
    expected = -torch.minimum(ratio * A[:, None], ratio.clamp(0.9, 1.1) * A[:, None])
    expected += 0.05 * ((ref - logps).exp() - (ref - logps) - 1) * ratio
    torch.testing.assert_close(per_token, expected)
    torch.testing.assert_close(loss, (expected * mask).sum() / mask.sum())
    clipped = ((ratio < 0.9) & (A[:, None] < 0)) | ((ratio > 1.1) & (A[:, None] > 0))
    assert 0 < metrics["clip_ratio/region_mean"].item() == pytest.approx(((clipped * mask).sum() / mask.sum()).item())


@pytest.mark.parametrize(("arch", "attention"), [("gpt", "sdpa"), ("llama", "manual"), ("llama", "einops")])
def test_batched_sampling_is_generate_per_prompt(arch, attention):
    """Prompts of different lengths in one batch (greedy): each row's completion is generate()'s for its prompt."""
    torch.manual_seed(1)
    tokenizer = ChatTokenizer.for_base(ByteTokenizer())
    kv = dict(n_kv_head=2) if arch == "llama" else {}
    model = GPT(
        GPTConfig(arch=arch, attention=attention, n_layer=2, n_head=4, n_embd=32, block_size=40, vocab_size=259, **kv)
    ).eval()
    prompts = [tokenizer.encode_prompt([{"role": "user", "content": text}]) for text in ("1+1=", "12+30=?")]
    long_prompt = list(range(65, 65 + 36))  # 4 tokens of room: the context ends the completion
    completions = sample_groups(model, prompts + [long_prompt], 2, 10, 0.0, tokenizer.eot_id)
    assert len(completions) == 6 and [len(c) for c in completions[4:]] == [4, 4]
    for r, completion in enumerate(completions):
        prompt = (prompts + [long_prompt])[r // 2]
        alone = generate(model, torch.tensor([prompt]), min(10, 40 - len(prompt)), temperature=0.0)
        ids = alone[0, len(prompt) :].tolist()
        cut = ids.index(tokenizer.eot_id) + 1 if tokenizer.eot_id in ids else len(ids)
        assert completion == ids[:cut]


BASES = {
    "char": lambda: CharTokenizer("abcdefghijklmnopqrstuvwxyz0123456789 +=?\n"),
    "byte": ByteTokenizer,
    "tiktoken": lambda: TiktokenTokenizer(small_bpe()),
    "hf": lambda: hf_base(with_markers=False),
}


@pytest.mark.parametrize("value", [1e39, -1e39, 10**400])
def test_a_reward_past_float32s_range_is_refused_in_one_line(value):
    """1e39 is finite in Python but inf in the float32 rewards (the loss became NaN, blamed on the learning rate);
    10**400 made float() raise OverflowError, a traceback."""
    with pytest.raises(UserError, match=r"^the reward function returned .* for the prompt of row 1 .* not a finite"):
        score(lambda prompt, completion, answer: value, ["1+2?"], ["3"], ["3"], ["row 1"])
    assert score(lambda prompt, completion, answer: 3.0e38, ["1+2?"], ["3"], ["3"], ["row 1"]).isfinite().all()


def test_a_reward_that_calls_sys_exit_is_one_line_and_a_one_number_tensor_is_a_reward():
    """sys.exit() in a reward ended training with its exit code and no word; torch.tensor(1.0) was "not a finite
    number"."""

    def leaves(prompt, completion, answer):
        raise SystemExit(3)

    with pytest.raises(UserError, match=r"^the reward function failed on the prompt of row 1 .* with SystemExit: 3"):
        score(leaves, ["1+2?"], ["3"], ["3"], ["row 1"])
    rewards = score(lambda prompt, completion, answer: torch.tensor(0.5), ["1+2?"], ["3"], ["3"], ["row 1"])
    assert rewards.tolist() == [0.5]
    with pytest.raises(UserError, match="not a finite number"):
        score(lambda prompt, completion, answer: torch.ones(2), ["1+2?"], ["3"], ["3"], ["row 1"])


@pytest.mark.parametrize("value", [np.True_, np.float32(0.5), np.int64(1), np.where(True, 1.0, 0.0)])
def test_a_numpy_scalar_is_a_reward_its_bool_as_1_or_0(value):
    """np.isclose(...) and a comparison of numpy numbers return np.True_, which is no numbers.Real, and
    np.where(...) on numbers a 0-d array: a reward returning one stopped the run with "the reward function returned
    np.True_ ..., not a finite number"."""
    assert score(lambda prompt, completion, answer: value, ["1+2?"], ["3"], ["3"], ["row 1"]).tolist() == [float(value)]
    with pytest.raises(UserError, match="returned '1' .* not a finite"):  # numpy's text is still text
        score(lambda prompt, completion, answer: np.str_("1"), ["1+2?"], ["3"], ["3"], ["row 1"])


@pytest.mark.parametrize("kind", list(BASES))
def test_a_rollout_and_its_loss_on_every_tokenizer_kind(kind):
    """Prompt ids from the chat template, completions that stop at its end-of-turn token, texts the reward reads,
    rows whose targets are the completions, a loss with a gradient: on each tokenizer kind a model may have."""
    torch.manual_seed(2)
    chat = ChatTokenizer.for_base(BASES[kind](), None, [[{"role": "user", "content": "what is 1+2?"}]])
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=48, vocab_size=chat.vocab_size))
    messages = [{"role": "user", "content": "what is 1+2?"}]
    prompt = chat.encode_chat(messages, add_generation_prompt=True)[0]
    assert chat.decode(prompt).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        model.lm_head.weight[chat.eot_id] += 0.5  # some completions stop early
    completions = sample_groups(model.eval(), [prompt], 4, 6, 1.0, chat.eot_id, torch.Generator().manual_seed(0))
    assert all(len(c) == 6 or (c[-1] == chat.eot_id and chat.eot_id not in c[:-1]) for c in completions)
    texts = [chat.decode_text(c) for c in completions]  # as the run's rewards read them
    start = chat.token_id("<|im_start|>")  # a marker the model wrote is no text, as TRL's skip_special_tokens
    assert chat.decode_text([*prompt[-2:], start, chat.eot_id]) == chat.decode(prompt[-2:])
    assert score(exact_match, [messages] * 4, texts, ["3"] * 4, ["row 1"] * 4).shape == (4,)
    rows = completion_rows([prompt], completions, 4)
    assert chat.decode([~t for t in rows[0, : len(prompt)].tolist()]) == chat.decode(prompt)
    logps, mask = token_logps(model.train(), rows, 1.0)
    assert mask.sum(1).tolist() == [len(c) for c in completions]
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.5]), 4)
    loss = grpo_loss(logps, logps.detach(), None, advantages, mask, 0.2, 0.0)[0]
    loss.backward()
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_grpo_logs_its_metrics_learns_the_reward_and_resumes_as_if_uninterrupted(setup):
    train_main(grpo_args(setup, "full", steps=8, **{"grpo.beta": 0.05}))
    logged = scalars(setup / "full")
    for name in ("reward", "reward_std", "completions/mean_length", "clip_ratio/region_mean", "kl", "train_loss"):
        assert len(logged[name]) == 8, name
    for name in ("val_pass@1", "val_pass@G", "val_reward", "val_loss"):
        assert len(logged[name]) >= 2, name
    assert logged["kl"][0] == 0.0 and logged["kl"][-1] > 0  # the policy leaves the start
    assert sum(logged["reward"][-3:]) > sum(logged["reward"][:3])  # it learns what the reward asks for
    ckpt = torch.load(setup / "full" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["minigpt"]["grpo"]["fingerprint"] and not any("reference" in k for k in ckpt["state_dict"])

    train_main(grpo_args(setup, "resumed", steps=4, **{"grpo.beta": 0.05}))
    train_main(grpo_args(setup, "resumed", steps=8, resume="true", **{"grpo.beta": 0.05}))
    whole = ckpt["state_dict"]
    resumed = torch.load(setup / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert whole.keys() == resumed.keys()
    for k in whole:  # the same completions were sampled after the resume: the same weights
        torch.testing.assert_close(resumed[k], whole[k], atol=1e-6, rtol=0)
    assert scalars(setup / "resumed")["reward"] == pytest.approx(logged["reward"], abs=1e-6)

    with pytest.raises(UserError, match="is a GRPO run; resume it with --data.format prompts"):
        train_main(grpo_args(setup, "resumed", steps=9, resume="true", **{"data.format": "chat"}))
    with pytest.raises(UserError, match="is a GRPO run; resume it with --data.format prompts"):
        train_main(grpo_args(setup, "resumed", steps=9, resume="true", **{"data.format": "preference"}))
    torch.manual_seed(1)  # another model of the same shape: the frozen copy it would rebuild is not the start
    other = GPT(GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=48, vocab_size=256))
    save_file(model_checkpoint(other, ByteTokenizer()), setup / "other.ckpt")
    with pytest.raises(UserError, match="not the model this GRPO run started from"):
        train_main(
            grpo_args(setup, "resumed", steps=9, resume="true", init_from=setup / "other.ckpt", **{"grpo.beta": 0.05})
        )
    assert torch.load(setup / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8
    # a part without the KL (grpo.beta 0) keeps the start the run recorded, so the KL can come back
    train_main(grpo_args(setup, "resumed", steps=9, resume="true", **{"grpo.beta": 0.0}))
    train_main(grpo_args(setup, "resumed", steps=10, resume="true", **{"grpo.beta": 0.05}))
    assert torch.load(setup / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 10


def test_a_run_started_without_a_kl_is_not_resumed_with_one(setup):
    """Started with grpo.beta 0, a run records no reference: resumed with a KL it took init_from as it is now as
    its start, unchecked (a KL to another model, without a word)."""
    train_main(grpo_args(setup, "no_kl", steps=2, **{"grpo.beta": 0.0}))
    with pytest.raises(UserError, match=r"started without a reference \(grpo.beta 0\).*resume it with --grpo.beta 0"):
        train_main(grpo_args(setup, "no_kl", steps=4, resume="true", **{"grpo.beta": 0.05}))
    assert torch.load(setup / "no_kl" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_lora_grpo_in_bf16_autocast_with_the_adapters_off_as_reference_ends_in_a_usable_checkpoint(
    setup, tmp_path, capsys
):
    """LoRA, the KL to the adapters-off start, in bf16-mixed (a GPU's precision; here CPU autocast: sampling under
    autocast with a bf16 KV cache), ending in a checkpoint every command takes."""
    extra = {"grpo.beta": 0.1, "lora.rank": 4, "trainer.precision": "bf16-mixed"}
    train_main(grpo_args(setup, "lora", steps=4, finetune="lora", eval_full="true", **extra))
    assert "validation prompts, pass@1 " in capsys.readouterr().out
    logged = scalars(setup / "lora")
    assert logged["kl"][-1] > 0 and len(logged["val_pass@G"]) >= 1
    model, tokenizer = load_model(setup / "lora")  # merged on load, as any LoRA run
    assert isinstance(tokenizer, ChatTokenizer) and model.config.vocab_size == tokenizer.vocab_size
    sample_main(["--ckpt", str(setup / "lora"), "--prompt", "1+2=", "--max_new_tokens", "4", "--num_samples", "1"])
    export_main(["--ckpt", str(setup / "lora"), "--format", "peft", "--out", str(tmp_path / "adapter")])
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    export_main(["--ckpt", str(setup / "lora"), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize("last", ["assistant", "system"])
def test_a_prompt_row_must_end_with_the_users_turn(last):
    """A prompt of only a system turn was accepted (docs/grpo.md: a list of messages must end with the user's turn)."""
    from minigpt.data.prompts import to_prompt_row

    row = {"prompt": [{"role": "user", "content": "1+2?"}, {"role": last, "content": "x"}], "answer": "3"}
    with pytest.raises(UserError, match=rf"^prompts.jsonl line 2: the prompt ends with an? {last} turn; end it"):
        to_prompt_row(row, "prompts.jsonl line 2")
    assert to_prompt_row({"prompt": row["prompt"][:1], "answer": "3"}, "prompts.jsonl line 2").answer == "3"


@pytest.mark.parametrize("answer", ["", "  "])
def test_a_blank_answer_is_refused_as_exact_match_would_reward_an_empty_reply(answer):
    from minigpt.data.prompts import to_prompt_row

    with pytest.raises(UserError, match=r'^prompts.jsonl line 3: "answer" is empty; give the answer the reward checks'):
        to_prompt_row({"prompt": "1+2?", "answer": answer}, "prompts.jsonl line 3")
