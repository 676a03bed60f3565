"""Hardening IV, the library side (issue 40): every read of user data is bounded where it is read.  JSON by depth
(one helper for every reader), files by kind and size, chat templates by a render budget in steps and characters,
generation by the memory its sizes imply, and a long chat by what it runs through the model per turn.  Each
hostile input is built here, on the fly."""

from __future__ import annotations

import io
import json
import os
import random

import pytest
import torch

from minigpt import GPT, GPTConfig
from minigpt.core.chat import ChatSession
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import DataError, UserError
from minigpt.core.limits import check_sampling_size, sampling_bytes
from minigpt.core.template_sandbox import MAX_STEPS
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, bpe_vocab_size
from minigpt.core.user_files import (MAX_JSON_DEPTH, TEMPLATE_BYTES, json_depth, json_lines, loads, nesting,
                                     read_user_text)

DEEP = 100_000
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ JSON depth


@pytest.mark.parametrize("text", ["[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP,
                                  "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)])
def test_json_nested_past_the_bound_is_a_value_error_not_a_recursion_error(text):
    with pytest.raises(ValueError, match=f"nested more than {MAX_JSON_DEPTH} levels deep"):
        loads(text)
    assert json_depth(io.BytesIO(text.encode())) > MAX_JSON_DEPTH  # the streaming check agrees


def test_json_within_the_bound_and_plain_values_parse():
    assert loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    assert loads("null") is None and loads("3") == 3 and loads(b'{"a": [1]}') == {"a": [1]}


def test_the_streaming_depth_scan_reads_strings_and_escapes_as_json_does():
    """Brackets inside strings, escaped quotes and backslash runs cut across chunk boundaries: the scan gives the
    parsed value's depth for every chunk size."""
    rng = random.Random(0)
    pieces = ["\\", '"', "[", "{", "]", "}", 'x\\\\"', "\\\\\\\\"]
    for _ in range(200):
        value = {"a": ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))) for _ in range(4)],
                 "b": [[[{"c": "\\\\"}]]]}
        for _ in range(rng.randint(0, 5)):
            value = [value, "\\"]
        text = json.dumps(value).encode()
        for chunk in (1, 2, 3, 7, 1 << 20):
            assert json_depth(io.BytesIO(text), chunk=chunk) == nesting(value), (text, chunk)


def test_json_lines_split_on_newlines_only():
    """U+2028, U+2029, NEL and U+001E may stand in a JSON string as they are; str.splitlines() broke there."""
    rows = [{"text": f"a{sep}b"} for sep in ("\u2028", "\u2029", "\u0085", "\x1e", "\x1c", "\x0b")]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows) + "\n \t\n"
    assert [loads(line) for _, line in json_lines(text)] == rows
    assert [n for n, _ in json_lines(text)] == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------------------------------------ file kinds


def test_a_device_a_fifo_a_folder_or_a_huge_file_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block until a writer comes
    big = tmp_path / "big.jinja"
    big.write_bytes(b"x" * (TEMPLATE_BYTES + 1))
    for path, why in [("/dev/zero", "a character device"), (fifo, "a FIFO"), (tmp_path, "a directory"),
                      (big, f"larger than {TEMPLATE_BYTES:,} bytes")]:
        with pytest.raises(ValueError, match=why):
            read_user_text(path, TEMPLATE_BYTES)


# ------------------------------------------------------------------------------------------------ templates


def render(template: str, messages=None) -> str:
    tok = ChatTokenizer(ByteTokenizer(), template + "<|im_end|>", added=["<|im_end|>"], specials=["<|im_end|>"])
    return tok.render(messages or [{"role": "user", "content": "hi"}])[0]


@pytest.mark.parametrize("template", [
    "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}",  # issue 40's
    "{% for m in messages %}{% for a in m.content * 5000 %}{% for b in m.content * 5000 %}{% endfor %}"
    "{% endfor %}{% endfor %}",  # loops over data, no call in the body
    "{% for x in [[1]] recursive %}{% for i in range(10**5) %}{% endfor %}{{ loop([[1]]) }}{% endfor %}",
])
def test_a_template_that_loops_for_ever_stops_at_its_step_budget(template):
    with pytest.raises(DataError, match=f"render budget of {MAX_STEPS:,} steps"):
        render(template)


@pytest.mark.parametrize("template", [
    "{{ 'x' * 3*10**8 }}",  # issue 40's: refused before it is built
    "{{ 'x'.center(10**9) }}", "{{ 'x'|center(10**9) }}", "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999d' % 1 }}", "{{ ('x' * 60000).replace('x', 'y' * 60000) }}",
    "{{ ('x' * 100000).join(range(100000)|map('string')) }}", "{{ (range(100000)|map('string'))|join('x' * 100000) }}",
    "{% set a = 'x' * 900000 %}{{ a ~ a ~ a ~ a ~ a ~ a }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{{ [['x' * 1000] * 1000] * 1000 }}", "{{ 2 ** 100000000 }}",
    "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",  # the output itself
])
def test_a_template_that_grows_without_end_stops_at_its_size_budget(template):
    with pytest.raises(DataError, match="more than the 1,048,5.. its conversation allows"):
        render(template)


def test_ordinary_templates_render_as_before():
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    out = render("{{ messages|tojson }}|{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|"
                 "{{ '%d-%s' % (3, 'a') }}|{{ '{}:{}'.format(1, 2) }}|{{ messages[0]['content']|upper }}|"
                 "{% for m in messages %}{{ loop.index }}{{ m.role[0] }}{% endfor %}", messages)
    assert out == json.dumps(messages) + "|1|3-a|1:2|HI THERE|1u2a<|im_end|>"
    tok = ChatTokenizer.for_base(ByteTokenizer())  # the default ChatML template, on a long conversation
    long = [{"role": ("user", "assistant")[i % 2], "content": "word " * 2000} for i in range(50)]
    assert tok.render(long)[0].count("<|im_end|>") == 50


# ------------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize("spec", ["bpe:²⁵⁸", "bpe:٤٠٩٦", "bpe:4096\u0660"])
def test_bpe_vocab_in_unicode_digits_is_one_line(spec):
    """str.isdigit() takes superscripts and other scripts' digits; int() refuses some and reads others."""
    with pytest.raises(DataError, match="in the digits 0-9"):
        bpe_vocab_size(spec)
    assert bpe_vocab_size("bpe:4_096") == 4096


def test_sampling_memory_is_bounded_from_the_sizes_before_anything_is_allocated(monkeypatch):
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=100)
    parts = sampling_bytes(config, batch=1000, prompt_tokens=10, new_tokens=100)
    assert parts["logits"] == 4 * 1000 * 10 * 100 and parts["tokens"] == 8 * 1000 * 110
    assert parts["KV cache"] == 4 * 2 * 2 * 1000 * 2 * 64 * 16  # 2 x 110 positions, capped at block_size
    monkeypatch.setenv("MINIGPT_MAX_MODEL_GB", "1")
    check_sampling_size(config, 1000, 10, 100)  # about 0.1 GB
    with pytest.raises(UserError, match=r"generating 100,000 sequence\(s\) of 10 \+ 100 tokens .* more than "
                                        r"MINIGPT_MAX_MODEL_GB=1 \(1.0 GB\); draw fewer samples"):
        check_sampling_size(config, 100_000, 10, 100)


# ------------------------------------------------------------------------------------------------ long chats


def test_a_long_chat_runs_each_token_about_once_and_replies_as_without_the_cache():
    """Once the conversation fills the block, its oldest turns go down to half a block at once: the cache is filled
    again once per half block of conversation, not at every turn (which ran ~2x as many tokens here)."""
    tok = ChatTokenizer.for_base(CharTokenizer("abcdefghijklmnopqrstuvwxyz \n?0123456789"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=96, vocab_size=tok.vocab_size)).eval()
    cached, plain = (ChatSession(model, tok, "be kind", max_new_tokens=8, temperature=0, use_kv_cache=c)
                     for c in (True, False))
    turns = [f"turn {t} hello" for t in range(24)]
    for turn in turns:
        assert cached.reply(turn) == plain.reply(turn)
    assert len(tok.encode_chat(cached.messages)[0]) <= 96  # the old turns were dropped
    per_turn = len(tok.encode_chat([{"role": "user", "content": turns[-1]},
                                    {"role": "assistant", "content": "x" * 8}])[0])
    assert cached.prefilled <= len(turns) * per_turn  # 678 of 1,008 here; a refill at every turn ran 1,558
