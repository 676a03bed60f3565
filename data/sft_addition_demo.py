"""Chat fine-tuning shown to work: a base model learns multi-digit addition as an assistant, measured on held-out
questions before and after.

    python3 data/sft_addition_demo.py                # reuses out/default (else pretrains it: python train.py)
    python3 data/sft_addition_demo.py --minutes 2 --base out/my_char_run
    python3 data/sft_addition_demo.py --smoke        # tiny everything (seconds; the test suite runs it)
    python3 data/sft_addition_demo.py --steps 2000 --lora   # LoRA r16 against full SFT: run it with and without

Method.  data/addition_chat.py makes 9,000 training conversations ("What is 47 + 89?" -> "136", operands of 0
to 99) and 200 held out by a hash of the pair, so no test question is ever trained on.  The base is the
default recipe's char model (out/default, pretrained on the standard library's source if absent).  Fine-tuning is
configs/sft_addition.yaml (train.py --init_from BASE --data.format chat), stopped after --minutes of training.
Accuracy is exact match of the greedy reply (minigpt.chat, stopping at <|im_end|>) with the sum, over the 200
held-out conversations.  "Before" asks the base the same way: its tokenizer given the same chat template and new
tokens, and its embedding grown the same way (new rows at the mean), which is where fine-tuning starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere without installing

from minigpt.cli.train import main as train_main  # noqa: E402
from minigpt.core.chat import chat  # noqa: E402
from minigpt.core.chat_template import ChatTokenizer  # noqa: E402
from minigpt.core.model import GPT  # noqa: E402
from minigpt.loading import load_model  # noqa: E402
from minigpt.training.sft import grow_vocabulary  # noqa: E402


def recipe():
    spec = importlib.util.spec_from_file_location("addition_chat", REPO / "data" / "addition_chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def accuracy(model: GPT, tokenizer: ChatTokenizer, test: list[dict]) -> float:
    right = 0
    for row in test:
        question, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        right += chat(model, tokenizer, question, max_new_tokens=8) == answer
    return right / len(test)


def before(base: Path, test: list[dict]) -> float:
    """The base, asked in the chat format it is about to be fine-tuned in."""
    model, tokenizer = load_model(base)
    chat_tokenizer = ChatTokenizer.for_base(tokenizer, conversations=[r["messages"] for r in test])
    config = type(model.config).from_dict({**model.config.to_dict(), "vocab_size": chat_tokenizer.vocab_size})
    grown = GPT.from_weights(config, grow_vocabulary(model.state_dict(), config.vocab_size)).eval()
    return accuracy(grown, chat_tokenizer, test)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, default=REPO / "out" / "default", help="the base run (pretrained if absent)")
    p.add_argument("--out", type=Path, default=REPO / "out" / "sft_demo")
    p.add_argument("--data", type=Path, default=REPO / "data" / "addition")
    p.add_argument("--minutes", type=float, default=5.0, help="training time of the fine-tune")
    p.add_argument("--steps", type=int, default=None, help="train this many steps instead, with no time cap")
    p.add_argument("--lora", action="store_true", help="fine-tune LoRA adapters (r16, alpha 32), not every weight")
    p.add_argument("--smoke", action="store_true", help="tiny base, data and steps: checks that it runs")
    args = p.parse_args(argv)
    n_train, n_test = (200, 10) if args.smoke else (9_000, 200)
    train, test = recipe().make(n_train, n_test, digits=2, seed=0)
    args.data.mkdir(parents=True, exist_ok=True)
    recipe().write_jsonl(train, args.data / "train.jsonl")
    tiny = (
        [
            "--model.n_layer",
            "1",
            "--model.n_head",
            "2",
            "--model.n_embd",
            "16",
            "--model.block_size",
            "64",
            "--trainer.max_steps",
            "4",
            "--data.batch_size",
            "4",
            "--trainer.val_check_interval",
            "2",
            "--trainer.enable_progress_bar",
            "false",
        ]
        if args.smoke
        else []
    )
    data_root = ["--data.data_root", str(args.out.parent / "sft_demo_data")] if args.smoke else []
    if not (args.base / "checkpoints" / "last.ckpt").is_file():
        print(f"no base at {args.base}: pretraining it with configs/default.yaml")
        text = args.data / "smoke_base.txt"  # the smoke base reads the questions as plain text
        text.write_text("".join(r["messages"][0]["content"] + "\n" for r in train))
        train_main(
            ["--out_dir", str(args.base), *tiny, *data_root, "--data.source", str(text)]
            if args.smoke
            else ["--out_dir", str(args.base)]
        )
    accuracy_before = before(args.base, test)
    print(f"before fine-tuning: {accuracy_before:.1%} exact match on {len(test)} held-out conversations")
    seconds = int(args.minutes * 60)
    start = time.perf_counter()
    trainer = train_main(
        [
            "--config",
            str(REPO / "configs" / "sft_addition.yaml"),
            "--init_from",
            str(args.base),
            "--out_dir",
            str(args.out),
            "--data.source",
            str(args.data / "train.jsonl"),
            "--trainer.max_time",
            f"00:00:{seconds // 60:02d}:{seconds % 60:02d}" if args.steps is None else "null",
            *(["--trainer.max_steps", str(args.steps)] if args.steps is not None else []),
            *(["--finetune", "lora", "--lora.rank", "16", "--lora.alpha", "32"] if args.lora else []),
            "--overwrite",
            "true",
            *(
                [
                    "--trainer.max_steps",
                    "4",
                    "--data.batch_size",
                    "4",
                    "--trainer.val_check_interval",
                    "2",
                    "--trainer.enable_progress_bar",
                    "false",
                    *data_root,
                ]
                if args.smoke
                else []
            ),
        ]
    )
    wall = time.perf_counter() - start
    model, tokenizer = load_model(args.out)
    accuracy_after = accuracy(model, tokenizer, test)
    trainable = sum(p.numel() for p in trainer.lightning_module.model.parameters() if p.requires_grad)
    result = {
        "before": accuracy_before,
        "after": accuracy_after,
        "steps": trainer.global_step,
        "trainable": trainable,
        "wall_s": round(wall, 1),
        "test_conversations": len(test),
        "machine": platform.platform(),
    }
    print(
        f"after {trainer.global_step} {'LoRA' if args.lora else 'full'} SFT steps ({trainable:,} trainable, "
        f"{wall:.0f} s in train.py, {torch.get_num_threads()} threads): "
        f"{accuracy_after:.1%} exact match (before: {accuracy_before:.1%})"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
