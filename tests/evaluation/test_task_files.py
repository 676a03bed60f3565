"""Task files for --tasks (minigpt.evaluation.task_files, issue 40): read only from where the user named them, and
one that cannot be used is one line."""

from __future__ import annotations

import pytest

from minigpt.core.errors import UserError
from minigpt.evaluation import task_files


def test_a_task_name_is_never_read_as_a_file_of_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "hook.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w')\ndef f(d): return d\n")
    (tmp_path / "arc_easy").write_text("task: arc_easy\nprocess_docs: !function hook.f\n")
    monkeypatch.chdir(tmp_path)

    class NoTasks:  # the harness's index (15 s to build): here it knows no task
        def __init__(self, **kwargs):
            pass

        def match_tasks(self, names):
            return []

    monkeypatch.setattr(task_files, "checked_task_manager", lambda: NoTasks)
    with pytest.raises(UserError, match="unknown task 'arc_easy'.*ending in .yaml"):
        task_files.resolve_tasks(["arc_easy"])
    assert not (tmp_path / "RAN").exists()


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "task: deep\nx: " + "[" * 100_000 + "]" * 100_000 + "\n",
            "nested more than 100 levels deep",
        ),  # libyaml crashed
        ("task: loop\ninclude: loop.yaml\n", "it includes itself"),
        ("task: far\nprocess_docs: !function json.loads\n", "!function json.loads is not a function of json.py"),
    ],
    ids=["deep", "include-cycle", "installed-module"],
)
def test_a_task_file_that_cannot_be_used_is_one_line(tmp_path, text, message):
    (tmp_path / "loop.yaml").write_text(text)
    with pytest.raises(UserError, match=message) as e:
        task_files.read_task_file(str(tmp_path / "loop.yaml"))
    assert "\n" not in str(e.value)


def test_a_hook_module_that_exits_is_one_line_at_load_and_at_call(tmp_path):
    """sys.exit in a task's hook module (an argparse at its top reading eval.py's arguments, say) ended eval.py with
    the module's exit code and no word; when a hook calls it, the same."""
    (tmp_path / "task.yaml").write_text("task: mine\nprocess_docs: !function hooks.process\n")
    (tmp_path / "hooks.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(UserError, match="SystemExit") as e:
        task_files.read_task_file(str(tmp_path / "task.yaml"))
    assert "\n" not in str(e.value)
    (tmp_path / "hooks.py").write_text("import sys\ndef process(docs):\n    sys.exit(4)\n")
    hook = task_files.read_task_file(str(tmp_path / "task.yaml"))["process_docs"]
    with pytest.raises(UserError, match=r"task mine: its hook !function hooks.process .* failed with SystemExit: 4"):
        hook([])
