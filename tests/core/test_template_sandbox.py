"""The chat template's sandbox (minigpt.core.template_sandbox; issue 40): a template that loops for ever stops at its
step budget, one that grows without end at its size budget, and ordinary templates render as before."""

from __future__ import annotations

import json

import pytest

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import DataError
from minigpt.core.template_sandbox import MAX_STEPS
from minigpt.core.tokenizers import ByteTokenizer
from support import deadline

pytestmark = pytest.mark.usefixtures("one_thread")


def render(template: str, messages=None) -> str:
    tok = ChatTokenizer(ByteTokenizer(), template + "<|im_end|>", added=["<|im_end|>"], specials=["<|im_end|>"])
    return tok.render(messages or [{"role": "user", "content": "hi"}])[0]


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}",  # issue 40's
        "{% for m in messages %}{% for a in m.content * 5000 %}{% for b in m.content * 5000 %}{% endfor %}"
        "{% endfor %}{% endfor %}",  # loops over data, no call in the body
        "{% for x in [[1]] recursive %}{% for i in range(10**5) %}{% endfor %}{{ loop([[1]]) }}{% endfor %}",
    ],
)
def test_a_template_that_loops_for_ever_stops_at_its_step_budget(template):
    with pytest.raises(DataError, match=f"render budget of {MAX_STEPS:,} steps"):
        render(template)


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 3*10**8 }}",  # issue 40's: refused before it is built
        "{{ 'x'.center(10**9) }}",
        "{{ 'x'|center(10**9) }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ '%999999999d' % 1 }}",
        "{{ ('x' * 60000).replace('x', 'y' * 60000) }}",
        "{{ ('x' * 100000).join(range(100000)|map('string')) }}",
        "{{ (range(100000)|map('string'))|join('x' * 100000) }}",
        "{% set a = 'x' * 900000 %}{{ a ~ a ~ a ~ a ~ a ~ a }}",
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{{ [['x' * 1000] * 1000] * 1000 }}",
        "{{ 2 ** 100000000 }}",
        "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",  # the output itself
    ],
)
def test_a_template_that_grows_without_end_stops_at_its_size_budget(template):
    with pytest.raises(DataError, match="more than the 1,048,5.. its conversation allows"):
        render(template)


@pytest.mark.parametrize("call", ["lipsum(10**9)", "lipsum(1, False, 20, 10**9)", "lipsum(n=10**6, html=False)"])
def test_lipsum_is_refused_before_it_writes_past_the_budget(call):
    # jinja2's global builds its whole text first: lipsum(10**7) took minutes and gigabytes before the size check
    with deadline(5), pytest.raises(DataError, match="more than the 1,048,5.. its conversation allows"):
        render("{{ " + call + " }}")
    assert render("{{ lipsum(2, False, 3, 5)|wordcount > 0 }}") == "True<|im_end|>"


def test_ordinary_templates_render_as_before():
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    out = render(
        "{{ messages|tojson }}|{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|"
        "{{ '%d-%s' % (3, 'a') }}|{{ '{}:{}'.format(1, 2) }}|{{ messages[0]['content']|upper }}|"
        "{% for m in messages %}{{ loop.index }}{{ m.role[0] }}{% endfor %}",
        messages,
    )
    assert out == json.dumps(messages) + "|1|3-a|1:2|HI THERE|1u2a<|im_end|>"
    tok = ChatTokenizer.for_base(ByteTokenizer())  # the default ChatML template, on a long conversation
    long = [{"role": ("user", "assistant")[i % 2], "content": "word " * 2000} for i in range(50)]
    assert tok.render(long)[0].count("<|im_end|>") == 50
