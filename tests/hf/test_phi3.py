"""Phi-3 / Phi-4-mini end to end, offline: small random models built from transformers' own Phi3Config
(hf_models.py: tied/untied, GQA, MHA and MQA, partial rotary 0.75 and 0.5, a sliding window shorter than the
sequence, LongRoPE within its original context) are imported from a folder and from hf:ORG/NAME, compute
transformers' logits on every attention path and its greedy ids past the window, fine-tune (full and LoRA), export
to a Hugging Face folder (Phi3ForCausalLM), to GGUF (llama.cpp's phi3 architecture, run in xllamacpp), to PEFT
(fused qkv_proj / gate_up_proj adapters), and are served."""

from __future__ import annotations

import json
import math
import unicodedata

import pytest
import torch

from minigpt.cli.train import main as train_main
from minigpt.core.config import GPTConfig
from minigpt.core.generation import generate, prompt_ids
from minigpt.core.lora import LoRAConfig, lora_model
from minigpt.core.tokenizers import CharTokenizer
from minigpt.export.gguf import export_gguf
from minigpt.export.hf import export_hf
from minigpt.export.peft import export_peft
from minigpt.hf.families import FAMILIES
from minigpt.hf.tokenizer_files import save_hf_tokenizer
from minigpt.loading import load_lora_run, load_model

transformers = pytest.importorskip("transformers")
from hf_models import MODELS, ROPE_LONGROPE, hf_logits, ids, our_logits, random_hf_model
from test_qwen import first_loss_of, helper

PHI3 = [name for name in MODELS if name.startswith("phi3")]
NO_WINDOW = [name for name in PHI3 if "window" not in name]  # llama.cpp's phi3 computes no sliding window


# ------------------------------------------------------------------------------------------------- same function


@pytest.mark.parametrize("name", PHI3)
@pytest.mark.parametrize("attention", ["sdpa", "manual", "einops"])
def test_logits_equal_transformers_within_1e_5(saved, name, attention):
    hf_model, path = saved[name]
    model, _ = load_model(path, attention=attention)
    idx = ids()  # 40 tokens: past the 16-token window
    theirs = hf_logits(hf_model, idx)
    # float32: 1e-5 of the logits' scale (about 10 here); manual and einops agree exactly, sdpa's kernel to 1.2e-5
    torch.testing.assert_close(our_logits(model, idx), theirs, atol=1e-5 * theirs.abs().max().item(), rtol=0)


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
def test_the_import_reads_the_family(saved, name):
    config = load_model(saved[name][1])[0].config
    hf_config = MODELS[name]()
    assert config.family == "phi3" and config.arch == "llama" and not config.bias and not config.qkv_bias
    assert config.tie_embeddings == hf_config.tie_word_embeddings and config.n_kv_head == hf_config.num_key_value_heads
    assert config.partial_rotary_factor == hf_config.rope_parameters.get("partial_rotary_factor", 1.0)
    assert config.sliding_window == hf_config.sliding_window
    assert config.head_dim == (getattr(hf_config, "head_dim", None) or hf_config.hidden_size // 4)
    if name == "phi3-mqa-longrope":  # capped at the original context; the attention factor as transformers derives it
        assert config.block_size == 64 and config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    else:
        assert config.block_size == hf_config.max_position_embeddings and config.rope_scaling is None


@pytest.mark.parametrize("name", PHI3)
def test_greedy_ids_equal_transformers_generate_for_32_tokens(saved, name):
    hf_model, path = saved[name]
    model, _ = load_model(path)
    prompt = ids(batch=1, T=8, seed=3)
    with torch.no_grad():  # 8 + 32 positions: past the 16-token window, through both libraries' caches
        expected = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32, min_new_tokens=32
        )
    assert len(set(expected[0, 8:].tolist())) > 4
    for use_kv_cache in (True, False):
        assert generate(model, prompt, 32, temperature=0.0, use_kv_cache=use_kv_cache).tolist() == expected.tolist()


def test_a_hub_id_imports_from_the_cache(saved, hub_cache):
    from test_hub import fill_hub_cache

    for name in PHI3:
        hf_model, path = saved[name]
        fill_hub_cache(hub_cache, f"someorg/{name}", path)
        model, tokenizer = load_model(f"hf:someorg/{name}")
        assert tokenizer.name == f"someorg/{name}" and model.config.family == "phi3"
        assert (our_logits(model, ids()) - hf_logits(hf_model, ids())).abs().max() < 1e-4


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


@pytest.mark.parametrize("name", PHI3)
def test_the_hf_export_is_phi3_with_the_same_logits_and_imports_back(saved, name, tmp_path):
    hf_model, path = saved[name]
    model, tokenizer = load_model(path)
    out = export_hf(model, tokenizer, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["model_type"] == "phi3"
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back).__name__ == "Phi3ForCausalLM"
    idx = ids()
    expected = hf_logits(hf_model, idx)  # eager attention; the export loads with transformers' default (sdpa)
    torch.testing.assert_close(hf_logits(back.eval(), idx), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    again, _ = load_model(out)
    assert again.config == model.config


@pytest.mark.parametrize("targets", [["q", "k", "v", "o", "gate", "up", "down"], ["q", "v", "up"]])
@pytest.mark.parametrize("name", PHI3)
def test_peft_adapters_on_the_fused_modules_load_in_peft_with_equal_logits(saved, name, targets, tmp_path):
    """Our q, k and v adapters are one PEFT adapter on qkv_proj (rank 3r, B block-diagonal), gate and up one on
    gate_up_proj (rank 2r); a piece without an adapter is zero rows of B."""
    peft = pytest.importorskip("peft")
    base, tokenizer = load_model(saved[name][1])
    cfg = LoRAConfig(rank=4, targets=targets)
    model = lora_model(base, base.config, cfg).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.2)
    idx = ids()
    with torch.no_grad():
        expected = model(idx)[0]
    export_peft(model, tokenizer, cfg, tmp_path / "adapter", tmp_path / "base")
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    want = {"self_attn.qkv_proj", "mlp.gate_up_proj"} | (
        {"self_attn.o_proj", "mlp.down_proj"} if "o" in targets else set()
    )
    assert set(adapter["target_modules"]) == want
    assert adapter["rank_pattern"]["self_attn.qkv_proj"] == 4 * (3 if "k" in targets else 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert type(hf).__name__ == "Phi3ForCausalLM"
    with torch.no_grad():
        plain = hf(idx).logits
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(idx).logits
    assert (theirs - plain).abs().max() > 1e-2  # the adapters change the function
    torch.testing.assert_close(theirs, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NO_WINDOW)
def test_llama_cpp_runs_the_gguf_export_as_phi3(saved, name, tmp_path):
    """Fused attn_qkv and ffn_up, rope.dimension_count for partial rotary, LongRoPE's short factors and attention
    factor: llama.cpp's greedy ids and log-probs are ours."""
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    from minigpt.core.tokenizers import ByteTokenizer

    gguf_models, LlamaCpp = helper("gguf_models"), helper("llamacpp_server").LlamaCpp
    imported = load_model(saved[name][1])[0].config.to_dict()
    if imported["rope_scaling"] is not None:  # llama.cpp rounds its context up to 256, past which it takes long_factor
        imported["rope_scaling"] |= {"original_max_position_embeddings": 256}
    model = gguf_models.random_model(seed=PHI3.index(name), **{**imported, "block_size": 64})
    result = export_gguf(model, ByteTokenizer(), tmp_path / "model.gguf")
    assert result.arch == FAMILIES["phi3"].gguf_arch == "phi3"
    assert any("long_factor" in note for note in result.notes) == (imported["rope_scaling"] is not None)
    prompt = list("héllo wörld ☃".encode())
    with torch.no_grad():
        ours = generate(model, torch.tensor([prompt]), max_new_tokens=40, temperature=0)[0, len(prompt) :].tolist()
        reference = torch.log_softmax(model(torch.tensor([prompt + ours]))[0][0].double(), -1)
    assert len(set(ours)) > 8  # a real continuation, not one token repeated
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        assert llama.argmax_along(prompt, ours) == ours
        for t in (len(prompt), len(prompt) + 20, len(prompt) + 39):
            theirs = llama.next_logprobs((prompt + ours)[:t], 8)
            assert max(abs(reference[t - 1, i].item() - lp) for i, lp in theirs.items()) < 1e-4


def test_llama_cpp_runs_a_phi3_gguf_export_with_its_sentencepiece_tokenizer(saved, tmp_path):
    """Phi-3's tokenizer.json shape (Llama 2's: SentencePiece BPE, a Prepend + Replace normaliser, so a dummy "▁"
    before each text, byte fallback, <s> by the post-processor; its added tokens, most taking in the whitespace
    after them), trained here and read from a folder: llama.cpp tokenizes text as transformers does and writes our
    greedy ids."""
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    import transformers

    from minigpt.hf.tokenizer_files import load_hf_tokenizer

    gguf_models, LlamaCpp = helper("gguf_models"), helper("llamacpp_server").LlamaCpp
    tokenizer = gguf_models.spm_tokenizer("llama2", post_bos=True, phi3=True, converted=True)  # merges as converted
    save_hf_tokenizer(tokenizer, tmp_path / "tok")
    tokenizer = load_hf_tokenizer(tmp_path / "tok", {"model_type": "phi3"})
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    config = load_model(saved[NO_WINDOW[0]][1])[0].config.to_dict()
    model = gguf_models.random_model(seed=2, **{**config, "vocab_size": tokenizer.vocab_size, "block_size": 64})
    result = export_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert (result.arch, result.vocab.kind, result.vocab.add_space_prefix, result.vocab.add_bos) == (
        "phi3",
        "spm",
        True,
        True,
    )
    assert result.vocab.phi3_rstrip  # written with a name that says Phi-3, for llama.cpp to strip as transformers
    chat = "<|user|>\nhéllo  wörld ☃ 42<|end|>\n<|assistant|>\n"
    prompt = tokenizer.encode(chat)
    with torch.no_grad():
        ours = generate(model, torch.tensor([prompt]), max_new_tokens=32, temperature=0)[0, len(prompt) :].tolist()
    assert len(set(ours)) > 8  # a real continuation, not one token repeated
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        for text in [chat, *gguf_models.TEXTS[:6]]:
            assert llama.tokenize(text, add_special=True) == tokenizer.encode(text) == fast(text)["input_ids"], text
        assert llama.argmax_along(prompt, ours) == ours


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
    model, _ = load_model(saved["phi3-gqa-tied-partial"][1])
    model = helper("gguf_models").random_model(**{**model.config.to_dict(), "vocab_size": tokenizer.vocab_size})
    result = export_gguf(model, back, tmp_path / "model.gguf")
    assert result.vocab.pre == "gpt-4o"
    with helper("llamacpp_server").LlamaCpp(tmp_path / "model.gguf") as llama:
        for text in helper("gguf_models").TEXTS:
            text = unicodedata.normalize("NFC", text)
            assert llama.tokenize(text) == tokenizer.encode(text), text


# ------------------------------------------------------------------------------------------------- train, serve


@pytest.fixture(scope="module")
def phi3_folders(corpus, tmp_path_factory):
    """name -> a small random Phi-3 saved with save_pretrained, with a char tokenizer.json of ours covering the
    corpus (so train.py can fine-tune it on that text)."""
    tok = CharTokenizer(corpus.read_text())
    out = {}
    for name in ("phi3-mha-untied-window", "phi3-mqa-longrope"):
        config = MODELS[name]()
        config.vocab_size = tok.vocab_size
        folder = tmp_path_factory.mktemp(name)
        random_hf_model(config).save_pretrained(folder)
        save_hf_tokenizer(tok, folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("name", ["phi3-mha-untied-window", "phi3-mqa-longrope"])
def test_train_py_fine_tunes_a_phi3_folder_full_and_lora(
    phi3_folders, lora, name, record_training_losses, tiny_run_args, corpus, data_root, tmp_path, monkeypatch
):
    hf_dir = phi3_folders[name]
    args = tiny_run_args(corpus, data_root, tmp_path / "ft", steps=3, trainer__precision="32-true")
    pairs = [(k, v) for k, v in zip(args[::2], args[1::2]) if not k.startswith("--model.")]
    argv = [x for pair in pairs for x in pair] + ["--init_from", str(hf_dir)]
    argv += ["--finetune", "lora", "--lora.rank", "4"] if lora else []
    seen = record_training_losses(monkeypatch)
    trainer = train_main(argv)
    assert trainer.global_step == 3
    batch, first_loss = seen[0]
    assert first_loss == pytest.approx(first_loss_of(hf_dir, batch), abs=1e-4), "the first step sees the HF weights"
    assert math.isfinite(seen[-1][1])
    model = load_lora_run(tmp_path / "ft")[0] if lora else load_model(tmp_path / "ft")[0]
    assert model.config.family == "phi3"
    assert model.config.sliding_window == MODELS[name]().sliding_window


def test_a_served_phi3_import_completes_as_generate_does(saved):
    openai = pytest.importorskip("openai")
    from minigpt.serve.app import create_app

    serving = helper("serve_support", "serve").serving
    for name in ("phi3-mha-untied-window", "phi3-mqa-longrope"):
        model, tokenizer = load_model(saved[name][1])
        ids_ = prompt_ids(tokenizer, "héllo")
        expected = generate(model, torch.tensor([ids_]), 24, temperature=0, vocab_size=tokenizer.vocab_size)
        with serving(create_app(model, tokenizer, name)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            reply = client.completions.create(model=name, prompt="héllo", max_tokens=24, temperature=0)
        assert reply.choices[0].text == tokenizer.decode(expected[0, len(ids_) :].tolist())


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
    from minigpt.core.model import GPT
    from minigpt.hf.load import config_from_hf
    from minigpt.hf.weights import to_hf_state_dict

    hf = PUBLISHED[name]
    config = config_from_hf(hf)
    with torch.device("meta"):
        ours = to_hf_state_dict(GPT(config).state_dict(), config)
        model = transformers.Phi3ForCausalLM(transformers.AutoConfig.for_model(**hf))
        theirs = model.state_dict()
    if hf["tie_word_embeddings"]:
        theirs.pop("lm_head.weight")
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
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
