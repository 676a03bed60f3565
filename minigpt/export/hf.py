"""Export a minigpt model as a Hugging Face model directory that plain `transformers` loads, no minigpt code:

    export_hf(model, tokenizer, "gpt2-export")
    # then, anywhere:  AutoModelForCausalLM.from_pretrained("gpt2-export"), AutoTokenizer.from_pretrained(...)

The model's family (minigpt.hf.families: GPTConfig.family, unset = GPT-2 for the `gpt` block, Llama for the `llama`
block) says the class, its config.json keys and tensor names. The directory holds what `save_pretrained` writes:
config.json, model.safetensors, generation_config.json, and the tokenizer (tokenizer.json, tokenizer_config.json,
special_tokens_map.json; see minigpt.hf.tokenizer_files), and minigpt_export.json, the manifest that lets
`--overwrite` replace it (minigpt.export.folder).

A model option the target class cannot express (qk_norm, relu2, ...) is refused before anything is written.
The directory is written whole or not at all: into a hidden sibling folder, then renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError
from minigpt.core.fsutil import remove_stale, temp_sibling, write_json
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer
from minigpt.export.folder import (
    MANIFEST,
    FolderState,
    check_out_path,
    check_previous_export,
    folder_state,
    install_export,
    restore_interrupted,
    seal_export,
    storage_errors,
)
from minigpt.hf.families import family_of
from minigpt.hf.tokenizer_files import save_hf_tokenizer
from minigpt.hf.weights import to_hf_state_dict

__all__ = ["EXPORT_FILES", "check_exportable", "export_hf", "hf_config"]

# everything an export writes; --overwrite trusts the manifest's sizes and hashes, never these names
EXPORT_FILES = {
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    MANIFEST,
}


# ------------------------------------------------------------------------------------------------- what HF can hold


def unsupported_options(config: GPTConfig) -> list[str]:
    """Each option of `config` that its family's HF class cannot express, as "option: why; fix"."""
    family = family_of(config)
    return [*family.block_problems(config), *family.export_problems(config)]


def check_exportable(config: GPTConfig) -> None:
    """Raise UserError naming the first option the target HF class cannot express (before anything is written)."""
    problems = unsupported_options(config)
    if problems:
        raise UserError(f"cannot export to Hugging Face: {problems[0]}")


# ------------------------------------------------------------------------------------------------- config.json


def hf_config(config: GPTConfig, tokenizer: Tokenizer | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of config's family's HF class, as save_pretrained writes it: the keys every class shares, then
    the family's own."""
    bos, eos = special_ids(tokenizer)
    family = family_of(config)
    common = {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "tie_word_embeddings": config.tie_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    common["torch_dtype"] = common["dtype"]  # the key transformers 4, vLLM and llama.cpp's converter read
    return {**common, **family.hf_config(config)}


def special_ids(tokenizer: Tokenizer | None) -> tuple[int | None, int | None]:
    """(BOS id, EOS id): a Hugging Face tokenizer's own; for tiktoken BPE, end-of-text is both (GPT-2's way)."""
    if tokenizer is None:
        return None, None
    eos = getattr(tokenizer, "eos_id", tokenizer.eot_id)
    return getattr(tokenizer, "bos_id", eos), eos


def generation_config(config: GPTConfig, tokenizer: Tokenizer | None) -> dict:
    """generation_config.json: greedy by default (transformers' default), stopping at EOS.  No max_length: the
    context is config.json's, and a max_length here makes transformers warn at every generate(max_new_tokens=...)
    that both are set."""
    bos, eos = special_ids(tokenizer)
    # a chat model stops at its end of turn, and where its base ends a text otherwise (Gemma 3 IT: <end_of_turn>
    # and <eos>), as the source's own generation_config.json lists both
    # and at every other end a source folder lists (Llama 3 Instruct's <|end_of_text|>, Phi-3's <|assistant|>)
    base = tokenizer.base if isinstance(tokenizer, ChatTokenizer) else tokenizer
    ends = [special_ids(base)[1], *base.end_ids] if base is not None else []
    ends = list(dict.fromkeys(i for i in ends if i is not None and i != eos))
    if eos is not None and ends:
        eos = [eos, *ends]
    return {k: v for k, v in {"bos_token_id": bos, "eos_token_id": eos}.items() if v is not None}


# ------------------------------------------------------------------------------------------------- weights


def hf_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """The HF-named tensors of `model`, on the CPU, each owning its memory (safetensors refuses shared storage)."""
    config = model.config
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if family_of(config).all_biases and not config.bias:  # the class always has biases: zeros compute the same
        state |= zero_biases(model)
    tensors = to_hf_state_dict(state, config)
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        # a view (a q/k/v split of one matrix) or a storage seen before is copied into its own
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def zero_biases(model: GPT) -> dict[str, torch.Tensor]:
    """The bias tensors a bias-free gpt model would have, as zeros (for GPT-2's always-present biases)."""
    state = model.state_dict()
    biases = {}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is None and name != "lm_head":
            weight = state[f"{name}.weight"]
            biases[f"{name}.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return biases


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})  # "pt": transformers reads the file as torch's


# ------------------------------------------------------------------------------------------------- the directory


def check_out_dir(out_dir: str | Path, overwrite: bool, checked: FolderState | None = None) -> FolderState:
    """An empty or missing folder is fine; with overwrite, a previous export proven by its manifest; else never.

    Returns the folder's state as approved: export_hf replaces the folder only in that state, and a call given the
    state an earlier call returned (`checked`: the command line checks before loading the model) does not read the
    files again when nothing changed since.
    """
    out_dir = Path(out_dir)
    check_out_path(out_dir)
    restore_interrupted(out_dir)  # an export killed between its renames: its old folder goes back first
    try:
        state = folder_state(out_dir)
        if not state:
            return frozenset()
        if not overwrite:
            present = sorted(name for name, *_ in state)
            raise UserError(
                f"{out_dir} already holds files ({', '.join(present[:3])}"
                f"{', ...' if len(present) > 3 else ''}); choose another output folder, or pass "
                "--overwrite to replace a previous export"
            )
        if state != checked:
            check_previous_export(out_dir)  # overwrite deletes the folder: only ever an export, unchanged
    except OSError as e:  # a folder or file we may not read
        raise UserError(f"cannot read {e.filename or out_dir} ({e.strerror}); choose another output folder") from None
    return state


def export_hf(
    model: GPT,
    tokenizer: Tokenizer | None,
    out_dir: str | Path,
    overwrite: bool = False,
    checked: FolderState | None = None,
) -> Path:
    """Write `model` (and `tokenizer`) as a Hugging Face model directory; returns its path.

    Refuses, before writing anything, an option the HF class cannot express and an `out_dir` that already holds
    files (unless overwrite, and then only an unchanged previous export; `checked`: see check_out_dir). The folder
    appears whole or not at all; with overwrite, the old one is replaced only once the new one is complete. A full
    disk, Ctrl-C or any failure leaves the old folder as it was and no temporary folder.
    """
    out_dir = Path(out_dir).resolve()  # ".." or a symlink: the temporary sibling must sit beside the real folder
    check_exportable(model.config)
    approved = check_out_dir(out_dir, overwrite, checked)
    tensors = hf_tensors(model)  # before any file: a failure here leaves nothing behind
    write_folder(out_dir, approved, lambda tmp: write_files(tmp, model.config, tokenizer, tensors))
    return out_dir


def write_folder(out_dir: Path, approved: FolderState, write: Callable[[Path], None]) -> None:
    """write(folder) into a hidden sibling of out_dir, then rename it into place (minigpt.export.folder): the folder
    appears whole or not at all, and a full disk, Ctrl-C or any failure leaves the old one and no temporary folder."""
    created = [p for p in out_dir.parents if not p.exists()]  # removed again if the export fails
    tmp = temp_sibling(out_dir)
    with storage_errors(out_dir):
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(out_dir.parent)
            tmp.mkdir()
            write(tmp)
            install_export(tmp, out_dir, approved)
        except BaseException:  # Ctrl-C included: leave no half export, and never lose the old one
            restore_interrupted(out_dir, pid=os.getpid())  # stopped between install_export's two renames
            shutil.rmtree(tmp, ignore_errors=True)
            for parent in created:  # deepest first; only if still empty
                with contextlib.suppress(OSError):
                    parent.rmdir()
            raise


def write_files(folder: Path, config: GPTConfig, tokenizer: Tokenizer | None, tensors: dict[str, torch.Tensor]) -> None:
    """Every file of the export into `folder`, flushed to disk, and last the manifest listing them."""
    dtype = next(iter(tensors.values())).dtype
    write_json(folder / "config.json", hf_config(config, tokenizer, dtype))
    write_json(folder / "generation_config.json", generation_config(config, tokenizer))
    save_safetensors(tensors, folder / "model.safetensors")
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, folder)
    seal_export(folder)
