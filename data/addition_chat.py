"""Recipe: a chat skill a base model lacks, multi-digit addition, as conversations with held-out prompts.

    python3 data/addition_chat.py                     # data/addition/train.jsonl (9,000) and test.jsonl (200)
                                                      # and prompts.jsonl: train's questions for GRPO (docs/grpo.md)
    python3 train.py --config configs/sft_addition.yaml
    python3 sample.py --ckpt out/sft_addition --chat --temperature 0

Each row is {"messages": [{"role": "user", "content": "What is 47 + 89?"}, {"role": "assistant", "content":
"136"}]}.  A pair (a, b) goes to the test set or the training set by a hash of the pair itself, so no test
question (in either order) is ever seen in training, whatever the sizes asked for.  No network needed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path


def is_held_out(a: int, b: int, share: float) -> bool:
    """The pair's side, from the unordered pair alone (a + b and b + a fall on the same side)."""
    key = f"{min(a, b)}+{max(a, b)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64 < share


def conversation(a: int, b: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
    }


def make(n_train: int, n_test: int, digits: int, seed: int, share: float = 0.05) -> tuple[list[dict], list[dict]]:
    """n_train training and n_test held-out conversations, distinct pairs of operands drawn uniformly from 0 to
    10**digits - 1."""
    rng = random.Random(seed)
    train, test, seen = [], [], set()
    for _ in range(100 * (n_train + n_test)):
        if len(train) >= n_train and len(test) >= n_test:
            break
        a, b = rng.randrange(10**digits), rng.randrange(10**digits)
        side = test if is_held_out(a, b, share) else train
        if (a, b) in seen or len(side) >= (n_test if side is test else n_train):
            continue
        seen.add((a, b))
        side.append(conversation(a, b))
    else:
        raise SystemExit(
            f"error: {digits}-digit operands give too few distinct sums for {n_train} + {n_test} "
            "conversations; ask for fewer or allow more digits"
        )
    return train, test


def prompt_row(conversation: dict) -> dict:
    """A conversation as GRPO's prompt row: {"prompt": the question, "answer": the reply the reward checks}."""
    question, answer = conversation["messages"]
    return {"prompt": question["content"], "answer": answer["content"]}


def write_jsonl(rows: list[dict], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "addition")
    p.add_argument("--train", type=int, default=9_000, help="training conversations")
    p.add_argument("--test", type=int, default=200, help="held-out conversations")
    p.add_argument("--digits", type=int, default=2, help="at most this many digits per operand")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 1 <= args.digits <= 9 or args.train < 1 or args.test < 1:
        p.error("--digits must be 1 to 9, --train and --test at least 1")
    train, test = make(args.train, args.test, args.digits, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, args.out / "train.jsonl")
    write_jsonl(test, args.out / "test.jsonl")
    # the same training questions as GRPO's prompt rows (--data.format prompts), their answers for the reward
    write_jsonl([prompt_row(row) for row in train], args.out / "prompts.jsonl")
    print(
        f"wrote {args.out / 'train.jsonl'} ({len(train):,}), {args.out / 'test.jsonl'} ({len(test):,}, held out) "
        f"and {args.out / 'prompts.jsonl'} (train's questions, for GRPO); fine-tune on it with:\n"
        "  python3 train.py --config configs/sft_addition.yaml"
    )


if __name__ == "__main__":
    main()
