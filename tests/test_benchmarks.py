"""Smoke tests: each benchmark script runs end to end with --quick (tiny shapes, a few steps) and writes the
JSON it promises.  The figures themselves are not checked: they depend on the machine."""

import json
import random
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `benchmarks` is a folder of scripts, not an installed package

from benchmarks import bench_attention, bench_decode, bench_sampling, bench_train, common  # noqa: E402

MACHINE_KEYS = {"cpu", "cores", "torch_threads", "torch", "python", "dtype", "device", "load_avg_1m"}


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_bench_attention_quick(tmp_path, capsys):
    out = tmp_path / "results" / "attention.json"  # the folder does not exist yet: the script creates it
    returned = bench_attention.main(["--quick", "--json", str(out), "--device", "cpu"])
    result = read(out)
    assert result["benchmark"] == "attention" and result["results"] == json.loads(json.dumps(returned["results"]))
    assert MACHINE_KEYS <= set(result["machine"])
    s = result["settings"]
    assert {"batch", "n_head", "head_dim", "gqa_kv_heads", "seq_lens", "dtype", "scope", "repeats"} <= set(s)
    rows = result["results"]
    assert len(rows) == 3 * 2 * len(s["seq_lens"])  # paths x GQA off/on x lengths
    assert {(r["path"], r["gqa"]) for r in rows} == {
        (p, g) for p in ("sdpa", "manual", "einops") for g in ("off", "on")
    }
    for r in rows:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["peak_bytes"] > 0
        assert r["n_kv_head"] == (s["n_head"] if r["gqa"] == "off" else s["gqa_kv_heads"])
    assert len(result["scaling"]) == 6 and all(x["mem_ratio"] > 0 for x in result["scaling"])
    assert result["checks"]  # sdpa-vs-others checks are present (their outcome depends on the machine)
    table = capsys.readouterr().out
    assert "| path | GQA |" in table and "peak MiB" in table


def test_bench_train_quick(tmp_path, capsys):
    out = tmp_path / "train.json"
    bench_train.main(["--quick", "--json", str(out), "--device", "cpu"])
    result = read(out)
    assert result["benchmark"] == "train" and MACHINE_KEYS <= set(result["machine"])
    assert set(result["peak_matmul"]) == {"float32", "bfloat16"}
    rows = result["results"]
    assert [(r["precision"], r["compile"]) for r in rows] == [("32-true", False), ("bf16-mixed", False)]
    for r in rows:
        for key in (
            "step_ms",
            "tokens_per_s",
            "mfu",
            "bare_step_ms",
            "bare_tokens_per_s",
            "overhead_pct",
            "flops_per_token",
            "warmup_s",
        ):
            assert key in r, key
        # mfu has 4 decimals: the quick shape's 232 tokens/s on a busy machine (load 10) is 0.0
        assert r["tokens_per_s"] > 0 and 0 <= r["mfu"] < 1
    assert {a["impl"] for a in result["adamw"]} == {"fused", "foreach", "for-loop"}
    assert "| shape | precision | compile |" in capsys.readouterr().out


def test_bench_train_overhead_breakdown_quick(tmp_path):
    out = tmp_path / "train.json"
    bench_train.main(
        [
            "--quick",
            "--json",
            str(out),
            "--device",
            "cpu",
            "--precisions",
            "32-true",
            "--overhead_detail",
            "on",
            "--adamw",
            "off",
            "--no_bare",
        ]
    )
    detail = read(out)["overhead_breakdown"]
    assert len(detail) == len(bench_train.DETAIL_VARIANTS)
    assert detail[0]["overhead_pct"] == 0
    for d in detail:  # every phase stamped, for Lightning and the bare loop alike
        assert all(d[f"{k}_ms"] >= 0 for k, *_ in bench_train.PHASES), d
    headline = read(out)["train_py_overhead"]  # train.py's loop vs the bare loop, in adjacent pairs
    assert headline["rounds"] == len(headline["ratios"]) == len(headline["bare_ms"]) == 2
    assert headline["ratio"] == pytest.approx(statistics.median(headline["ratios"]), rel=1e-3)


def test_pairs_alternate_their_order():
    order = []
    bench_train.alternating_pairs(lambda: order.append("a") or {}, lambda: order.append("b") or {}, 3)
    assert order == ["a", "b", "b", "a", "a", "b"]


def test_overhead_is_the_median_of_paired_ratios():
    """A ratio of adjacent runs, not of best-of times: the machine slowing down between rounds must not
    show up as overhead (best-of here would say 0.6 / 0.5 = +20%)."""
    bare = [{"step_s": 1.0}, {"step_s": 0.5}, {"step_s": 0.8}]
    lightning = [{"step_s": 1.05}, {"step_s": 0.6}, {"step_s": 0.84}]
    assert bench_train.paired_ratio(lightning, bare) == pytest.approx(1.05)


def test_bench_sampling_quick(tmp_path, capsys):
    out = tmp_path / "sampling.json"
    bench_sampling.main(["--quick", "--json", str(out), "--device", "cpu"])
    result = read(out)
    assert result["benchmark"] == "sampling" and MACHINE_KEYS <= set(result["machine"])
    assert [r["kv_cache"] for r in result["results"]] == [False, True]
    assert all(r["tokens_per_s"] > 0 for r in result["results"])
    assert "| no KV cache |" in capsys.readouterr().out


def test_bench_long_context_quick(tmp_path, capsys, one_thread):
    from benchmarks import bench_long_context

    out = tmp_path / "long_context.json"
    bench_long_context.main(["--quick", "--json", str(out), "--device", "cpu"])
    result = read(out)
    assert result["benchmark"] == "long_context" and MACHINE_KEYS <= set(result["machine"])
    assert [(r["arch"], r["tokens"]) for r in result["sampling"]] == [("gpt", 64), ("llama", 64)]  # 4 blocks of 16
    assert all(len(r["ms_per_token_windows"]) == 8 and r["ms_once_full"] > 0 for r in result["sampling"])
    assert len(result["chat"]["windows"]) == 8 and all(w["prefilled_per_turn"] > 0 for w in result["chat"]["windows"])
    assert "tokens run per turn" in capsys.readouterr().out


def test_cpu_peak_memory_tracks_the_timeline():
    import torch

    def work():
        a = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB
        b = torch.empty(2 << 20, dtype=torch.uint8)  # +2 MiB: peak 3 MiB
        del a, b
        c = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB after the frees: the net sum would say 1
        return c

    peak = common.peak_memory(work, "cpu")
    assert 3 << 20 <= peak < (3 << 20) + (64 << 10)


def test_markdown_table_and_machine_label():
    table = common.markdown_table([{"a": "x", "b": 1.234}, {"a": "y", "b": None}], [("a", "A", ""), ("b", "B", ".1f")])
    assert table.splitlines() == ["| A | B |", "|---|---:|", "| x | 1.2 |", "| y | - |"]
    label = common.machine_label("cpu", "bfloat16")
    assert MACHINE_KEYS <= set(label) and label["dtype"] == "bfloat16"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.slow
def test_bench_attention_lab_quick(tmp_path):
    from benchmarks import bench_attention_lab

    out = tmp_path / "attention_lab.json"
    bench_attention_lab.main(["--quick", "--json", str(out), "--device", "cpu", "--repeats", "1"])
    result = read(out)
    assert MACHINE_KEYS <= set(result["machine"]) and result["offline"] is True
    assert (result["n_layer"], result["n_head"], result["tokens"]) == (2, 2, 32) and result["html_bytes"] > 0


@pytest.mark.slow
def test_bench_hf_quick(capsys):
    from benchmarks import bench_hf

    result = bench_hf.main(["--quick", "--device", "cpu"])
    assert result["agreement"] and all(
        r["greedy_equal"] and r["import_max_abs"] < 1e-4 and r["export_max_abs"] < 1e-4 for r in result["agreement"]
    )
    assert [c["operation"] for c in result["cost"]] == [
        "minigpt import (load_model)",
        "transformers from_pretrained (reference)",
        "minigpt export (export_hf)",
    ]
    assert all(c["seconds"] > 0 and c["peak_rss_mib"] > 0 for c in result["cost"])


def test_peak_matmul_flops_is_the_best_size_and_skips_sizes_whose_matmul_would_take_over_a_second(monkeypatch):
    # an AVX2 CPU's bfloat16: fastest at 128^3, and a 2048^3 matmul would take ~13 s (a probe of it, minutes)
    gflops = {64: 2.4, 128: 3.0, 256: 1.4, 512: 1.2, 1024: 1.2, 2048: 1.2}
    probed = []

    def fake(dtype, device, n, repeats):
        probed.append(n)
        seconds = 2 * n**3 / (gflops[n] * 1e9)
        return dict(n=n, seconds_per_matmul=seconds, flops=2 * n**3 / seconds)

    monkeypatch.setattr(common, "matmul_flops", fake)
    peak = common.peak_matmul_flops("bf16", "cpu", n=2048)
    assert peak["n"] == 128 and peak["flops"] == pytest.approx(3.0e9)
    assert probed == peak["sizes"] == [64, 128, 256, 512]  # 512^3 took 0.22 s: 1024^3 would take 1.8 s
    assert peak["skipped"] == [1024, 2048]
    probed.clear()
    gflops = dict.fromkeys(gflops, 200.0)  # float32 (or a GPU): every size is quick, the largest is probed
    assert common.peak_matmul_flops("fp32", "cpu", n=2048)["sizes"] == probed == [64, 128, 256, 512, 1024, 2048]


def test_bf16_numerics_runs_the_recipe_as_each_kind_of_cpu_computes_it(
    tiny_run_args, corpus, data_root, tmp_path, monkeypatch, capsys
):
    # the figure it reports (loss per step with a native-bf16 CPU's numerics, measured on any CPU) is only right if
    # the bf16 run really trains in bf16 autocast with Muon's iteration in bf16, and the float32 run in neither
    import minigpt.training.optim
    from benchmarks import bf16_numerics

    monkeypatch.setattr(
        minigpt.training.optim, "has_native_bf16", minigpt.training.optim.has_native_bf16
    )  # undone after the test
    ran = {}
    for numerics in ("bf16", "float32"):
        argv = [
            "--config",
            bf16_numerics.CONFIG,
            *tiny_run_args(corpus, data_root, tmp_path / numerics, steps=2),
            "--compile",
            "false",
            "--trainer.max_time",
            "null",
            "--sample_tokens",
            "0",
        ]
        bf16_numerics.train_child(numerics, argv)
        line = capsys.readouterr().out.splitlines()[-1]
        ran[numerics] = json.loads(line.removeprefix(bf16_numerics.RESULT))
    assert {k: (r["precision"], r["muon_dtype"], r["steps"]) for k, r in ran.items()} == {
        "bf16": ("bf16-mixed", "bfloat16", 2),
        "float32": ("32-true", "float32", 2),
    }
    assert all(0 < r["full_val_loss"] < 10 for r in ran.values())


def test_time_to_loss_runs_the_config_as_shipped_and_validates_at_its_interval(corpus, data_root, tmp_path, capsys):
    # the recipe's row is the recipe as a user runs it: the benchmark adds no validations the config does not make
    import yaml

    from benchmarks import time_to_loss

    config = yaml.safe_load((REPO / time_to_loss.CONFIG).read_text())
    config["trainer"]["val_check_interval"] = 7
    config_path = tmp_path / "recipe.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # a fixed step count, not the benchmark's time budget: what a busy machine trains in 3 s is not a test's to know
    tiny = [
        "--data.data_root",
        data_root,
        "--model.n_layer",
        1,
        "--model.n_embd",
        32,
        "--model.n_head",
        2,
        "--model.mlp_hidden",
        64,
        "--model.block_size",
        32,
        "--data.batch_size",
        8,
        "--data.val_batches",
        2,
        "--compile",
        "false",
        "--trainer.max_steps",
        21,
        "--trainer.max_time",
        "null",
    ]
    extra = [f"--extra={flag}={value}" for flag, value in zip(tiny[::2], tiny[1::2])]
    out = tmp_path / "ttl.json"
    time_to_loss.main(["--quick", "--corpus", str(corpus), "--config", str(config_path), "--json", str(out), *extra])
    result = read(out)
    assert result["val_every"] == 7 and "validation every 7 steps" in capsys.readouterr().out
    (row,) = result["results"]
    assert row["variant"] == "recipe" and row["steps"] == 21, row
    assert 0 < row["full_val_loss"] < 10
    # every 7 steps, as the config says (each validation is logged at the step before it)
    assert [step for step, _ in row["curve"]] == [6, 13, 20], row["curve"]


def test_bench_startup_quick(tmp_path, capsys):
    from benchmarks import bench_startup

    out = tmp_path / "startup.json"
    timed = ["sample.py --help", "minigpt sample --help", f"sample.py {bench_startup.NEW_TOKENS} tokens"]
    bench_startup.main(["--quick", "--json", str(out), "--device", "cpu", "--commands", ",".join(timed)])
    result = read(out)
    assert result["benchmark"] == "startup" and MACHINE_KEYS <= set(result["machine"])
    assert result["settings"]["repeats"] == 1 and result["settings"]["goal_s"] == bench_startup.GOAL_S
    rows = {r["command"]: r for r in result["results"]}
    assert list(rows) == [bench_startup.BASELINE, *timed]
    assert rows[bench_startup.BASELINE]["seconds"] == result["baseline_s"] > 0
    for name in timed:  # the console script may be absent (minigpt not installed): then it says so
        r = rows[name]
        if "note" in r:
            assert name.startswith("minigpt ") and "not installed" in r["note"]
            continue
        assert len(r["runs"]) == 1 and r["seconds"] > 0
        assert r["over_torch_s"] == pytest.approx(r["seconds"] - result["baseline_s"], abs=2e-3)
        assert r["goal"] == ("PASS" if r["over_torch_s"] <= bench_startup.GOAL_S else "FAIL")
    assert result["passed"] == all(r["goal"] == "PASS" for r in rows.values() if "goal" in r)
    printed = capsys.readouterr().out
    assert "| command | seconds |" in printed and "Goal: every command within" in printed


def test_bench_prepare_quick(tmp_path, capsys):
    """Preparation and the bare encoder see the same text: the same number of tokens (and so does the tiktoken
    twin of the trained BPE, offline), and every rate is a positive figure."""
    from benchmarks import bench_prepare

    corpus = tmp_path / "seed.txt"
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    corpus.write_text("\n".join(" ".join(rng.choices(words, k=12)) + "." for _ in range(3000)) + "\n")
    out = tmp_path / "prepare.json"
    result = bench_prepare.main(["--quick", "--corpus", str(corpus), "--json", str(out)])
    assert read(out) == json.loads(json.dumps(result))
    trained, *rows = result["rows"]  # bpe:VOCAB trained and prepared, then the prepared-with-a-file rows
    assert trained["prepare_mb_s"] > 0 and trained["peak_rss_mb"] > 0 and trained["tokens"] is None
    assert len({row["tokens"] for row in rows}) == 1 and rows[0]["tokens"] > 0
    assert rows[0]["prepare_mb_s"] > 0 and rows[0]["bare_mb_s"] > 0 and rows[0]["peak_rss_mb"] > 0
    assert "preparation / bare" in capsys.readouterr().out


def test_tokens_per_char_quick(tmp_path, capsys):
    """Char is one token per character and byte one per UTF-8 byte (1 in English, ~2 in Cyrillic); a BPE trained
    on the text spends fewer tokens than characters."""
    from benchmarks import tokens_per_char

    rng = random.Random(0)
    texts = {}
    for name, alphabet in (("english", "etaoinshrdlucmfw"), ("russian", "оеаинтсрвлкмдпу")):
        words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 7))) for _ in range(400)]
        texts[name] = tmp_path / f"{name}.txt"
        texts[name].write_text("\n".join(" ".join(rng.choices(words, k=10)) for _ in range(2000)) + "\n")
    result = tokens_per_char.main(
        ["--quick", "--json", str(tmp_path / "t.json"), *(f"--text={name}={path}" for name, path in texts.items())]
    )
    rows = {row["tokenizer"]: row for row in result["tokens_per_char"]}
    assert rows["char"]["english"] == rows["char"]["russian"] == 1.0
    assert rows["byte"]["english"] == 1.0 and 1.8 < rows["byte"]["russian"] < 2.0  # spaces and newlines: 1 byte
    assert rows["bpe:300"]["english"] < 1.0 and rows["bpe:300"]["russian"] < 1.0
    assert "Tokens per character" in capsys.readouterr().out


@pytest.mark.slow  # about 45 s of CPU: eight train.py children
def test_bench_lora_quick(tmp_path, capsys):
    from benchmarks import bench_lora

    result = bench_lora.main(["--quick", "--work", str(tmp_path), "--json", str(tmp_path / "lora.json")])
    assert read(tmp_path / "lora.json")["benchmark"] == "bench_lora" and MACHINE_KEYS <= set(result["machine"])
    rows = {(r["variant"], r["n_layer"]): r for r in result["results"]}
    full, lora = rows[("full (extrapolated from n_layer 1/2)", 3)], rows[("lora8", 3)]
    assert lora["trainable"] == 3 * 8 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))  # rank 8: q o, k v, mlp
    assert full["trainable"] == pytest.approx(sum(p.numel() for p in bench_lora_model().parameters()))
    assert lora["checkpoint_bytes"] < full["checkpoint_bytes"] / 2
    for r in result["results"]:
        assert r["peak_rss"] > 2**20 and r["s_per_step"] > 0
    assert "| shape | layers | run |" in capsys.readouterr().out


def bench_lora_model():
    from benchmarks.bench_lora import SHAPES
    from minigpt.core.config import GPTConfig
    from minigpt.core.model import GPT

    return GPT(GPTConfig(**SHAPES["tiny"], block_size=32))


def test_bench_serve_quick(tmp_path, capsys):
    """Tiny shapes, 1 and 2 concurrent clients through the real server; every client gets all its tokens."""
    from benchmarks import bench_serve

    out = tmp_path / "serve.json"
    result = bench_serve.main(["--quick", "--json", str(out), "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "torch.backends.cpu.get_cpu_capability()" in printed and "TTFT" in printed
    rows = json.loads(out.read_text())["results"]
    assert [(r["shape"], r["clients"]) for r in rows] == [("124m", 1), ("124m", 2), ("char", 1), ("char", 2)]
    for r in rows:  # the random models never stop early
        assert r["completion_tokens"] == 8 * r["clients"] and r["tokens_per_s"] > 0 and r["ttft_max_s"] > 0
    assert result["results"] == rows


@pytest.mark.slow  # compiles the decode step of four tiny models
def test_bench_decode_quick(tmp_path, capsys):
    out = tmp_path / "decode.json"
    bench_decode.main(["--quick", "--json", str(out)])
    result = read(out)
    assert result["benchmark"] == "decode" and MACHINE_KEYS <= set(result["machine"])
    rows = result["rows"]
    ways = (
        "minigpt float32, compiled step",
        "minigpt float32, eager",
        "minigpt int8, compiled step",
        "transformers float32",
    )
    assert [(r["shape"], r["way"]) for r in rows] == [(s, w) for s in ("GPT-2-124M", "SmolLM2-135M") for w in ways]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0
        if "float32" in r["way"]:  # the same weights and the same greedy ids as transformers
            assert r["ids_equal_transformers"], r["way"]
    int8, fp32 = rows[2], rows[0]
    assert int8["weight_bytes"] < 0.3 * fp32["weight_bytes"]  # int8 weights and per-row scales: about a quarter
    assert "| shape | way | tokens/s |" in capsys.readouterr().out


@pytest.mark.slow  # compiles the tiny model's decode step
def test_bench_decode_single_stream_quick(tmp_path, capsys):
    """The GPU measurement (eager, compiled, transformers, the serve engine), tiny and on the CPU."""
    out = tmp_path / "decode.json"
    bench_decode.main(["--quick", "--single_stream", "--device", "cpu", "--json", str(out)])
    rows = read(out)["rows"]
    ways = ["minigpt eager", "minigpt compiled", "transformers generate", "serve engine, one client"]
    assert [r["way"] for r in rows] == ways
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["ids_equal_transformers"] for r in rows[:3])  # the same weights give the same greedy ids
    assert "| minigpt compiled |" in capsys.readouterr().out
