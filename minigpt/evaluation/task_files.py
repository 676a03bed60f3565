"""The tasks eval.py --tasks names: the harness's own (by name) and task YAML files (by path), read so that
nothing runs from a place the user did not name.

    config = read_task_file("my_tasks/quiz.yaml")     # the harness's task format, `include:` and hooks resolved
    specs, manager = resolve_tasks(["hellaswag", "my_tasks/quiz.yaml"])

A task file is code, like a script: its `!function module.fn` hooks are Python functions the harness calls (to
process the documents, to write a prompt, to score an answer).  minigpt reads them from `module.py` in the task
file's own folder only, never from the current directory or the installed packages as the harness's own loader
also would, and an error in one is one line naming the task and the hook.  A task given without the .yaml/.yml
ending is a harness task name, never a file of the current directory.  The file itself is bounded like any other
(a regular file of at most 1 MiB, nested at most MAX_JSON_DEPTH deep: libyaml crashes the interpreter on deeper).

TaskManager checks, once the tasks are built, that each can draw the few-shot examples asked of it (the harness
would stop on a ValueError from random.sample).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from minigpt.core.errors import UserError, first_line
from minigpt.core.user_files import (
    MAX_JSON_DEPTH,
    TEMPLATE_BYTES,
    TOO_DEEP,
    code_module,
    json_depth,
    read_user_text,
)

__all__ = ["read_task_file", "resolve_tasks"]

FORMAT = "a task file is a YAML mapping: task, dataset_path, output_type, doc_to_text, doc_to_target, ..."
YAML_SUFFIXES = (".yaml", ".yml")


class NotATask(ValueError):
    """A YAML file that holds no task mapping."""


def _hook(spec: str, task_file: Path, task: dict[str, str]) -> Callable[..., Any]:
    """`!function module.fn` of task_file: fn from module.py in its folder, whose errors name the task and hook."""
    module, _, name = spec.rpartition(".")
    source = (task_file.parent / f"{module.replace('.', '/')}.py").resolve()
    fn = (
        getattr(code_module(source, "minigpt_task_hooks_"), name, None)
        if module and source.is_file() and source.is_relative_to(task_file.parent)
        else None
    )
    if not callable(fn):
        raise ValueError(
            f"its hook !function {spec} is not a function of {module or '?'}.py in the task file's "
            "folder, the one place task hooks are read from"
        )

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (Exception, SystemExit) as e:  # the user's own code (sys.exit too): which task and hook, in one line
            raise UserError(
                f"task {task['name']}: its hook !function {spec} ({source}) failed with "
                f"{type(e).__name__}: {first_line(e)}; fix the function"
            ) from None

    return hook


def _load(path: Path, task: dict[str, str], seen: set[Path]) -> dict[str, Any]:
    """A task YAML as the harness reads it (lm_eval.tasks._yaml_loader.load_yaml: `include:` merged, the file's
    own keys winning), with its hooks from _hook."""
    path = path.expanduser().resolve()
    text = read_user_text(path, TEMPLATE_BYTES)
    if path in seen or json_depth(io.BytesIO(text.encode("utf-8", "surrogatepass"))) > MAX_JSON_DEPTH:
        raise ValueError(TOO_DEEP if path not in seen else f"it includes itself ({path.name})")
    seen.add(path)
    loader = type("TaskLoader", (getattr(yaml, "CSafeLoader", yaml.SafeLoader),), {})
    loader.add_constructor("!function", lambda load, node: _hook(load.construct_scalar(node), path, task))
    config = yaml.load(text, Loader=loader)  # noqa: S506 (a safe loader, plus the one tag above)
    if not isinstance(config, dict):
        raise NotATask(f"{path.name} holds a {type(config).__name__}")
    includes = config.pop("include", None) or []
    merged: dict[str, Any] = {}
    for include in includes if isinstance(includes, list) else [includes]:
        merged.update({k: v for k, v in _load(path.parent / include, task, seen).items() if k != "task_list"})
    return {**merged, **config}


def read_task_file(task: str) -> dict:
    """A task YAML file as the harness reads it (`include:` and `!function` resolved); UserError naming the file
    when it is missing, does not parse, holds no task or names a hook outside its folder."""
    path = Path(task).expanduser()
    named = {"name": task}  # the hooks' errors name the task: its file until its name is read
    config, error = None, None
    try:
        config = _load(path, named, set()) if path.is_file() else None
    except (Exception, SystemExit) as e:  # the file's, its includes' or its hooks' (their module's code runs, sys.exit
        # too: it ended eval.py silently with the module's exit code): one line
        error = e
    named["name"] = config.get("task", config.get("group")) if config else None
    if not isinstance(named["name"], str):
        raise UserError(_unusable(task, path, error))
    return config


def _unusable(task: str, path: Path, error: BaseException | None) -> str:
    """Why a task file cannot be used, in one line."""
    if not path.is_file():
        return f"task file not found: {task}; give an existing task YAML file or a task name"
    if isinstance(error, yaml.YAMLError):
        return (
            f"task file {task} is not valid YAML ({' '.join(first_line(error).split())}); fix it (the harness's "
            "task format: task, dataset_path, output_type, doc_to_text, ...)"
        )
    if error is None or isinstance(error, NotATask):
        why = first_line(error, 300) if error else "no `task: NAME` in it"
        return f"task file {task} is not a harness task ({why}); {FORMAT}"
    return (
        f"task file {task} cannot be read ({type(error).__name__}: {first_line(error)}); fix it or the files it "
        "includes"
    )


# ---------------------------------------------------------------------------------------------------- tasks


def fewshot_room(task: Any) -> tuple[int, str]:
    """(how many few-shot examples the task can draw, where from): its few-shot documents, less the question
    itself when they are the split being evaluated (the harness then draws one more and drops it)."""
    sampler = getattr(task, "sampler", None)
    pool = len(sampler.fewshot_docs()) if sampler is not None else 0
    fewshot = getattr(task, "fewshot_cfg", None)
    split = getattr(fewshot, "split", None)
    borrowed = (  # no split, samples, training or validation documents: the harness takes the evaluated ones
        split is None
        and getattr(fewshot, "samples", None) is None
        and not task.has_training_docs()
        and not task.has_validation_docs()
    )
    if borrowed:  # and then does not leave the question out: its own answer could be among its examples
        return 0, (
            " (it has only the documents it evaluates, which the harness would not leave out of their own examples; "
            f"set `fewshot_split: {task.config.test_split}` in its YAML, which leaves each question out)"
        )
    same = split is not None and split == task.config.test_split
    where = f" (its {split} split{', less the question itself' if same else ''})" if split else ""
    return max(pool - same, 0), where


@functools.cache
def checked_task_manager() -> type:
    """The harness's TaskManager, checking that each task it builds can draw its few-shot examples."""
    from lm_eval.tasks import TaskManager

    class CheckedTaskManager(TaskManager):
        num_fewshot: int | None = None  # evaluate_tasks's, which simple_evaluate sets on every task

        def load(self, task_list: Any) -> Any:
            loaded = super().load(task_list)
            for name, task in loaded["tasks"].items():
                own = task.get_config("num_fewshot")
                shots = own if self.num_fewshot is None or own == 0 else self.num_fewshot
                room, where = fewshot_room(task) if shots else (0, "")
                if shots and shots > room:
                    raise UserError(
                        f"num_fewshot={shots}: task {name} has {room} document(s) to draw few-shot "
                        f"examples from{where}; ask for {room} or fewer"
                    )
            return loaded

    return CheckedTaskManager


def resolve_tasks(tasks: Sequence[str]) -> tuple[list[str | dict], Any]:
    """(task specs for simple_evaluate, the TaskManager): names checked against the harness's index, YAML files
    read.  Raises UserError for an unknown name or a task file that cannot be used."""
    tasks = [t.strip() for t in tasks if t.strip()]
    is_file = [t.lower().endswith(YAML_SUFFIXES) for t in tasks]  # a name is never looked up as a file
    specs = [read_task_file(t) if f else t for t, f in zip(tasks, is_file)]
    names = [t for t, f in zip(tasks, is_file) if not f]
    manager = checked_task_manager()(include_defaults=bool(names))  # indexing the built-in tasks takes ~15 s
    unknown = [name for name in names if not manager.match_tasks([name])]
    if unknown or not tasks:
        what = f"unknown task {unknown[0]!r}" if unknown else "no task given"
        raise UserError(
            f"{what}; `lm-eval ls tasks` lists the harness's tasks (pass --tasks NAME[,NAME...], e.g. "
            "hellaswag,arc_easy), or give the path of a task YAML file (ending in .yaml)"
        )
    return specs, manager
