"""GRPO's rewards (grpo.reward): the built-in exact match of the final answer, or a user's function from a file.

    reward = load_reward("exact_match")                  # or "my_rewards.py:score" (the user's code: it runs)
    rewards = score(reward, prompts, completions, answers, wheres)   # (N,) float32, every one a finite number

exact_match: the completion's final answer is its last number (commas between digit groups dropped: "1,234" is
1234; a fraction "3/4" is one number), or, where it holds none, its last non-empty line; it scores 1.0 when it
equals the row's answer, numbers compared as numbers ("42.0" equals "42", "6/8" equals "0.75"), other text after
stripping spaces at both ends; else 0.0.

A user's reward is Python code, like a task file's hooks: `grpo.reward path/to/file.py:function` runs that file
(and nothing from the current directory or the installed packages by that name), then calls, per completion,

    function(prompt=..., completion=..., answer=...) -> a number (True/False count as 1/0)

prompt as the row gave it (text, or a list of messages), completion the sampled text (without special tokens: the
end of turn, a marker the model wrote), answer the row's answer text. A function that raises, or returns anything
but a finite number, stops training with one line naming the prompt (nothing already saved is touched).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minigpt.core.errors import DataError, UserError, first_line
from minigpt.core.user_files import code_module

__all__ = ["EXACT_MATCH", "exact_match", "final_answer", "load_reward", "score"]

EXACT_MATCH = "exact_match"
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")  # a fraction's "/4" with it: "3/4" is not 4
Reward = Callable[..., Any]


def final_answer(text: str) -> str:
    """The completion's last number (commas dropped), or its last non-empty line, stripped."""
    numbers = NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(",", "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def as_number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    try:
        value = float(Fraction(text)) if "/" in text else float(text)  # "3/4" as 0.75
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def exact_match(prompt: Any = None, completion: str = "", answer: str = "") -> float:
    """1.0 when the completion's final answer equals `answer` (numbers as numbers), else 0.0."""
    got, want = final_answer(completion), str(answer).strip()
    a, b = as_number(got), as_number(want)
    if a is not None and b is not None:
        return float(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9))
    return float(got == want)


def load_reward(spec: str) -> Reward:
    """grpo.reward: "exact_match", or "FILE.py:FUNCTION" (FUNCTION loaded from FILE only)."""
    if spec == EXACT_MATCH:
        return exact_match
    file, sep, function = spec.rpartition(":")
    usage = 'give "exact_match" or "path/to/file.py:function_name"'
    if not sep or not file.endswith(".py") or not function.isidentifier():
        raise UserError(f"grpo.reward {spec!r}: not a reward; {usage}")
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise UserError(f"grpo.reward {spec}: no such file {file}; {usage}")
    try:
        module = code_module(path, "minigpt_reward_")
    except (Exception, SystemExit) as e:  # the user's file failed to run: its error, in one line (sys.exit at its
        # top level, or an argparse there reading train.py's arguments, ended the run with no word)
        raise UserError(
            f"grpo.reward {spec}: {file} failed to load ({type(e).__name__}: {first_line(e)}); fix the file"
        ) from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise UserError(f"grpo.reward {spec}: {file} has no function {function}; {usage}")
    return fn


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def score(reward: Reward, prompts: list[Any], completions: list[str], answers: list[str], wheres: list[str]):
    """(N,) float32 rewards of N completions; one UserError naming the prompt for a reward that raises or is not
    a finite number."""
    values = []
    for prompt, completion, answer, where in zip(prompts, completions, answers, wheres):
        try:
            value = reward(prompt=prompt, completion=completion, answer=answer)
        except (Exception, SystemExit) as e:  # the user's code: which prompt, in one line (sys.exit too: no end)
            raise DataError(
                f"the reward function failed on the prompt of {where} ({prompt!r:.60}) with {type(e).__name__}: "
                f"{first_line(e)}; fix the function (grpo.reward)"
            ) from None
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            value = value.item()  # a one-number tensor, as a reward computed with torch ends
        elif isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.size == 1):
            value = value.item()  # numpy's as Python's: np.bool_ (np.isclose's, a comparison's) is no numbers.Real
        try:  # (bool is an int: 1/0)
            number = float(value) if isinstance(value, numbers.Real) else None
        except OverflowError:  # an int past float's range
            number = None
        # the rewards are float32: a float past its range (1e39) became inf there, and the loss NaN
        if number is None or not math.isfinite(number) or abs(number) > FLOAT32_MAX:
            raise DataError(
                f"the reward function returned {value!r:.60} for the prompt of {where} ({prompt!r:.60}), not a "
                "finite number; "
                "make it return a float for every completion (grpo.reward)"
            )
        values.append(number)
    return torch.tensor(values, dtype=torch.float32)
