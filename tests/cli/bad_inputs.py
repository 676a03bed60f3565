"""Every case of the bad-input table (tests/cli/bad_input_cases.py), run through the real commands.

    python3 tests/cli/bad_inputs.py                 # the markdown table of docs/errors.md on stdout

Each case runs `python train.py ...` or `python sample.py ...` in a subprocess in a scratch directory, as a
user would, and records the exit code, the number of stderr lines, whether a traceback appeared, and the
message.  A tiny run is trained first (a few seconds) for the cases that need a checkpoint or a run directory.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # run from anywhere without installing

from bad_input_cases import CASES, make_workdir  # this script's own folder


def run(script: str, args: list[str], cwd: Path, stdin: str | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        input=stdin,
        timeout=600,
    )
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in err if line.startswith("error")]  # other lines: Lightning's info logs
    return dict(
        exit_code=proc.returncode,
        error_lines=len(errors),
        stderr_lines=len(err),
        traceback=any("Traceback" in x for x in err),
        message=errors[-1] if errors else (err[-1] if err else ""),
    )


def main() -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bad_inputs_") as tmp:
        w = Path(tmp)

        def train_tiny_run(argv: list[str]) -> None:
            ok = run("train.py", argv, w)
            if ok["exit_code"] != 0:
                raise SystemExit(f"the tiny run failed: {ok['message']}")

        make_workdir(w, train_tiny_run)
        for case in CASES:
            result = run(case.command, case.argv(w), w, case.stdin)
            result["message"] = result["message"].replace(f"{w}/", "")  # scratch paths, as a user would see them
            rows.append(dict(command=case.command, case=case.case, **result))
        code_ran = (w / "PWNED").exists()
        ckpt = w / "run" / "checkpoints" / "last.ckpt"
        survived = (
            ckpt.is_file() and run("sample.py", ["--ckpt", str(ckpt), "--max_new_tokens", "5"], w)["exit_code"] == 0
        )

    print("| command | bad input | what it prints (exit code 2, no traceback) |\n|---|---|---|")
    for r in rows:
        print(f"| `{r['command']}` | {r['case']} | {r['message']} |")
    one_line = all(r["exit_code"] == 2 and r["error_lines"] == 1 and not r["traceback"] for r in rows)
    print(
        f"\nall {len(rows)} cases: exit 2, one line, no traceback: {'yes' if one_line else 'NO'}; "
        f"malicious checkpoint ran code: {'YES' if code_ran else 'no'}; "
        f"the run's checkpoint still samples after all of them: {'yes' if survived else 'NO'}"
    )
    return dict(results=rows, all_one_line=one_line, malicious_code_ran=code_ran, checkpoint_survived=survived)


if __name__ == "__main__":
    main()
