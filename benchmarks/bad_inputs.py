"""Every bad input the hardening issue lists, run through the real commands: exit code and what they print.

    python benchmarks/bad_inputs.py                  # markdown table on stdout, JSON in benchmarks/results/

Each case runs `python train.py ...` or `python sample.py ...` in a subprocess in a scratch directory, as a
user would, and records the exit code, the number of stderr lines, whether a traceback appeared, and the
message.  A tiny run is trained first (a few seconds) for the cases that need a checkpoint or a run directory.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from benchmarks.common import REPO_ROOT, common_parser, markdown_table, write_json  # noqa: E402

TINY = ["--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32",
        "--data.batch_size", "8", "--data.val_batches", "2", "--trainer.max_steps", "10",
        "--trainer.val_check_interval", "10", "--trainer.enable_progress_bar", "false", "--model.sample_tokens", "0"]


class _RunsCode:
    """Unpickling this calls open(marker, 'w'): a stand-in for a checkpoint crafted to run code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def run(script: str, args: list[str], cwd: Path, stdin: str | None = None) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / script), *args], cwd=cwd, capture_output=True,
                          text=True, input=stdin, timeout=600)
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in err if line.startswith("error")]  # other lines: Lightning's info logs
    return dict(exit_code=proc.returncode, error_lines=len(errors), stderr_lines=len(err),
                traceback=any("Traceback" in x for x in err), message=errors[-1] if errors else (err[-1] if err else ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common_parser(__doc__.splitlines()[0], "bad_inputs")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bad_inputs_") as tmp:
        w = Path(tmp)
        corpus = w / "words.txt"
        corpus.write_text("\n".join(f"the quick brown fox {i % 7} jumps over the lazy dog" for i in range(2000)))
        (w / "empty.txt").write_text("")
        (w / "short.txt").write_text("far fewer characters than one window\n")
        (w / "blob.bin").write_bytes(bytes(range(256)) * 64)
        base = ["--data.source", str(corpus), "--data.data_root", str(w / "data"), *TINY]
        ok = run("train.py", [*base, "--out_dir", str(w / "run")], w)
        if ok["exit_code"] != 0:
            raise SystemExit(f"the tiny run failed: {ok['message']}")
        ckpt = w / "run" / "checkpoints" / "last.ckpt"
        (w / "truncated.ckpt").write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
        (w / "notes.txt").write_text("not a checkpoint\n")
        marker = w / "PWNED"
        (w / "evil.ckpt").write_bytes(pickle.dumps({"state_dict": _RunsCode(str(marker))}))
        blocker = w / "a-file"  # a path under a file: unwritable even for root, unlike a chmod-ed folder
        blocker.write_text("not a folder\n")

        def train(case: str, *extra: str, source: str | None = None) -> None:
            a = list(base)
            if source is not None:
                a[1] = source
            rows.append(dict(command="train.py", case=case, **run("train.py", [*a, "--out_dir", str(w / "new"),
                                                                                 *extra], w)))

        train("missing corpus path", source=str(w / "no_such_corpus.txt"))
        train("empty corpus", source=str(w / "empty.txt"))
        train("corpus shorter than one window", source=str(w / "short.txt"))
        train("binary file with the char tokenizer", source=str(w / "blob.bin"))
        train("unknown tiktoken encoding", "--data.tokenizer", "gpt5_bpe")
        train("tiktoken encoding not downloadable offline", "--data.tokenizer", "o200k_base")
        train("unknown config key", "--model.n_layers", "2")
        train("wrong value type", "--trainer.max_steps", "ten")
        train("unknown arch", "--model.arch", "mamba")
        train("unknown attention", "--model.attention", "flash3")
        train("n_embd % n_head != 0", "--model.n_embd", "30", "--model.n_head", "4")
        train("n_head % n_kv_head != 0", "--model.n_head", "4", "--model.n_kv_head", "3", "--model.n_embd", "64")
        train("odd head dim with RoPE", "--model.arch", "llama", "--model.n_embd", "36", "--model.n_head", "4")
        train("--resume with no run there", "--resume", "true")
        rows.append(dict(command="train.py", case="checkpoint shape disagrees with the flags",
                         **run("train.py", [*base, "--out_dir", str(w / "run"), "--resume", "true",
                                            "--model.n_layer", "2"], w)))
        rows.append(dict(command="train.py", case="existing run, neither --resume nor --overwrite",
                         **run("train.py", [*base, "--out_dir", str(w / "run")], w)))
        rows.append(dict(command="train.py", case="out_dir cannot be written",
                         **run("train.py", [*base, "--out_dir", str(blocker / "run")], w)))

        def sample(case: str, *a: str, stdin: str | None = None) -> None:
            rows.append(dict(command="sample.py", case=case, **run("sample.py", list(a), w, stdin)))

        sample("missing checkpoint", "--ckpt", str(w / "nope.ckpt"))
        sample("truncated checkpoint", "--ckpt", str(w / "truncated.ckpt"))
        sample("not a checkpoint", "--ckpt", str(w / "notes.txt"))
        sample("checkpoint that runs code when unpickled", "--ckpt", str(w / "evil.ckpt"))
        code_ran = marker.exists()
        sample("prompt characters outside the char vocabulary", "--ckpt", str(ckpt), "--prompt", "Zebra ©")
        sample("temperature < 0", "--ckpt", str(ckpt), "--temperature", "-1")
        sample("top_k < 1", "--ckpt", str(ckpt), "--top_k", "0")
        sample("top_p outside (0, 1]", "--ckpt", str(ckpt), "--top_p", "1.5")
        sample("negative max_new_tokens", "--ckpt", str(ckpt), "--max_new_tokens", "-5")
        survived = ckpt.is_file() and run("sample.py", ["--ckpt", str(ckpt), "--max_new_tokens", "5"], w)["exit_code"] == 0

    print(markdown_table(rows, [("command", "command", ""), ("case", "bad input", ""), ("exit_code", "exit", "d"),
                                ("error_lines", "error lines", "d"), ("message", "message", "")]))
    one_line = all(r["exit_code"] == 2 and r["error_lines"] == 1 and not r["traceback"] for r in rows)
    print(f"\nall {len(rows)} cases: exit 2, one line, no traceback: {'yes' if one_line else 'NO'}; "
          f"malicious checkpoint ran code: {'YES' if code_ran else 'no'}; "
          f"the run's checkpoint still samples after all of them: {'yes' if survived else 'NO'}")
    result = dict(benchmark="bad_inputs", results=rows, all_one_line=one_line, malicious_code_ran=code_ran,
                  checkpoint_survived=survived)
    print(f"\nwrote {write_json(result, args.json)}")
    return result


if __name__ == "__main__":
    main()
