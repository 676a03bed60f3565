"""One suite for every imported model family (Qwen2, Qwen3, Phi-3, Gemma 3 text), parametrized over their small
random configs in hf_models.py: each is imported from a folder and from hf:ORG/NAME, computes transformers' logits on
every attention path and its greedy ids, fine-tunes (full and LoRA), exports to a Hugging Face folder (the family's
class), to GGUF (run in xllamacpp), to PEFT, and is served. A new family adds its configs to hf_models.py and its
name to FAMILY_MODELS, not tests; what only one family has stays in its own file (test_qwen.py, test_phi3.py,
test_gemma.py), which takes the shared helpers from here."""

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
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer
from minigpt.export.gguf import export_gguf
from minigpt.export.hf import export_hf
from minigpt.export.peft import export_peft
from minigpt.hf.families import FAMILIES
from minigpt.hf.tokenizer_files import save_hf_tokenizer
from minigpt.loading import load_lora_run, load_model

transformers = pytest.importorskip("transformers")
from hf_models import CLASSES, MODELS, hf_logits, ids, our_logits, random_hf_model

TESTS = Path(__file__).resolve().parents[1]
FAMILY_MODELS = [name for name in MODELS if name.startswith(("qwen", "phi3", "gemma3"))]
ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
# Phi-3's fused qkv_proj / gate_up_proj adapters are test_phi3.py's
UNFUSED_PEFT = [name for name in FAMILY_MODELS if name.startswith("qwen")]
UNFUSED_PEFT += ["gemma3-gqa-tied-window", "gemma3-mqa-untied-pattern"]
# llama.cpp's phi3 computes no sliding window; its gemma3 only the 1B-shaped layout (test_gemma.py's refusals)
GGUF = [name for name in FAMILY_MODELS if name.startswith("qwen")]
GGUF += ["phi3-gqa-tied-partial", "phi3-mqa-longrope", "gemma3-mqa-untied-pattern"]
# the first of each Qwen family, Phi-3 with a window and with LongRoPE, Gemma 3 with sliding and full layers
FINE_TUNED = ["qwen2-gqa-tied", "qwen3-gqa-tied-head-dim", "phi3-mha-untied-window", "phi3-mqa-longrope"]
FINE_TUNED += ["gemma3-gqa-tied-window"]


def helper(name: str, folder: str = "export"):
    """A helper module of another test folder (export/gguf_models, export/llamacpp_server, serve/serve_support),
    imported by path."""
    spec = importlib.util.spec_from_file_location(name, TESTS / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_gguf(path: Path, tokenizer, out: Path, **overrides):
    """A random model of the config imported from `path`, sized for `tokenizer`, exported to GGUF at `out` with it:
    (the model, the export's result)."""
    config = load_model(path)[0].config.to_dict()
    model = helper("gguf_models").random_model(**{**config, "vocab_size": tokenizer.vocab_size, **overrides})
    return model, export_gguf(model, tokenizer, out)


def assert_llama_cpp_tokenizes_nfc_texts_as(gguf: Path, tokenizer):
    with helper("llamacpp_server").LlamaCpp(gguf) as llama:
        for text in helper("gguf_models").TEXTS:
            text = unicodedata.normalize("NFC", text)
            assert llama.tokenize(text) == tokenizer.encode(text), text


def assert_llama_cpp_tokenizes_a_chat_as_transformers_and_continues_it(gguf: Path, model, tokenizer, fast, chat: str):
    """llama.cpp tokenizes `chat` and six texts (special tokens added) as `tokenizer` and transformers' `fast` do, and
    its greedy ids after `chat` are ours."""
    prompt = tokenizer.encode(chat)
    with torch.no_grad():
        ours = generate(model, torch.tensor([prompt]), max_new_tokens=32, temperature=0)[0, len(prompt) :].tolist()
    assert len(set(ours)) > 8  # a real continuation, not one token repeated
    with helper("llamacpp_server").LlamaCpp(gguf) as llama:
        for text in [chat, *helper("gguf_models").TEXTS[:6]]:
            assert llama.tokenize(text, add_special=True) == tokenizer.encode(text) == fast(text)["input_ids"], text
        assert llama.argmax_along(prompt, ours) == ours


def text_config(name: str):
    """The HF config of `name`'s text model: its own, or a multimodal one's text_config (imported text-only)."""
    config = MODELS[name]()
    return getattr(config, "text_config", config)


def family_of(name: str) -> str:
    """The family the import names and the exports write: the text model's model_type."""
    return text_config(name).model_type


def lora_through_peft(path: Path, targets: list[str], tmp_path: Path):
    """A LoRA model of the import at `path` (every adapter weight drawn at std 0.2) exported to PEFT and loaded there:
    (adapter_config.json, the HF base model, its logits without and with the adapters, ours)."""
    peft = pytest.importorskip("peft")
    base, tokenizer = load_model(path)
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
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        plain = hf(idx).logits
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(idx).logits
    return adapter, hf, plain, theirs, expected


def tensor_shapes(hf_config: dict, config) -> tuple[dict, dict]:
    """(ours, transformers') tensor shapes by HF name for a published config.json and our config of it, both built on
    the meta device (nothing allocated); a tied lm_head.weight is left out of transformers'."""
    from minigpt.core.model import GPT
    from minigpt.hf.weights import to_hf_state_dict

    hf = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        ours = to_hf_state_dict(GPT(config).state_dict(), config)
        theirs = getattr(transformers, hf_config["architectures"][0])(hf).state_dict()
    if hf.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    return {k: tuple(v.shape) for k, v in ours.items()}, {k: tuple(v.shape) for k, v in theirs.items()}


# ------------------------------------------------------------------------------------------------- same function


@pytest.mark.parametrize("name", FAMILY_MODELS)
@pytest.mark.parametrize("attention", ["sdpa", "manual", "einops"])
def test_logits_equal_transformers_within_1e_5(saved, name, attention):
    hf_model, path = saved[name]
    model, _ = load_model(path, attention=attention)
    idx = ids()  # 40 tokens: past Phi-3's 16-token window and Gemma's 8- and 12-token ones
    theirs = hf_logits(hf_model, idx)
    # float32, 1e-5 of the logits' scale (about 9 to 19 here): manual and einops agree to 2e-6 (Phi-3's and Gemma's
    # bit for bit, Gemma's norm gains as 1 + HF's being exact), sdpa's kernel to 1.2e-5
    torch.testing.assert_close(our_logits(model, idx), theirs, atol=1e-5 * theirs.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_the_import_reads_the_family_heads_and_tying(saved, name):
    config = load_model(saved[name][1])[0].config
    hf_config = text_config(name)
    assert config.family == hf_config.model_type and config.arch == "llama" and not config.bias
    assert config.tie_embeddings == hf_config.tie_word_embeddings and config.n_kv_head == hf_config.num_key_value_heads
    default_head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    assert config.head_dim == (getattr(hf_config, "head_dim", None) or default_head_dim)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_greedy_ids_equal_transformers_generate_for_32_tokens(saved, name):
    hf_model, path = saved[name]
    model, _ = load_model(path)
    prompt = ids(batch=1, T=8, seed=3)
    with torch.no_grad():  # 8 + 32 positions: past the windows, through both libraries' caches
        expected = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32, min_new_tokens=32
        )
    # a real continuation, but where a tied head over scaled random embeddings (Gemma's) repeats one token (a sliding
    # layer's decoding past its window is test_gemma.py's kv-cache test, by logits)
    repeats = model.config.scale_embeddings and model.config.tie_embeddings
    assert repeats or len(set(expected[0, 8:].tolist())) > 4
    for use_kv_cache in (True, False):
        assert generate(model, prompt, 32, temperature=0.0, use_kv_cache=use_kv_cache).tolist() == expected.tolist()


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_a_hub_id_imports_from_the_cache(saved, hub_cache, name):
    from test_hub import fill_hub_cache

    hf_model, path = saved[name]
    fill_hub_cache(hub_cache, f"someorg/{name}", path)
    model, tokenizer = load_model(f"hf:someorg/{name}")
    assert tokenizer.name == f"someorg/{name}" and model.config.family == family_of(name)
    assert (our_logits(model, ids()) - hf_logits(hf_model, ids())).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------- exports


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_the_hf_export_is_the_familys_class_with_the_same_logits_and_imports_back(saved, name, tmp_path):
    hf_model, path = saved[name]
    model, tokenizer = load_model(path)
    out = export_hf(model, tokenizer, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASSES[family_of(name)]] and config["model_type"] == family_of(name)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back).__name__ == CLASSES[family_of(name)]
    idx = ids()
    expected = hf_logits(hf_model, idx)  # eager attention; the export loads with transformers' default (sdpa)
    torch.testing.assert_close(hf_logits(back.eval(), idx), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    again, _ = load_model(out)
    assert again.config == model.config


@pytest.mark.parametrize("name", UNFUSED_PEFT)
def test_peft_adapters_of_a_lora_model_load_in_peft_with_equal_logits(saved, name, tmp_path):
    adapter, hf, plain, theirs, expected = lora_through_peft(saved[name][1], ALL_TARGETS, tmp_path)
    assert adapter["target_modules"] == sorted(f"{target}_proj" for target in ALL_TARGETS)
    assert type(hf).__name__ == CLASSES[family_of(name)]
    assert (theirs - plain).abs().max() > 1e-2  # the adapters change the function
    torch.testing.assert_close(theirs, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", GGUF)
def test_llama_cpp_runs_the_gguf_export_as_the_familys_architecture(saved, name, tmp_path):
    """Qwen's q/k/v biases and q/k norms; Phi-3's fused attn_qkv and ffn_up, rope.dimension_count for partial rotary,
    LongRoPE's short factors and attention factor; Gemma 3's 1B layout (every 6th layer full, local base 10000, a
    12-token window that the 53 tokens outgrow): llama.cpp's greedy ids and log-probs are ours. llama.cpp's GELU reads
    a float16 table, so GeGLU log-probs agree to 3e-3 as gpt2's do (tests/export/test_gguf.py); with our GELU
    evaluated at float16 too they agree to 2e-5."""
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    gguf_models, LlamaCpp = helper("gguf_models"), helper("llamacpp_server").LlamaCpp
    imported = load_model(saved[name][1])[0].config.to_dict()
    if imported["rope_scaling"] is not None:  # llama.cpp rounds its context up to 256, past which it takes long_factor
        imported["rope_scaling"] |= {"original_max_position_embeddings": 256}
    model = gguf_models.random_model(seed=GGUF.index(name), **{**imported, "block_size": 96})
    result = export_gguf(model, ByteTokenizer(), tmp_path / "model.gguf")
    assert result.arch == FAMILIES[family_of(name)].gguf_arch == family_of(name).removesuffix("_text")
    assert any("long_factor" in note for note in result.notes) == (imported["rope_scaling"] is not None)
    prompt = list("héllo wörld ☃".encode())
    with torch.no_grad():
        ours = generate(model, torch.tensor([prompt]), max_new_tokens=40, temperature=0)[0, len(prompt) :].tolist()
        reference = torch.log_softmax(model(torch.tensor([prompt + ours]))[0][0].double(), -1)
    assert len(set(ours)) > 8  # a real continuation, not one token repeated
    tolerance = 3e-3 if imported["mlp"] == "geglu" else 1e-4
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        assert llama.argmax_along(prompt, ours) == ours
        for t in (len(prompt), len(prompt) + 20, len(prompt) + 39):
            theirs = llama.next_logprobs((prompt + ours)[:t], 8)
            assert max(abs(reference[t - 1, i].item() - lp) for i, lp in theirs.items()) < tolerance


# ------------------------------------------------------------------------------------------------- train, serve


@pytest.fixture(scope="module")
def fine_tuned_folders(corpus, tmp_path_factory):
    """name -> a small random model saved with save_pretrained, with a char tokenizer.json of ours covering the
    corpus (so train.py can fine-tune it on that text)."""
    tok = CharTokenizer(corpus.read_text())
    out = {}
    for name in FINE_TUNED:
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


KEPT = ("sliding_window", "layer_types", "post_norms", "qkv_bias", "qk_norm", "partial_rotary_factor", "rope_scaling")


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("name", FINE_TUNED)
def test_train_py_fine_tunes_a_folder_full_and_lora_from_its_weights(
    fine_tuned_folders, lora, name, record_training_losses, tiny_run_args, corpus, data_root, tmp_path, monkeypatch
):
    hf_dir = fine_tuned_folders[name]
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
    assert model.config.family == family_of(name)
    ours, imported = model.config.to_dict(), load_model(hf_dir)[0].config.to_dict()
    assert {k: ours[k] for k in KEPT} == {k: imported[k] for k in KEPT}


@pytest.mark.parametrize("name", FINE_TUNED)
def test_a_served_import_completes_as_generate_does(saved, name):
    openai = pytest.importorskip("openai")
    from minigpt.serve.app import create_app

    serving = helper("serve_support", "serve").serving
    model, tokenizer = load_model(saved[name][1])
    prompt = "héllo wörld, past the window"  # 30 tokens, and 24 more: past Phi-3's and Gemma's windows
    ids_ = prompt_ids(tokenizer, prompt)
    expected = generate(model, torch.tensor([ids_]), 24, temperature=0, vocab_size=tokenizer.vocab_size)
    with serving(create_app(model, tokenizer, name)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0)
    assert reply.choices[0].text == tokenizer.decode(expected[0, len(ids_) :].tolist())
