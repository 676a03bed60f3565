"""The lm-evaluation-harness on a multiple-choice task: requests per second through minigpt's MiniGPTLM and
through the harness's HFLM on the model's Hugging Face export, and what a 500-item task takes at that rate.

    python benchmarks/bench_eval.py                  # a GPT-2 124M-shaped model, 12 items (about 2 minutes on 2 cores)

Method and results: docs/evaluation.md#speed.
"""

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task is local: never reach the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks import common

SHAPES = {  # n_layer, n_head, n_embd, block_size
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=256),
}
GPT2_VOCAB = 50257
BATCH = 4  # requests per call, through both backends
LETTERS = "abcdefghijklmnopqrstuvwxyz"
COLUMNS = [("backend", "backend", ""), ("shape", "shape", ""), ("params_m", "params (M)", ".1f")]
COLUMNS += [("items", "items", "d"), ("requests", "requests", "d"), ("seconds", "seconds", ".1f")]
COLUMNS += [("requests_per_s", "requests/s", ".2f"), ("minutes_for_500_items", "500 items (min)", ".1f")]
COLUMNS += [("acc", "acc", ".3f")]


def write_task(folder: Path, items: int, context_chars: int = 80, ending_chars: int = 25) -> dict[str, Any]:
    """A HellaSwag-shaped multiple-choice task of random lowercase words: its JSONL, and the harness's config."""
    rng = random.Random(0)

    def text(n: int) -> str:
        words = []
        while sum(len(w) + 1 for w in words) < n:
            words.append("".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8))))
        return " ".join(words)[:n]

    rows = [
        dict(ctx=text(context_chars), endings=[text(ending_chars) for _ in range(4)], label=i % 4) for i in range(items)
    ]
    (folder / "mc.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = dict(data_files=dict(test=str(folder / "mc.jsonl")))
    config = dict(task="bench_mc", dataset_path="json", dataset_kwargs=data, test_split="test")
    config |= dict(output_type="multiple_choice", doc_to_text="{{ctx}}", doc_to_target="{{label}}")
    return config | dict(doc_to_choice="{{endings}}", metric_list=[dict(metric="acc"), dict(metric="acc_norm")])


def timed_run(lm: Any, task: dict[str, Any]) -> dict[str, Any]:
    """simple_evaluate on the task, timing the loglikelihood calls; requests, seconds, accuracy."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    spent, count = [0.0], [0]
    real = lm.loglikelihood

    def loglikelihood(requests, *args, **kwargs):
        start = time.perf_counter()
        out = real(requests, *args, **kwargs)
        spent[0] += time.perf_counter() - start
        count[0] += len(requests)
        return out

    lm.loglikelihood = loglikelihood
    tasks = TaskManager(include_defaults=False)
    results = simple_evaluate(model=lm, tasks=[task], task_manager=tasks, bootstrap_iters=0, log_samples=False)
    acc = results["results"]["bench_mc"]["acc,none"]
    return dict(requests=count[0], seconds=spent[0], requests_per_s=count[0] / spent[0], acc=acc)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__, "bench_eval")
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt2")
    args = p.parse_args(argv)
    shape = "tiny" if args.quick else args.shape
    items = {"tiny": 4, "small": 40, "gpt2": 12}[shape]
    device = torch.device("cpu" if args.device == "auto" else args.device)  # HFLM and minigpt on the same device
    label = common.start(args, device)

    from lm_eval.models.huggingface import HFLM

    from minigpt import GPT, GPTConfig
    from minigpt.core.tokenizers import CharTokenizer
    from minigpt.evaluation.harness import MiniGPTLM
    from minigpt.export.hf import export_hf

    tokenizer = CharTokenizer(LETTERS + " \n")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPES[shape], vocab_size=GPT2_VOCAB)).to(device).eval()
    with tempfile.TemporaryDirectory() as tmp:
        task = write_task(Path(tmp), items)
        ours = timed_run(MiniGPTLM(model, tokenizer, batch_size=BATCH), task)
        export = export_hf(model, tokenizer, Path(tmp) / "export")
        hflm = HFLM(pretrained=str(export), device=str(device), dtype="float32", batch_size=BATCH)
        theirs = timed_run(hflm, task)
    rows = []
    for backend, r in (("minigpt (MiniGPTLM)", ours), ("HFLM on the export", theirs)):
        row = dict(backend=backend, shape=shape, params_m=model.num_params() / 1e6, items=items, **r)
        rows.append(row | dict(minutes_for_500_items=500 * 4 / r["requests_per_s"] / 60))
    common.print_table(rows, COLUMNS)
    same = ours["acc"] == theirs["acc"]
    print(f"same accuracy through both: {same} ({ours['acc']:.3f})")
    return common.finish(dict(machine=label, batch_size=BATCH, rows=rows, same_accuracy=same), args)


if __name__ == "__main__":
    main()
