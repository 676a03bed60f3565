"""An exported chat model in plain transformers: apply_chat_template gives minigpt's ids, return_assistant_tokens_mask
gives minigpt's loss mask, and generate stops at the end-of-turn token (generation_config.json)."""

from __future__ import annotations

import pytest
import torch

from minigpt.core.chat import chat
from minigpt.core.chat_template import IM_END, ChatTokenizer
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.export.hf import export_hf
from support import BASES, CONVERSATION, SMOL_TEMPLATE, hf_base

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
