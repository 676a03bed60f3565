"""Preference pairs for DPO from a chat model's own answers: the right answer chosen, its own wrong answer rejected.

    python3 data/make_preference_pairs.py --ckpt out/posttrain_addition/sft --source data/addition/train.jsonl \
        --out data/addition/pairs.jsonl                   # greedy answers only
    python3 data/make_preference_pairs.py ... --samples 4 --temperature 1.0   # and 4 sampled answers per question

The source holds questions with their answers: chat rows ({"messages": [..., user turn, assistant turn]}, the last
turn the answer: data/addition_chat.py's layout) or prompt rows ({"prompt": text or messages, "answer": text}, the
layout of train.py --data.format prompts).  For each question the model answers greedily (and --samples times at
--temperature), as `sample.py --chat` does, stopping at its end-of-turn token; each distinct wrong answer (at most
--pairs_per_question of them, the greedy one first) becomes one row of TRL's standard layout, read by
train.py --data.format preference (docs/dpo.md):

    {"prompt": "What is 47 + 89?", "chosen": "136", "rejected": "126"}

(conversational when the prompt is more than one user turn).  An answer is right when it equals the expected one
after stripping spaces, or when both are numbers and equal as numbers ("136.0" is 136).  Questions the model always
answers right give no pair.  Make pairs from training questions only, never from the ones you measure on.

Answers are decoded in batches of prompts with the same number of tokens (no padding needed) with the KV cache.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere without installing

from minigpt.cli.errors import run_cli  # noqa: E402
from minigpt.core.chat import NO_CHAT_TEMPLATE  # noqa: E402
from minigpt.core.chat_template import ChatTokenizer  # noqa: E402
from minigpt.core.errors import DataError, UserError  # noqa: E402
from minigpt.core.generation import generate  # noqa: E402
from minigpt.core.model import GPT  # noqa: E402
from minigpt.data.conversations import source_rows  # noqa: E402
from minigpt.loading import load_chat_model  # noqa: E402

LAYOUT = '{"messages": [..., user, assistant]} or {"prompt": ..., "answer": ...}'
Messages = list[dict[str, str]]


def same_answer(reply: str, answer: str) -> bool:
    """Exact match after stripping spaces; two numbers match as numbers ("136.0" is 136)."""
    reply, answer = reply.strip(), answer.strip()
    if reply == answer:
        return True
    try:
        a, b = float(reply), float(answer)
    except ValueError:
        return False
    return math.isfinite(a) and a == b


def question(row: object, where: str) -> tuple[Messages, str]:
    """A row as (the prompt's messages, ending with a user turn; the expected answer), or one DataError."""
    if isinstance(row, dict) and isinstance(row.get("messages"), list) and len(row["messages"]) >= 2:
        *prompt, last = row["messages"]
        if isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str):
            row = {"prompt": prompt, "answer": last["content"]}
    if not isinstance(row, dict) or not isinstance(row.get("answer"), str) or "prompt" not in row:
        raise DataError(f"{where}: a question needs {LAYOUT}, got {row!r:.80}; fix the row")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    ok = isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)
    if not ok or not all(isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in prompt):
        raise DataError(f'{where}: "prompt" must be text or a list of messages with "role" and "content"; fix the row')
    if prompt[-1]["role"] != "user":
        raise DataError(f"{where}: the prompt must end with a user turn for the model to answer; fix the row")
    return [{"role": m["role"], "content": m["content"]} for m in prompt], row["answer"]


@torch.inference_mode()
def own_answers(
    model: GPT,
    tokenizer: ChatTokenizer,
    prompts: list[Messages],
    n: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 16,
    batch_size: int = 256,
    seed: int = 0,
) -> list[list[str]]:
    """n replies of the model to each prompt (greedy when temperature is 0), as sample.py --chat gives them."""
    ids = [tokenizer.encode_prompt(p) for p in prompts]
    by_length: dict[int, list[int]] = defaultdict(list)  # prompts of one length decode together, unpadded
    for i, x in enumerate(ids):
        by_length[len(x)].append(i)
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    replies: list[list[str]] = [[] for _ in prompts]
    model.eval()
    for length, rows in sorted(by_length.items()):
        room = min(max_new_tokens, model.config.block_size - length)
        if room < 1:
            raise UserError(
                f"a prompt of {length} tokens leaves no room for an answer in block_size "
                f"{model.config.block_size}; shorten the questions"
            )
        for _ in range(n):
            for start in range(0, len(rows), batch_size):
                chunk = rows[start : start + batch_size]
                idx = torch.tensor([ids[i] for i in chunk], device=model.lm_head.weight.device)  # (B, T)
                out = generate(
                    model,
                    idx,
                    room,
                    temperature=temperature,
                    stop_token=tokenizer.eot_id,
                    generator=generator,
                    vocab_size=tokenizer.vocab_size,
                )[:, length:]  # (B, <= room)
                for i, reply in zip(chunk, out.tolist()):
                    end = reply.index(tokenizer.eot_id) if tokenizer.eot_id in reply else len(reply)
                    replies[i].append(tokenizer.decode(reply[:end]))
    return replies


def make_pairs(
    model: GPT,
    tokenizer: ChatTokenizer,
    questions: list[tuple[Messages, str]],
    samples: int = 0,
    temperature: float = 1.0,
    pairs_per_question: int = 1,
    max_new_tokens: int = 16,
    seed: int = 0,
) -> tuple[list[dict], dict]:
    """Pairs (TRL's standard layout, or conversational for a multi-turn prompt) of each question's right answer
    and the model's own distinct wrong ones, the greedy one first; and counts of what was found."""
    prompts = [p for p, _ in questions]
    greedy = own_answers(model, tokenizer, prompts, 1, 0.0, max_new_tokens, seed=seed)
    sampled = (
        own_answers(model, tokenizer, prompts, samples, temperature, max_new_tokens, seed=seed) if samples else None
    )
    pairs, greedy_right = [], 0
    for i, (prompt, answer) in enumerate(questions):
        greedy_right += same_answer(greedy[i][0], answer)
        wrong = [r for r in dict.fromkeys(greedy[i] + (sampled[i] if sampled else [])) if not same_answer(r, answer)]
        for reply in wrong[:pairs_per_question]:
            if len(prompt) == 1:
                pairs.append({"prompt": prompt[0]["content"], "chosen": answer, "rejected": reply})
            else:
                assistant = [{"role": "assistant", "content": answer}], [{"role": "assistant", "content": reply}]
                pairs.append({"prompt": prompt, "chosen": assistant[0], "rejected": assistant[1]})
    counts = {"questions": len(questions), "greedy_right": greedy_right, "pairs": len(pairs)}
    return pairs, counts


def read_questions(source: str) -> list[tuple[Messages, str]]:
    questions = [question(row, where) for row, where in source_rows(source, "questions", LAYOUT)]
    if not questions:
        raise DataError(f"{source}: no questions; it needs rows of {LAYOUT}")
    return questions


def write_jsonl(rows: list[dict], path: Path) -> None:
    """All rows or none: written beside the target, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="the chat model: a run directory or checkpoint (an SFT run)")
    p.add_argument("--source", required=True, help=f"questions with answers: rows of {LAYOUT}")
    p.add_argument("--out", type=Path, required=True, help="the pairs, JSON Lines (replaced whole)")
    p.add_argument("--samples", type=int, default=0, help="sampled answers per question, besides the greedy one")
    p.add_argument("--temperature", type=float, default=1.0, help="of the sampled answers (> 0)")
    p.add_argument("--pairs_per_question", type=int, default=1, help="distinct wrong answers kept per question")
    p.add_argument("--max_new_tokens", type=int, default=16, help="longest answer (longer ones are cut: wrong)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.samples < 0 or args.pairs_per_question < 1 or args.max_new_tokens < 1 or not args.temperature > 0:
        p.error("--samples must be >= 0, --pairs_per_question and --max_new_tokens >= 1, --temperature > 0")
    questions = read_questions(args.source)
    model, tokenizer = load_chat_model(args.ckpt)
    if not isinstance(tokenizer, ChatTokenizer):
        raise UserError(f"{args.ckpt} {NO_CHAT_TEMPLATE}")
    pairs, counts = make_pairs(
        model,
        tokenizer,
        questions,
        args.samples,
        args.temperature,
        args.pairs_per_question,
        args.max_new_tokens,
        args.seed,
    )
    write_jsonl(pairs, args.out)
    print(
        f"{counts['greedy_right']:,} of {counts['questions']:,} questions answered right (greedy); wrote "
        f"{counts['pairs']:,} pairs to {args.out}; train on them with:\n"
        f"  python3 train.py --init_from {args.ckpt} --data.format preference --data.source {args.out}"
    )
    return counts


if __name__ == "__main__":
    run_cli(main)
