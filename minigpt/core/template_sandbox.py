"""The chat template's sandbox: jinja2's immutable sandbox (no code runs, no data is changed), and a budget for
each render, so that a template from the hub or a user can neither loop forever nor fill the memory.

    env = TemplateSandbox(trim_blocks=True, lstrip_blocks=True)
    with env.budget(input_chars=1000) as budget:
        for block in env.from_string(text).generate(messages=...):
            budget.emit(block)

Two bounds, spent through jinja2's sandbox hooks (call, getattr, getitem, the intercepted operators), its filters
and two places of the generated code (each loop's items, the `~` operator):
- steps: every loop item, call, filter, lookup and operator costs one; a 200-message conversation takes ~1,600
  with ChatML and ~2,000 with a Llama-3.1-style template, MAX_STEPS 500 times that (0.1 s of empty loops);
- characters: no value the template computes, and not its output, may pass OUTPUT_BASE + 4x the characters of
  the conversation.  A value that would grow past it (`'x' * 3*10**8`, a width of 10**9, a text joined or
  replaced into a huge one, `lipsum(10**7)`) is refused before it is built, from its operands' sizes; anything
  else is checked as soon as it exists.
Either is one DataError.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import wraps
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import EvalContext
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

from minigpt.core.errors import DataError

__all__ = ["TemplateSandbox", "MAX_STEPS", "OUTPUT_BASE"]

MAX_STEPS = 1_000_000
OUTPUT_BASE = 1 << 20  # characters a template may write beyond 4x its conversation (markup, a system prompt)
_METERED = "_metered_items"  # the filter each loop's iterable is passed through
_NUMBERS = re.compile(r"\d+")
LIPSUM_WORD_CHARS = 16  # lipsum's longest word (12 characters), its comma or full stop and a space, rounded up


def refuse(message: str) -> NoReturn:
    raise DataError(message)


@dataclass
class RenderBudget:
    steps: int
    chars: int  # the size bound of any one value, and of the whole output
    written: int = 0

    def spend(self, steps: int = 1) -> None:
        self.steps -= steps
        if self.steps < 0:
            refuse(
                f"the chat template ran past its render budget of {MAX_STEPS:,} steps (loop items, calls, "
                "lookups); a template renders a conversation in a few thousand: fix its loops"
            )

    def allow(self, size: int, what: str = "a text") -> None:
        if size > self.chars:
            refuse(
                f"the chat template builds {what} of {size:,} characters, more than the {self.chars:,} its "
                f"conversation allows ({OUTPUT_BASE:,} + 4x the messages' characters); fix it"
            )

    def emit(self, block: str) -> None:
        self.written += len(block)
        self.allow(self.written, "an output")


_BUDGET: ContextVar[RenderBudget | None] = ContextVar("template_render_budget", default=None)


def _budget() -> RenderBudget:
    """The render's budget.  Outside TemplateSandbox.budget() each hook gets a fresh one: sizes stay bounded but
    steps do not add up, so render inside it (ChatTokenizer.render, the one caller, does)."""
    return _BUDGET.get() or RenderBudget(MAX_STEPS, OUTPUT_BASE)


def size(x: Any, seen: dict[int, int] | None = None) -> int:
    """About the length of str(x): a text's characters; a container's items and, all the way down, their texts'
    characters (a list repeating one huge list a thousand times counts a thousand times; each object is measured
    once)."""
    if isinstance(x, (str, range)):
        return len(x)
    if not isinstance(x, (list, tuple, dict, set, frozenset)):
        return 0
    seen = {} if seen is None else seen
    if id(x) not in seen:
        seen[id(x)] = 0  # (a cycle: the immutable sandbox cannot build one)
        items = [v for kv in x.items() for v in kv] if isinstance(x, dict) else x
        seen[id(x)] = len(x) + sum(size(i, seen) for i in items)
    return seen[id(x)]


def _operand(x: Any) -> int:
    """What an argument can add to a text: its size, or for a count or width its value."""
    return abs(x) if isinstance(x, int) and not isinstance(x, bool) else size(x)


def grown(subject: Any, args: Iterable[Any]) -> int:
    """An upper bound on the size of what a text method or filter makes of `subject` and its arguments: replace,
    join, center, format and the like never exceed (size + 1) * (1 + the arguments' sizes and counts) plus the
    widths a format string writes."""
    widths = (
        max(map(int, _NUMBERS.findall(subject)), default=0)
        if isinstance(subject, str) and ("{" in subject or "%" in subject)
        else 0
    )
    return (size(subject) + 1) * (1 + sum(map(_operand, args))) + widths


def _materialized(values: Iterable[Any]) -> tuple[Any, ...]:
    """Iterators (a filter's generator) as tuples, so that their size is known before they are used."""
    return tuple(tuple(v) if isinstance(v, Iterator) else v for v in values)


def _metered_filter(func: Callable[..., Any]) -> Callable[..., Any]:
    """A jinja2 filter that costs a step, refused beforehand when its text could outgrow the budget, and checked
    after.  (wraps keeps jinja2's pass_context / pass_environment marks, so it is called as the original.)"""

    @wraps(func)
    def metered(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.spend()
        args, kwargs = _materialized(args), dict(zip(kwargs, _materialized(kwargs.values())))
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.Environment, EvalContext))]
        if values:
            budget.allow(grown(values[0], [*values[1:], *kwargs.values()]))
        result = func(*args, **kwargs)
        budget.allow(size(result))
        return result

    metered.metered = True  # type: ignore[attr-defined]
    return metered


@jinja2.pass_context
def _metered_items(context: Any, items: Any) -> Iterator[Any]:
    """A loop's iterable, one step per item (pass_context: never evaluated while compiling)."""
    budget = _budget()
    for item in items:
        budget.spend()
        yield item


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (jinja2's names)
    """jinja2's `lipsum` global, refused before it writes its n paragraphs of fewer than `max` words each when they
    could outgrow the budget (it builds the whole text before returning it: lipsum(10**7) is gigabytes)."""
    _budget().allow(_operand(n) * ((_operand(max) + 1) * LIPSUM_WORD_CHARS + len("<p></p>\n")))
    return generate_lorem_ipsum(n, html, min, max)


class _MeteredCode(CodeGenerator):
    """jinja2's code generator with every `{% for %}` iterable passed through _metered_items and every `~` join
    checked for size before it is made."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        for loop in node.find_all(nodes.For):  # before the dependencies are pulled: the filter is one of them
            loop.iter = nodes.Filter(loop.iter, _METERED, [], [], None, None, lineno=loop.lineno)
        super().visit_Template(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.joined((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class TemplateSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with a render budget (see the module docstring)."""

    code_generator_class = _MeteredCode
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters[_METERED] = _metered_items
        self.globals["lipsum"] = _lipsum

    def from_string(self, source: Any, *args: Any, **kwargs: Any) -> jinja2.Template:
        for name, func in self.filters.items():  # every filter, those added after construction (tojson) too
            if name != _METERED and not getattr(func, "metered", False):
                self.filters[name] = _metered_filter(func)
        return super().from_string(source, *args, **kwargs)

    @contextmanager
    def budget(self, input_chars: int = 0) -> Iterator[RenderBudget]:
        """The budget of one render: MAX_STEPS steps, values and output up to OUTPUT_BASE + 4 * input_chars."""
        token = _BUDGET.set(RenderBudget(MAX_STEPS, OUTPUT_BASE + 4 * input_chars))
        try:
            yield _BUDGET.get()
        finally:
            _BUDGET.reset(token)

    # ------------------------------------------------------------------------------------- the sandbox's hooks

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        budget = _budget()
        budget.spend()
        owner = getattr(inspect.unwrap(__obj), "__self__", None)  # a text's method (format: jinja2 wraps it)
        if isinstance(owner, str):
            args, kwargs = _materialized(args), dict(zip(kwargs, _materialized(kwargs.values())))
            budget.allow(grown(owner, [*args, *kwargs.values()]))
        if isinstance(__obj, LoopContext) and args:  # loop(children) of a recursive loop: its items cost too
            args = (_metered_items(__context, args[0]), *args[1:])
        result = super().call(__context, __obj, *args, **kwargs)
        budget.allow(size(result))
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().spend()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().spend()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.spend()
        if operator == "*" and (isinstance(left, int) or isinstance(right, int)):  # a text or list repeated
            budget.allow(size(left) * _operand(right) if isinstance(right, int) else _operand(left) * size(right))
        elif operator == "+":
            budget.allow(size(left) + size(right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):  # its digits, roughly
            budget.allow(abs(right) * max(abs(left), 1).bit_length() // 3, "a number")
        elif operator == "%" and isinstance(left, str):  # printf-style formatting
            budget.allow(grown(left, right if isinstance(right, tuple) else [right]))
        result = super().call_binop(context, operator, left, right)
        budget.allow(size(result))
        return result

    def joined(self, parts: tuple[Any, ...]) -> str:
        """`a ~ b ~ ...`: the parts as text, refused before joining when they add up past the budget."""
        texts = [str(p) for p in parts]
        budget = _budget()
        budget.spend()
        budget.allow(sum(map(len, texts)))
        return "".join(texts)
