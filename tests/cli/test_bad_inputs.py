"""The shared bad-input table (tests/cli/bad_input_cases.py): each case gives one `error:` line with the
expected words and exit code 2, in-process; and docs/errors.md's table lists exactly these cases."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from bad_input_cases import CASES, make_workdir

from minigpt.cli import attention as attention_cli
from minigpt.cli import eval as eval_cli
from minigpt.cli import export as export_cli
from minigpt.cli import sample as sample_cli
from minigpt.cli import train as train_cli
from minigpt.cli.errors import run_cli

REPO = Path(__file__).resolve().parents[2]  # the repository root

RUN = {
    "train.py": lambda argv, stdin: run_cli(lambda: train_cli.main(argv)),
    "sample.py": lambda argv, stdin: sample_cli.main(argv, stdout=io.StringIO(), stdin=io.StringIO(stdin or "")),
    "eval.py": lambda argv, stdin: eval_cli.main(argv),
    "attention.py": lambda argv, stdin: attention_cli.main(argv, stdout=io.StringIO(), stdin=io.StringIO(stdin or "")),
    "export.py": lambda argv, stdin: export_cli.main(argv),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("bad_inputs"), train_cli.main)


@pytest.mark.parametrize("case", [c for c in CASES if not c.network], ids=lambda c: f"{c.command}: {c.case}")
def test_each_bad_input_is_one_clear_line(case, workdir, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        RUN[case.command](case.argv(workdir), case.stdin)
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, err
    for fragment in case.expect:
        assert fragment in errors[0], (fragment, errors[0])
    assert not (workdir / "PWNED").exists(), "a checkpoint ran code"


def test_readme_table_is_the_case_table():
    """docs/errors.md's bad-input table has one row per case, in order, whose message holds the expected words."""
    readme = (REPO / "docs" / "errors.md").read_text()
    rows = re.findall(r"^\| `(train|sample|eval|attention|export)\.py` \| (.+?) \| (error: .+?) \|$", readme, re.M)
    assert [(f"{cmd}.py", case) for cmd, case, _ in rows] == [(c.command, c.case) for c in CASES]
    for (_, _, message), case in zip(rows, CASES):
        for fragment in case.expect:
            assert fragment in message.replace("\\|", "|"), (case.case, fragment, message)
