"""A model family is one place: minigpt/hf/families holds everything specific to a Hugging Face family, and no other
module names one (read from the source with `ast`, as tests/test_layers.py reads imports)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

from minigpt.core.config import ARCHS, Family
from minigpt.hf.families import FAMILIES

PACKAGE = Path(__file__).resolve().parents[2] / "minigpt"
LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0] * 8,
    long_factor=[2.0] * 8,
    original_max_position_embeddings=256,
    attention_factor=1.2,
)  # a 16-dim head's 8 pairs
FAMILY_MODULES = PACKAGE / "hf" / "families"
HF_CLASS = re.compile(r"\b[A-Z]\w*(ForCausalLM|LMHeadModel)\b")
# string constants equal to a family's model_type that name something else, with what they name
NOT_A_FAMILY = {
    ("core/config.py", "gpt2"): "the GPT-2 124M preset",
    ("export/gguf_vocab.py", "gpt2"): "llama.cpp's byte-level BPE tokenizer model",
    ("export/gguf_vocab.py", "llama"): "llama.cpp's SentencePiece tokenizer model",
}


def docstrings(tree: ast.AST) -> set[int]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, nodes) and node.body and isinstance(node.body[0], ast.Expr)
    }


def family_type_declaration(tree: ast.AST) -> set[int]:
    """The constants of `Family = Literal[...]`: the field's type declares its values, once."""
    return {
        id(const)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "Family" for t in node.targets)
        for const in ast.walk(node.value)
    }


def places_naming_a_family() -> list[str]:
    """file:line 'name' for every string constant outside the family modules (docstrings apart) that is an HF class
    name or a family's model_type; the block kinds (gpt, llama) are the core's to name."""
    model_types = set(FAMILIES)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(FAMILY_MODULES):
            continue
        relative = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = docstrings(tree) | family_type_declaration(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
                continue
            value = node.value
            block_kind = relative.startswith("core/") and value in ARCHS
            named = HF_CLASS.search(value) or (value in model_types and not block_kind)
            if named and (relative, value) not in NOT_A_FAMILY:
                found.append(f"{relative}:{node.lineno} {value[:60]!r}")
    return found


def test_no_module_outside_the_family_modules_names_a_family():
    assert places_naming_a_family() == []


def test_the_count_sees_a_family_named_elsewhere(tmp_path, monkeypatch):
    """The counter counts: a branch on a model_type and a class name, written into a copy of a module, are found."""
    import shutil

    copy = tmp_path / "minigpt"
    shutil.copytree(PACKAGE, copy)
    extra = 'def f(c):\n    return c.family == "mistral" or c == "Qwen2ForCausalLM"\n'
    (copy / "export" / "hf.py").write_text((copy / "export" / "hf.py").read_text() + extra)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    monkeypatch.setattr(__import__(__name__), "FAMILY_MODULES", copy / "hf" / "families")
    assert len(places_naming_a_family()) == 2


def test_the_family_type_declares_the_registry():
    assert set(get_args(Family)) == set(FAMILIES)
    for name, family in FAMILIES.items():
        assert family.model_type == name and family.block in ARCHS


def test_each_byte_level_family_tokenizer_has_its_llama_cpp_pre_tokenizer():
    from minigpt.export.gguf_vocab import PRE_TOKENIZERS

    for family in FAMILIES.values():
        if family.gguf_pre_tokenizer is not None:
            pattern, name = family.gguf_pre_tokenizer
            assert PRE_TOKENIZERS[pattern] == name


@pytest.mark.parametrize(
    "overrides, option",
    [
        (dict(arch="llama", qkv_bias=True), "qkv_bias=true: LlamaForCausalLM has no biases on q/k/v alone"),
        (dict(arch="llama", family="qwen2"), "qkv_bias=false: Qwen2ForCausalLM's q, k and v projections always"),
        (dict(arch="llama", family="qwen3"), "qk_norm=false: Qwen3ForCausalLM always normalises queries and keys"),
        (dict(arch="llama", family="qwen3", qk_norm=True, qkv_bias=True), "qkv_bias=true: Qwen3ForCausalLM"),
        (dict(arch="gpt", family="qwen2", qkv_bias=True), "model.family=qwen2 with arch gpt"),
        (dict(arch="llama", family="gpt2"), "model.family=gpt2 with arch llama"),
        (dict(arch="llama", sliding_window=8), "sliding_window=8: LlamaForCausalLM attends to the whole context"),
        (dict(sliding_window=8), "sliding_window=8: GPT2LMHeadModel attends to the whole context"),
        (
            dict(arch="llama", family="mistral", sliding_window=8, layer_types=["full_attention"]),
            "layer_types: MistralForCausalLM slides on every layer",
        ),
        (dict(arch="llama", partial_rotary_factor=0.5), "partial_rotary_factor=0.5: LlamaForCausalLM rotates every"),
        (
            dict(
                arch="llama",
                family="phi3",
                head_dim=8,
                rope_scaling={**LONGROPE, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
            ),
            "head_dim=8 with rope_scaling longrope: Phi3ForCausalLM checks longrope's factors",
        ),
        (dict(arch="llama", family="phi3", rope_scaling=LLAMA3), "rope_scaling llama3: Phi3ForCausalLM computes plain"),
        (
            dict(arch="llama", family="phi3", sliding_window=8, layer_types=["full_attention"]),
            "layer_types: Phi3ForCausalLM slides on every layer",
        ),
        (
            dict(arch="llama", family="mistral", sliding_window=8, rope_local_base=500.0),
            "rope_local_base=500: MistralForCausalLM has one RoPE base",
        ),
    ],
)
def test_a_family_refuses_what_its_class_cannot_hold_in_one_line_before_writing(overrides, option, tmp_path):
    from minigpt.core.config import GPTConfig
    from minigpt.core.errors import UserError
    from minigpt.core.model import GPT
    from minigpt.core.tokenizers import ByteTokenizer
    from minigpt.export.hf import export_hf

    model = GPT(GPTConfig(**{"n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 256, **overrides}))
    with pytest.raises(UserError) as e:
        export_hf(model, ByteTokenizer(), tmp_path / "out")
    assert str(e.value).startswith(f"cannot export to Hugging Face: {option}") and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides, option",
    [
        (dict(arch="llama", qk_norm=True), "qk_norm=true: llama.cpp's llama architecture has no query/key"),
        (dict(arch="llama", family="qwen3"), "qk_norm=false: llama.cpp's qwen3 architecture always normalises"),
        (dict(arch="gpt", family="llama"), "model.family=llama with arch gpt"),
        (dict(arch="llama", family="mistral", sliding_window=8), "sliding_window=8: llama.cpp's llama architecture"),
        (dict(arch="llama", partial_rotary_factor=0.5), "partial_rotary_factor=0.5: llama.cpp's llama architecture"),
        (dict(arch="llama", family="phi3", sliding_window=8), "sliding_window=8: llama.cpp's phi3 architecture"),
        (dict(arch="llama", family="phi3", head_dim=8), "head_dim=8: llama.cpp's phi3 head size is n_embd / n_head"),
        (dict(arch="llama", rope_scaling=LONGROPE), "rope_scaling longrope: llama.cpp's llama architecture holds"),
        (  # llama.cpp's qwen3 and qwen2 load no rope_freqs: such a file was written, and failed to load
            dict(arch="llama", family="qwen3", qk_norm=True, rope_scaling=LLAMA3),
            "rope_scaling llama3: minigpt writes llama.cpp's qwen3 architecture with plain RoPE only",
        ),
        (
            dict(arch="llama", family="qwen2", qkv_bias=True, rope_scaling=LLAMA3),
            "rope_scaling llama3: minigpt writes llama.cpp's qwen2 architecture with plain RoPE only",
        ),
    ],
)
def test_the_gguf_export_asks_the_family_too(overrides, option, tmp_path):
    pytest.importorskip("gguf")
    from minigpt.core.config import GPTConfig
    from minigpt.core.errors import UserError
    from minigpt.core.model import GPT
    from minigpt.core.tokenizers import ByteTokenizer
    from minigpt.export.gguf import export_gguf

    model = GPT(GPTConfig(**{"n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 256, **overrides}))
    with pytest.raises(UserError) as e:
        export_gguf(model, ByteTokenizer(), tmp_path / "model.gguf")
    assert str(e.value).startswith(f"cannot export to GGUF: {option}") and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_sliding_window_model_exports_as_mistral_with_its_window_and_the_same_logits(tmp_path):
    """A window shorter than the context is Mistral's sliding_window in config.json: transformers computes our
    function past the window."""
    import torch
    import transformers

    from minigpt.core.config import GPTConfig
    from minigpt.core.model import GPT
    from minigpt.core.tokenizers import ByteTokenizer
    from minigpt.export.hf import export_hf

    torch.manual_seed(0)
    config = GPTConfig(
        arch="llama",
        family="mistral",
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        vocab_size=256,
        block_size=48,
        sliding_window=8,
    )
    model = GPT(config).eval()
    export_hf(model, ByteTokenizer(), tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(hf).__name__ == "MistralForCausalLM" and hf.config.sliding_window == 8
    idx = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx)[0], hf(idx).logits
        full = GPT(GPTConfig(**{**config.to_dict(), "sliding_window": None}))
        full.load_state_dict(model.state_dict())
        assert (full.eval()(idx)[0] - ours).abs().max() > 1e-3  # the window bites
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", [f for f in FAMILIES.values() if f.config_defaults], ids=lambda f: f.model_type)
def test_a_field_config_json_leaves_out_is_read_as_transformers_reads_it(family):
    """config_defaults are transformers' own defaults (a Qwen3 config without head_dim has heads of 128, not
    hidden/heads; Phi-3's eps is 1e-5, not Llama's 1e-6), and an import without those fields computes with them."""
    import transformers

    from minigpt.hf.load import config_from_hf

    hf_config = transformers.AutoConfig.for_model(family.model_type)
    assert family.config_defaults == {k: getattr(hf_config, k) for k in family.config_defaults}
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    left_out = {*family.config_defaults, "head_dim"}  # (the default config's head_dim: its own 4096 / 32)
    fields = {k: v for k, v in hf_config.to_dict().items() if k not in left_out} | small
    config = config_from_hf(fields | {"architectures": [family.hf_class], "intermediate_size": 128})
    assert config.block_size == family.config_defaults["max_position_embeddings"]
    assert config.norm_eps == hf_config.rms_norm_eps
    assert config.head_dim == family.config_defaults.get("head_dim", 64 // 4)
