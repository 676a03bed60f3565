"""What only Gemma 3 text (`Gemma3ForCausalLM`) has, read from transformers' own config class (hf_models.py): the
import's options (scaled embeddings, GeGLU, four norms a block with gains 1 + HF's, q/k norms, sliding layers with
their own RoPE base, query_pre_attn_scalar), a sliding layer's ring cache, what the import and the exports refuse, PEFT
trainable tokens of the scaled embedding, its tokenizer and chat template, the published configs' shapes, and a model
trained here with the same options that exports as Gemma 3. Its logits, greedy ids, hub import, exports (HF, GGUF,
PEFT), fine-tuning and serving are test_family_suite.py's, with every other family's."""

from __future__ import annotations

import io
import json

import pytest
import torch

from minigpt.cli.sample import main as sample_main
from minigpt.cli.train import main as train_main
from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError, UserError
from minigpt.core.generation import generate, prompt_ids
from minigpt.core.lora import LoRAConfig, lora_model
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.gguf import export_gguf
from minigpt.export.hf import export_hf
from minigpt.export.peft import export_peft
from minigpt.hf.families import FAMILIES
from minigpt.hf.tokenizer_files import save_hf_tokenizer
from minigpt.loading import load_model

transformers = pytest.importorskip("transformers")
from hf_models import CLASSES, MODELS, hf_logits, ids, our_logits, random_hf_model
from test_family_suite import (
    assert_llama_cpp_tokenizes_a_chat_as_transformers_and_continues_it,
    helper,
    random_gguf,
)

CLASS = "Gemma3ForCausalLM"
FAMILY = "gemma3_text"


# ------------------------------------------------------------------------------------------------- same function
# (the logits, greedy ids, hub import, exports, fine-tuning and serving of every config: test_family_suite.py)


def test_the_import_reads_the_family(saved):
    config = load_model(saved["gemma3-gqa-tied-window"][1])[0].config
    assert (config.family, config.arch, config.mlp, config.gelu_approximate) == (FAMILY, "llama", "geglu", "tanh")
    assert config.scale_embeddings and config.post_norms and config.qk_norm and not config.bias
    assert (config.head_dim, config.attn_scale_dim, config.tie_embeddings) == (24, 20, True)
    assert (config.sliding_window, config.rope_base, config.rope_local_base) == (8, 1e6, 100.0)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    # sliding_window_pattern 6 (no layer_types in the config): layer 5 full; the local base is the default 10000
    config = load_model(saved["gemma3-mqa-untied-pattern"][1])[0].config
    assert [config.layer_window(i) for i in range(7)] == [12] * 5 + [None, 12]
    assert (config.rope_local_base, config.attn_scale_dim, config.n_kv_head, config.tie_embeddings) == (
        10000.0,
        None,
        1,
        False,
    )
    config = load_model(saved["gemma3-mha-exact-gelu"][1])[0].config
    assert (config.gelu_approximate, config.n_kv_head, config.head_dim) == ("none", 3, 32)


def test_norm_gains_are_hf_plus_one_exactly_in_float32(saved):
    hf_model, path = saved["gemma3-gqa-tied-window"]
    model, _ = load_model(path)
    hf_layer, ours = hf_model.model.layers[0], model.transformer.h[0]
    pairs = [
        (hf_layer.input_layernorm, ours.ln_1),
        (hf_layer.post_attention_layernorm, ours.post_attn_norm),
        (hf_layer.pre_feedforward_layernorm, ours.ln_2),
        (hf_layer.post_feedforward_layernorm, ours.post_mlp_norm),
        (hf_layer.self_attn.q_norm, ours.attn.q_norm),
        (hf_layer.self_attn.k_norm, ours.attn.k_norm),
        (hf_model.model.norm, model.transformer.ln_f),
    ]
    for theirs, mine in pairs:
        assert torch.equal(mine.weight, 1.0 + theirs.weight.float())
        x = torch.randn(3, 5, mine.weight.numel())  # the width (64) or a head (24)
        with torch.no_grad():
            assert torch.equal(mine(x), theirs(x))


def test_bfloat16_gains_become_1_plus_w_in_float32(tmp_path):
    """A bf16 file: the gain is 1 + w added in float32, as HF's forward adds it (in bf16 the 1 would round w away)."""
    from hf_models import save

    save(random_hf_model(MODELS["gemma3-gqa-tied-window"]()).to(torch.bfloat16), tmp_path)
    model, _ = load_model(tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    hf_gain = hf_model.model.layers[0].input_layernorm.weight
    assert (
        torch.equal(model.transformer.h[0].ln_1.weight, 1.0 + hf_gain) and (hf_gain * 128).frac().abs().max() > 0
    )  # bf16 steps 1/128 in [1, 2)
    idx = ids()
    theirs = hf_logits(hf_model, idx)
    torch.testing.assert_close(our_logits(model, idx), theirs, atol=1e-5 * theirs.abs().max().item(), rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "manual", "einops"])
def test_kv_cache_decoding_past_the_window_equals_the_full_forward(saved, attention):
    """A sliding layer's cache keeps only its last 8 positions (a ring): decoding 30 tokens one by one after a
    4-token prefill gives the full forward's logits, and transformers'."""
    hf_model, path = saved["gemma3-gqa-tied-window"]
    model, _ = load_model(path, attention=attention)
    idx = ids(batch=2, T=34, seed=4)
    cache = model.new_kv_cache(batch_size=2)
    assert [c.window for c in cache] == [8, None, 8, 8]
    with torch.no_grad():
        steps = [model(idx[:, :4], kv_cache=cache, input_pos=0)[0]]
        steps += [model(idx[:, t : t + 1], kv_cache=cache, input_pos=t)[0] for t in range(4, 34)]
        full = model(idx)[0]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5 * full.abs().max().item(), rtol=0)
    theirs = hf_logits(hf_model, idx)
    torch.testing.assert_close(full, theirs, atol=1e-5 * theirs.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(final_logit_softcapping=30.0), "its config.json sets final_logit_softcapping=30.0"),
        (dict(attn_logit_softcapping=50.0), "its config.json sets attn_logit_softcapping=50.0"),
        (dict(use_bidirectional_attention=True), "its config.json sets use_bidirectional_attention=true"),
        (dict(attention_bias=True), "its config.json sets attention_bias=true"),
        (dict(hidden_activation="silu"), "its hidden_activation is 'silu'"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "its RoPE scaling on full_attention layers is"),
        (  # Gemma scales the full layers only: a sliding layer's scaling is no Gemma 3's
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100.0},
                }
            ),
            "its RoPE scaling on sliding_attention layers is 'linear'",
        ),
        (dict(rope_scaling={"rope_type": "linear", "factor": "8"}), "its linear RoPE scaling on full_attention"),
    ],
)
def test_what_the_import_does_not_compute_is_refused_in_one_line(saved, tmp_path, changes, message):
    import shutil

    path = shutil.copytree(saved["gemma3-gqa-tied-window"][1], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert str(e.value).startswith(f"{path}: {message}") and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------- Gemma 3 4B-27B

MULTIMODAL = "gemma3-multimodal-linear"


def test_a_conditional_generation_folder_imports_its_text_model_with_a_note(saved, capsys):
    """The folder transformers writes for Gemma3ForConditionalGeneration (text_config, a vision tower and projector,
    the language model's tensors under language_model.model.) imports as the text model, saying so in a note; the
    logits, greedy ids and HF export are the parametrized tests' above (GEMMA holds this model)."""
    from safetensors import safe_open

    hf_model, path = saved[MULTIMODAL]
    config_json = json.loads((path / "config.json").read_text())
    assert config_json["architectures"] == ["Gemma3ForConditionalGeneration"] and "text_config" in config_json
    with safe_open(path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in names) and any(
        n.startswith("multi_modal_projector.") for n in names
    )
    assert all(n.startswith(("language_model.model.", "vision_tower.", "multi_modal_projector.")) for n in names)
    capsys.readouterr()
    model, _ = load_model(path)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "the import is text-only" in notes[0] and "exports as Gemma3ForCausalLM" in notes[0]
    c = model.config
    assert (c.family, c.rope_scaling, c.rope_base, c.rope_local_base) == (
        FAMILY,
        {"rope_type": "linear", "factor": 8.0},
        1e6,
        1e4,
    )
    assert (c.n_layer, c.n_kv_head, c.sliding_window, c.attn_scale_dim, c.tie_embeddings) == (6, 1, 12, 24, True)


def test_newer_tensor_names_and_an_older_minimal_text_config_import_alike(saved, tmp_path):
    """Gemma 3 4B's config.json as published (transformers 4.50): a text_config of the keys that differ from
    Gemma3TextConfig's defaults, rope_scaling linear, rope_local_base_freq; and the tensor names transformers 4.52-5
    keep in memory (model.language_model.): transformers reads that folder to the same function, and so do we."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf_model, saved_path = saved[MULTIMODAL]
    path = shutil.copytree(saved_path, tmp_path / "m")
    state = load_file(path / "model.safetensors")
    renamed = {n.replace("language_model.model.", "model.language_model.", 1): t for n, t in state.items()}
    assert renamed.keys() != state.keys()
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((path / "config.json").read_text())
    config_json["text_config"] = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 80,
        "num_hidden_layers": 6,
        "num_key_value_heads": 1,
        "num_attention_heads": 4,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "max_position_embeddings": 64,
        "sliding_window": 12,
        "sliding_window_pattern": 6,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_local_base_freq": 10000.0,
        "vocab_size": 256,
    }
    (path / "config.json").write_text(json.dumps(config_json))
    idx = ids()
    expected = hf_logits(hf_model, idx)
    again = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()
    torch.testing.assert_close(hf_logits(again, idx), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    for attention in ("sdpa", "manual", "einops"):
        model, _ = load_model(path, attention=attention)
        torch.testing.assert_close(our_logits(model, idx), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(text_config=None), "its config.json (Gemma3ForConditionalGeneration) has no text_config object"),
        (dict(text_config={"hidden_size": "64"}), "its text_config: "),
        (dict(text_config={"final_logit_softcapping": 30.0}), "its config.json sets final_logit_softcapping=30.0"),
    ],
)
def test_what_a_conditional_generation_folder_lacks_is_refused_in_one_line(saved, tmp_path, changes, message):
    import shutil

    path = shutil.copytree(saved[MULTIMODAL][1], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    if isinstance(changes["text_config"], dict):
        changes = {"text_config": {**config["text_config"], **changes["text_config"]}}
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert str(e.value).startswith(f"{path}: {message}") and "\n" not in str(e.value)


def test_linear_rope_scaling_of_a_model_trained_here_exports_where_it_is_expressed(tmp_path):
    """rope_scaling linear scales the rope_base layers: a Gemma 3 export needs its sliding layers at a base of their
    own (rope_local_base, unscaled, as Gemma's); llama.cpp's llama holds no linear scaling: both refused in one line."""
    pytest.importorskip("gguf")
    linear = {"rope_type": "linear", "factor": 8.0}
    gemma = GPTConfig(**{"vocab_size": 256, **GGUF_BASE, "rope_scaling": linear, "rope_local_base": None})
    with pytest.raises(UserError) as e:
        export_hf(GPT(gemma), ByteTokenizer(), tmp_path / "out")
    assert str(e.value).startswith(
        "cannot export to Hugging Face: rope_scaling=linear without rope_local_base: Gemma3ForCausalLM never scales"
    ) and "\n" not in str(e.value)
    llama = GPTConfig(arch="llama", n_layer=1, n_head=2, n_embd=32, vocab_size=256, rope_scaling=linear)
    with pytest.raises(UserError) as e:
        export_gguf(GPT(llama), ByteTokenizer(), tmp_path / "model.gguf")
    assert str(e.value).startswith("cannot export to GGUF: rope_scaling linear: minigpt writes llama.cpp's llama")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match="linear needs factor > 0"):  # checked where it enters
        GPTConfig(arch="llama", n_layer=1, n_head=2, n_embd=32, rope_scaling={"rope_type": "linear", "factor": 0})


def test_linear_rope_scaling_of_a_llama_trained_here_computes_what_transformers_computes(tmp_path):
    """rope_scaling linear is a core RoPE option: a Llama-block model with it exports to LlamaForCausalLM, whose
    logits equal ours (and differ from the unscaled model's), and imports back."""
    gguf_models = helper("gguf_models")
    config = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, vocab_size=256)
    model = gguf_models.random_model(seed=2, **config, rope_scaling={"rope_type": "linear", "factor": 4.0})
    unscaled = gguf_models.random_model(seed=2, **config)
    out = export_hf(model, ByteTokenizer(), tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_type"] == "linear"
    idx = ids()
    ours, theirs = our_logits(model, idx), hf_logits(back, idx)
    torch.testing.assert_close(ours, theirs, atol=1e-5 * theirs.abs().max().item(), rtol=0)
    assert (our_logits(unscaled, idx) - theirs).abs().max() > 100 * 1e-5 * theirs.abs().max()
    again, _ = load_model(out)  # and LlamaForCausalLM's linear scaling imports
    assert again.config == model.config
    torch.testing.assert_close(our_logits(again, idx), theirs, atol=1e-5 * theirs.abs().max().item(), rtol=0)


# ------------------------------------------------------------------------------------------------- exports


@pytest.mark.parametrize("train_embeddings, vocab_size", [(True, 256), (False, 260)])
def test_peft_trainable_tokens_of_the_scaled_embedding_load_in_peft(saved, train_embeddings, vocab_size, tmp_path):
    """Every row trained (lora.train_embeddings) or 4 new tokens (a grown vocabulary): PEFT's trainable tokens sit in
    Gemma's scaled embedding, scaled as ours are."""
    peft = pytest.importorskip("peft")
    base, tokenizer = load_model(saved["gemma3-gqa-tied-window"][1])
    cfg = LoRAConfig(rank=4, targets=["q", "v"], train_embeddings=train_embeddings)
    config = GPTConfig.from_dict({**base.config.to_dict(), "vocab_size": vocab_size})
    model = lora_model(base, config, cfg).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    idx = torch.cat([ids(), torch.full((2, 1), vocab_size - 1)], dim=1)  # the last token a new one where grown
    with torch.no_grad():
        expected = model(idx)[0]
    export_peft(model, tokenizer, cfg, tmp_path / "adapter", tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(idx).logits
    torch.testing.assert_close(theirs[..., :vocab_size], expected, atol=1e-4, rtol=0)


def test_llama_cpp_runs_a_linear_rope_gguf_export_as_gemma3(saved, tmp_path):
    """Gemma 3 4B's RoPE (linear factor 8 on the full layers, the sliding ones at base 10000 unscaled) goes to llama.cpp
    as rope.scaling.type linear and its factor, which llama.cpp's gemma3 applies to its full layers alone: greedy ids
    equal, log-probs within the tolerance above, where the same weights without the scaling are far off."""
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    gguf_models, LlamaCpp = helper("gguf_models"), helper("llamacpp_server").LlamaCpp
    imported = load_model(saved["gemma3-linear-rope"][1])[0].config.to_dict()
    assert imported["rope_scaling"] == {"rope_type": "linear", "factor": 8.0} and imported["rope_local_base"] == 1e4
    imported["tie_embeddings"] = False  # a tied head over scaled random embeddings repeats one token
    model = gguf_models.random_model(seed=1, **imported)
    unscaled = gguf_models.random_model(seed=1, **{**imported, "rope_scaling": None})
    export_gguf(model, ByteTokenizer(), tmp_path / "model.gguf")
    prompt = list("héllo wörld ☃".encode())
    with torch.no_grad():
        ours = generate(model, torch.tensor([prompt]), max_new_tokens=40, temperature=0)[0, len(prompt) :].tolist()
        reference = torch.log_softmax(model(torch.tensor([prompt + ours]))[0][0].double(), -1)
        without = torch.log_softmax(unscaled(torch.tensor([prompt + ours]))[0][0].double(), -1)
    assert len(set(ours)) > 8
    with LlamaCpp(tmp_path / "model.gguf") as llama:
        assert llama.argmax_along(prompt, ours) == ours
        for t in (len(prompt), len(prompt) + 20, len(prompt) + 39):
            theirs = llama.next_logprobs((prompt + ours)[:t], 8)
            assert max(abs(reference[t - 1, i].item() - lp) for i, lp in theirs.items()) < 3e-3
            if t > len(prompt):  # the scaling changes what llama.cpp must match
                assert max(abs(without[t - 1, i].item() - lp) for i, lp in theirs.items()) > 3e-2


GGUF_BASE = dict(arch="llama", family=FAMILY, n_layer=7, n_head=4, n_embd=64, mlp="geglu", gelu_approximate="tanh")
GGUF_BASE |= dict(qk_norm=True, scale_embeddings=True, post_norms=True, sliding_window=8, rope_local_base=10000.0)
GGUF_BASE |= dict(layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"], rope_base=1e6)


@pytest.mark.parametrize(
    "overrides, option",
    [
        (dict(attn_scale_dim=20), "attn_scale_dim=20: llama.cpp's gemma3 architecture scales attention by"),
        (dict(layer_types=None), "layer_types: llama.cpp's gemma3 architecture slides on every layer but each 6th"),
        (dict(rope_local_base=100.0), "rope_local_base=100: llama.cpp's gemma3 architecture rotates its sliding"),
        (dict(mlp="swiglu"), "mlp=swiglu: llama.cpp's gemma3 architecture's MLP is GELU-gated"),
        (dict(post_norms=False), "post_norms=false: llama.cpp's gemma3 architecture always normalises"),
        (dict(scale_embeddings=False), "scale_embeddings=false: llama.cpp's gemma3 architecture always scales"),
        (
            dict(family=None, sliding_window=None, layer_types=None, rope_local_base=None),
            "mlp=geglu: llama.cpp's llama architecture's MLP is not GELU-gated",
        ),
    ],
)
def test_the_gguf_export_refuses_what_llama_cpp_gemma3_hard_codes(overrides, option, tmp_path):
    pytest.importorskip("gguf")
    model = GPT(GPTConfig(**{"vocab_size": 256, **GGUF_BASE, **overrides}))
    with pytest.raises(UserError) as e:
        export_gguf(model, ByteTokenizer(), tmp_path / "model.gguf")
    assert str(e.value).startswith(f"cannot export to GGUF: {option}") and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_the_exports_of_other_families_refuse_gemmas_variants(tmp_path):
    base = dict(arch="llama", n_layer=1, n_head=2, n_embd=32, vocab_size=256)
    for overrides, option in [
        (dict(mlp="geglu"), "mlp=geglu: LlamaForCausalLM's MLP is not GELU-gated"),
        (dict(scale_embeddings=True), "scale_embeddings=true: LlamaForCausalLM never scales its token embeddings"),
        (dict(post_norms=True), "post_norms=true: LlamaForCausalLM never normalises sublayer outputs"),
        (dict(attn_scale_dim=20), "attn_scale_dim=20: LlamaForCausalLM scales attention by 1/sqrt(head_dim)"),
        (dict(arch="gpt", mlp="geglu"), "mlp=geglu: GPT2LMHeadModel's MLP is not GELU-gated"),
        (dict(family=FAMILY), "mlp=swiglu: Gemma3ForCausalLM's MLP is GELU-gated (GeGLU)"),
        (dict(family=FAMILY, mlp="geglu"), "qk_norm=false: Gemma3ForCausalLM always normalises queries and keys"),
        (dict(family=FAMILY, mlp="geglu", qk_norm=True), "scale_embeddings=false: Gemma3ForCausalLM always scales"),
    ]:
        model = GPT(GPTConfig(**{**base, **overrides}))
        with pytest.raises(UserError) as e:
            export_hf(model, ByteTokenizer(), tmp_path / "out")
        assert str(e.value).startswith(f"cannot export to Hugging Face: {option}"), str(e.value)
        assert list(tmp_path.iterdir()) == []


def gemma_style_tokenizer():
    """A Gemma-style tokenizer.json: SentencePiece BPE ('▁' for spaces by a Replace normaliser, <0xNN> byte
    fallback, no pre-tokenizer), built offline."""
    import tokenizers as t

    from minigpt.core.tokenizers import HFTokenizer

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{i:02X}>" for i in range(256)), "▁", "h", "e", "l", "o"]
    pieces += ["▁h", "▁he", "ll", "▁hell", "▁hello"]
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o")]
    backend = t.Tokenizer(
        t.models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True, unk_token="<unk>")
    )
    backend.normalizer = t.normalizers.Replace(" ", "▁")
    backend.decoder = t.decoders.Sequence([t.decoders.Replace("▁", " "), t.decoders.ByteFallback(), t.decoders.Fuse()])
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"])
    return HFTokenizer(backend.to_str(), eos_id=1)


def test_a_gemma_style_tokenizer_reads_and_llama_cpp_runs_its_gguf_export(saved, tmp_path):
    """Gemma's tokenizer.json shape (SentencePiece BPE, "▁" by a Replace normaliser, no dummy prefix, byte fallback,
    <bos> written by the post-processor) read from a folder as the import reads it, then a trained one of that shape
    exported to GGUF with a random Gemma 3: llama.cpp tokenizes text as transformers does and writes our greedy ids."""
    from minigpt.hf.tokenizer_files import load_hf_tokenizer

    hand = gemma_style_tokenizer()
    save_hf_tokenizer(hand, tmp_path / "hand")
    back = load_hf_tokenizer(tmp_path / "hand", {"model_type": FAMILY, "vocab_size": hand.vocab_size})
    text = " hello héllo ☃"
    assert back.encode(text) == hand.encode(text) and back.decode(back.encode(text)) == text
    assert back.encode(" hello") == [269]  # one merged piece; é and ☃ fall back to their UTF-8 bytes
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    # as transformers converts Gemma's tokenizer.model: every split a merge rule, a no-op Split at " "
    tokenizer = helper("gguf_models").spm_tokenizer("gemma-split", post_bos=True, converted=True)
    save_hf_tokenizer(tokenizer, tmp_path / "tok")
    tokenizer = load_hf_tokenizer(tmp_path / "tok", {"model_type": FAMILY})
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    model, result = random_gguf(saved["gemma3-mqa-untied-pattern"][1], tokenizer, tmp_path / "model.gguf", seed=1)
    assert (result.arch, result.vocab.kind, result.vocab.add_space_prefix, result.vocab.add_bos) == (
        "gemma3",
        "spm",
        False,
        True,
    )
    chat = "<start_of_turn>user\nhéllo  wörld ☃ 42<end_of_turn>\n<start_of_turn>model\n"
    assert_llama_cpp_tokenizes_a_chat_as_transformers_and_continues_it(
        tmp_path / "model.gguf", model, tokenizer, fast, chat
    )


GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""  # Gemma 3's chat_template (tokenizer_config.json of the instruction-tuned models)


def gemma_it_folder(path, extra_tokens=()):
    """A Gemma 3 IT-shaped folder: EOS <eos> (1), Gemma's template, and generation_config.json's eos_token_id
    [<eos>, <end_of_turn>] as the published ones list them; `extra_tokens`: special tokens past the model's rows."""
    tokenizer = gemma_style_tokenizer()
    config = MODELS["gemma3-gqa-tied-window"]()
    config.vocab_size, config.bos_token_id, config.eos_token_id = tokenizer.vocab_size, 2, 1
    model = random_hf_model(config)
    end_of_turn = tokenizer.backend.token_to_id("<end_of_turn>")
    model.generation_config = transformers.GenerationConfig(bos_token_id=2, eos_token_id=[1, end_of_turn])
    model.save_pretrained(path)
    tokenizer.backend.add_special_tokens(list(extra_tokens))
    (path / "tokenizer.json").write_text(tokenizer.backend.to_str())
    tokenizer_config = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": GEMMA_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def test_gemmas_chat_template_renders_through_the_sandbox_as_transformers_renders_it(tmp_path):
    from minigpt.loading import load_chat_model

    tokenizer = gemma_style_tokenizer()
    _, chat_tok = load_chat_model(gemma_it_folder(tmp_path))
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello? "},
        {"role": "assistant", "content": "hello, é☃"},
        {"role": "user", "content": "And 1 + 1?"},
    ]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ours = chat_tok.encode_chat(conversation, add_generation_prompt=True)[0]
    assert ours == theirs and ours[0] == 2 and ours.count(tokenizer.backend.token_to_id("<start_of_turn>")) == 4
    with pytest.raises(UserError, match="Conversation roles must alternate"):
        chat_tok.encode_chat(conversation[:2] + conversation[3:], add_generation_prompt=True)


def test_an_instruct_model_ends_its_turns_where_its_generation_config_says_and_its_export_keeps_that(tmp_path):
    """Gemma 3 IT's EOS is <eos>, but its turns end with <end_of_turn>, which generation_config.json lists beside
    it: a reply stops there and SFT trains up to it (not the newline after); the HF export of the folder keeps the
    template, and its generation_config.json lists both ends again."""
    from minigpt.cli.export import run as export_run
    from minigpt.loading import load_chat_model

    folder = gemma_it_folder(tmp_path / "it")
    _, chat_tok = load_chat_model(folder)
    end_of_turn = chat_tok.token_id("<end_of_turn>")
    assert chat_tok.eot_id == end_of_turn != 1
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello hello"}]
    ids, mask = chat_tok.encode_chat(conversation)
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained[-1] == end_of_turn and chat_tok.decode(trained[:-1]) == "hello hello"
    export_run(["--ckpt", str(folder), "--out", str(tmp_path / "export")])
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    prompt = conversation[:1]
    theirs = hf_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert theirs["input_ids"] == chat_tok.encode_chat(prompt, add_generation_prompt=True)[0]
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [end_of_turn, 1]


def test_a_special_token_past_the_models_rows_is_kept_and_refused_in_a_text(tmp_path):
    """Gemma 3's tokenizer.json holds <image_soft_token> (its vision tower's) one past the text model's vocab_size:
    the folder loads, a text that writes the token is refused in one line, and the GGUF export leaves it out."""
    from minigpt.export.gguf_vocab import gguf_vocab

    folder = gemma_it_folder(tmp_path / "it", extra_tokens=["<image_soft_token>"])
    model, tokenizer = load_model(folder)
    assert model.config.vocab_size == tokenizer.vocab_size == len(gemma_style_tokenizer().backend.get_vocab())
    assert tokenizer.decode(tokenizer.encode(" hello")) == " hello"
    with pytest.raises(UserError, match=r"'<image_soft_token>' \(id \d+\), which this model has no embedding for"):
        tokenizer.encode("look: <image_soft_token>")
    pytest.importorskip("gguf")
    assert len(gguf_vocab(tokenizer, model.config.vocab_size).tokens) == model.config.vocab_size


def test_hidden_act_is_not_gemma_3s_activation(saved, tmp_path):
    """transformers' Gemma 3 reads hidden_activation only (default: the tanh GELU); a config that also carries an
    older hidden_act computes the tanh GELU there, and so does the import."""
    folder = tmp_path / "legacy"
    folder.mkdir()
    for file in saved["gemma3-gqa-tied-window"][1].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config.pop("hidden_activation", None)
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    model = load_model(folder)[0]
    assert model.config.gelu_approximate == "tanh"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    torch.testing.assert_close(our_logits(model, ids()), hf_logits(theirs, ids()), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------- trained here

GEMMA_OPTIONS = [
    "--model.arch", "llama", "--model.n_layer", "3", "--model.n_kv_head", "1", "--model.mlp", "geglu",
    "--model.gelu_approximate", "tanh", "--model.post_norms", "true", "--model.scale_embeddings", "true",
    "--model.attn_scale_dim", "12", "--model.qk_norm", "true", "--model.sliding_window", "8",
    "--model.layer_types", '["sliding_attention", "full_attention", "sliding_attention"]',
    "--model.rope_local_base", "100",
]  # fmt: skip


def test_a_model_trained_here_with_gemmas_options_trains_samples_and_exports_as_gemma3(
    tiny_run_args, corpus, data_root, tmp_path
):
    args = tiny_run_args(corpus, data_root, tmp_path / "run", steps=12, trainer__precision="32-true")
    trainer = train_main([*args, *GEMMA_OPTIONS])
    assert trainer.global_step == 12
    model, tokenizer = load_model(tmp_path / "run")
    config = model.config
    assert (config.mlp, config.post_norms, config.scale_embeddings, config.attn_scale_dim) == ("geglu", True, True, 12)
    idx = torch.tensor([prompt_ids(tokenizer, corpus.read_text()[:30])])  # 30 tokens: past the 8-token window
    logits = {}
    for attention in ("sdpa", "manual", "einops"):
        model.set_attention(attention)
        logits[attention] = our_logits(model, idx)
    for attention in ("manual", "einops"):
        torch.testing.assert_close(logits[attention], logits["sdpa"], atol=1e-5, rtol=0)
    cached = generate(model, idx[:, :5], 24, temperature=0, use_kv_cache=True)
    assert cached.tolist() == generate(model, idx[:, :5], 24, temperature=0, use_kv_cache=False).tolist()
    out = io.StringIO()
    sample_main(["--ckpt", str(tmp_path / "run"), "--temperature", "0", "--max_new_tokens", "20"], stdout=out)
    assert out.getvalue().strip()
    # the same options are Gemma 3's: the model exports as Gemma3ForCausalLM and transformers computes it
    model.config.family = FAMILY
    folder = export_hf(model, tokenizer, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(theirs).__name__ == CLASS
    torch.testing.assert_close(hf_logits(theirs, idx), logits["sdpa"], atol=1e-5, rtol=0)


# the published configs' sizes (Gemma 3 270M: layer_types given, 4 heads of 256 over a 640-wide model, one KV head;
# Gemma 3 1B: sliding_window_pattern 6, tied); both sliding_window 512, local base 10000, global 1e6
PUBLISHED = {
    "gemma-3-270m": {
        "architectures": [CLASS],
        "model_type": FAMILY,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "vocab_size": 262144,
    },
    "gemma-3-1b": {
        "architectures": [CLASS],
        "model_type": FAMILY,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "vocab_size": 262144,
    },
    # Gemma 3 4B (the 12B and 27B are the same shape of file): Gemma3ForConditionalGeneration, a text_config of the
    # keys that differ from Gemma3TextConfig's defaults (8 heads of 256, 4 KV heads, vocab 262208, every 6th layer
    # full), linear RoPE scaling 8 on the full layers, a SigLIP vision tower
    "gemma-3-4b": {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    },
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_gemma_configs_give_transformers_tensor_shapes_and_llama_cpps_layout(name):
    """Our model for each config.json, renamed to HF names, has exactly the tensors transformers builds from it (both
    on the meta device), and its layer pattern, local base and attention scale are what llama.cpp's gemma3 assumes."""
    from minigpt.export.gguf import unsupported_options
    from minigpt.hf.load import config_from_hf
    from minigpt.hf.weights import to_hf_state_dict

    hf = PUBLISHED[name]
    config = config_from_hf(hf, block_size=1024)
    assert config.sliding_window == hf.get("text_config", hf)["sliding_window"] and config.rope_base == 1e6
    assert config.rope_local_base == 10000.0 and unsupported_options(config) == []
    with torch.device("meta"):
        ours = to_hf_state_dict(GPT(config).state_dict(), config)
        hf_class = (
            transformers.Gemma3ForConditionalGeneration if "text_config" in hf else transformers.Gemma3ForCausalLM
        )
        theirs = hf_class(transformers.AutoConfig.for_model(**hf)).state_dict()
    # a multimodal model's text tensors, by the names the import reads them as; the tied head left out
    family = FAMILIES[FAMILY]
    theirs = {new: t for n, t in theirs.items() if (new := family.text_weight_name(hf, n)) and new != "lm_head.weight"}
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}


def test_gemma_is_registered():
    assert CLASSES[FAMILY] == CLASS and FAMILIES[FAMILY].hf_class == CLASS


def test_a_config_json_without_sliding_window_slides_as_transformers_default_window(tmp_path):
    """Gemma3TextConfig's sliding_window where config.json has no such key is 4096, not the whole context: the sliding
    layer of a model written without it sees the last 4096 positions in both libraries."""
    config = transformers.Gemma3TextConfig(
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=8192,
        layer_types=["sliding_attention"],
        vocab_size=256,
    )
    hf_model = random_hf_model(config)
    hf_model.save_pretrained(tmp_path)
    save_hf_tokenizer(ByteTokenizer(), tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())
    del config_json["sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model, _ = load_model(tmp_path)
    assert model.config.sliding_window == hf_model.config.sliding_window == 4096
    idx = ids(batch=1, T=4100)  # past the window
    theirs = hf_logits(hf_model, idx)
    torch.testing.assert_close(our_logits(model, idx), theirs, atol=1e-5 * theirs.abs().max().item(), rtol=0)
