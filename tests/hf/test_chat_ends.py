"""A Phi-3 Instruct-shaped folder: its EOS is <|endoftext|>, its turns end with <|end|>, and its
generation_config.json lists [<|endoftext|>, <|assistant|>, <|end|>] (Phi-3-mini-instruct's), while its template
writes <|assistant|> too.  Turns end at <|end|>, a reply stops at any end the folder lists, and a raw text (a
completion's prompt) starts with the BOS its tokenizer writes, as transformers' tokenizer(text) does."""

from __future__ import annotations

import json
import re

import pytest
import torch

from minigpt import ChatSession
from minigpt.core.errors import CheckpointError
from minigpt.core.generation import prompt_ids
from minigpt.loading import load_chat_model
from support import SMOL_TEMPLATE

transformers = pytest.importorskip("transformers")
from test_family_suite import helper

PHI3_TEMPLATE = (  # Phi-3.5-mini-instruct's chat_template
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\n' + "
    "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def phi3_instruct_folder(path):
    tokenizer = helper("gguf_models").spm_tokenizer("llama2", post_bos=True, phi3=True).backend
    ids = {t: tokenizer.token_to_id(t) for t in ("<s>", "<|endoftext|>", "<|assistant|>", "<|end|>")}
    config = transformers.Phi3Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    model = transformers.Phi3ForCausalLM(config)
    ends = [ids["<|endoftext|>"], ids["<|assistant|>"], ids["<|end|>"]]
    model.generation_config = transformers.GenerationConfig(bos_token_id=ids["<s>"], eos_token_id=ends)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tokenizer.to_str())
    tokenizer_config = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "chat_template": PHI3_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path, ids


def test_phi3s_turns_end_at_end_not_at_the_assistant_marker_its_generation_config_lists_first(tmp_path):
    folder, ids = phi3_instruct_folder(tmp_path)
    _, chat = load_chat_model(folder)
    assert chat.eot_id == ids["<|end|>"]  # it was <|assistant|>: replies ran on past <|end|>
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}]
    tokens, mask = chat.encode_chat(conversation)
    trained = [i for i, m in zip(tokens, mask) if m]
    assert trained[-1] == ids["<|end|>"] and chat.decode(trained[:-1]) == "hello world"


def test_a_chat_models_raw_text_prompt_starts_with_its_bos_as_transformers_encodes_it(tmp_path):
    folder, ids = phi3_instruct_folder(tmp_path)
    _, chat = load_chat_model(folder)
    fast = transformers.AutoTokenizer.from_pretrained(folder)
    text = "hello world"
    assert prompt_ids(chat, text) == fast(text)["input_ids"] and prompt_ids(chat, text)[0] == ids["<s>"]
    messages = [{"role": "user", "content": text}]
    rendered = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat.encode_prompt(messages) == rendered["input_ids"]  # a rendered chat gets no BOS of the tokenizer's


class Always(torch.nn.Linear):
    """An lm_head that always says `token`: a model whose every reply is that token."""

    def __init__(self, n_embd: int, vocab_size: int, token: int) -> None:
        super().__init__(n_embd, vocab_size, bias=False)
        self.token = token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.full(x.shape[:-1], self.token), self.out_features).to(x.dtype)


def test_a_reply_ends_at_any_end_the_folder_lists_as_transformers_generate_stops(tmp_path):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from minigpt.serve.app import create_app

    folder, ids = phi3_instruct_folder(tmp_path)
    model, chat = load_chat_model(folder)
    model.lm_head = Always(model.config.n_embd, model.config.vocab_size, ids["<|assistant|>"])
    assert chat.eot_id != ids["<|assistant|>"]  # not its end of turn: an end its generation_config lists
    assert ChatSession(model, chat, temperature=0, max_new_tokens=5).reply("hello") == ""  # it wrote <|assistant|>
    with helper("serve_support", "serve").serving(create_app(model, chat, "phi3")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="phi3", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
        )
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("", "stop")
    assert reply.usage.completion_tokens == 1


def test_a_completion_in_sample_py_ends_at_any_end_the_folder_lists_as_generate_and_the_server_do(
    tmp_path, monkeypatch
):
    """sample.py (no --chat) stopped only at the tokenizer's own end (<|endoftext|>): it wrote on past
    <|assistant|>, where transformers' generate, minigpt's server and llama.cpp stop."""
    import io

    import minigpt.cli.sample as sample_cli

    folder, ids = phi3_instruct_folder(tmp_path)

    def load_model(*args, **kwargs):
        model, tokenizer = real_load_model(*args, **kwargs)
        model.lm_head = Always(model.config.n_embd, model.config.vocab_size, ids["<|assistant|>"])
        return model, tokenizer

    real_load_model = sample_cli.load_model
    monkeypatch.setattr(sample_cli, "load_model", load_model)
    for samples in ("1", "2"):
        out = io.StringIO()
        sample_cli.main(
            ["--ckpt", str(folder), "--prompt", "hello", "--temperature", "0", "--max_new_tokens", "4"]
            + ["--num_samples", samples],
            stdout=out,
        )
        assert "<|assistant|>" not in out.getvalue() and "hello" in out.getvalue()


def test_the_gguf_of_a_folder_with_three_ends_stops_at_each_in_llama_cpp(tmp_path):
    """llama.cpp stops at EOS, EOT and EOM (and at tokens it knows by their text): Phi-3's <|assistant|>, an end its
    generation_config lists, was none of them, and llama.cpp wrote on past it where minigpt stops."""
    pytest.importorskip("xllamacpp")
    from minigpt.export.gguf import export_gguf

    llama_cpp = helper("llamacpp_server").LlamaCpp
    folder, ids = phi3_instruct_folder(tmp_path / "phi3")
    model, chat = load_chat_model(folder)
    export_gguf(model, chat, tmp_path / "m.gguf", name="phi3")
    with llama_cpp(tmp_path / "m.gguf") as llama:
        start = llama.tokenize("hello")
        for end in sorted(chat.stop_ids):  # forced: it is sampled, then ends the text
            result = llama.completion(start, 3, logit_bias=[[end, 1e9]])
            assert (result["tokens"], result["stop_type"]) == ([end], "eos"), chat.token(end)
        text = llama.tokenize("o")[0]
        assert llama.completion(start, 3, logit_bias=[[text, 1e9]])["tokens"] == [text] * 3  # a text token does not


def test_a_template_writing_markers_the_tokenizer_lacks_is_refused_when_loaded(tmp_path):
    # ChatML over Phi-3's tokenizer: its markers got ids past the embedding, and the first turn an IndexError
    folder, _ = phi3_instruct_folder(tmp_path)
    (folder / "chat_template.jinja").write_text(SMOL_TEMPLATE)
    written = re.escape("writes '<|im_start|>', '<|im_end|>', which its tokenizer lacks")
    with pytest.raises(CheckpointError, match=written):
        load_chat_model(folder)


@pytest.mark.parametrize("end", ["<|assistant|>", "<|end|>"])
def test_eval_tasks_generation_ends_at_any_end_the_folder_lists_as_hflm_does(tmp_path, end):
    """MiniGPTLM.generate_until stopped only at the tokenizer's EOS (<|endoftext|>): on a Phi-3 folder it wrote on
    past <|end|> and <|assistant|>, where HFLM (transformers' generate, the folder's generation_config) stops."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from minigpt.evaluation.harness import MiniGPTLM
    from minigpt.loading import load_model

    folder, ids = phi3_instruct_folder(tmp_path)
    model, tokenizer = load_model(folder)
    model.lm_head = Always(model.config.n_embd, model.config.vocab_size, ids[end])
    request = Instance("generate_until", {}, ("hello", {"until": [], "max_gen_toks": 4}), 0)
    assert MiniGPTLM(model, tokenizer).generate_until([request]) == [""]  # it was end * 4


def test_eval_tasks_generated_text_leaves_out_special_tokens_as_hflm_does(tmp_path):
    """A generated <|user|> (special, not an end) stayed in MiniGPTLM's text, which HFLM decodes without it."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from minigpt.evaluation.harness import MiniGPTLM
    from minigpt.loading import load_model

    folder, _ = phi3_instruct_folder(tmp_path)
    model, tokenizer = load_model(folder)
    model.lm_head = Always(model.config.n_embd, model.config.vocab_size, tokenizer.encode("<|user|>")[-1])
    request = Instance("generate_until", {}, ("hello", {"until": [], "max_gen_toks": 3}), 0)
    assert MiniGPTLM(model, tokenizer).generate_until([request]) == [""]  # it was "<|user|>" * 3
