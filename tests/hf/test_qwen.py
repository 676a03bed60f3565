"""Qwen2 / Qwen2.5 and Qwen3 end to end, offline: small random models built from transformers' own config classes
(hf_models.py: tied/untied, GQA, MQA and MHA, Qwen2's q/k/v biases, Qwen3's q/k norms and explicit head_dim) are
imported from a folder and from hf:ORG/NAME, compute transformers' logits on every attention path and its greedy
ids, fine-tune (full and LoRA), export to a Hugging Face folder (the family's class), to GGUF (llama.cpp's qwen2 /
qwen3 architecture, run in xllamacpp), to PEFT, and are served."""

from __future__ import annotations

import importlib.util
import json
import math
import unicodedata
from pathlib import Path

import pytest
import torch

from minigpt.cli.train import main as train_main
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
from hf_models import CLASSES, MODELS, hf_logits, ids, our_logits, random_hf_model

TESTS = Path(__file__).resolve().parents[1]
QWEN = [name for name in MODELS if name.startswith("qwen")]
ONE_OF_EACH = list({name.split("-")[0]: name for name in reversed(QWEN)}.values())  # the first model of each family


def helper(name: str, folder: str = "export"):
    """A helper module of another test folder (export/gguf_models, export/llamacpp_server, serve/serve_support),
    imported by path."""
    spec = importlib.util.spec_from_file_location(name, TESTS / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def family_name(name: str) -> str:
    return MODELS[name]().model_type


# ------------------------------------------------------------------------------------------------- same function


@pytest.mark.parametrize("name", QWEN)
@pytest.mark.parametrize("attention", ["sdpa", "manual", "einops"])
def test_logits_equal_transformers_within_1e_5(saved, name, attention):
    hf_model, path = saved[name]
    model, _ = load_model(path, attention=attention)
    idx = ids()
    theirs = hf_logits(hf_model, idx)
    # float32: 1e-5 of the logits' scale (about 9 here); manual and einops agree to 2e-6, sdpa's kernel to 1.2e-5
    torch.testing.assert_close(our_logits(model, idx), theirs, atol=1e-5 * theirs.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", QWEN)
def test_the_import_reads_the_family(saved, name):
    config = load_model(saved[name][1])[0].config
    hf_config = MODELS[name]()
    assert config.family == hf_config.model_type and config.arch == "llama" and not config.bias
    assert config.qkv_bias == (hf_config.model_type == "qwen2")
    assert config.qk_norm == (hf_config.model_type == "qwen3")
    assert config.rope_base == 1e6 and config.tie_embeddings == hf_config.tie_word_embeddings
    default_head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    assert config.head_dim == (getattr(hf_config, "head_dim", None) or default_head_dim)


@pytest.mark.parametrize("name", QWEN)
def test_greedy_ids_equal_transformers_generate_for_32_tokens(saved, name):
    hf_model, path = saved[name]
    model, _ = load_model(path)
    prompt = ids(batch=1, T=8, seed=3)
    with torch.no_grad():
        expected = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32, min_new_tokens=32
        )
    for use_kv_cache in (True, False):
        assert generate(model, prompt, 32, temperature=0.0, use_kv_cache=use_kv_cache).tolist() == expected.tolist()


def test_a_hub_id_imports_from_the_cache(saved, hub_cache):
    from test_hub import fill_hub_cache

    for name in QWEN:
        hf_model, path = saved[name]
        fill_hub_cache(hub_cache, f"someorg/{name}", path)
        model, tokenizer = load_model(f"hf:someorg/{name}")
        assert tokenizer.name == f"someorg/{name}" and model.config.family == family_name(name)
        assert (our_logits(model, ids()) - hf_logits(hf_model, ids())).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------- exports


@pytest.mark.parametrize("name", QWEN)
def test_the_hf_export_is_the_familys_class_with_the_same_logits_and_imports_back(saved, name, tmp_path):
    hf_model, path = saved[name]
    model, tokenizer = load_model(path)
    out = export_hf(model, tokenizer, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASSES[family_name(name)]] and config["model_type"] == family_name(name)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back).__name__ == CLASSES[family_name(name)]
    idx = ids()
    expected = hf_logits(hf_model, idx)  # eager attention; the export loads with transformers' default (sdpa)
    torch.testing.assert_close(hf_logits(back.eval(), idx), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    again, _ = load_model(out)
    assert again.config == model.config


@pytest.mark.parametrize("name", QWEN)
def test_peft_adapters_of_a_lora_model_load_in_peft_with_equal_logits(saved, name, tmp_path):
    peft = pytest.importorskip("peft")
    base, tokenizer = load_model(saved[name][1])
    cfg = LoRAConfig(rank=4, targets=["q", "k", "v", "o", "gate", "up", "down"])
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
    assert adapter["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert type(hf).__name__ == CLASSES[family_name(name)]
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(idx).logits
    torch.testing.assert_close(theirs, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", QWEN)
def test_llama_cpp_runs_the_gguf_export_as_the_familys_architecture(saved, name, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    from minigpt.core.tokenizers import ByteTokenizer

    gguf_models, LlamaCpp = helper("gguf_models"), helper("llamacpp_server").LlamaCpp
    imported = load_model(saved[name][1])[0].config.to_dict()
    model = gguf_models.random_model(seed=QWEN.index(name), **{**imported, "block_size": 96})
    result = export_gguf(model, ByteTokenizer(), tmp_path / "model.gguf")
    assert result.arch == FAMILIES[family_name(name)].gguf_arch == family_name(name)
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
    assert {FAMILIES[family_name(name)].gguf_pre_tokenizer[1] for name in QWEN} == {"qwen2"}


def test_llama_cpp_tokenizes_nfc_text_as_the_qwen_style_tokenizer_and_the_export_says_what_differs(saved, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    tokenizer = qwen_style_tokenizer()
    model, _ = load_model(saved[ONE_OF_EACH[-1]][1])
    model = helper("gguf_models").random_model(**{**model.config.to_dict(), "vocab_size": tokenizer.vocab_size})
    result = export_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert result.vocab.pre == "qwen2" and any("NFC" in note for note in result.notes)
    with helper("llamacpp_server").LlamaCpp(tmp_path / "model.gguf") as llama:
        for text in helper("gguf_models").TEXTS:
            text = unicodedata.normalize("NFC", text)
            assert llama.tokenize(text) == tokenizer.encode(text), text


# ------------------------------------------------------------------------------------------------- train, serve


@pytest.fixture(scope="module")
def qwen_folders(corpus, tmp_path_factory):
    """name -> a small random model of each family saved with save_pretrained, with a char tokenizer.json of
    ours covering the corpus (so train.py can fine-tune it on that text)."""
    tok = CharTokenizer(corpus.read_text())
    out = {}
    for name in ONE_OF_EACH:
        config = MODELS[name]()
        config.vocab_size = tok.vocab_size
        folder = tmp_path_factory.mktemp(name)
        random_hf_model(config).save_pretrained(folder)
        save_hf_tokenizer(tok, folder)
        out[name] = folder
    return out


def first_loss_of(hf_dir: Path, batch: torch.Tensor) -> float:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = hf_model(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("name", ONE_OF_EACH)
def test_train_py_fine_tunes_a_qwen_folder_full_and_lora(
    qwen_folders, lora, name, record_training_losses, tiny_run_args, corpus, data_root, tmp_path, monkeypatch
):
    hf_dir = qwen_folders[name]
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
    assert model.config.family == json.loads((hf_dir / "config.json").read_text())["model_type"]


def test_a_served_qwen_import_completes_as_generate_does(saved):
    openai = pytest.importorskip("openai")
    from minigpt.serve.app import create_app

    serving = helper("serve_support", "serve").serving

    for name in ONE_OF_EACH:
        model, tokenizer = load_model(saved[name][1])
        ids_ = prompt_ids(tokenizer, "héllo")
        expected = generate(model, torch.tensor([ids_]), 12, temperature=0, vocab_size=tokenizer.vocab_size)
        with serving(create_app(model, tokenizer, name)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            reply = client.completions.create(model=name, prompt="héllo", max_tokens=12, temperature=0)
        assert reply.choices[0].text == tokenizer.decode(expected[0, len(ids_) :].tolist())


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
    from minigpt.core.model import GPT
    from minigpt.hf.load import config_from_hf
    from minigpt.hf.weights import to_hf_state_dict

    config = config_from_hf(PUBLISHED[name])
    with torch.device("meta"):
        ours = to_hf_state_dict(GPT(config).state_dict(), config)
        theirs = getattr(transformers, PUBLISHED[name]["architectures"][0])(
            transformers.AutoConfig.for_model(**PUBLISHED[name])
        ).state_dict()
    theirs.pop("lm_head.weight")  # tied
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
