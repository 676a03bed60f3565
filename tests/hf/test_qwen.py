"""What only Qwen2 / Qwen2.5 and Qwen3 have: Qwen2's q/k/v biases and Qwen3's q/k norms read from transformers' own
config classes (hf_models.py), their tokenizer.json shape (single digits, NFC) named for llama.cpp, and the published
configs' tensor shapes. Their logits, greedy ids, hub import, exports (HF, GGUF, PEFT), fine-tuning and serving are
test_family_suite.py's, with every other family's."""

from __future__ import annotations

import json

import pytest
import torch

from minigpt.hf.families import FAMILIES
from minigpt.hf.tokenizer_files import save_hf_tokenizer
from minigpt.loading import load_model

transformers = pytest.importorskip("transformers")
from hf_models import MODELS, ROPE_LLAMA3, hf_logits, ids, our_logits, random_hf_model, save
from test_family_suite import assert_llama_cpp_tokenizes_nfc_texts_as, family_of, helper, random_gguf, tensor_shapes

QWEN = [name for name in MODELS if name.startswith("qwen")]


# ------------------------------------------------------------------------------------------------- same function
# (the logits, greedy ids, hub import, exports, fine-tuning and serving of every config: test_family_suite.py)


@pytest.mark.parametrize("name", QWEN)
def test_the_import_reads_qwen2s_biases_and_qwen3s_qk_norms(saved, name):
    config = load_model(saved[name][1])[0].config
    hf_config = MODELS[name]()
    assert config.qkv_bias == (hf_config.model_type == "qwen2")
    assert config.qk_norm == (hf_config.model_type == "qwen3")
    assert config.rope_base == 1e6


@pytest.mark.parametrize("name", ["qwen2-gqa-tied", "qwen3-gqa-tied-head-dim"])
@pytest.mark.parametrize("scaling", [ROPE_LLAMA3, dict(rope_type="linear", factor=4.0)], ids=["llama3", "linear"])
def test_a_qwen_model_with_rope_scaling_imports_with_transformers_logits_and_exports_back(name, scaling, tmp_path):
    """Qwen2ForCausalLM and Qwen3ForCausalLM compute llama3 and linear RoPE scaling as Llama does, and minigpt's
    own qwen2/qwen3 exports write them: the import reads them (its GGUF export still refuses them)."""
    from minigpt.export.hf import export_hf

    hf_config = MODELS[name]()
    hf_config.rope_parameters = {**scaling, "rope_theta": 1e6}
    hf_model = random_hf_model(hf_config)
    model, tokenizer = load_model(save(hf_model, tmp_path / "hf"))
    assert model.config.rope_scaling == scaling
    idx = ids(T=60)  # past original_max_position_embeddings (16), where llama3 scaling changes the frequencies
    expected = hf_logits(hf_model, idx)
    torch.testing.assert_close(our_logits(model, idx), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    again, _ = load_model(export_hf(model, tokenizer, tmp_path / "export"))
    assert again.config == model.config


# ------------------------------------------------------------------------------------------------- tokenizers


def qwen_style_tokenizer():
    """A byte-level BPE tokenizer.json as Qwen2's and Qwen3's are: their split pattern (single digits) and an NFC
    normaliser (gguf_models.hf_tokenizer's BPE, built offline)."""
    from minigpt.core.tokenizers import HFTokenizer

    base = helper("gguf_models").hf_tokenizer("qwen2")
    doc = json.loads(base.tokenizer_json)
    doc["normalizer"] = {"type": "NFC"}
    return HFTokenizer(json.dumps(doc), eos_id=base.eos_id)


def test_a_qwen_style_tokenizer_json_reads_and_names_its_llama_cpp_pre_tokenizer(tmp_path):
    from minigpt.export.gguf_vocab import gguf_vocab
    from minigpt.hf.tokenizer_files import load_hf_tokenizer

    tokenizer = qwen_style_tokenizer()
    save_hf_tokenizer(tokenizer, tmp_path)
    back = load_hf_tokenizer(tmp_path, {"model_type": "qwen2", "vocab_size": tokenizer.vocab_size})
    text = "It's 12345 héllo\n\n  wörld"
    assert back.encode(text) == tokenizer.encode(text) and back.decode(back.encode(text)) == text
    assert back.encode("e\u0301") == back.encode("\u00e9")  # NFC first: a decomposed é is the composed one
    assert len(back.encode("12345")) == 5  # Qwen2 splits digits one by one
    vocab = gguf_vocab(back, back.vocab_size)
    assert vocab.pre == "qwen2" and vocab.nfc  # llama.cpp's name; every Qwen family declares it for its tokenizer
    assert {FAMILIES[family_of(name)].gguf_pre_tokenizer[1] for name in QWEN} == {"qwen2"}


def test_llama_cpp_tokenizes_nfc_text_as_the_qwen_style_tokenizer_and_the_export_says_what_differs(saved, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    tokenizer = qwen_style_tokenizer()
    _, result = random_gguf(saved["qwen3-gqa-tied-head-dim"][1], tokenizer, tmp_path / "model.gguf")
    assert result.vocab.pre == "qwen2" and any("NFC" in note for note in result.notes)
    assert_llama_cpp_tokenizes_nfc_texts_as(tmp_path / "model.gguf", tokenizer)


@pytest.mark.parametrize("kind", ["qwen-style", "char", "byte", "tiktoken"])
def test_a_qwen2_export_says_when_autotokenizer_would_read_other_ids(kind, tmp_path, capsys):
    """transformers 5 loads any qwen2 folder's tokenizer as Qwen2Tokenizer, which keeps tokenizer.json's vocabulary
    and merges but not its pipeline: the export says so where that changes the ids, and not for Qwen's own."""
    from minigpt.cli.export import main as export_main
    from minigpt.core.checkpoint import model_checkpoint, save_file
    from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer
    from support import byte_bpe

    text = "It's 12345 héllo e\u0301\n\n  wörld"
    tokenizer = {
        "qwen-style": qwen_style_tokenizer,
        "char": lambda: CharTokenizer(text),
        "byte": ByteTokenizer,  # no NFC: a decomposed é is two bytes more than Qwen2Tokenizer's composed one
        "tiktoken": lambda: TiktokenTokenizer(byte_bpe()),
    }[kind]()
    model = helper("gguf_models").random_model(
        arch="llama", family="qwen2", qkv_bias=True, n_kv_head=2, vocab_size=tokenizer.vocab_size
    )
    save_file(model_checkpoint(model, tokenizer), tmp_path / "model.ckpt")
    export_main(["--ckpt", str(tmp_path / "model.ckpt"), "--out", str(tmp_path / "hf")])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert type(auto).__name__ == "Qwen2Tokenizer"
    same = auto(text)["input_ids"] == tokenizer.encode(text)
    assert same == (kind == "qwen-style") and len(notes) == (not same)
    if notes:
        assert "PreTrainedTokenizerFast.from_pretrained(folder)" in notes[0]
        fast = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")
        assert fast(text)["input_ids"] == tokenizer.encode(text)


# the published configs' sizes (Qwen2.5-0.5B: q/k/v biases, tied; Qwen3-0.6B: head_dim 128 with 16 heads of a
# 1024-wide model, q/k norms, tied)
PUBLISHED = {
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": 24,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "hidden_act": "silu",
    },
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "attention_bias": False,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "hidden_act": "silu",
    },
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_qwen_configs_give_transformers_tensor_shapes(name):
    """Our model for each config.json, renamed to HF names, has exactly the tensors transformers builds from it
    (both on the meta device: nothing allocated)."""
    from minigpt.hf.load import config_from_hf

    ours, theirs = tensor_shapes(PUBLISHED[name], config_from_hf(PUBLISHED[name]))
    assert ours == theirs
