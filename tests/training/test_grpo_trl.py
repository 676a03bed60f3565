"""GRPO equals TRL's: on a fixed batch (prompts, completions, rewards) and the Hugging Face export of the same
models, TRL's GRPOTrainer (trl 1.16: its default loss_type "dapo", its advantages, its k3 KL to a reference it
loads itself) gives minigpt's advantages, loss, KL and clip metrics, and the same gradients of one step, for
beta 0 and beta > 0.  TRL is fed the fixed completions through its public rollout_func (what a custom generator
hands it) and a reward function returning the fixed rewards; everything else is TRL's own code path
(training_step -> _generate_and_score_completions -> compute_loss -> backward).  Offline: tiny random models."""

from __future__ import annotations

import copy

import pytest
import safetensors.torch
import torch

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.config import GPTConfig
from minigpt.core.lora import LoRAConfig, adapters_disabled, lora_model
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.hf import export_hf, hf_tensors
from minigpt.export.peft import export_peft, peft_tensors
from minigpt.training.grpo import group_advantages, grpo_loss, token_logps
from minigpt.training.rollouts import completion_rows

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

G = 4
TEMPERATURE = 0.7
# prompts of the same token length (TRL left-pads prompts; GPT-2's learned positions would see the padding)
ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
    for a, b in ((12, 30), (47, 89))
]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5, 1.0])  # groups of G, neither uniform


def fixed_batch(tokenizer: ChatTokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts' ids and G completions each: some end with the end-of-turn token, some are cut (no end)."""
    prompts = [tokenizer.encode_chat(r["prompt"], add_generation_prompt=True)[0] for r in ROWS]
    g = torch.Generator().manual_seed(3)
    completions = []
    for r in range(len(ROWS) * G):
        n = 2 + r % 5
        ids = torch.randint(40, 120, (n,), generator=g).tolist()
        completions.append(ids + [tokenizer.eot_id] if r % 3 else ids)
    return prompts, completions


def grads_of(model: torch.nn.Module) -> torch.nn.Module:
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), copied.parameters()):
            if p.requires_grad:
                q.data = p.grad.clone()
    return copied


def trl_step(policy, tokenizer_dir, tmp_path, prompts, completions, beta, scale, state=None, peft_config=None):
    """TRL's training_step on the fixed batch: (loss, its logged metrics, its advantages, its tokenizer, the model
    it trained).  state: the policy's weights, loaded once the trainer has made its reference (a full run's: loaded
    from the policy's path; with peft_config: the fresh adapter switched off); with peft_config, the adapter's."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)

    def rollout(batch_prompts, trainer):  # the fixed completions, in TRL's order (each prompt G times)
        assert len(batch_prompts) == len(completions)
        return {
            "prompt_ids": [prompts[r // G] for r in range(len(completions))],
            "completion_ids": completions,
            "logprobs": [[0.0] * len(c) for c in completions],
        }

    def reward(prompts, completions, **kwargs):
        return REWARDS.tolist()

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        num_generations=G,
        per_device_train_batch_size=len(completions),
        max_completion_length=16,
        temperature=TEMPERATURE,
        beta=beta,
        epsilon=0.2,
        scale_rewards=scale,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
    )
    assert args.loss_type == "dapo" and args.use_bias_correction_kl  # TRL 1.16's defaults, what minigpt computes
    trainer = trl.GRPOTrainer(
        model=policy,
        reward_funcs=reward,
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
        rollout_func=rollout,
        peft_config=peft_config,
    )
    policy = trainer.model
    if state is not None and peft_config is not None:  # the trained adapter, into TRL's fresh one
        assert not peft.set_peft_model_state_dict(policy, state).unexpected_keys
    elif state is not None:  # the policy some steps away from the reference
        with torch.no_grad():
            policy.load_state_dict(state)
    trainer.current_gradient_accumulation_steps = 1  # (set by Trainer's loop, which this test does not run)
    inputs = [row for row in ROWS for _ in range(G)]
    loss = trainer.training_step(policy, inputs, None)
    advantages = torch.tensor(list(trainer._logs["advantages"]))  # the advantages TRL computed, as it logs them
    trainer.log({})
    return loss, trainer.state.log_history[-1], advantages, tokenizer, policy


@pytest.mark.parametrize(("arch", "beta", "scale"), [("llama", 0.0, True), ("llama", 0.04, True), ("gpt", 0.1, False)])
def test_grpo_equals_trl_advantages_loss_metrics_and_gradients(arch, beta, scale, tmp_path):
    torch.manual_seed(0)
    tokenizer = ChatTokenizer.for_base(ByteTokenizer())
    kv = dict(n_kv_head=2) if arch == "llama" else {}
    config = GPTConfig(arch=arch, n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=tokenizer.vocab_size, **kv)
    reference = GPT(config)
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export_hf(reference, tokenizer, tmp_path / "ref")
    export_hf(policy, tokenizer, tmp_path / "policy")
    prompts, completions = fixed_batch(tokenizer)

    # minigpt: the loss of one generation step (old log-probs = the policy's own, detached)
    advantages = group_advantages(REWARDS, G, scale)
    rows = completion_rows(prompts, completions, G)
    policy.train()
    logps, mask = token_logps(policy, rows, TEMPERATURE)
    with torch.no_grad():
        ref_logps = token_logps(reference.eval(), rows, TEMPERATURE)[0] if beta else None
    loss, per_token, metrics = grpo_loss(logps, logps.detach(), ref_logps, advantages, mask, 0.2, beta)
    loss.backward()

    trl_policy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref")  # TRL's reference: its path
    state = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    trl_loss, logged, trl_advantages, hf_tokenizer, trl_policy = trl_step(
        trl_policy, tmp_path / "ref", tmp_path, prompts, completions, beta, scale, state
    )
    for row, ids in zip(ROWS, prompts):  # TRL's own rendering of the prompts is minigpt's, token for token
        rendered = hf_tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)
        assert list(rendered["input_ids"]) == ids

    diffs = {
        "advantages": (advantages - trl_advantages).abs().max().item(),
        "loss": abs(loss.item() - trl_loss.item()),
        "clip_ratio": abs(metrics["clip_ratio/region_mean"].item() - logged["clip_ratio/region_mean"]),
        "reward": abs(REWARDS.mean().item() - logged["reward"]),
    }
    if beta:
        diffs["kl"] = abs(metrics["kl"].item() - logged["kl"])
        assert metrics["kl"].item() > 1e-4  # the policy is not the reference: a real comparison
    assert max(diffs.values()) < 1e-5, diffs
    # the per-token loss is TRL's documented formula; its token-level mean is the loss TRL returned
    torch.testing.assert_close((per_token * mask).sum() / mask.sum(), trl_loss, atol=1e-6, rtol=0)

    expected = hf_tensors(grads_of(policy))
    got = {n: p.grad for n, p in trl_policy.named_parameters() if p.grad is not None}
    assert got and set(got) <= set(expected)
    grad_diff = max((got[n] - expected[n]).abs().max().item() for n in got)
    scale_ = max(expected[n].abs().max().item() for n in got)
    assert scale_ > 1e-4 and grad_diff < 1e-5 * max(1.0, scale_), (grad_diff, scale_)
    print(
        f"\n{arch} beta={beta} scale_rewards={scale}: max |diff| {diffs}, gradients {grad_diff:.2e} "
        f"(largest {scale_:.2e})"
    )


def test_lora_grpo_equals_trl_with_peft_on_the_peft_export(tmp_path):
    """A LoRA run (the KL's reference: the adapters switched off) against TRL with peft on export.py's PEFT files
    (TRL's reference for a PEFT model: its adapters disabled).  The base holds the chat tokens already (an SFT
    model): TRL's fused head cannot read PEFT's trainable-token rows (as in tests/training/test_dpo_trl.py)."""
    torch.manual_seed(0)
    tokenizer = ChatTokenizer.for_base(ByteTokenizer())
    config = GPTConfig(
        arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=64, vocab_size=tokenizer.vocab_size
    )
    model = lora_model(GPT(config), config, LoRAConfig(rank=4))
    with torch.no_grad():  # adapters some steps away from their start
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    export_peft(model, tokenizer, LoRAConfig(rank=4), tmp_path / "adapter", tmp_path / "base")
    prompts, completions = fixed_batch(tokenizer)

    advantages = group_advantages(REWARDS, G)
    rows = completion_rows(prompts, completions, G)
    with torch.no_grad(), adapters_disabled(model):
        ref_logps = token_logps(model.eval(), rows, TEMPERATURE)[0]
    logps, mask = token_logps(model.train(), rows, TEMPERATURE)
    loss, _, metrics = grpo_loss(logps, logps.detach(), ref_logps, advantages, mask, 0.2, 0.04)
    loss.backward()

    # TRL given a trained adapter would copy it as its reference; given a peft_config it makes a fresh adapter and
    # its reference is that adapter switched off (the base, minigpt's): the trained adapter is loaded into it after
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapter = safetensors.torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    lora = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    trl_loss, logged, trl_advantages, _, policy = trl_step(
        base, tmp_path / "base", tmp_path, prompts, completions, 0.04, True, adapter, lora
    )
    diffs = {
        "advantages": (advantages - trl_advantages).abs().max().item(),
        "loss": abs(loss.item() - trl_loss.item()),
        "kl": abs(metrics["kl"].item() - logged["kl"]),
    }
    assert metrics["kl"].item() > 1e-4 and max(diffs.values()) < 1e-5, diffs
    expected, _ = peft_tensors(grads_of(model))
    got = {n.replace(".default", ""): p.grad for n, p in policy.named_parameters() if ".default." in n}
    assert set(got) == set(expected)
    grad_diff = max((got[n] - expected[n]).abs().max().item() for n in got)
    scale = max(expected[n].abs().max().item() for n in got)
    assert scale > 1e-4 and grad_diff < 1e-5 * max(1.0, scale), (grad_diff, scale)
    print(f"\nllama LoRA beta=0.04: max |diff| {diffs}, gradients {grad_diff:.2e} (largest {scale:.2e})")
