"""DPO equals TRL's: on the Hugging Face export of the same models and the same batch, TRL's DPOTrainer (its own
tokenization of the conversational rows, its collator, its compute_loss) gives minigpt's loss, the four rewards/*
metrics and logps/*, and the same gradients of one step; a LoRA run against TRL with peft on export.py's PEFT files
(the reference: the adapters switched off on both sides); with dpo.rpo_alpha, against TRL's loss_type ["sigmoid",
"sft"] with loss_weights [1, rpo_alpha] (RPO in trl 1.16).  Offline: tiny models with random weights, the policy
moved away from the reference at random so that every reward is non-zero."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from minigpt.cli.train import parse
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.lora import LoRAConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.hf import export_hf, hf_tensors
from minigpt.export.peft import export_peft, peft_tensors
from minigpt.training.dpo import METRICS, RPO_METRIC, pair_batch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

N_PAIRS = 4
ROWS = [  # TRL's conversational layout; prompts and answers of different lengths, so the batch is padded
    {
        "prompt": [{"role": "user", "content": f"What is {a} + {a * 7 + 1}?"}],
        "chosen": [{"role": "assistant", "content": str(8 * a + 1)}],
        "rejected": [{"role": "assistant", "content": f"{8 * a + 3}, I think"}],
    }
    for a in range(1, 9)
]


def dpo_start(tmp_path, arch: str, finetune: str, chat_base: bool = False, rpo_alpha: float | None = None):
    """A byte-level base checkpoint and a DPO run on it, parsed (nothing trained): the module and its data.
    chat_base: the base has ChatML's tokens already (an SFT model), so the run grows no vocabulary."""
    torch.manual_seed(0)
    kv = dict(n_kv_head=2) if arch == "llama" else {}
    tokenizer = ChatTokenizer.for_base(ByteTokenizer()) if chat_base else ByteTokenizer()
    config = GPTConfig(arch=arch, n_layer=2, n_head=4, n_embd=32, block_size=96, vocab_size=tokenizer.vocab_size, **kv)
    save_file(model_checkpoint(GPT(config), tokenizer), tmp_path / "base.ckpt")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    argv = ["--init_from", str(tmp_path / "base.ckpt"), "--finetune", finetune, "--data.format", "preference"]
    argv += [
        "--data.source",
        str(pairs),
        "--data.data_root",
        str(tmp_path / "data"),
        "--out_dir",
        str(tmp_path / "run"),
    ]
    argv += ["--data.val_fraction", "0.1", "--lora.rank", "4", "--dpo.beta", "0.3"]
    if rpo_alpha is not None:
        argv += ["--dpo.rpo_alpha", str(rpo_alpha)]
    cli = parse(argv)
    return cli.model, cli.datamodule.prepared


def trl_step(
    model, ref_model, tokenizer_dir, tmp_path, pairs: list[dict], rpo_alpha: float | None = None
) -> tuple[torch.Tensor, dict, dict]:
    """TRL's loss and logged metrics on `pairs` as one batch, after its backward: (loss, metrics, inputs).
    rpo_alpha: RPO as trl 1.16 spells it, the sigmoid loss plus rpo_alpha x its "sft" loss."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    rpo = dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, rpo_alpha]) if rpo_alpha is not None else {}
    args = trl.DPOConfig(
        **rpo,
        output_dir=str(tmp_path / "trl"),
        beta=0.3,
        per_device_train_batch_size=len(pairs),
        report_to=[],
        use_cpu=True,
        max_length=None,
        bf16=False,
        fp16=False,
    )
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=datasets.Dataset.from_list(pairs),
        processing_class=tokenizer,
    )
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
    model.train()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    trainer.log({})  # TRL's metrics of this batch into its log history
    return loss.detach(), trainer.state.log_history[-1], inputs


def ours_step(module, data):
    """minigpt's loss and metrics on the first N_PAIRS training pairs, after its backward; and which rows of ROWS
    they are (the split shuffles)."""
    pairs = data.train[:N_PAIRS]
    rows, ids = pair_batch(pairs, list(range(N_PAIRS)))
    module.model.train()
    loss = module.batch_loss((rows, ids), "train")
    loss.backward()
    return loss.detach(), {k: v.item() for k, v in module.pop_metrics().items()}, rows


def source_rows(data, tokenizer) -> list[dict]:
    """The rows of ROWS the first N_PAIRS training pairs came from (matched by their decoded prompt)."""
    found = []
    for chosen, _ in data.train[:N_PAIRS]:
        text = tokenizer.decode([~t if t < 0 else t for t in chosen.tolist()])
        found.append(next(r for r in ROWS if r["prompt"][0]["content"] in text))
    return found


def assert_same_batch(inputs: dict, rows: torch.Tensor) -> None:
    """TRL's tokenization and split (prompt / answer) of the rows are minigpt's, token for token."""
    for i in range(rows.size(0)):
        n = int(inputs["attention_mask"][i].sum())
        ours = rows[i][rows[i] != -1]
        assert n == len(ours)
        assert inputs["input_ids"][i, :n].tolist() == torch.where(ours < 0, ~ours, ours).tolist()
        assert inputs["completion_mask"][i, :n].tolist() == (ours >= 0).long().tolist()


def compare(our_loss, ours, trl_loss, theirs) -> dict[str, float]:
    diffs = {"loss": abs(our_loss.item() - trl_loss.item())}
    diffs |= {name: abs(ours[name] - theirs[name]) for name in METRICS}
    assert max(diffs.values()) < 1e-5, diffs
    assert abs(ours["rewards/margins"]) > 1e-3  # the policy is not the reference: a real comparison
    return diffs


def grads_of(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose trained tensors hold their gradients (an export maps them as it maps weights)."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), copied.parameters()):
            if p.requires_grad:
                q.data = p.grad.clone()
    return copied


@pytest.mark.parametrize("arch, rpo_alpha", [("llama", None), ("gpt", None), ("llama", 0.7)])
def test_full_dpo_equals_trl_loss_metrics_and_gradients(arch, rpo_alpha, tmp_path):
    module, data = dpo_start(tmp_path, arch, "full", rpo_alpha=rpo_alpha)
    reference = module._reference[0]
    with torch.no_grad():  # a policy some steps away from the reference
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export_hf(reference, module.tokenizer, tmp_path / "ref")
    export_hf(module.model, module.tokenizer, tmp_path / "policy")

    our_loss, ours, rows = ours_step(module, data)
    policy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref")
    pairs = source_rows(data, module.tokenizer)
    trl_loss, theirs, inputs = trl_step(policy, ref, tmp_path / "policy", tmp_path, pairs, rpo_alpha)
    assert_same_batch(inputs, rows)
    diffs = compare(our_loss, ours, trl_loss, theirs)
    if rpo_alpha is not None:  # the NLL term is there and weighs: not plain DPO's loss
        chosen_tokens = sum(int(m.sum()) for m in inputs["completion_mask"].chunk(2)[0])
        assert ours[RPO_METRIC] == pytest.approx(-ours["logps/chosen"] * N_PAIRS / chosen_tokens, rel=1e-5)
        assert rpo_alpha * ours[RPO_METRIC] > 0.1

    expected = hf_tensors(grads_of(module.model))
    got = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert got and set(got) <= set(expected)
    grad_diff = max((got[n] - expected[n]).abs().max().item() for n in got)
    scale = max(expected[n].abs().max().item() for n in got)
    assert grad_diff < 1e-5 * max(1.0, scale), (grad_diff, scale)
    print(
        f"\n{arch} full, rpo_alpha {rpo_alpha}: max |diff| {diffs}, "
        f"gradients {grad_diff:.2e} (largest gradient {scale:.2e})"
    )


def test_lora_dpo_equals_trl_with_peft_on_the_peft_export(tmp_path):
    # the base an SFT run made (ChatML's tokens in its vocabulary): TRL's fused head cannot read PEFT's trainable
    # token rows (a grown vocabulary's); tests/training/test_dpo.py proves the new rows' reference
    module, data = dpo_start(tmp_path, "llama", "lora", chat_base=True)
    assert not module._reference  # no second copy: the adapters switch off
    with torch.no_grad():  # adapters some steps away from their start
        for p in module.model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    export_peft(module.model, module.tokenizer, LoRAConfig(rank=4), tmp_path / "adapter", tmp_path / "base")

    our_loss, ours, rows = ours_step(module, data)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    policy = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)
    # TRL would copy a given adapter as its reference (the adapter as TRL starts); minigpt's is the run's start,
    # the base with the adapters off: the base export itself
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    pairs = source_rows(data, module.tokenizer)
    trl_loss, theirs, inputs = trl_step(policy, reference, tmp_path / "base", tmp_path, pairs)
    assert_same_batch(inputs, rows)
    diffs = compare(our_loss, ours, trl_loss, theirs)

    expected, _ = peft_tensors(grads_of(module.model))
    got = {n.replace(".default", ""): p.grad for n, p in policy.named_parameters() if ".default." in n}
    assert set(got) == set(expected)
    grad_diff = max((got[n] - expected[n]).abs().max().item() for n in got)
    scale = max(expected[n].abs().max().item() for n in got)
    assert grad_diff < 1e-5 * max(1.0, scale), (grad_diff, scale)
    print(f"\nllama LoRA: max |diff| {diffs}, gradients {grad_diff:.2e} (largest gradient {scale:.2e})")
