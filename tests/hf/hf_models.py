"""Small random GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 3 and Phi-3 models written by transformers'
save_pretrained, and their logits: what test_load.py, test_hub.py, test_qwen.py, test_gemma.py and test_phi3.py share
(importable by name from tests/hf; the `saved` fixture is in conftest.py)."""

import pytest
import torch

from minigpt.core.tokenizers import ByteTokenizer
from minigpt.hf.tokenizer_files import save_hf_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 256  # the byte tokenizer's: every model here gets a tokenizer.json of ours
ROPE_LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)  # a short original context, so the scaling bites in 64
ROPE_LONGROPE = dict(  # 4 factors: one per rotated pair of a 16-dim head at partial_rotary_factor 0.5
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.4, 2.3, 3.1], long_factor=[2.0, 3.0, 5.0, 9.0]
)
SMALL = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MODELS = {
    "gpt2": lambda: transformers.GPT2Config(n_positions=64, n_embd=48, n_layer=2, n_head=4, **SMALL),
    "gpt2-exact-gelu-untied": lambda: transformers.GPT2Config(
        n_positions=64,
        n_embd=48,
        n_layer=2,
        n_head=3,
        n_inner=80,
        activation_function="gelu",
        layer_norm_epsilon=1e-3,
        tie_word_embeddings=False,
        reorder_and_upcast_attn=True,
        **SMALL,
    ),
    "llama-gqa-tied": lambda: transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        **SMALL,
    ),
    "llama-head-dim-untied": lambda: transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=24,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **SMALL,
    ),
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_theta=500000.0,
        rope_scaling=dict(ROPE_LLAMA3),  # a copy: the config class writes rope_theta into it
        tie_word_embeddings=True,
        **SMALL,
    ),
    "mistral": lambda: transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=64,
        **SMALL,
    ),
    # Qwen2: q/k/v biases (drawn like every weight), rope_theta 1e6, tied or untied, GQA ratios 2, 4 (MQA) and 1
    "qwen2-gqa-tied": lambda: transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        **SMALL,
    ),
    "qwen2-mqa-untied": lambda: transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **SMALL,
    ),
    "qwen2-mha-untied": lambda: transformers.Qwen2Config(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=3,
        max_position_embeddings=64,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        **SMALL,
    ),
    # Qwen3: q/k norms (their gains drawn too), head_dim other than hidden_size / heads, no biases
    "qwen3-gqa-tied-head-dim": lambda: transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        **SMALL,
    ),
    "qwen3-mqa-untied": lambda: transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **SMALL,
    ),
    "qwen3-mha-untied": lambda: transformers.Qwen3Config(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=16,
        max_position_embeddings=64,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        **SMALL,
    ),
    # Gemma 3: scaled embeddings, GeGLU, four norms a block (1 + w), q/k norms; sliding layers (a window shorter than
    # the tests' 40 tokens) mixed with full ones, their own RoPE base, query_pre_attn_scalar != head_dim
    "gemma3-gqa-tied-window": lambda: transformers.Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        query_pre_attn_scalar=20,
        max_position_embeddings=64,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
        tie_word_embeddings=True,
        **SMALL,
    ),
    # Gemma 3 1B's shape of config: sliding_window_pattern 6 (every 6th layer full), local base 10000, MQA, untied
    "gemma3-mqa-untied-pattern": lambda: transformers.Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=96,
        sliding_window=12,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **SMALL,
    ),
    "gemma3-mha-exact-gelu": lambda: transformers.Gemma3TextConfig(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=32,
        query_pre_attn_scalar=32,
        hidden_activation="gelu",
        max_position_embeddings=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
        **SMALL,
    ),
    # Gemma 3 4B-27B's RoPE: linear scaling (factor 8) on the full layers, the sliding ones at their local base unscaled
    "gemma3-linear-rope": lambda: transformers.Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=64,
        sliding_window=10,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
        **SMALL,
    ),
    # Gemma 3 4B-27B as published: Gemma3ForConditionalGeneration, its text model in text_config (a config.json
    # older than transformers 5: rope_scaling linear, rope_local_base_freq), a tiny SigLIP vision tower beside it
    "gemma3-multimodal-linear": lambda: transformers.Gemma3Config(
        text_config=dict(
            hidden_size=64,
            intermediate_size=80,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=24,
            max_position_embeddings=64,
            sliding_window=12,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            **SMALL,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
    ),
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj; partial rotary 0.75 (Phi-4-mini's) and 0.5; an explicit
    # head_dim; a sliding window shorter than the test's 40 tokens; LongRoPE within its original context (short
    # factors that bite, and the attention factor transformers derives from max_position_embeddings /
    # original_max_position_embeddings)
    "phi3-gqa-tied-partial": lambda: transformers.Phi3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        partial_rotary_factor=0.75,
        tie_word_embeddings=True,
        **SMALL,
    ),
    "phi3-mha-untied-window": lambda: transformers.Phi3Config(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=24,
        max_position_embeddings=64,
        sliding_window=16,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **SMALL,
    ),
    "phi3-mqa-longrope": lambda: transformers.Phi3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters=dict(ROPE_LONGROPE),
        partial_rotary_factor=0.5,
        tie_word_embeddings=False,
        **SMALL,
    ),
}
CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
}


def random_hf_model(config, seed: int = 0):
    """An HF model with EVERY weight drawn at std 0.5 (norm gains and biases too), so that a swapped, untransposed
    or missing tensor changes the logits by far more than the tolerance."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = getattr(transformers, CLASSES[config.model_type])(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def save(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    save_hf_tokenizer(ByteTokenizer(), path)
    return path


def ids(batch=2, T=40, seed=1):
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def our_logits(model, idx):
    with torch.no_grad():
        return model(idx)[0]
