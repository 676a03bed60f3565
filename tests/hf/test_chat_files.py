"""An exported chat model in plain transformers: apply_chat_template gives minigpt's ids, return_assistant_tokens_mask
gives minigpt's loss mask, and generate stops at the end-of-turn token (generation_config.json)."""

from __future__ import annotations

import pytest
import torch

from minigpt.core.chat import ChatSession, chat
from minigpt.core.chat_template import IM_END, IM_START, ChatTokenizer
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.export.hf import export_hf
from support import BASES, CONVERSATION, SMOL_TEMPLATE, hf_base, scripted_gpt

transformers = pytest.importorskip("transformers")


def chat_model(tok: ChatTokenizer, arch: str = "gpt") -> GPT:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            arch=arch, n_layer=1, n_head=2, n_embd=32, block_size=128, vocab_size=tok.vocab_size, tie_embeddings=False
        )
    ).eval()


@pytest.mark.parametrize("kind", BASES)
def test_transformers_gives_minigpts_prompt_ids_and_loss_mask(tmp_path, kind):
    tok = ChatTokenizer.for_base(BASES[kind](), conversations=[CONVERSATION])
    export_hf(chat_model(tok), tok, tmp_path / "export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    prompt = hf_tok.apply_chat_template(CONVERSATION[:-1], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert prompt["input_ids"] == tok.encode_chat(CONVERSATION[:-1], add_generation_prompt=True)[0]
    ids, mask = tok.encode_chat(CONVERSATION)
    out = hf_tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert out["input_ids"] == ids
    assert out["assistant_masks"] == [int(m) for m in mask] and sum(mask) > 0
    assert hf_tok.eos_token == IM_END and hf_tok.convert_tokens_to_ids(IM_END) == tok.eot_id


def test_an_imported_instruct_models_own_template_survives_the_round_trip(tmp_path):
    tok = ChatTokenizer.for_base(hf_base(with_markers=True), SMOL_TEMPLATE)  # SmolLM2-Instruct's shape
    export_hf(chat_model(tok, arch="llama"), tok, tmp_path / "export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    prompt = hf_tok.apply_chat_template(CONVERSATION[:-1], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert prompt["input_ids"] == tok.encode_chat(CONVERSATION[:-1], add_generation_prompt=True)[0]


def test_generate_stops_at_the_end_of_turn_token(tmp_path):
    tok = ChatTokenizer.for_base(BASES["char"](), conversations=[CONVERSATION])
    model = chat_model(tok)
    with torch.no_grad():  # a model that always says end-of-turn: a constant final state, one head row reading it
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eot_id] = 1.0
    assert chat(model, tok, "What is 12 + 30?") == ""  # minigpt stops there too
    export_hf(model, tok, tmp_path / "export")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert hf_model.generation_config.eos_token_id == tok.eot_id
    prompt = torch.tensor([tok.encode_chat(CONVERSATION[:2], add_generation_prompt=True)[0]])
    out = hf_model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out[0, prompt.size(1) :].tolist() == [tok.eot_id]  # one token, and it ended the reply
    hf_model.generation_config.eos_token_id = None  # the control: without it, all five come
    assert hf_model.generate(prompt, max_new_tokens=5, do_sample=False).size(1) == prompt.size(1) + 5


def marker_reply(tok: ChatTokenizer) -> list[int]:
    """A reply's ids with <|im_start|>, special and no stop, where a small model may write it: between words, and
    (byte-level tokenizers) between the two bytes of an 'é'; then the end of turn."""
    start, e = tok.token_id(IM_START), tok.encode("é") if tok.kind != "char" else tok.encode("e")
    return [start, *tok.encode("Hi"), start, *tok.encode(" there"), *e[:1], start, *e[1:], start, tok.eot_id]


@pytest.mark.parametrize("kind", [*BASES, "smol"])
def test_a_marker_the_model_writes_is_no_text_in_its_reply_as_transformers_decodes_it(tmp_path, kind):
    """A chat model that wrote <|im_start|> mid-reply had it in the reply's text ('<|im_start|>Hi<|im_start|> the'),
    streamed and whole: now the reply is transformers' decode(ids, skip_special_tokens=True) on the export, and the
    next turn goes on from it."""
    if kind == "smol":  # the markers the base's own special tokens (SmolLM2-Instruct's shape)
        tok = ChatTokenizer.for_base(hf_base(with_markers=True), SMOL_TEMPLATE)
    else:
        tok = ChatTokenizer.for_base(BASES[kind](), conversations=[CONVERSATION])
    prompt, reply = tok.encode_prompt([{"role": "user", "content": "Hi"}]), marker_reply(tok)
    model = scripted_gpt(tok.vocab_size, {len(prompt) - 1 + k: t for k, t in enumerate(reply)})
    session = ChatSession(model, tok, max_new_tokens=len(reply) + 4, temperature=0)
    pieces: list[str] = []
    text = session.reply("Hi", on_text=pieces.append)
    assert session.cached[len(prompt) :] == reply[:-1]  # the model wrote the ids above, the end of turn last
    export_hf(model, tok, tmp_path / "export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert text == "".join(pieces) == hf_tok.decode(reply, skip_special_tokens=True) == tok.decode_text(reply)
    assert text.startswith("Hi there") and "<" not in text
    assert session.messages[-1] == {"role": "assistant", "content": text}
    session.reply("And again?")  # the conversation goes on from the reply's text
