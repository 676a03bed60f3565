"""The lm-evaluation-harness on minigpt models (minigpt.evaluation.harness, eval.py --tasks), offline: tasks built here
as YAML + JSONL (`dataset_path: json`), a multiple-choice, a rolling-perplexity and a generate-until task.  Scores
through minigpt equal those of transformers on the export (HFLM, no extra arguments) and eval.py's own loss."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
import tiktoken
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

from minigpt import GPT, GPTConfig
from minigpt.cli import eval as eval_cli
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer
from minigpt.evaluation.harness import MiniGPTLM, evaluate_tasks, flat_metrics
from minigpt.export.hf import export_hf

REPO = Path(__file__).resolve().parents[2]
os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"  # never download (conftest sets them too)

WORDS = "the quick brown fox jumps over a lazy dog while cats sit on warm mats and birds sing".split()
MC = [
    {
        "question": f"what does the {a} do",
        "choices": [f"the {a} {v}" for v in ("sits", "sings", "jumps")],
        "answer": i % 3,
    }
    for i, a in enumerate(["fox", "dog", "cat", "bird", "mat", "sun", "owl"])
]


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


PPL = [{"text": words(n, seed=i)} for i, n in enumerate((5, 40, 600))]
GEN = [{"prompt": f"the {w}", "answer": " sits"} for w in ("fox", "dog", "cat")]


def task_yaml(folder: Path, name: str, rows: list[dict], body: str) -> Path:
    data = folder / f"{name}.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path = folder / f"{name}.yaml"
    path.write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{body}"
    )
    return path


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tasks")
    return {
        "mc": task_yaml(
            folder,
            "local_mc",
            MC,
            "output_type: multiple_choice\n"
            'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n',
        ),
        "ppl": task_yaml(
            folder,
            "local_ppl",
            PPL,
            'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
            'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
            "  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        ),
        "gen": task_yaml(
            folder,
            "local_gen",
            GEN,
            'output_type: generate_until\ndoc_to_text: "{{prompt}}"\n'
            'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: [" on", "\\n"]\n'
            "  max_gen_toks: 12\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
        ),
    }


def all_text() -> str:
    return json.dumps([MC, PPL, GEN]) + "\nQuestion: Answer:" + " ".join(WORDS)


def small_bpe() -> tiktoken.Encoding:
    """A BPE with a few merges and <|endoftext|>, built here (tiktoken's own encodings would be a download)."""
    merges = [b"th", b"the", b" t", b" the", b"in", b"ing", b"at", b" s", b"ts", b"its", b"og", b" d", b"ox"]
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(merges)}
    return tiktoken.Encoding(
        "small_bpe",
        pat_str=r"""'s|'t| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": len(ranks)},
    )


def trained(model: GPT, ids: list[int], steps: int = 150) -> GPT:
    """A few hundred milliseconds of Adam on `ids`, so the model's predictions depend on the context."""
    data = torch.tensor(ids)
    T = model.config.block_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - T - 1, (8,), generator=g)
        batch = torch.stack([data[s : s + T + 1] for s in starts])
        _, loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[GPT, object, Path]]:
    """name -> (trained model, tokenizer, its Hugging Face export): a gpt block on chars, a llama block (GQA) on a
    tiktoken BPE, a gpt block on bytes."""
    root = tmp_path_factory.mktemp("models")
    text = words(2000, seed=100)
    built = {}
    for name, tokenizer, config in [
        ("char", CharTokenizer(all_text()), dict(arch="gpt")),
        ("bpe", TiktokenTokenizer(small_bpe()), dict(arch="llama", n_kv_head=1, mlp="swiglu", bias=False)),
        ("byte", ByteTokenizer(), dict(arch="gpt")),
    ]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=tokenizer.vocab_size, **config))
        trained(model, tokenizer.encode(text))
        built[name] = (model, tokenizer, export_hf(model, tokenizer, root / name))
    return built


@pytest.fixture(scope="module")
def char_ckpt(models, tmp_path_factory) -> Path:
    model, tokenizer, _ = models["char"]
    path = tmp_path_factory.mktemp("ckpt") / "char.ckpt"
    save_file(model_checkpoint(model, tokenizer), path)
    return path


def samples(lm, task: Path) -> list[dict]:
    """The harness's per-document records of `task` through `lm`, in document order."""
    results = simple_evaluate(
        model=lm,
        tasks=[load_yaml(task)],
        task_manager=TaskManager(include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    return sorted(next(iter(results["samples"].values())), key=lambda s: s["doc_id"])


def hflm(path: Path, **kwargs) -> HFLM:
    return HFLM(pretrained=str(path), device="cpu", dtype="float32", batch_size=3, **kwargs)


# ------------------------------------------------------------------------------------------------ the export


def test_every_export_says_its_context_and_char_exports_have_a_start_token(models):
    for name, (model, _, path) in models.items():
        config = json.loads((path / "tokenizer_config.json").read_text())
        assert config["model_max_length"] == model.config.block_size == 32, name
        hf = transformers.AutoTokenizer.from_pretrained(path)
        assert hf.model_max_length == 32
    char_tok, char_path = models["char"][1], models["char"][2]
    hf = transformers.AutoTokenizer.from_pretrained(char_path)
    # the newline: what minigpt's sampler starts from, in the vocabulary (no new id, no new embedding row)
    assert hf.bos_token == "\n" and hf.bos_token_id == char_tok.encode("\n")[0] and len(hf) == char_tok.vocab_size
    assert hf(all_text())["input_ids"] == char_tok.encode(all_text())
    assert json.loads((char_path / "special_tokens_map.json").read_text()) == {"bos_token": "\n"}
    bpe_tok = models["bpe"][1]
    assert transformers.AutoTokenizer.from_pretrained(models["bpe"][2]).bos_token_id == bpe_tok.eot_id


def test_a_char_vocabulary_without_a_newline_starts_from_its_first_character(tmp_path):
    tokenizer = CharTokenizer("abc xyz")
    export_hf(
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=tokenizer.vocab_size)),
        tokenizer,
        tmp_path / "x",
    )
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "x")
    assert (hf.bos_token, hf.bos_token_id, len(hf)) == (" ", 0, tokenizer.vocab_size)
    assert (
        MiniGPTLM(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=7)), tokenizer).prefix_token_id
        == 0
    )


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_a_chat_models_start_token_is_the_one_its_export_registers(kind, tmp_path):
    """HFLM conditions a text on the export's BOS, else its EOS.  A char chat run's was <|im_end|> where its export
    registers the newline: a perplexity task gave 9.3155 bits/byte on the run and 9.3240 on its export."""
    from minigpt.core.chat_template import ChatTokenizer

    base = {
        "char": lambda: CharTokenizer("ab \n"),
        "byte": ByteTokenizer,
        "bpe": lambda: TiktokenTokenizer(small_bpe()),
    }
    chat = ChatTokenizer.for_base(base[kind](), conversations=[[{"role": "user", "content": "ab"}]])
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=chat.vocab_size))
    export_hf(model, chat, tmp_path / "x")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "x")
    start = hf.bos_token_id if hf.bos_token_id is not None else hf.eos_token_id
    assert MiniGPTLM(model, chat).prefix_token_id == start == hflm(tmp_path / "x").prefix_token_id


# ------------------------------------------------------------------------------------------------ agreement


@pytest.mark.parametrize("name", ["char", "bpe", "byte"])
def test_multiple_choice_loglikelihoods_and_answers_equal_transformers_on_the_export(models, tasks, name):
    model, tokenizer, path = models[name]
    ours = samples(MiniGPTLM(model, tokenizer, batch_size=4), tasks["mc"])
    # a byte export registers no start token (see minigpt.hf.tokenizer_files): HFLM is told the newline's id
    theirs = samples(hflm(path, **({"prefix_token_id": 10} if name == "byte" else {})), tasks["mc"])
    assert len(ours) == len(theirs) == len(MC)
    for a, b in zip(ours, theirs):
        assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in b["resps"]]  # greedy flags
        assert torch.allclose(
            torch.tensor([r[0][0] for r in a["resps"]]), torch.tensor([r[0][0] for r in b["resps"]]), atol=1e-4, rtol=0
        )
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
    assert len({s["acc"] for s in ours}) == 2, "the task should have right and wrong answers"


@pytest.mark.parametrize("name", ["char", "bpe"])
def test_rolling_loglikelihoods_equal_transformers_on_the_export_with_no_extra_arguments(models, tasks, name):
    """The issue's failure: HFLM on a char export died for want of a start token; now it needs nothing."""
    model, tokenizer, path = models[name]
    ours = samples(MiniGPTLM(model, tokenizer), tasks["ppl"])
    theirs = samples(hflm(path), tasks["ppl"])
    lengths = [len(tokenizer.encode(d["text"])) for d in PPL]
    assert max(lengths) > 3 * model.config.block_size, "the longest text must span several windows"
    for a, b in zip(ours, theirs):
        assert math.isclose(a["resps"][0][0], b["resps"][0][0], abs_tol=1e-4)


def test_generation_equals_transformers_greedy_and_stops_at_the_stop_sequence(models, tasks):
    model, tokenizer, path = models["bpe"]
    ours = samples(MiniGPTLM(model, tokenizer), tasks["gen"])
    theirs = samples(hflm(path), tasks["gen"])
    outputs = [s["filtered_resps"][0] for s in ours]
    assert outputs == [s["filtered_resps"][0] for s in theirs]
    assert all(" on" not in o and "\n" not in o for o in outputs)
    assert any(outputs), "greedy generation from a trained model says something"


def test_bits_per_byte_equals_eval_py_on_the_same_windows(models, tmp_path, char_ckpt, capsys):
    """The harness scores a text in windows that start from its start token (the newline for chars); eval.py on
    the newline followed by the text predicts the same tokens from the same contexts, so the two agree.  (eval.py
    on the text alone cuts windows one token later: at block_size 32 that moves the figure by about 1 %; a last
    partial window the harness fills with earlier context, eval.py does not: 0.1 % here.)"""
    model, tokenizer, _ = models["char"]
    T = model.config.block_size
    text = PPL[-1]["text"][: len(PPL[-1]["text"]) // T * T]  # whole windows: the harness's last one slides back
    assert text.isascii() and len(tokenizer.encode(text)) > 50 * model.config.block_size  # bytes = chars = tokens
    harness = flat_metrics(
        evaluate_tasks(
            MiniGPTLM(model, tokenizer),
            [
                str(
                    task_yaml(
                        tmp_path,
                        "one_text",
                        [{"text": text}],
                        "output_type: loglikelihood_rolling\n"
                        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
                        "  - metric: bits_per_byte\n",
                    )
                )
            ],
            bootstrap_iters=0,
        )
    )["one_text/bits_per_byte"]
    (tmp_path / "text.txt").write_text("\n" + text)
    nats, n = eval_cli.run(["--ckpt", str(char_ckpt), "--text", str(tmp_path / "text.txt")])
    eval_bits_per_char = float(capsys.readouterr().out.split(",")[-1].split()[0])
    assert n == len(text)
    assert math.isclose(harness, eval_bits_per_char, rel_tol=0.005), (harness, eval_bits_per_char)
    assert abs(harness - eval_bits_per_char) < 1e-4, "the same windows: equal up to eval.py's 4 printed decimals"
    assert 0.5 < harness < 3.0, "a trained model: well below the 5.3 bits of a uniform guess over 40 characters"


# ------------------------------------------------------------------------------------------------ eval.py


def test_eval_py_runs_local_tasks_prints_the_table_and_writes_the_json(char_ckpt, tasks, tmp_path, capsys):
    out = tmp_path / "results" / "r.json"
    eval_cli.main(
        [
            "--ckpt",
            str(char_ckpt),
            "--tasks",
            ",".join(str(p) for p in tasks.values()),
            "--limit",
            "2",
            "--batch_size",
            "4",
            "--output",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    for fragment in ("local_mc", "acc_norm", "local_ppl", "bits_per_byte", "local_gen", "exact_match", str(out)):
        assert fragment in printed, fragment
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"local_mc", "local_ppl", "local_gen"}
    assert results["n-samples"]["local_mc"] == {"original": len(MC), "effective": 2}
    assert 0 <= results["results"]["local_mc"]["acc,none"] <= 1
    # which checkpoint the figures are of (the harness wrote model_args: null)
    assert results["config"]["model_args"] == {"ckpt": str(char_ckpt), "quantize": None, "device": "cpu"}


def test_flat_metrics_names_task_and_metric_and_drops_stderr():
    results = {
        "results": {
            "t": {
                "alias": "t",
                "acc,none": 0.5,
                "acc_stderr,none": 0.1,
                "sample_len": 3,
                "exact_match,strict-match": 1.0,
                "ppl,none": "N/A",
            }
        }
    }
    assert flat_metrics(results) == {"t/acc": 0.5, "t/exact_match_strict-match": 1.0}


def one_error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_bad_task_input_is_one_line(char_ckpt, tasks, tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: x\ndoc_to_text: [unclosed\n")
    assert "broken.yaml is not valid YAML" in one_error_line(capsys, ["--ckpt", str(char_ckpt), "--tasks", str(broken)])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert "list.yaml is not a harness task" in one_error_line(
        capsys, ["--ckpt", str(char_ckpt), "--tasks", str(tmp_path / "list.yaml")]
    )
    (tmp_path / "notask.yaml").write_text("dataset_path: json\n")
    assert "is not a harness task" in one_error_line(
        capsys, ["--ckpt", str(char_ckpt), "--tasks", str(tmp_path / "notask.yaml")]
    )
    assert "task file not found" in one_error_line(
        capsys, ["--ckpt", str(char_ckpt), "--tasks", str(tmp_path / "nope.yaml")]
    )
    assert "--limit must be >= 1" in one_error_line(
        capsys, ["--ckpt", str(char_ckpt), "--tasks", str(tasks["mc"]), "--limit", "0"]
    )
    assert "either --text" in one_error_line(capsys, ["--ckpt", str(char_ckpt)])
    missing_data = tmp_path / "gone.yaml"
    missing_data.write_text(tasks["mc"].read_text().replace("local_mc.jsonl", "gone.jsonl"))
    assert "could not be found" in one_error_line(capsys, ["--ckpt", str(char_ckpt), "--tasks", str(missing_data)])


def test_a_char_model_given_text_outside_its_vocabulary_is_one_line(char_ckpt, tmp_path, capsys):
    odd = task_yaml(
        tmp_path,
        "odd",
        [{"text": "ünïcödé"}],
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: bits_per_byte\n',
    )
    assert "outside the model's char vocabulary" in one_error_line(
        capsys, ["--ckpt", str(char_ckpt), "--tasks", str(odd)]
    )


def test_a_model_without_a_tokenizer_is_one_line(models, tasks, tmp_path, capsys):
    from minigpt.core.errors import UserError

    with pytest.raises(UserError, match="has no tokenizer"):
        MiniGPTLM(models["char"][0], None)
    path = tmp_path / "bare.ckpt"
    save_file(model_checkpoint(models["char"][0], None), path)
    assert "no tokenizer" in one_error_line(capsys, ["--ckpt", str(path), "--tasks", str(tasks["mc"])])


@pytest.mark.slow  # naming a task makes the harness index its ~15,000 task files (~15 s)
def test_an_unknown_task_name_is_one_line(char_ckpt, capsys):
    assert "unknown task 'hellaswagg'" in one_error_line(capsys, ["--ckpt", str(char_ckpt), "--tasks", "hellaswagg"])


def test_without_lm_eval_tasks_is_one_line_saying_how_to_install(char_ckpt, tasks):
    code = (
        "import sys; sys.modules['lm_eval'] = None\nfrom minigpt.cli.eval import main\n"
        f"main(['--ckpt', {str(char_ckpt)!r}, '--tasks', {str(tasks['mc'])!r}])"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.strip().splitlines() == [
        'error: the lm-evaluation-harness is not installed; install the eval extra: pip install -e ".[eval]" '
        "(or, outside a checkout of minigpt, python3 -m pip install lm-eval==0.4.13)"
    ]
    assert 'eval = ["lm-eval==0.4.13"]' in (REPO / "pyproject.toml").read_text()  # the pin the message names


@pytest.mark.slow  # ~12 s: a tiny model through both backends
def test_bench_eval_quick_measures_both_backends_on_the_same_answers(tmp_path, capsys):
    sys.path.insert(0, str(REPO))
    from benchmarks import bench_eval

    result = bench_eval.main(["--quick", "--json", str(tmp_path / "b.json"), "--device", "cpu"])
    assert [r["requests"] for r in result["rows"]] == [16, 16] and result["same_accuracy"]
    assert all(r["requests_per_s"] > 0 for r in result["rows"])
    assert "CPU capability " in capsys.readouterr().out  # the machine's label
