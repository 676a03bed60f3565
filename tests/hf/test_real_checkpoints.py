"""One small published checkpoint per family, imported through hf:ORG/NAME from the local huggingface_hub cache and
compared with transformers' model and tokenizer of the same snapshot, and llama.cpp's reading of its GGUF export.
Slow, and skipped unless `hf download ORG/NAME` has put the model in the cache: tests never download (HF_HUB_OFFLINE).
test_the_comparison_runs_on_a_fake_cache_entry runs the same comparison on a random model put in a cache here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.generation import generate
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.hf.chat_files import read_chat_template
from minigpt.hf.tokenizer_files import save_hf_tokenizer
from minigpt.loading import load_model

transformers = pytest.importorskip("transformers")
from hf_models import MODELS, random_hf_model
from test_family_suite import helper
from test_hub import fill_hub_cache

PROMPT = "The Eiffel Tower was completed in 1889 for the World's Fair in Paris, and at the time it was"
TEXTS = [PROMPT, "def add(a, b):\n    return a + b  # café, naïve ☃", "  two  spaces\tand 1234567 digits\n\n"]
CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}  # of the logits' largest magnitude
PHI = "microsoft/Phi-4-mini-instruct"  # 3.8B parameters: 15 GiB a copy in float32
# Mistral is left out: its smallest published model (Mistral-7B) is 29 GiB a copy in float32
CHECKPOINTS = [
    "openai-community/gpt2",
    "HuggingFaceTB/SmolLM2-135M",
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen3-0.6B",
    "google/gemma-3-270m",
    pytest.param(PHI, marks=pytest.mark.large),
]


def cached_snapshot(repo_id: str) -> Path | None:
    """The snapshot folder `hf download REPO_ID` left in the cache (config and safetensors there), asking no server."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json")
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    return folder if any(folder.glob("model*.safetensors*")) else None


def available_gib() -> float:
    """MemAvailable from /proc/meminfo (0 where there is none: then the large model runs in bfloat16)."""
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0.0
    return int(line.split()[1]) / 2**20


def compare_with_transformers(repo_id: str, folder: Path, dtype: torch.dtype, gguf_dir: Path) -> None:
    """hf:REPO_ID through minigpt against transformers' model and tokenizer from `folder`: logits on PROMPT within
    RELATIVE_TOLERANCE, greedy ids for 16 tokens, the tokenizer's ids on TEXTS and the chat template's, and
    llama.cpp's tokenization of the GGUF export."""
    model, tokenizer = load_model(f"hf:{repo_id}")
    model = model.to(dtype).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    fast = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert tokenizer.encode(text) == fast(text)["input_ids"], text
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        theirs, ours = hf(prompt).logits.float(), model(prompt)[0].float()
        scale = theirs.abs().max().item()
        torch.testing.assert_close(ours, theirs, atol=RELATIVE_TOLERANCE[dtype] * scale, rtol=0)
        expected = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16, min_new_tokens=16
        )  # greedy, with none of the snapshot's generation_config penalties
        assert generate(model, prompt, 16, temperature=0.0).tolist() == expected.tolist()
    del hf  # Phi-4-mini's export below needs the memory
    template = read_chat_template(folder)
    assert (template is None) == (fast.chat_template is None)
    if template is not None:
        chat = ChatTokenizer.for_base(tokenizer, template)
        ours_chat = chat.encode_chat(CONVERSATION, add_generation_prompt=True)[0]
        rendered = fast.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
        assert ours_chat == fast(rendered, add_special_tokens=False)["input_ids"]
    pytest.importorskip("gguf")
    pytest.importorskip("xllamacpp")
    from minigpt.export.gguf import export_gguf

    export_gguf(model.float(), tokenizer, gguf_dir / "model.gguf", gguf_type="f16", chat_template=template)
    with helper("llamacpp_server").LlamaCpp(gguf_dir / "model.gguf", n_ctx=256) as llama:
        for text in TEXTS + ([rendered] if template is not None else []):
            assert llama.tokenize(text, add_special=True) == fast(text)["input_ids"], text


@pytest.mark.slow
@pytest.mark.parametrize("repo_id", CHECKPOINTS)
def test_a_published_checkpoint_computes_and_tokenizes_as_transformers(repo_id, monkeypatch, tmp_path):
    from huggingface_hub import constants

    folder = cached_snapshot(repo_id)
    if folder is None:
        pytest.skip(f"{repo_id} is not in the Hugging Face cache: `hf download {repo_id}` enables this test")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # never a download, whatever the environment says
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dtype = torch.float32 if repo_id != PHI or available_gib() > 36 else torch.bfloat16  # two copies, and a margin
    compare_with_transformers(repo_id, folder, dtype, tmp_path)


def test_the_comparison_runs_on_a_fake_cache_entry(hub_cache, tmp_path):
    """A random Qwen3 with a ChatML byte tokenizer, put in a cache as `hf download` would: the slow test's finding
    of the snapshot and its comparison pass, and fail against a snapshot of other weights."""
    chat = ChatTokenizer.for_base(ByteTokenizer())  # <|im_start|> and <|im_end|> added to the 256 bytes
    config = MODELS["qwen3-gqa-tied-head-dim"]()
    config.max_position_embeddings, config.vocab_size = 128, chat.vocab_size  # PROMPT is 92 bytes, then 16 more
    folder = tmp_path / "model"
    random_hf_model(config).save_pretrained(folder)
    save_hf_tokenizer(chat, folder)
    fill_hub_cache(hub_cache, "someorg/fake-qwen3", folder)
    assert cached_snapshot("someorg/absent") is None
    snapshot = cached_snapshot("someorg/fake-qwen3")
    assert snapshot is not None and snapshot.is_relative_to(hub_cache) and read_chat_template(snapshot) is not None
    (tmp_path / "gguf").mkdir()
    compare_with_transformers("someorg/fake-qwen3", snapshot, torch.float32, tmp_path / "gguf")
    other = tmp_path / "other"
    random_hf_model(config, seed=1).save_pretrained(other)
    save_hf_tokenizer(chat, other)
    with pytest.raises(AssertionError):
        compare_with_transformers("someorg/fake-qwen3", other, torch.float32, tmp_path / "gguf")
