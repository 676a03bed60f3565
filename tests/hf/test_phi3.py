"""What only Phi-3 / Phi-4-mini has, read from transformers' own Phi3Config (hf_models.py): partial rotary, a sliding
window shorter than the sequence and LongRoPE within its original context, each changing the function; PEFT
adapters on its fused qkv_proj / gate_up_proj; llama.cpp running its SentencePiece and Phi-4-style tokenizers; the
published configs' shapes and RoPE; LongRoPE as a core option; the config.json it refuses. Its logits, greedy ids,
hub import, exports (HF, GGUF, PEFT of every module), fine-tuning and serving are test_family_suite.py's, with every
other family's."""

from __future__ import annotations

import json
import math

import pytest
import torch

from minigpt.core.config import GPTConfig
from minigpt.export.hf import export_hf
from minigpt.hf.families import FAMILIES
from minigpt.hf.tokenizer_files import save_hf_tokenizer
from minigpt.loading import load_model

transformers = pytest.importorskip("transformers")
from hf_models import MODELS, ROPE_LONGROPE, SMALL, hf_logits, ids, our_logits, random_hf_model, save
from test_family_suite import (
    assert_llama_cpp_tokenizes_a_chat_as_transformers_and_continues_it,
    assert_llama_cpp_tokenizes_nfc_texts_as,
    helper,
    lora_through_peft,
    random_gguf,
    tensor_shapes,
)

PHI3 = [name for name in MODELS if name.startswith("phi3")]
NO_WINDOW = [name for name in PHI3 if "window" not in name]  # llama.cpp's phi3 computes no sliding window


# ------------------------------------------------------------------------------------------------- same function
# (the logits, greedy ids, hub import, exports, fine-tuning and serving of every config: test_family_suite.py)


def test_the_window_partial_rotary_and_longrope_each_change_the_function(saved):
    """Each Phi-3 option the import maps is one transformers computes: the same weights without it give other
    logits (so the equalities above prove the option, not a no-op)."""
    idx = ids()
    for name, option, plain in (
        ("phi3-mha-untied-window", "sliding_window", None),
        ("phi3-gqa-tied-partial", "partial_rotary_factor", 1.0),
        ("phi3-mqa-longrope", "rope_scaling", None),
    ):
        model, _ = load_model(saved[name][1])
        other = type(model).from_weights(GPTConfig(**{**model.config.to_dict(), option: plain}), model.state_dict())
        assert (our_logits(other.eval(), idx) - hf_logits(saved[name][0], idx)).abs().max() > 1e-2, option


@pytest.mark.parametrize("name", PHI3)
def test_the_import_reads_phi3s_rotary_window_and_longrope(saved, name):
    config = load_model(saved[name][1])[0].config
    hf_config = MODELS[name]()
    assert not config.qkv_bias
    assert config.partial_rotary_factor == hf_config.rope_parameters.get("partial_rotary_factor", 1.0)
    assert config.sliding_window == hf_config.sliding_window
    if name == "phi3-mqa-longrope":  # capped at the original context; the attention factor as transformers derives it
        assert config.block_size == 64 and config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    else:
        assert config.block_size == hf_config.max_position_embeddings and config.rope_scaling is None


def test_a_longrope_block_size_past_the_original_context_is_refused_in_one_line(saved):
    from minigpt.core.errors import CheckpointError
    from minigpt.hf.load import load_hf_model

    with pytest.raises(CheckpointError) as e:
        load_hf_model(saved["phi3-mqa-longrope"][1], block_size=65)
    message = str(e.value)
    assert "longrope switches to long_factor past original_max_position_embeddings 64" in message
    assert "at most 64" in message and "\n" not in message
    assert load_hf_model(saved["phi3-mqa-longrope"][1], block_size=32)[0].config.block_size == 32


# ------------------------------------------------------------------------------------------------- exports


@pytest.mark.parametrize("targets", [["q", "k", "v", "o", "gate", "up", "down"], ["q", "v", "up"]])
@pytest.mark.parametrize("name", PHI3)
def test_peft_adapters_on_the_fused_modules_load_in_peft_with_equal_logits(saved, name, targets, tmp_path):
    """Our q, k and v adapters are one PEFT adapter on qkv_proj (rank 3r, B block-diagonal), gate and up one on
    gate_up_proj (rank 2r); a piece without an adapter is zero rows of B."""
    adapter, hf, plain, theirs, expected = lora_through_peft(saved[name][1], targets, tmp_path)
    want = {"self_attn.qkv_proj", "mlp.gate_up_proj"} | (
        {"self_attn.o_proj", "mlp.down_proj"} if "o" in targets else set()
    )
    assert set(adapter["target_modules"]) == want
    assert adapter["rank_pattern"]["self_attn.qkv_proj"] == 4 * (3 if "k" in targets else 2)
    assert type(hf).__name__ == "Phi3ForCausalLM"
    assert (theirs - plain).abs().max() > 1e-2  # the adapters change the function
    torch.testing.assert_close(theirs, expected, atol=1e-4, rtol=0)


def test_a_window_llama_cpp_would_not_compute_is_refused_in_gguf_with_a_fix_an_import_can_take(tmp_path):
    """An imported Phi-3 whose window (16) is shorter than its context (64) cannot be trained without it: the refusal
    names the fine-tune that can (block_size at most the window, where the window is the whole context)."""
    pytest.importorskip("gguf")
    from minigpt.core.errors import UserError
    from minigpt.export.gguf import export_gguf
    from minigpt.hf.load import load_hf_model

    config = transformers.Phi3Config(  # Phi-3-mini-4k's shape: a window (2047) shorter than the context (4096)
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        sliding_window=16,
        **SMALL,
    )
    path = save(random_hf_model(config), tmp_path / "phi3")
    model, tokenizer = load_model(path)
    with pytest.raises(UserError) as e:
        export_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert "sliding_window=16: llama.cpp's phi3 architecture attends to the whole context" in str(e.value)
    assert str(e.value).endswith("or fine-tune with --model.block_size 16 or less") and "\n" not in str(e.value)
    model, tokenizer = load_hf_model(path, block_size=16)  # the fine-tune's model
    assert export_gguf(model, tokenizer, tmp_path / "model.gguf").arch == "phi3"


def test_llama_cpp_runs_a_phi3_gguf_export_with_its_sentencepiece_tokenizer(saved, tmp_path):
    """Phi-3's tokenizer.json shape (Llama 2's: SentencePiece BPE, a Prepend + Replace normaliser, so a dummy "▁"
    before each text, byte fallback, <s> by the post-processor; its added tokens, most taking in the whitespace
    after them), trained here and read from a folder: llama.cpp tokenizes text as transformers does and writes our
    greedy ids."""
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    import transformers

    from minigpt.hf.tokenizer_files import load_hf_tokenizer

    tokenizer = helper("gguf_models").spm_tokenizer("llama2", post_bos=True, phi3=True, converted=True)  # as converted
    save_hf_tokenizer(tokenizer, tmp_path / "tok")
    tokenizer = load_hf_tokenizer(tmp_path / "tok", {"model_type": "phi3"})
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    model, result = random_gguf(saved[NO_WINDOW[0]][1], tokenizer, tmp_path / "model.gguf", seed=2, block_size=64)
    assert (result.arch, result.vocab.kind, result.vocab.add_space_prefix, result.vocab.add_bos) == (
        "phi3",
        "spm",
        True,
        True,
    )
    assert result.vocab.phi3_rstrip  # written with a name that says Phi-3, for llama.cpp to strip as transformers
    chat = "<|user|>\nhéllo  wörld ☃ 42<|end|>\n<|assistant|>\n"
    assert_llama_cpp_tokenizes_a_chat_as_transformers_and_continues_it(
        tmp_path / "model.gguf", model, tokenizer, fast, chat
    )


def phi4_style_tokenizer():
    """A byte-level BPE tokenizer.json split as Phi-4-mini's (tiktoken's o200k_base pattern)."""
    from minigpt.core.tokenizers import HFTokenizer

    base = helper("gguf_models").hf_tokenizer("qwen2")
    doc = json.loads(base.tokenizer_json)
    doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = FAMILIES["phi3"].gguf_pre_tokenizer[0]
    return HFTokenizer(json.dumps(doc), eos_id=base.eos_id)


def test_llama_cpp_tokenizes_as_a_phi4_style_tokenizer_json(saved, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    from minigpt.hf.tokenizer_files import load_hf_tokenizer

    tokenizer = phi4_style_tokenizer()
    save_hf_tokenizer(tokenizer, tmp_path / "tok")
    back = load_hf_tokenizer(tmp_path / "tok", {"model_type": "phi3", "vocab_size": tokenizer.vocab_size})
    text = "CamelCaseWords HTTPServer it's 12345"
    assert back.encode(text) == tokenizer.encode(text) and back.decode(back.encode(text)) == text
    _, result = random_gguf(saved["phi3-gqa-tied-partial"][1], back, tmp_path / "model.gguf")
    assert result.vocab.pre == "gpt-4o"
    assert_llama_cpp_tokenizes_nfc_texts_as(tmp_path / "model.gguf", tokenizer)


# the published configs (Phi-3-mini-4k-instruct: a 2047-token window over a 4096 context, SentencePiece vocabulary;
# Phi-4-mini-instruct: partial rotary 0.75, LongRoPE from 4096 to 131072, GQA 24/8, tied), long factors elided to
# one repeated value (only their count is read here)
PUBLISHED = {
    "Phi-3-mini-4k-instruct": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
        "vocab_size": 32064,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
    },
    "Phi-4-mini-instruct": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
        "sliding_window": 262144,
        "tie_word_embeddings": True,
        "vocab_size": 200064,
        "hidden_act": "silu",
        "bos_token_id": 199999,
        "eos_token_id": 199999,
        "pad_token_id": 199999,
    },
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_phi3_configs_give_transformers_tensor_shapes_and_its_rope(name):
    """Our model for each config.json, renamed to HF names, has exactly the tensors transformers builds from it
    (both on the meta device), and the import's context and RoPE are those transformers computes within it."""
    from minigpt.hf.load import config_from_hf

    hf = PUBLISHED[name]
    config = config_from_hf(hf)
    ours, theirs = tensor_shapes(hf, config)
    assert ours == theirs
    assert config.block_size == 4096 and config.sliding_window == hf["sliding_window"]
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(transformers.AutoConfig.for_model(**hf))
    assert config.rotary_dim == 2 * len(rotary.inv_freq) and config.partial_rotary_factor == hf.get(
        "partial_rotary_factor", 1.0
    )
    assert (config.rope_scaling or {}).get("attention_factor", 1.0) == pytest.approx(rotary.attention_scaling)
    if name == "Phi-4-mini-instruct":  # llama.cpp's converter writes 1.190238 for it
        assert config.rope_scaling["attention_factor"] == pytest.approx(1.190238, abs=1e-6)


@pytest.mark.parametrize("family", [None, "qwen2", "mistral", "phi3"])
def test_longrope_is_a_core_rope_option_every_llama_style_class_computes(family, tmp_path):
    """A model trained here with rope_scaling longrope (no partial rotary) exports to Llama, Qwen2, Mistral and
    Phi-3's classes, each computing its logits (transformers' longrope is one function for all of them)."""
    from minigpt.core.model import GPT
    from minigpt.core.tokenizers import ByteTokenizer

    scaling = dict(
        rope_type="longrope",
        short_factor=[1.0, 1.5, 2.0, 3.0] * 2,
        long_factor=[4.0] * 8,
        original_max_position_embeddings=64,
        attention_factor=1.2,
    )
    torch.manual_seed(0)
    config = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=256, block_size=64)
    model = GPT(GPTConfig(**config, rope_scaling=scaling, family=family, qkv_bias=family == "qwen2")).eval()
    with torch.no_grad():  # every weight drawn large, so that positions show in the logits
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    export_hf(model, ByteTokenizer(), tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    idx = ids()
    ours = our_logits(model, idx)
    torch.testing.assert_close(hf_logits(hf, idx), ours, atol=1e-5 * ours.abs().max().item(), rtol=0)
    plain = type(model).from_weights(GPTConfig(**{**model.config.to_dict(), "rope_scaling": None}), model.state_dict())
    assert (our_logits(plain.eval(), idx) - our_logits(model, idx)).abs().max() > 1e-2  # the scaling bites


@pytest.mark.parametrize(
    "changes, needle",
    [
        (
            dict(rope_parameters={**ROPE_LONGROPE, "partial_rotary_factor": "0.5"}),
            "partial_rotary_factor is '0.5', where Phi3Config reads a number",
        ),
        (dict(original_max_position_embeddings="64"), "original_max_position_embeddings is '64', where Phi3Config"),
        (
            dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
            "its RoPE scaling is 'dynamic', which minigpt does not compute",
        ),
        (dict(hidden_act="gelu"), "its hidden_act is 'gelu'; minigpt's SwiGLU MLP computes silu only"),
    ],
)
def test_a_phi3_config_json_minigpt_cannot_read_is_one_line(saved, tmp_path, changes, needle):
    import shutil

    from minigpt.core.errors import CheckpointError

    folder = shutil.copytree(saved["phi3-mqa-longrope"][1], tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert needle in str(e.value) and "\n" not in str(e.value)
