"""The chat template and tokenizer (minigpt.core.chat_template): the loss mask covers exactly what the assistant
says, every tokenizer kind, and a template that fails is one line (the rows: tests/data/test_conversations.py)."""

from __future__ import annotations

import json

import pytest

from minigpt.core.chat_template import DEFAULT_CHAT_TEMPLATE, IM_END, IM_START, ChatTokenizer
from minigpt.core.errors import DataError
from minigpt.core.tokenizers import ByteTokenizer, TiktokenTokenizer, tokenizer_from_dict
from support import BASES, CONVERSATION, SMOL_TEMPLATE, hf_base, small_bpe


def trained_text(tok: ChatTokenizer, ids: list[int], mask: list[bool]) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


@pytest.mark.parametrize("kind", BASES)
def test_the_mask_is_the_assistants_content_and_end_of_turn_for_every_tokenizer(kind):
    tok = ChatTokenizer.for_base(BASES[kind](), conversations=[CONVERSATION])
    ids, mask = tok.encode_chat(CONVERSATION)
    assert tok.decode(ids) == tok.render(CONVERSATION)[0]  # every character, the new ones of a char base too
    assert trained_text(tok, ids, mask) == f"42, é☃{IM_END}2{IM_END}"
    assert ids.count(tok.eot_id) == len(CONVERSATION) and tok.eot_id == tok.token_id(IM_END)
    assert tok.encode_chat(CONVERSATION, train_on_prompt=True)[1] == [True] * len(ids)
    prompt = tok.encode_chat(CONVERSATION[:2], add_generation_prompt=True)[0]
    assert tok.decode(prompt).endswith(f"What is 12 + 30?{IM_END}\n{IM_START}assistant\n")
    again = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))  # as a checkpoint stores it
    assert again.encode_chat(CONVERSATION) == (ids, mask) and again.vocab_size == tok.vocab_size


def test_markers_and_new_characters_take_the_ids_after_the_base():
    base = BASES["char"]()
    tok = ChatTokenizer.for_base(base, conversations=[CONVERSATION])
    assert tok.added[:2] == [IM_START, IM_END] and tok.first_added == base.vocab_size
    assert set(tok.added[2:]) == set("01234+,é☃") and tok.vocab_size == base.vocab_size + len(tok.added)
    assert tok.encode("ab") == base.encode("ab")  # the base's ids are unchanged
    assert tok.encode(f"a{IM_END}") == [base.stoi["a"], base.vocab_size + 1]
    bpe = ChatTokenizer.for_base(TiktokenTokenizer(small_bpe()), conversations=[CONVERSATION])
    assert bpe.added == [IM_START, IM_END]  # any text encodes: only the markers are new


def test_a_source_template_without_the_generation_tag_gives_the_same_mask():
    base = hf_base(with_markers=True)  # its markers are its own tokens: nothing is added
    own = ChatTokenizer.for_base(base, SMOL_TEMPLATE)
    assert own.added == [] and own.eot_id == base.backend.token_to_id(IM_END)
    ours = ChatTokenizer(base, DEFAULT_CHAT_TEMPLATE, [], [IM_START, IM_END])
    assert own.encode_chat(CONVERSATION) == ours.encode_chat(CONVERSATION)


@pytest.mark.parametrize(
    "template, why",
    [
        ("{{ raise_exception('no system role, please') }}", "no system role, please"),
        ("{{ messages[0].content.__class__.__mro__ }}", "SecurityError"),  # the sandbox holds
        ("{% for m in messages %}{{ m['role'] + 1 }}{% endfor %}", "TypeError"),
    ],
)
def test_a_template_that_fails_to_render_is_one_line(template, why):
    tok = ChatTokenizer.for_base(ByteTokenizer(), template + IM_END)
    with pytest.raises(DataError, match="the chat template fails to render") as e:
        tok.encode_chat(CONVERSATION)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_template_that_does_not_compile_names_its_line():
    with pytest.raises(DataError, match="does not compile .line 2"):
        ChatTokenizer.for_base(ByteTokenizer(), "ok\n{% for %}" + IM_END).render(CONVERSATION)
