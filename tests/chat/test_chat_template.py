"""The chat template and tokenizer (minigpt.core.chat_template) and the conversation rows (minigpt.data.conversations):
the loss mask covers exactly what the assistant says, every tokenizer kind, and every bad row is one line."""

from __future__ import annotations

import json

import pytest
import tiktoken

from minigpt.core.chat_template import DEFAULT_CHAT_TEMPLATE, IM_END, IM_START, ChatTokenizer
from minigpt.core.errors import DataError
from minigpt.core.hf_tokenizer import HFTokenizer
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer, tokenizer_from_dict
from minigpt.data.conversations import read_conversations

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"},
                {"role": "assistant", "content": "42, é☃"}, {"role": "user", "content": "And 1 + 1?"},
                {"role": "assistant", "content": "2"}]
# ChatML as SmolLM2-Instruct ships it: no {% generation %} tag
SMOL_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def small_bpe() -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate([b"Wh", b"at", b" 1", b"12"])}
    return tiktoken.Encoding(name="small_bpe", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks)})


def hf_base(with_markers: bool) -> HFTokenizer:
    """A byte-level BPE made by `tokenizers`, with the ChatML markers as special tokens when asked (SmolLM2's way)."""
    import tokenizers as t

    alphabet = sorted(t.pre_tokenizers.ByteLevel.alphabet())
    backend = t.Tokenizer(t.models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = t.decoders.ByteLevel()
    specials = ["<|endoftext|>"] + ([IM_START, IM_END] if with_markers else [])
    backend.add_special_tokens([t.AddedToken(s, special=True, normalized=False) for s in specials])
    return HFTokenizer(backend.to_str(), eos_id=backend.token_to_id("<|endoftext|>"))


BASES = {"char": lambda: CharTokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n?."),
         "byte": ByteTokenizer, "tiktoken": lambda: TiktokenTokenizer(small_bpe()),
         "hf": lambda: hf_base(with_markers=False)}


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


@pytest.mark.parametrize("template, why", [
    ("{{ raise_exception('no system role, please') }}", "no system role, please"),
    ("{{ messages[0].content.__class__.__mro__ }}", "SecurityError"),  # the sandbox holds
    ("{% for m in messages %}{{ m['role'] + 1 }}{% endfor %}", "TypeError"),
])
def test_a_template_that_fails_to_render_is_one_line(template, why):
    tok = ChatTokenizer.for_base(ByteTokenizer(), template + IM_END)
    with pytest.raises(DataError, match="the chat template fails to render") as e:
        tok.encode_chat(CONVERSATION)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_template_that_does_not_compile_names_its_line():
    with pytest.raises(DataError, match="does not compile .line 2"):
        ChatTokenizer.for_base(ByteTokenizer(), "ok\n{% for %}" + IM_END).render(CONVERSATION)


# ------------------------------------------------------------------------------------------------ rows

def test_rows_from_jsonl_json_and_parquet_and_alpaca_rows(tmp_path):
    alpaca = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n\n" + json.dumps(alpaca) + "\n")
    (tmp_path / "a.json").write_text(json.dumps([{"messages": CONVERSATION}, alpaca]))
    import datasets

    datasets.Dataset.from_list([{"messages": CONVERSATION}]).to_parquet(str(tmp_path / "a.parquet"))
    expected_alpaca = [{"role": "user", "content": "Add the numbers.\n\n2 and 3"}, {"role": "assistant", "content": "5"}]
    assert read_conversations(str(tmp_path / "a.jsonl")) == [CONVERSATION, expected_alpaca]
    assert read_conversations(str(tmp_path / "a.json")) == [CONVERSATION, expected_alpaca]
    assert read_conversations(str(tmp_path / "a.parquet")) == [CONVERSATION]


@pytest.mark.parametrize("row, message", [
    ("{not json", r"line 2: not JSON"),
    ('{"messages": [{"role": "user"}]}', r"line 2: message 0 has no \"role\" or no \"content\""),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', r"line 2: message 0 has the unknown role 'robot'"),
    ('{"messages": []}', r"line 2: the conversation is empty"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"line 2: the conversation has no assistant turn"),
    ('{"text": "hi"}', r"line 2: no \"messages\""),
    ('[1, 2]', r"line 2: a row must be a JSON object"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}', r"content is int"),
])
def test_a_bad_row_is_one_line_naming_the_file_and_line(tmp_path, row, message):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + row + "\n")
    with pytest.raises(DataError, match=message) as e:
        read_conversations(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)
