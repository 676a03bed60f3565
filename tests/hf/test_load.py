"""Importing Hugging Face models: small random GPT-2, Llama and Mistral models written by transformers'
save_pretrained load through load_model and compute what transformers computes (logits on all three attention
paths, KV-cache decoding, greedy generation); every bad input is one line (the hub:
test_hub.py).  Offline: every model and vocabulary is built here."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]  # the repository root
from minigpt.core.config import GPTConfig
from minigpt.core.errors import CheckpointError
from minigpt.core.generation import generate
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.hf.tokenizer_files import save_hf_tokenizer
from minigpt.loading import load_model
from support import count_model_builds

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("minigpt.hf.load")
from hf_models import MODELS, SMALL, VOCAB, hf_logits, ids, our_logits, random_hf_model, save

# ------------------------------------------------------------------------------------------- same function


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("attention", ["sdpa", "manual", "einops"])
def test_imported_logits_equal_transformers(saved, name, attention):
    hf_model, path = saved[name]
    model, tokenizer = load_model(path, attention=attention)
    assert model.config.attention == attention and tokenizer.vocab_size == VOCAB
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    idx = ids()
    diff = (our_logits(model, idx) - hf_logits(hf_model, idx)).abs().max().item()
    assert diff < 1e-4, f"{name} / {attention}: max abs logit difference {diff}"


def test_imported_config_carries_the_source_options(saved):
    cfg = load_model(saved["gpt2"][1])[0].config
    assert (cfg.arch, cfg.gelu_approximate, cfg.bias, cfg.tie_embeddings, cfg.block_size) == (
        "gpt",
        "tanh",
        True,
        True,
        64,
    )
    cfg = load_model(saved["gpt2-exact-gelu-untied"][1])[0].config
    assert (cfg.gelu_approximate, cfg.mlp_hidden, cfg.norm_eps, cfg.tie_embeddings) == ("none", 80, 1e-3, False)
    cfg = load_model(saved["llama-head-dim-untied"][1])[0].config
    assert (cfg.arch, cfg.head_dim, cfg.n_embd, cfg.norm_eps, cfg.tie_embeddings) == ("llama", 24, 64, 1e-5, False)
    cfg = load_model(saved["llama3-rope-scaling"][1])[0].config
    assert (cfg.n_kv_head, cfg.rope_base, cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == (
        1,
        500000.0,
        "llama3",
        8.0,
    )


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-tied", "llama3-rope-scaling", "mistral"])
def test_tied_embeddings_stay_one_parameter(saved, name):
    model, _ = load_model(saved[name][1])
    if model.config.tie_embeddings:
        assert model.lm_head.weight is model.transformer.wte.weight
    # the model owns its weights: training writes into them in place
    model.lm_head.weight.data.add_(1.0)


@pytest.mark.parametrize("name", MODELS)
def test_kv_cache_decoding_equals_the_full_forward(saved, name):
    hf_model, path = saved[name]
    model, _ = load_model(path, attention="sdpa" if name != "mistral" else "manual")
    idx = ids(batch=2, T=30, seed=2)
    expected = hf_logits(hf_model, idx)
    cache = model.new_kv_cache(batch_size=2)
    with torch.no_grad():
        steps = [model(idx[:, :12], kv_cache=cache, input_pos=0)[0]]  # prefill, then one token at a time
        steps += [model(idx[:, t : t + 1], kv_cache=cache, input_pos=t)[0] for t in range(12, 30)]
    diff = (torch.cat(steps, dim=1) - expected).abs().max().item()
    assert diff < 1e-4, f"{name}: cached decoding differs by {diff}"


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_gives_the_same_ids_as_transformers(saved, name):
    hf_model, path = saved[name]
    model, _ = load_model(path)
    prompt = ids(batch=1, T=8, seed=3)
    with torch.no_grad():
        expected = hf_model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=20,
            min_new_tokens=20,
            pad_token_id=0,
        )
    for use_kv_cache in (True, False):
        out = generate(model, prompt, 20, temperature=0.0, use_kv_cache=use_kv_cache)
        assert out.tolist() == expected.tolist()


def test_a_shorter_block_size_crops_the_learned_positions(saved):
    hf_model, path = saved["gpt2"]
    model, _ = hf.load_hf_model(path, block_size=32)
    assert model.config.block_size == 32 and model.transformer.wpe.weight.shape == (32, 48)
    idx = ids(T=32)
    assert (our_logits(model, idx) - hf_logits(hf_model, idx)).abs().max() < 1e-4
    with pytest.raises(
        CheckpointError,
        match=r"block_size 128 is longer than the source's context of 64 tokens; "
        r"ask for at most 64",
    ):
        hf.load_hf_model(path, block_size=128)


@pytest.mark.parametrize(
    "name, block_size", [("gpt2", None), ("gpt2", 32), ("llama-gqa-tied", None), ("llama3-rope-scaling", 16)]
)
def test_an_import_builds_the_model_once_on_the_meta_device(saved, monkeypatch, name, block_size):
    """The size check's meta model gives the shapes the files are checked against (the source's, with a shorter
    block_size too) and is the one filled."""
    hf_model, path = saved[name]
    builds = count_model_builds(monkeypatch)
    model, _ = hf.load_hf_model(path, block_size=block_size)
    assert builds == ["meta"]
    idx = ids(T=block_size or 16)
    assert (our_logits(model, idx) - hf_logits(hf_model, idx)).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------- the commands


def test_eval_and_sample_take_a_model_directory(saved, tmp_path, capsys):
    from minigpt.cli import eval as eval_cli
    from minigpt.cli import sample as sample_cli

    hf_model, path = saved["llama3-rope-scaling"]
    text = tmp_path / "text.txt"
    text.write_text("A short text, scored by both.\n")
    nats, n = eval_cli.run(["--ckpt", str(path), "--text", str(text)])
    idx = torch.tensor([list(text.read_bytes())])
    with torch.no_grad():
        expected = hf_model(idx, labels=idx).loss.item()
    assert n == idx.size(1) - 1 and abs(nats / n - expected) < 1e-4
    assert "nats/token" in capsys.readouterr().out
    sample_cli.main(["--ckpt", str(path), "--prompt", "Hi", "--max_new_tokens", "5", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("Hi")


def test_train_init_from_a_llama3_directory(
    tiny_run_args, record_training_losses, saved, corpus, data_root, tmp_path, monkeypatch
):
    """Fine-tuning starts from the imported weights: the first loss is transformers' on that batch, and the run's
    model config keeps the source's head_dim, RoPE scaling and GQA."""
    from minigpt.cli.train import main

    hf_model, path = saved["llama3-rope-scaling"]
    args = tiny_run_args(
        corpus, data_root, tmp_path / "ft", steps=2, trainer__precision="32-true", model__block_size=32
    )
    args = [
        x
        for k, v in zip(args[::2], args[1::2])
        if not k.startswith("--model.") or k == "--model.block_size"
        for x in (k, v)
    ] + ["--init_from", str(path)]
    seen = record_training_losses(monkeypatch)
    trainer = main(args)
    cfg = trainer.lightning_module.config
    assert (cfg.arch, cfg.block_size, cfg.n_kv_head, cfg.rope_scaling["rope_type"]) == ("llama", 32, 1, "llama3")
    batch, first_loss = seen[0]
    with torch.no_grad():
        logits = hf_model(batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert abs(first_loss - expected) < 1e-4


# ------------------------------------------------------------------------------------------- file layouts


def test_sharded_safetensors_load(tmp_path):
    hf_model = random_hf_model(MODELS["llama-gqa-tied"]())
    save(hf_model, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    model, _ = load_model(tmp_path)
    idx = ids()
    assert (our_logits(model, idx) - hf_logits(hf_model, idx)).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["gpt2", "llama-head-dim-untied"])
def test_pytorch_model_bin_loads(tmp_path, name):
    """transformers 5 writes only safetensors; older models ship pytorch_model.bin (torch.save of the state dict)."""
    hf_model = random_hf_model(MODELS[name]())
    hf_model.config.save_pretrained(tmp_path)
    torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    save_hf_tokenizer(ByteTokenizer(), tmp_path)
    model, _ = load_model(tmp_path)
    idx = ids()
    assert (our_logits(model, idx) - hf_logits(hf_model, idx)).abs().max() < 1e-4


def test_the_hub_gpt2_file_layout_loads(saved, tmp_path):
    """openai-community/gpt2's model.safetensors holds GPT2Model's names (no "transformer." prefix, no lm_head) and
    old transformers' attention buffers (attn.bias, attn.masked_bias)."""
    from safetensors.torch import save_file

    hf_model, path = saved["gpt2"]
    weights = {
        k.removeprefix("transformer."): v.clone() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"
    }
    for i in range(hf_model.config.n_layer):
        weights[f"h.{i}.attn.bias"] = torch.ones(64, 64).tril().view(1, 1, 64, 64)
        weights[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    path = shutil.copytree(path, tmp_path / "gpt2")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_model(path)
    idx = ids()
    assert (our_logits(model, idx) - hf_logits(hf_model, idx)).abs().max() < 1e-4


def test_bfloat16_weights_are_imported_as_float32(tmp_path):
    save(random_hf_model(MODELS["llama-gqa-tied"]()).to(torch.bfloat16), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model, _ = load_model(tmp_path)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # the reference: transformers reading the same file in float32 (the bf16 model's RoPE buffer is bf16 too)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    idx = ids()
    assert (our_logits(model, idx) - hf_logits(hf_model, idx)).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------- tokenizers


def test_the_sources_tokenizer_json_gives_transformers_ids(tmp_path):
    """A byte-level BPE trained here, with Llama's habit of prepending <s> (its post-processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 20
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    vocab = backend.get_vocab_size()
    hf_model = random_hf_model(
        transformers.LlamaConfig(
            vocab_size=vocab + 4,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=1,
        )
    )  # a vocabulary padded past the tokenizer's
    hf_model.save_pretrained(tmp_path)
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )

    model, tokenizer = load_model(tmp_path)
    sample = "Before we proceed, speak: hear me! héllo ☃\n"
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path)(sample)["input_ids"]
    assert tokenizer.encode(sample) == expected and expected[0] == 0 and len(expected) < len(sample)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.eot_id) == (0, 1, 1)
    assert tokenizer.vocab_size == model.config.vocab_size == vocab + 4
    assert tokenizer.decode(expected[1:]) == sample


def test_config_json_special_ids_outside_the_vocabulary_are_ignored(tmp_path):
    """GPT2Config writes bos/eos 50256 whatever the vocabulary: with a 256-token tokenizer that id is nobody's EOS
    (train.py's data preparation would otherwise write it into the token files)."""
    config = transformers.GPT2Config(n_positions=16, n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB)
    assert config.eos_token_id == 50256
    _, tokenizer = load_model(save(random_hf_model(config), tmp_path))
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.eot_id) == (None, None, None)


def test_a_gpt2_source_without_tokenizer_files_uses_tiktoken_gpt2(tmp_path, monkeypatch):
    config = transformers.GPT2Config(n_positions=16, n_embd=16, n_layer=1, n_head=2)  # GPT-2's own 50257 tokens
    random_hf_model(config).save_pretrained(tmp_path)
    asked = []  # tiktoken's gpt2 files are a download: a stand-in answers for them
    monkeypatch.setattr("minigpt.hf.tokenizer_files.get_tokenizer", lambda name: asked.append(name) or ByteTokenizer())
    model, tokenizer = load_model(tmp_path)
    assert asked == ["gpt2"] and isinstance(tokenizer, ByteTokenizer) and model.config.vocab_size == 50257


# ------------------------------------------------------------------------------------------- bad input


def copy_model(saved, name, tmp_path):
    return shutil.copytree(saved[name][1], tmp_path / name)


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def one_line_error(source, **kwargs) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(source, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("architecture", ["LlavaForConditionalGeneration", "BertForMaskedLM"])
def test_an_unsupported_architecture_is_named(saved, tmp_path, architecture):
    path = copy_model(saved, "llama-gqa-tied", tmp_path)
    edit_config(path, architectures=[architecture])
    assert one_line_error(path) == (
        f"{path}: its architecture is {architecture}, which minigpt cannot import; it "
        "imports GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Phi3ForCausalLM"
    )


def test_a_missing_weight_file_is_named(saved, tmp_path):
    path = copy_model(saved, "gpt2", tmp_path)
    (path / "model.safetensors").unlink()
    assert one_line_error(path).startswith(
        f"{path} has no weight file (model.safetensors, its sharded index, or "
        "pytorch_model.bin); download the weights into it"
    )


def test_a_missing_shard_is_named(tmp_path):
    save(random_hf_model(MODELS["gpt2"]()), tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert f"lacks the weight shard {shard.name} that model.safetensors.index.json lists" in one_line_error(tmp_path)


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_a_truncated_weight_file_is_named(saved, tmp_path, weights):
    path = copy_model(saved, "gpt2", tmp_path)
    if weights == "pytorch_model.bin":
        (path / "model.safetensors").unlink()
        torch.save(saved["gpt2"][0].state_dict(), path / weights)
    file = path / weights
    os.truncate(file, file.stat().st_size // 2)
    message = one_line_error(path)
    assert message.startswith(f"{path}: cannot read {file}: it is truncated") and "download the model again" in message


def test_a_shape_that_disagrees_with_config_json_is_named(saved, tmp_path):
    """By the name and shape the file holds (GPT-2's Conv1D weights stored (in, out)), not by minigpt's fused and
    transposed tensors: the user looks for the broken tensor in the file."""
    from safetensors.torch import load_file, save_file

    path = copy_model(saved, "gpt2", tmp_path)
    edit_config(path, n_inner=100)
    assert one_line_error(path) == (
        f"{path}: tensor transformer.h.0.mlp.c_fc.weight has shape (48, 192) but "
        "config.json implies (48, 100); the weights do not match config.json"
    )
    path = copy_model(saved, "llama-gqa-tied", tmp_path)
    edit_config(path, num_key_value_heads=4)
    assert "do not match config.json" in one_line_error(path)
    path = copy_model(saved, "qwen2-gqa-tied", tmp_path)
    weights = load_file(path / "model.safetensors")
    bias = weights["model.layers.1.self_attn.q_proj.bias"]
    weights["model.layers.1.self_attn.q_proj.bias"] = bias[:10].clone()  # fused with k and v's biases on import
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert one_line_error(path) == (
        f"{path}: tensor model.layers.1.self_attn.q_proj.bias has shape (10,) but config.json implies "
        f"{tuple(bias.shape)}; the weights do not match config.json"
    )


@pytest.mark.parametrize("name,key", [("gpt2", "n_layer"), ("llama-gqa-tied", "num_hidden_layers")])
def test_a_config_with_fewer_layers_than_the_weights_is_refused(saved, tmp_path, name, key):
    """Not a model silently cut to config.json's layers (transformers warns of the unused tensors and loads)."""
    path = copy_model(saved, name, tmp_path)
    edit_config(path, **{key: 1})
    message = one_line_error(path)
    assert "the weights have a tensor of layer 1 (" in message and "but config.json has 1 layer;" in message


def test_a_missing_tensor_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_model(saved, "llama-head-dim-untied", tmp_path)
    weights = load_file(path / "model.safetensors")
    del weights["lm_head.weight"]  # untied: the head is its own tensor
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert "the weights have no tensor for lm_head.weight" in one_line_error(path)


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            dict(scale_attn_by_inverse_layer_idx=True),
            "sets scale_attn_by_inverse_layer_idx=True, which minigpt's GPT-2 block does not compute",
        ),
        (dict(activation_function="relu"), "its activation_function is 'relu'"),
    ],
)
def test_gpt2_variants_our_block_cannot_compute_are_refused(saved, tmp_path, changes, message):
    path = copy_model(saved, "gpt2", tmp_path)
    edit_config(path, **changes)
    assert message in one_line_error(path)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0)), "its RoPE scaling is 'yarn'"),
        (dict(attention_bias=True), "its config.json sets attention_bias=true"),
        (dict(hidden_act="gelu"), "its hidden_act is 'gelu'"),
        (dict(num_hidden_layers=10**6), "n_layer=1000000, over the plausible limit"),
    ],
)
def test_llama_variants_minigpt_cannot_compute_are_refused(saved, tmp_path, changes, message):
    path = copy_model(saved, "llama-gqa-tied", tmp_path)
    edit_config(path, **changes)
    assert message in one_line_error(path)


def test_a_mistral_model_imports_its_whole_context_and_its_window(tmp_path):
    """The window is GPTConfig.sliding_window and the context stays the source's: past the window, every attention
    path gives transformers' logits, and greedy decoding its ids (through the ring KV cache and without a cache)."""
    hf_model = random_hf_model(
        transformers.MistralConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=12,
            **SMALL,
        )
    )
    path = save(hf_model, tmp_path)
    idx = ids(T=64)  # five windows long
    expected = hf_logits(hf_model, idx)
    for attention in ("sdpa", "manual", "einops"):
        model, _ = load_model(path, attention=attention)
        assert (model.config.block_size, model.config.sliding_window) == (64, 12)
        torch.testing.assert_close(our_logits(model, idx), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    full = type(model).from_weights(GPTConfig(**{**model.config.to_dict(), "sliding_window": None}), model.state_dict())
    assert (our_logits(full.eval(), idx) - expected).abs().max() > 1e-2  # the window bites
    prompt = ids(batch=1, T=8, seed=3)
    with torch.no_grad():  # 8 + 32 positions: past the window in both libraries' caches
        want = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32, min_new_tokens=32
        )
    assert len(set(want[0, 8:].tolist())) > 4
    for use_kv_cache in (True, False):
        assert generate(model, prompt, 32, temperature=0.0, use_kv_cache=use_kv_cache).tolist() == want.tolist()


def test_a_mistral_config_keeps_its_context_and_reads_its_window_as_transformers_does():
    config = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "vocab_size": 100,
    }
    read = hf.config_from_hf(config)
    assert (read.block_size, read.sliding_window) == (32768, 4096)
    assert hf.config_from_hf({**config, "sliding_window": None}).sliding_window is None  # v0.2, v0.3: no window
    absent = {k: v for k, v in config.items() if k != "sliding_window"}
    assert hf.config_from_hf(absent).sliding_window == transformers.MistralConfig().sliding_window == 4096
    assert hf.config_from_hf(config, block_size=8192).block_size == 8192  # past the window: it slides, as the source
    with pytest.raises(CheckpointError, match="block_size 65536 is longer than the source's context of 32768 tokens"):
        hf.config_from_hf(config, block_size=65536)


# ------------------------------------------------------------------------------------------- real shapes

REAL_CONFIGS = {  # the config.json of published models (abridged to what shapes the network), no weights needed
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_ctx": 1024,
        "n_embd": 768,
        "n_head": 12,
        "n_layer": 12,
        "n_positions": 1024,
        "vocab_size": 50257,
        "layer_norm_epsilon": 1e-05,
    },
    "distilgpt2": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_embd": 768,
        "n_head": 12,
        "n_layer": 6,
        "n_positions": 1024,
        "vocab_size": 50257,
    },
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "vocab_size": 128256,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    },
    "TinyLlama-1.1B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
        "hidden_act": "silu",
    },
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
        "hidden_act": "silu",
    },
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
        "hidden_act": "silu",
    },
}


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_published_configs_give_transformers_tensor_shapes(name):
    """Our model for each config.json, renamed to HF names, has exactly the tensors transformers builds from it
    (both on the meta device: nothing allocated)."""
    from minigpt.core.model import GPT
    from minigpt.hf.weights import to_hf_state_dict

    config = hf.config_from_hf(REAL_CONFIGS[name])
    hf_config = transformers.AutoConfig.for_model(**REAL_CONFIGS[name])
    with torch.device("meta"):
        ours = to_hf_state_dict(GPT(config).state_dict(), config)
        theirs = getattr(transformers, REAL_CONFIGS[name]["architectures"][0])(hf_config).state_dict()
    if config.tie_embeddings:
        theirs.pop("lm_head.weight", None)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    if name == "gpt2":
        assert sum(v.numel() for v in ours.values()) == 124_439_808


def test_a_transformers_4_llama3_config_gives_transformers_rope_frequencies():
    """Llama 3.2's config.json as published (rope_theta and rope_scaling at the top, as transformers 4 wrote them):
    our RoPE angles equal those of transformers' rotary embedding for it, at positions up to 131k."""
    from minigpt.core.model import rope_cache

    config = hf.config_from_hf(REAL_CONFIGS["Llama-3.2-1B"])
    assert (config.rope_base, config.block_size, config.head_dim) == (500000.0, 131072, 64)
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        transformers.AutoConfig.for_model(**REAL_CONFIGS["Llama-3.2-1B"])
    )
    positions = torch.tensor([[0, 1, 7, 1000, 8191, 65536, 131071]])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    our_cos, our_sin = rope_cache(131072, 64, config.rope_base, config.rope_scaling)
    assert torch.allclose(our_cos[positions[0]], cos[0], atol=1e-4)
    assert torch.allclose(our_sin[positions[0]], sin[0], atol=1e-4)
