"""Post-training past SFT shown to work: a weak SFT model of the addition chat task, made better by DPO on pairs of
its own answers and by GRPO with the exact-match reward, each measured on held-out questions.

    python3 data/posttrain_addition_demo.py                  # every stage: sft, dpo, grpo (reuses out/default)
    python3 data/posttrain_addition_demo.py --stages dpo     # again from the SFT run it left in --work
    python3 data/posttrain_addition_demo.py --smoke          # tiny everything (seconds; the test suite runs it)

Stages, each from the SFT model (the start), each measured the same way: exact match of the greedy reply
(minigpt.chat, as sample.py --chat gives it) with the sum, over data/addition_chat.py's 200 held-out questions (no
held-out pair, in either order, is trained on, by SFT, DPO or GRPO).
  sft   configs/sft_addition.yaml on the default char model (out/default, pretrained if absent), stopped early
        (--sft_steps, default 770 of the recipe's 2,000; the schedule is cosine over those steps): a weak start
        (35 % here; the rise is abrupt and not monotonic in the stopping step: 775 gave 19 %, 778 39.5 %, 780
        85.5 %, so another CPU or thread count may land elsewhere: check the sft row).  Its chat template ends a
        reply at <|im_end|> (configs/chatml_answer_ends_at_im_end.jinja; docs/dpo.md says why).
  dpo   data/make_preference_pairs.py asks the SFT model every TRAINING question (greedily, and --dpo_samples times (2)
        at temperature 1); each question it gets wrong gives a pair, the sum chosen and its own wrong answer
        rejected.  Then configs/dpo_addition.yaml (train.py --data.format preference, full fine-tuning, a frozen
        copy of the start as the reference, dpo.rpo_alpha 1: RPO, without which DPO lowers exact match here) for
        --dpo_steps steps.
  grpo  train.py --data.format prompts on the training questions ({"prompt", "answer"} rows) with the built-in
        exact-match reward: configs/grpo_addition.yaml (full fine-tuning, 16 prompts x 8 answers a step, no KL)
        for --grpo_steps steps.
Each stage prints its held-out exact match, its optimizer steps and its minutes of training (train.py's wall time,
start-up and validation included; making the pairs is counted apart), and the results go to --json (merged with the
stages already there, so a stage run alone updates its own row), with the CPU it ran on.
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
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere without installing

from minigpt.cli.train import main as train_main  # noqa: E402
from minigpt.core.checkpoint import checkpoint_summary, find_checkpoint, read_checkpoint  # noqa: E402
from minigpt.loading import load_chat_model  # noqa: E402

STAGES = ("sft", "dpo", "grpo")


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "data" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held_out(run: Path, test: list[dict], sft_demo) -> float:
    """Exact match of the run's greedy replies (its best checkpoint, as sample.py --chat reads a run)."""
    model, tokenizer = load_chat_model(run)
    return sft_demo.accuracy(model.eval(), tokenizer, test)


def train(settings: dict[str, object], extra: list[str]) -> tuple[int, float]:
    """Run train.py in this process with --KEY VALUE for each setting (in order: config first), then `extra`:
    (optimizer steps, seconds)."""
    flags = [x for key, value in settings.items() for x in (f"--{key}", "null" if value is None else str(value))]
    start = time.perf_counter()
    trainer = train_main([*flags, *extra, "--overwrite", "true"])
    return trainer.global_step, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="sft,dpo,grpo", help="comma-separated, of sft, dpo, grpo")
    p.add_argument("--base", type=Path, default=REPO / "out" / "default", help="the base run (pretrained if absent)")
    p.add_argument("--work", type=Path, default=REPO / "out" / "posttrain_addition", help="the runs: sft, dpo, grpo")
    p.add_argument("--data", type=Path, default=REPO / "data" / "addition")
    p.add_argument("--json", type=Path, default=None, help="default: docs/results/posttrain_addition.json")
    p.add_argument("--sft_steps", type=int, default=None, help="where SFT stops (default 770; the recipe runs 2,000)")
    p.add_argument("--dpo_steps", type=int, default=None, help="default 200")
    p.add_argument("--dpo_beta", type=float, default=0.1)
    p.add_argument(
        "--dpo_rpo_alpha", type=float, default=None, help="RPO's NLL weight (default: configs/dpo_addition.yaml's)"
    )
    p.add_argument("--dpo_lr", type=float, default=None, help="default: configs/dpo_addition.yaml's")
    p.add_argument(
        "--dpo_samples", type=int, default=None, help="sampled answers per question besides the greedy one (2)"
    )
    p.add_argument("--grpo_steps", type=int, default=None, help="default 700")
    p.add_argument("--grpo_lr", type=float, default=None, help="default: configs/grpo_addition.yaml's")
    p.add_argument("--smoke", action="store_true", help="tiny base, data and steps: checks that it runs")
    args = p.parse_args(argv)
    for name, default in (("sft_steps", 770), ("dpo_steps", 200), ("grpo_steps", 700), ("dpo_samples", 2)):
        if getattr(args, name) is None:
            setattr(args, name, 1 if args.smoke and name == "dpo_samples" else 4 if args.smoke else default)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not stages or any(s not in STAGES for s in stages):
        p.error(f"--stages takes a comma-separated list of {', '.join(STAGES)}, got {args.stages!r}")
    json_path = args.json or (
        args.work / "posttrain_addition.json" if args.smoke else REPO / "docs" / "results" / "posttrain_addition.json"
    )
    sft_demo, addition, pairs_script = (
        load_script(n) for n in ("sft_addition_demo", "addition_chat", "make_preference_pairs")
    )

    n_train, n_test = (200, 10) if args.smoke else (9_000, 200)
    train_rows, test = addition.make(n_train, n_test, digits=2, seed=0)
    args.data.mkdir(parents=True, exist_ok=True)
    addition.write_jsonl(train_rows, args.data / "train.jsonl")
    addition.write_jsonl(test, args.data / "test.jsonl")
    tiny = ["--data.batch_size", "4", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false"]
    tiny += ["--data.data_root", str(args.work / "prepared")]
    smoke = tiny if args.smoke else []
    sft_run, dpo_run, grpo_run = (args.work / s for s in STAGES)

    results = json.loads(json_path.read_text()) if json_path.is_file() else {}
    results.update(
        machine=platform.platform(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        test_questions=len(test),
    )

    def report(stage: str, row: dict) -> None:
        results[stage] = row
        start = results.get("sft", {}).get("exact_match")
        gain = f", {100 * (row['exact_match'] - start):+.1f} points over the start" if start is not None else ""
        if stage == "sft":
            gain = ""
        print(
            f"{stage}: {row['exact_match']:.1%} exact match on {len(test)} held-out questions after "
            f"{row['steps']} steps, {row['train_s'] / 60:.1f} minutes of training{gain}"
        )

    if "sft" in stages:
        if not (args.base / "checkpoints" / "last.ckpt").is_file():
            print(f"no base at {args.base}: pretraining it with configs/default.yaml")
            text = args.data / "smoke_base.txt"  # the smoke base reads the questions as plain text
            text.write_text("".join(r["messages"][0]["content"] + "\n" for r in train_rows))
            size = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 16, "model.block_size": 64}
            tiny_base = {**size, "trainer.max_steps": 4, "data.source": text}
            train({"out_dir": args.base, **(tiny_base if args.smoke else {})}, smoke)
        sft = {
            "config": REPO / "configs" / "sft_addition.yaml",
            "init_from": args.base,
            "out_dir": sft_run,
            "data.source": args.data / "train.jsonl",
            "trainer.max_steps": args.sft_steps,
            "trainer.max_time": None,  # stopped by steps, not by the recipe's 5 minutes
            # ChatML whose turns end at <|im_end|> (the newline between turns opens the next one): with the default
            # ChatML a DPO completion ends with a newline after <|im_end|> that SFT never trains, whose log-prob
            # (-8 to -14 nats, varying with the answer) then outweighs the answer's own tokens in DPO's margin
            "data.chat_template": REPO / "configs" / "chatml_answer_ends_at_im_end.jinja",
        }
        steps, seconds = train(sft, smoke)
        base = find_checkpoint(args.base)
        row = {"exact_match": held_out(sft_run, test, sft_demo), "steps": steps, "train_s": round(seconds, 1)}
        report("sft", {**row, "base": f"{base} ({checkpoint_summary(read_checkpoint(base), base)})"})
    elif not (sft_run / "checkpoints").is_dir():
        p.error(f"no SFT run at {sft_run}: run the sft stage first (--stages sft,{args.stages})")
    elif "sft" not in results:  # a start measured elsewhere is not this one's: measure it again
        report("sft", {"exact_match": held_out(sft_run, test, sft_demo), "steps": None, "train_s": 0.0})

    if "dpo" in stages:
        start = time.perf_counter()
        model, tokenizer = load_chat_model(sft_run)
        questions = [pairs_script.question(r, f"train row {i}") for i, r in enumerate(train_rows)]
        pairs, counts = pairs_script.make_pairs(
            model, tokenizer, questions, samples=args.dpo_samples, temperature=1.0, max_new_tokens=8
        )
        pairs_script.write_jsonl(pairs, args.work / "pairs.jsonl")
        pairs_s = time.perf_counter() - start
        print(
            f"pairs: the SFT model answers {counts['greedy_right']:,} of {counts['questions']:,} training questions "
            f"right (greedy); {counts['pairs']:,} pairs of its own wrong answers in {pairs_s:.0f} s"
        )
        dpo = {
            "config": REPO / "configs" / "dpo_addition.yaml",
            "init_from": sft_run,
            "out_dir": dpo_run,
            "data.source": args.work / "pairs.jsonl",
            "trainer.max_steps": args.dpo_steps,
            "dpo.beta": args.dpo_beta,
            **({"dpo.rpo_alpha": args.dpo_rpo_alpha} if args.dpo_rpo_alpha is not None else {}),
            **({"optim.learning_rate": args.dpo_lr} if args.dpo_lr is not None else {}),
        }
        steps, seconds = train(dpo, smoke)
        row = {"exact_match": held_out(dpo_run, test, sft_demo), "steps": steps, "train_s": round(seconds, 1)}
        config = yaml.safe_load(dpo["config"].read_text())
        lr = args.dpo_lr or config["optim"]["learning_rate"]
        rpo_alpha = args.dpo_rpo_alpha if args.dpo_rpo_alpha is not None else config["dpo"].get("rpo_alpha", 0.0)
        row.update(
            pairs=counts["pairs"],
            pairs_s=round(pairs_s, 1),
            beta=args.dpo_beta,
            rpo_alpha=rpo_alpha,
            lr=lr,
            samples=args.dpo_samples,
        )
        report("dpo", row)

    if "grpo" in stages:
        addition.write_jsonl([addition.prompt_row(r) for r in train_rows], args.data / "prompts.jsonl")
        grpo = {
            "config": REPO / "configs" / "grpo_addition.yaml",
            "init_from": sft_run,
            "out_dir": grpo_run,
            "data.source": args.data / "prompts.jsonl",
            "trainer.max_steps": args.grpo_steps,
            **({"optim.learning_rate": args.grpo_lr} if args.grpo_lr is not None else {}),
        }
        steps, seconds = train(grpo, smoke)
        row = {"exact_match": held_out(grpo_run, test, sft_demo), "steps": steps, "train_s": round(seconds, 1)}
        config = yaml.safe_load(grpo["config"].read_text())
        row.update(
            lr=args.grpo_lr or config["optim"]["learning_rate"],
            group_size=config["grpo"]["group_size"],
            prompts_per_step=config["data"]["batch_size"],
        )
        report("grpo", row)

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {json_path}")
    return results


if __name__ == "__main__":
    main()
