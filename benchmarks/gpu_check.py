"""The GPU paths in one pass: a PASS/FAIL/SKIP line per check, a summary, exit code 1 on any FAIL.

    python benchmarks/gpu_check.py --out results/gpu_check.json          # on a CUDA machine, ~4 minutes
    python benchmarks/gpu_check.py --device cpu --quick                  # tiny sizes: the script's own smoke test
    python benchmarks/gpu_check.py --only attention,serve                # a subset (names below)

Checks (each in its own try/except, so one failure hides nothing else):
  attention_fp32  sdpa, manual and einops give the logits and gradients of one another in float32 (1e-5 / 1e-4
                  of scale, as tests/core/test_model.py), gpt and llama-with-GQA blocks; KV-cache decode = full
  attention_bf16  the same under bf16 autocast: each path close to the float32 logits and to the others
  flash_kernel    (GPU only) forward + backward in bf16 inside sdpa_kernel(FLASH_ATTENTION), GQA included, and
                  the model's own sdpa_backend="flash"; the kernel torch picks by default is named (profiler)
  train           train.py as a subprocess: --trainer.precision auto (must resolve to bf16-mixed on a GPU),
                  --compile true, ~50 steps on a generated corpus; training loss falls
  resume          train.py --resume true to more steps: restores, reaches the new max_steps, loss no worse
  sample          sample.py --device on the run: eager, --compile, --quantize int8, int8 + --compile (greedy);
                  compiled must equal eager, int8's distance is reported
  lora            train.py --init_from RUN --finetune lora (and --lora.base_dtype bfloat16): adapters only
                  train, the base is untouched, the merged run loads and generates on the device
  serve           minigpt.serve.engine.Engine's batched greedy decode = generate() one prompt at a time
  decode_speed    GPT-2-124M shape (random weights, benchmarks/bench_decode.py's folder): greedy 128 tokens,
                  eager vs compiled step (and int8 compiled, transformers' generate) in tokens/s
--out PATH writes the results as JSON, and the subprocesses' logs beside it (PATH's stem + _logs/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # minigpt runs from the repository (not installed on the GPU machine)

import torch  # noqa: E402

CHECKS = ["attention", "flash", "train", "resume", "sample", "lora", "serve", "decode_speed"]


class Skip(Exception):
    """The check does not apply here (e.g. a GPU-only check on a CPU)."""


class Ctx:
    def __init__(self, args: argparse.Namespace, work: Path, logs: Path | None) -> None:
        self.args, self.work, self.logs = args, work, logs
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.quick = args.quick
        self.start = time.perf_counter()
        self.run_dir: Path | None = None  # the trained run, once `train` passed
        self.corpus: Path | None = None
        self.train_val_loss: float | None = None

    def remaining(self) -> float:
        return self.args.budget - (time.perf_counter() - self.start)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------
# Subprocesses: train.py and sample.py from the repository, with its path on PYTHONPATH


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_script(
    ctx: Ctx, name: str, script: str, argv: list[str], timeout: float | None = None, stdout_only: bool = False
) -> str:
    """Run `python script argv` in the repository root -> its stdout, then its stderr (only stdout with
    stdout_only; the log file holds both); raises on a non-zero exit."""
    limit = max(10.0, min(timeout or 1e9, ctx.remaining()))
    cmd = [sys.executable, str(REPO / script), *map(str, argv)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            timeout=limit,
        )
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
        stdout, stderr, rc = text[0], text[1] + f"\n[gpu_check: killed after {limit:.0f} s]", -9
    out = stdout + ("\n" if stdout and not stdout.endswith("\n") else "") + stderr
    seconds = time.perf_counter() - t0
    if ctx.logs is not None:
        ctx.logs.mkdir(parents=True, exist_ok=True)
        (ctx.logs / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n# exit {rc}, {seconds:.1f} s\n{out}")
    print(f"    [{name}: exit {rc}, {seconds:.1f} s]", flush=True)
    if rc != 0:
        tail = "\n".join(out.strip().splitlines()[-12:])
        raise RuntimeError(f"{script} exited {rc} after {seconds:.0f} s; last lines:\n{tail}")
    return stdout if stdout_only else out


def make_corpus(path: Path, n_lines: int, seed: int = 0) -> Path:
    """Text with learnable structure (a small vocabulary of words), as tests/conftest.py builds it."""
    import random

    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while cats sit on warm mats and birds sing".split()
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(n_lines)) + "\n")
    return path


def train_args(ctx: Ctx, out_dir: Path, steps: int, decay_steps: int) -> list[str]:
    q = ctx.quick
    args = {
        "data.source": ctx.corpus,
        "data.data_root": ctx.work / "data",
        "out_dir": out_dir,
        "data.batch_size": 8 if q else 32,
        "data.val_batches": 2,
        "optim.warmup_steps": 5,
        "optim.learning_rate": 0.01,
        "optim.decay_steps": decay_steps,
        "trainer.max_steps": steps,
        "trainer.val_check_interval": 10 if q else 25,
        "trainer.log_every_n_steps": 2 if q else 5,
        "trainer.enable_progress_bar": "false",
        "checkpoint_every": 10 if q else 25,
        "sample_tokens": 8,
        "trainer.accelerator": "gpu" if ctx.cuda else "cpu",
        "trainer.devices": 1,
        "trainer.precision": "auto",
    }
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def model_args(ctx: Ctx) -> list[str]:
    size = (
        dict(n_layer=1, n_head=4, n_embd=32, block_size=32)
        if ctx.quick
        else dict(n_layer=2, n_head=4, n_embd=128, block_size=64)
    )
    return ["--model.arch", "llama", "--model.n_kv_head", "2"] + [
        x for k, v in size.items() for x in (f"--model.{k}", str(v))
    ]


def train_losses(run_dir: Path) -> list[float]:
    """train_loss from the run's TensorBoard events, in step order ([] without tensorboard)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return []
    points: dict[int, float] = {}
    for events in sorted(run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if "train_loss" in acc.Tags().get("scalars", []):
            points.update({s.step: s.value for s in acc.Scalars("train_loss")})
    return [points[k] for k in sorted(points)]


def full_val_loss(output: str) -> float | None:
    found = re.findall(r"full val loss ([0-9.]+)", output)
    return float(found[-1]) if found else None


# --------------------------------------------------------------------------------------------------
# 1. Attention paths and blocks


def attention_variants(ctx: Ctx) -> list[tuple[str, Any]]:
    from minigpt import GPTConfig

    if ctx.quick:
        base = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=256)
        gqa = [("gpt", 4), ("llama", 2), ("llama", 1)]
    else:
        base = dict(n_layer=2, n_head=8, n_embd=256, block_size=256, vocab_size=512)  # head_dim 32
        gqa = [("gpt", 8), ("gpt", 2), ("llama", 2), ("llama", 1)]
    return [(f"{arch}/kv{kv}", GPTConfig(arch=arch, n_kv_head=kv, **base)) for arch, kv in gqa]


def build_model(cfg: Any, device: torch.device, seed: int = 0) -> Any:
    from minigpt import GPT

    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():  # biases start at zero; randomise them so they flow through every path too
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    return model.to(device).eval()


def batch(ctx: Ctx, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    B, T = (3, 64) if ctx.quick else (4, 256)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g).to(ctx.device)
    return ids[:, :-1], ids[:, 1:]


def forward_backward(
    model: Any, attention: str, idx: torch.Tensor, targets: torch.Tensor, autocast: torch.dtype | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.set_attention(attention)
    model.zero_grad(set_to_none=True)
    with torch.autocast(idx.device.type, dtype=autocast, enabled=autocast is not None):
        logits, loss = model(idx, targets)
    loss.backward()
    return logits.detach().float(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def check_attention_fp32(ctx: Ctx) -> tuple[str, dict]:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here (torch's default, made explicit)
    torch.backends.cudnn.allow_tf32 = False
    details, bad = {}, []
    for name, cfg in attention_variants(ctx):
        model = build_model(cfg, ctx.device)
        idx, targets = batch(ctx, cfg)
        ref, ref_grads = forward_backward(model, "sdpa", idx, targets)
        row = {}
        for path in ("manual", "einops"):
            logits, grads = forward_backward(model, path, idx, targets)
            dl = (logits - ref).abs().max().item()
            dg = max((grads[n] - g).abs().max().item() / (g.abs().max().item() + 1e-12) for n, g in ref_grads.items())
            row[path] = {"logits_max_abs_diff": dl, "grad_max_rel_diff": dg}
            if not (dl <= 1e-5 and dg <= 1e-4):
                bad.append(f"{name} {path}: logits {dl:.2e}, grads {dg:.2e} of scale")
        for path in ("sdpa", "manual", "einops"):  # the KV cache's decode = the full forward, on this device
            model.set_attention(path)
            with torch.no_grad():
                full = model(idx[:2])[0]
                cache = model.new_kv_cache(2)
                steps = [model(idx[:2, :17], kv_cache=cache, input_pos=0)[0]]
                steps += [model(idx[:2, p : p + 1], kv_cache=cache, input_pos=p)[0] for p in range(17, 40)]
            dc = (torch.cat(steps, 1) - full[:, :40]).abs().max().item()
            row[f"kv_cache_{path}"] = dc
            if not dc <= 1e-5:
                bad.append(f"{name} {path}: KV-cache decode differs from the full forward by {dc:.2e}")
        details[name] = row
    worst = max(r[p]["logits_max_abs_diff"] for r in details.values() for p in ("manual", "einops"))
    if bad:
        return "FAIL", {"problems": bad, **details}
    return (
        f"3 paths x {len(details)} blocks equal in float32 (worst logits diff {worst:.1e}, tol 1e-5), "
        "KV-cache decode = full forward",
        details,
    )


def check_attention_bf16(ctx: Ctx) -> tuple[str, dict]:
    details, bad = {}, []
    tol = 0.05  # of the largest float32 logit: bf16 keeps 8 bits of mantissa, through a few layers
    for name, cfg in attention_variants(ctx):
        model = build_model(cfg, ctx.device)
        idx, targets = batch(ctx, cfg)
        ref32, _ = forward_backward(model, "sdpa", idx, targets)
        scale = ref32.abs().max().item()
        out = {p: forward_backward(model, p, idx, targets, torch.bfloat16)[0] for p in ("sdpa", "manual", "einops")}
        row = {}
        for p, logits in out.items():
            vs32 = (logits - ref32).abs().max().item() / scale
            vs_sdpa = (logits - out["sdpa"]).abs().max().item() / scale
            agree = (logits.argmax(-1) == ref32.argmax(-1)).float().mean().item()
            row[p] = {"rel_diff_vs_fp32": vs32, "rel_diff_vs_sdpa_bf16": vs_sdpa, "argmax_agreement_vs_fp32": agree}
            if not (vs32 <= tol and vs_sdpa <= tol):
                bad.append(f"{name} {p}: {vs32:.3f} of scale from float32, {vs_sdpa:.3f} from sdpa bf16")
        details[name] = row
    worst = max(r[p]["rel_diff_vs_fp32"] for r in details.values() for p in r)
    if bad:
        return "FAIL", {"problems": bad, **details}
    return f"bf16 autocast: every path within {worst:.3f} of the float32 logits' scale (tol {tol})", details


def check_flash(ctx: Ctx) -> tuple[str, dict]:
    if not ctx.cuda and not ctx.args.flash_on_cpu:
        raise Skip("GPU-only: which fused SDPA kernel a GPU takes (--flash-on-cpu runs it on the CPU's flash kernel)")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from minigpt import GPTConfig

    details, bad = {"device": torch.cuda.get_device_name() if ctx.cuda else "cpu"}, []
    for name, cfg in attention_variants(ctx):
        model = build_model(cfg, ctx.device)
        idx, targets = batch(ctx, cfg)
        ref, _ = forward_backward(model, "manual", idx, targets, torch.bfloat16)
        row: dict[str, Any] = {}
        try:  # the training step: forward (is_causal, no mask) and backward, flash only
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                logits, _ = forward_backward(model, "sdpa", idx, targets, torch.bfloat16)
            row["flash_train_rel_diff_vs_manual"] = (logits - ref).abs().max().item() / ref.abs().max().item()
            if row["flash_train_rel_diff_vs_manual"] > 0.05:
                bad.append(f"{name}: flash logits {row['flash_train_rel_diff_vs_manual']:.3f} of scale from manual")
        except Exception as e:
            bad.append(
                f"{name}: forward/backward restricted to FLASH_ATTENTION failed: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:300]}"
            )
        try:  # the config's own switch: sdpa_backend="flash"
            flash = build_model(GPTConfig.from_dict({**cfg.to_dict(), "sdpa_backend": "flash"}), ctx.device)
            forward_backward(flash, "sdpa", idx, targets, torch.bfloat16)
            row["sdpa_backend_flash"] = "ok"
        except Exception as e:
            bad.append(f"{name}: sdpa_backend='flash' failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        try:  # decoding (prefill, then one token with no mask) under flash only: reported, not required
            with (
                sdpa_kernel(SDPBackend.FLASH_ATTENTION),
                torch.no_grad(),
                torch.autocast(ctx.device.type, torch.bfloat16),
            ):
                model.set_attention("sdpa")
                cache = model.new_kv_cache(2)
                model(idx[:2, :17], kv_cache=cache, input_pos=0)
                model(idx[:2, 17:18], kv_cache=cache, input_pos=17)
            row["flash_decode"] = "ok"
        except Exception as e:
            row["flash_decode"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        model.set_attention("sdpa")  # which kernel does torch pick unrestricted?
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])) as prof:
            forward_backward(model, "sdpa", idx, targets, torch.bfloat16)
            ctx.sync()
        row["default_sdpa_ops"] = sorted(
            {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "attention" in e.key.lower()}
        )[:8]
        details[name] = row
    if bad:
        return "FAIL", {"problems": bad, **details}
    picked = sorted(
        {
            op
            for r in details.values()
            if isinstance(r, dict)
            for op in r.get("default_sdpa_ops", [])
            if op.startswith("aten::_")
        }
    )
    return (
        f"bf16 forward+backward runs inside sdpa_kernel(FLASH_ATTENTION) for every block (GQA too); "
        f"unrestricted torch picks {', '.join(picked) or '?'}",
        details,
    )


# --------------------------------------------------------------------------------------------------
# 2. train.py, --resume, sample.py


def check_train(ctx: Ctx) -> tuple[str, dict]:
    ctx.corpus = make_corpus(ctx.work / "words.txt", 800 if ctx.quick else 4000)
    steps = ctx.args.steps or (20 if ctx.quick else 50)
    run = ctx.work / "run"
    argv = train_args(ctx, run, steps, decay_steps=2 * steps) + model_args(ctx)
    argv += ["--compile", "false" if ctx.args.no_compile else "true"]
    out = run_script(ctx, "train", "train.py", argv)
    details: dict[str, Any] = {"argv": argv}
    m = re.search(r"precision auto -> (\S+)", out)
    details["precision"] = m.group(1) if m else None
    details["compiled"] = bool(re.search(r"torch\.compile: compiled in ([0-9.]+)s", out))
    details["compile_line"] = next((l for l in out.splitlines() if "torch.compile" in l), None)
    losses = train_losses(run)
    details["train_loss_first_last"] = (losses[0], losses[-1]) if losses else None
    details["full_val_loss"] = full_val_loss(out)
    details["tail"] = out.strip().splitlines()[-4:]
    problems = []
    if details["precision"] is None:
        problems.append("no 'precision auto -> ...' line in the output")
    elif ctx.cuda and details["precision"] != "bf16-mixed":
        problems.append(f"precision auto chose {details['precision']} on the GPU, expected bf16-mixed")
    details["lightning_amp_line"] = next((l for l in out.splitlines() if "Automatic Mixed Precision" in l), None)
    if ctx.cuda and "bfloat16" not in (details["lightning_amp_line"] or ""):
        problems.append("Lightning did not say 'Using bfloat16 Automatic Mixed Precision (AMP)'")
    if not ctx.args.no_compile and not details["compiled"]:
        problems.append("--compile true, but no 'torch.compile: compiled in' line")
    if losses:
        if not losses[-1] < losses[0] - 0.1:
            problems.append(f"train_loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}")
    elif details["full_val_loss"] is None or details["full_val_loss"] > math.log(20) - 0.3:
        problems.append(f"no train_loss events, and full val loss {details['full_val_loss']} is not below chance")
    if not (run / "checkpoints" / "last.ckpt").is_file():
        problems.append("no checkpoints/last.ckpt")
    if problems:
        return "FAIL", {"problems": problems, **details}
    ctx.run_dir, ctx.train_val_loss = run, details["full_val_loss"]
    loss = f"train_loss {losses[0]:.2f} -> {losses[-1]:.2f}" if losses else f"val {details['full_val_loss']}"
    return (
        f"{steps} steps, precision auto -> {details['precision']}, compiled={details['compiled']}, {loss}, "
        f"full val loss {details['full_val_loss']}",
        details,
    )


def need_run(ctx: Ctx) -> Path:
    if ctx.run_dir is None:
        raise Skip("needs the run of the train check, which did not pass")
    return ctx.run_dir


def check_resume(ctx: Ctx) -> tuple[str, dict]:
    from minigpt.core.checkpoint import read_checkpoint

    run = need_run(ctx)
    steps = ctx.args.steps or (20 if ctx.quick else 50)
    before = ctx.train_val_loss
    first_step = read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"]
    more = steps + (10 if ctx.quick else 30)
    argv = train_args(ctx, run, more, decay_steps=2 * steps) + model_args(ctx) + ["--resume", "true"]
    argv += ["--compile", "false" if ctx.args.no_compile else "true"]
    out = run_script(ctx, "resume", "train.py", argv)
    last_step = read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"]
    after = full_val_loss(out)
    details = {
        "steps_before": first_step,
        "steps_after": last_step,
        "full_val_loss_before": before,
        "full_val_loss_after": after,
        "restored_line": next((l for l in out.splitlines() if "estor" in l), None),
    }
    problems = []
    if last_step != more:
        problems.append(f"last.ckpt at step {last_step}, expected {more}")
    if f"after {more} steps" not in out:
        problems.append(f"no 'after {more} steps' in the output")
    if details["restored_line"] is None:
        problems.append("Lightning did not say it restored the checkpoint")
    if before is not None and after is not None and after > before + 0.05:
        problems.append(f"full val loss rose on resume: {before} -> {after}")
    if problems:
        return "FAIL", {"problems": problems, **details}
    return f"resumed at step {first_step} -> {last_step}, full val loss {before} -> {after}", details


def check_sample(ctx: Ctx) -> tuple[str, dict]:
    run = need_run(ctx)
    n = 40 if ctx.quick else 150
    base = [
        "--ckpt",
        run,
        "--device",
        ctx.args.device,
        "--prompt",
        "the quick ",
        "--temperature",
        "0",
        "--max_new_tokens",
        n,
        "--seed",
        "1",
    ]
    ways = {
        "eager": [],
        "compile": ["--compile"],
        "int8": ["--quantize", "int8"],
        "int8_compile": ["--quantize", "int8", "--compile"],
    }
    if ctx.args.no_compile:
        ways = {k: v for k, v in ways.items() if "compile" not in k}
    texts, details, problems = {}, {}, []
    for way, extra in ways.items():
        try:
            text = run_script(ctx, f"sample_{way}", "sample.py", base + extra, stdout_only=True)
        except Exception as e:
            problems.append(f"{way}: {e}")
            continue
        log = (ctx.logs / f"sample_{way}.log").read_text()
        notes = [l for l in log.splitlines() if l.startswith("note:")]
        texts[way] = text
        details[way] = {"text": text[:200], "notes": notes}
        if notes:
            problems.append(f"{way}: {notes[0]}")
    if "eager" not in texts:
        return "FAIL", {"problems": problems, **details}
    eager = texts["eager"]
    if not eager.startswith("the quick ") or len(eager) < len("the quick ") + n // 2:
        problems.append(f"eager text too short or without the prompt: {eager[:80]!r}")
    prompt_chars = len("the quick ")  # a char model: one character per token, so characters count tokens
    for way, text in texts.items():
        gen, ref = text[prompt_chars:].rstrip("\n"), eager[prompt_chars:].rstrip("\n")
        first = next((i for i, (x, y) in enumerate(zip(gen, ref)) if x != y), None)
        if first is None and len(gen) != len(ref):
            first = min(len(gen), len(ref))
        agree = sum(x == y for x, y in zip(gen, ref)) / max(1, len(ref))
        details[way] |= {
            "equal_to_eager": first is None,
            "first_different_token": first,
            "tokens_equal_fraction": round(agree, 3),
        }
        if way == "compile" and first is not None:  # float32 either way: the same ids expected
            problems.append(f"--compile differs from eager from generated token {first} of {len(ref)}")
    summary = ", ".join(
        f"{w} "
        + (
            "= eager"
            if d["equal_to_eager"]
            else f"!= eager from token {d['first_different_token']} of {n} "
            f"({100 * d['tokens_equal_fraction']:.0f}% of positions equal)"
        )
        for w, d in details.items()
        if w != "eager" and "equal_to_eager" in d
    )
    if problems:
        return "FAIL", {"problems": problems, **details}
    return f"sample.py --device {ctx.args.device} gives text; vs eager greedy: {summary}", details


# --------------------------------------------------------------------------------------------------
# 3. LoRA


def lora_run(ctx: Ctx, name: str, steps: int, extra: list[str]) -> tuple[Path, dict]:
    from minigpt.core.checkpoint import model_state_dict, read_checkpoint
    from minigpt.core.lora import fingerprint
    from minigpt.loading import load_lora_run, load_model

    run = need_run(ctx)
    out_dir = ctx.work / name
    argv = train_args(ctx, out_dir, steps, decay_steps=2 * steps) + [
        "--init_from",
        run,
        "--finetune",
        "lora",
        "--lora.rank",
        "4",
        "--eval_full",
        "false",
    ]
    out = run_script(ctx, name, "train.py", argv + extra)
    ckpt = read_checkpoint(out_dir / "checkpoints" / "last.ckpt")
    saved = model_state_dict(ckpt)
    source, _ = load_model(run)
    adapted, _, _ = load_lora_run(out_dir)
    state = adapted.state_dict()
    base_kept = all(
        k in state and torch.equal(state[k].float(), t.to(state[k].dtype).float())
        for k, t in source.state_dict().items()
    )
    lora_b = [t for k, t in saved.items() if "lora_B" in k]
    details = {
        "saved_tensors": len(saved),
        "all_saved_are_adapters": all("lora_" in k for k in saved),
        "optimizer_states": len(ckpt["optimizer_states"][0]["state"]),
        "lora_B_trained": any(t.abs().max().item() > 0 for t in lora_b),
        "base_fingerprint_matches": ckpt["minigpt"]["lora"]["base"]["fingerprint"] == fingerprint(source),
        "base_weights_unchanged": base_kept,
        "precision": (m.group(1) if (m := re.search(r"precision auto -> (\S+)", out)) else None),
    }
    merged, tok = load_model(out_dir, device=ctx.device)  # merged on load, as sample.py/eval.py/serve do
    from minigpt.core.generation import generate

    ids = generate(merged, torch.tensor([tok.encode("the ")], device=ctx.device), 20, temperature=0)
    details["generated"] = tok.decode(ids[0].tolist())
    return out_dir, details


def check_lora(ctx: Ctx) -> tuple[str, dict]:
    steps = 6 if ctx.quick else 20
    details, problems = {}, []
    for name, extra in (("lora", []), ("lora_bf16_base", ["--lora.base_dtype", "bfloat16"])):
        try:
            _, d = lora_run(ctx, name, steps if name == "lora" else max(3, steps // 2), extra)
        except Skip:
            raise
        except Exception as e:
            problems.append(f"{name}: {type(e).__name__}: {e}")
            continue
        details[name] = d
        for key in ("all_saved_are_adapters", "lora_B_trained", "base_fingerprint_matches", "base_weights_unchanged"):
            if not d[key]:
                problems.append(f"{name}: {key} is false")
        if d["saved_tensors"] != d["optimizer_states"]:
            problems.append(f"{name}: {d['optimizer_states']} optimizer states for {d['saved_tensors']} adapters")
        if ctx.cuda and d["precision"] != "bf16-mixed":
            problems.append(f"{name}: precision auto -> {d['precision']} on the GPU")
    if problems:
        return "FAIL", {"problems": problems, **details}
    d = details["lora"]
    return (
        f"{steps} LoRA steps on {ctx.args.device}: {d['saved_tensors']} adapter tensors saved and trained, "
        f"base frozen (fingerprint and weights equal); bf16 base too; merged run generates",
        details,
    )


# --------------------------------------------------------------------------------------------------
# 4. The serve engine


def check_serve(ctx: Ctx) -> tuple[str, dict]:
    import math as m

    from minigpt import GPT, GPTConfig
    from minigpt.core.generation import generate
    from minigpt.core.tokenizers import CharTokenizer
    from minigpt.serve.engine import Engine, Request

    chars = "\n !',.:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXY"
    tok = CharTokenizer(chars)
    prompts = ["hello there", "what is two plus two?", "a", "the cat sat on the mat, and then", "why", "Good day!"]
    lengths = [30, 50, 12, 40, 60, 25]
    details, problems = {}, []
    for arch, kv in (("llama", 2), ("gpt", 4)):
        torch.manual_seed(0)  # tests/support.py's varied_gpt: weights large enough that greedy varies
        model = GPT(
            GPTConfig(
                arch=arch,
                n_layer=2,
                n_head=4,
                n_kv_head=kv,
                n_embd=64 if ctx.quick else 256,
                block_size=128,
                vocab_size=tok.vocab_size,
            )
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.02)
                elif p.dim() >= 2:
                    p.normal_(0, 2 / m.sqrt(p.shape[-1]))
        model = model.to(ctx.device).eval()
        alone = [
            tok.decode(
                generate(
                    model, torch.tensor([tok.encode(p)], device=ctx.device), n, temperature=0, vocab_size=tok.vocab_size
                )[0, len(p) :].tolist()
            )
            for p, n in zip(prompts, lengths)
        ]
        engine = Engine(model, tok, max_batch=4, max_queue=16)  # 6 requests, 4 rows: some join mid-way
        got = [""] * len(prompts)
        done = [threading.Event() for _ in prompts]

        def on_update(i: int) -> Callable:
            def update(u: Any) -> None:
                got[i] += u.text
                if u.finish_reason is not None:
                    details.setdefault(f"{arch}_finish", {})[i] = u.finish_reason
                    if u.error:
                        problems.append(f"{arch} request {i}: {u.error}")
                    done[i].set()

            return update

        engine.start()
        try:
            for i, (p, n) in enumerate(zip(prompts, lengths)):
                engine.submit(Request(prompt=tok.encode(p), max_tokens=n, temperature=0), on_update(i))
            if not all(e.wait(timeout=max(5.0, min(120.0, ctx.remaining()))) for e in done):
                problems.append(f"{arch}: requests did not finish")
            steps = engine.steps
        finally:
            engine.stop()
        same = [a == b for a, b in zip(got, alone)]
        details[arch] = {"equal": same, "engine_steps": steps, "tokens": sum(lengths)}
        for i, ok in enumerate(same):
            if not ok:
                at = next((j for j, (a, b) in enumerate(zip(got[i], alone[i])) if a != b), None)
                problems.append(
                    f"{arch} prompt {i}: batched differs from generate() at char {at}: "
                    f"{got[i][:40]!r} vs {alone[i][:40]!r}"
                )
    if problems:
        return "FAIL", {"problems": problems, **details}
    return (
        f"Engine on {ctx.args.device} (4 rows, 6 requests, llama GQA and gpt): batched greedy = generate() "
        f"alone for every prompt ({details['llama']['engine_steps']} batched steps for {sum(lengths)} tokens)",
        details,
    )


# --------------------------------------------------------------------------------------------------
# 5. Decode speed


def check_decode_speed(ctx: Ctx) -> tuple[str, dict]:
    from benchmarks.bench_decode import SHAPE_NAMES, build_hf_folder, hf_generate
    from minigpt.core.generation import generate
    from minigpt.loading import load_model

    tokens = 16 if ctx.quick else 128
    repeats = 1 if ctx.quick else 3
    src = build_hf_folder("gpt2", ctx.quick, ctx.work / "gpt2", seed=0)
    fp32, _ = load_model(src, device=ctx.device)
    prompt = torch.randint(0, fp32.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(ctx.device)
    ways: dict[str, Callable[[], torch.Tensor]] = {"eager": lambda: generate(fp32, prompt, tokens, temperature=0.0)}
    if not ctx.args.no_compile:
        ways["compiled step"] = lambda: generate(fp32, prompt, tokens, temperature=0.0, compile=True)
        int8, _ = load_model(src, device=ctx.device, quantize="int8")
        ways["int8, compiled step"] = lambda: generate(int8, prompt, tokens, temperature=0.0, compile=True)
    try:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(ctx.device).eval()
        ways["transformers generate"] = lambda: hf_generate(hf, prompt, tokens)
    except Exception as e:  # a reference only
        print(f"    (transformers reference skipped: {type(e).__name__}: {e})")
    rows, ids = {}, {}
    for way, fn in ways.items():
        if ctx.remaining() < 20:
            rows[way] = {"skipped": "out of time"}
            continue
        ctx.sync()
        t0 = time.perf_counter()
        out = fn()
        ctx.sync()
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ctx.sync()
            times.append(time.perf_counter() - t0)
        ids[way] = out[0, prompt.size(1) :].tolist()
        best = sorted(times)[len(times) // 2]
        rows[way] = {"tokens_per_s": tokens / best, "first_call_s": first, "median_s": best}
        print(
            f"    {SHAPE_NAMES['gpt2']}{' (quick shape)' if ctx.quick else ''}, {way}: "
            f"{tokens / best:.1f} tokens/s (first call {first:.1f} s)",
            flush=True,
        )
    for way in ids:
        rows[way]["agreement_with_eager"] = sum(a == b for a, b in zip(ids[way], ids["eager"])) / tokens
    details = {
        "tokens": tokens,
        "prompt_tokens": 16,
        "repeats": repeats,
        "rows": rows,
        "device": torch.cuda.get_device_name() if ctx.cuda else "cpu",
    }
    timed = {w: r for w, r in rows.items() if "tokens_per_s" in r}
    if "eager" not in timed:
        return "FAIL", details
    speed = ", ".join(f"{w} {r['tokens_per_s']:.0f} tok/s" for w, r in timed.items())
    if "compiled step" in timed:
        speed += f" (compiled/eager x{timed['compiled step']['tokens_per_s'] / timed['eager']['tokens_per_s']:.2f})"
    return f"greedy {tokens} tokens, batch 1: {speed}", details


# --------------------------------------------------------------------------------------------------


def environment(ctx: Ctx) -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "device": str(ctx.device)}
    for mod in ("lightning", "transformers", "peft", "triton", "datasets", "jsonargparse", "tensorboard"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:
            env[mod] = f"missing ({type(e).__name__})"
    if ctx.cuda:
        env |= {
            "gpu": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda,
            "capability": torch.cuda.get_device_capability(),
            "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False),
        }
    from minigpt.core.compiled import compiler_available

    env["compiler_available"] = compiler_available(ctx.device.type)
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps (the CPU smoke test)")
    p.add_argument("--out", default=None, help="write the results as JSON here (logs beside it)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(CHECKS)}")
    p.add_argument("--steps", type=int, default=None, help="training steps of the train check (default 50; quick 20)")
    p.add_argument("--no-compile", dest="no_compile", action="store_true", help="skip every torch.compile path")
    p.add_argument(
        "--budget",
        type=float,
        default=540.0,
        help="seconds: a check that would start later is skipped, subprocesses are cut at it",
    )
    p.add_argument("--flash-on-cpu", dest="flash_on_cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here (use --device cpu --quick)")
    only = set(args.only.split(",")) if args.only else set(CHECKS)
    if unknown := only - set(CHECKS):
        p.error(f"--only: unknown check(s) {', '.join(sorted(unknown))}")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    logs = Path(args.out).with_name(Path(args.out).stem + "_logs") if args.out else work / "logs"
    ctx = Ctx(args, work, logs)
    env = environment(ctx)
    print("gpu_check: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)

    plan = [
        ("attention_fp32", "attention", check_attention_fp32),
        ("attention_bf16", "attention", check_attention_bf16),
        ("flash_kernel", "flash", check_flash),
        ("train", "train", check_train),
        ("resume", "resume", check_resume),
        ("sample", "sample", check_sample),
        ("lora", "lora", check_lora),
        ("serve", "serve", check_serve),
        ("decode_speed", "decode_speed", check_decode_speed),
    ]
    results = []
    for name, group, fn in plan:
        if group not in only:
            continue
        t0 = time.perf_counter()
        print(f"... {name} (at {t0 - ctx.start:.0f} s)", flush=True)
        details: dict[str, Any] = {}
        try:
            if ctx.remaining() < 15:
                raise Skip(f"out of time (--budget {args.budget:.0f} s)")
            message, details = fn(ctx)
            status = "PASS"
            if message == "FAIL":
                status, message = "FAIL", "; ".join(details.get("problems", ["failed"]))
        except Skip as e:
            status, message = "SKIP", str(e)
        except Exception as e:
            status, message = "FAIL", f"{type(e).__name__}: {e}"
            details = {"traceback": traceback.format_exc()[-3000:]}
        seconds = time.perf_counter() - t0
        results.append(
            {"check": name, "status": status, "seconds": round(seconds, 1), "message": message, "details": details}
        )
        print(f"{status} {name} ({seconds:.1f} s): {message}", flush=True)
        if status == "FAIL" and "traceback" in details:
            print("    " + details["traceback"].strip().splitlines()[-1], flush=True)

    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    total = time.perf_counter() - ctx.start
    print(
        f"\nSUMMARY: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {total:.0f} s on "
        f"{env.get('gpu', args.device)}",
        flush=True,
    )
    for r in results:
        print(f"  {r['status']:4} {r['check']}", flush=True)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "environment": env,
                    "args": vars(args),
                    "seconds": round(total, 1),
                    "counts": counts,
                    "results": results,
                },
                indent=2,
                default=str,
            )
        )
        print(f"wrote {path} (logs: {logs})", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
