"""Export a minigpt model as one GGUF file that llama.cpp (and Ollama, LM Studio, llamafile) runs, no minigpt code:

    export_gguf(model, tokenizer, "model.gguf", gguf_type="q8_0")
    # then, anywhere:  llama-cli -m model.gguf -p "Once upon a time"

The file is written with gguf-py (llama.cpp's own writer) in the layout llama.cpp's convert_hf_to_gguf.py gives
the same model exported to Hugging Face: the model's family (minigpt.hf.families) names llama.cpp's architecture and
lays out its tensors (GPT-2's fused attn_qkv with every bias; Llama's split q/k/v with q and k rows permuted to
llama.cpp's interleaved rotary pairs, Llama 3 RoPE scaling as the rope_freqs factors; ...).  A tied head is
the token embedding (no output tensor).  The tokenizer goes in the file (minigpt.export.gguf_vocab).

Weight types: f32, f16, bf16, q8_0 and q4_0 for the matrices; norms, biases, positions and RoPE factors stay f32
(as convert_hf_to_gguf keeps them).  A matrix whose rows are not a multiple of the 32-value block stays f16, and
the export counts them; with q4_0 the output matrix (the tied embedding) is q8_0, as llama.cpp's own q4_0 keeps
the output in a finer type.  What llama.cpp cannot express is refused before anything is written; the file
appears whole or not at all and --overwrite replaces only an unchanged export (minigpt.export.gguf_file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError
from minigpt.core.generation import generate, prompt_ids
from minigpt.core.model import GPT
from minigpt.core.tokenizers import CharTokenizer, Tokenizer
from minigpt.export.gguf_file import SHA_KEY, FileState, check_out_file, write_gguf_file
from minigpt.export.gguf_vocab import GGUFVocab, gguf_name, gguf_vocab
from minigpt.export.hf import zero_biases
from minigpt.hf.families import family_of

__all__ = ["GGUFType", "GGUF_TYPES", "GGUFExport", "check_gguf_exportable", "export_gguf", "gguf_tensors"]

GGUFType = Literal["f32", "f16", "bf16", "q8_0", "q4_0"]
GGUF_TYPES: tuple[str, ...] = get_args(GGUFType)
BLOCK = 32  # values per q8_0 / q4_0 block: a quantized row is a whole number of blocks
NFC_NOTE = (
    "the tokenizer NFC-normalises text first and llama.cpp does not: "
    "text already in NFC, nearly all text, gets the same ids; decomposed accents may not"
)


def gguf_lib():
    """gguf-py, imported on first use (only the GGUF export needs it)."""
    try:
        import gguf
    except ImportError:
        raise UserError(
            "the GGUF export needs the `gguf` package (llama.cpp's writer); install it with "
            "`python3 -m pip install gguf`"
        ) from None
    return gguf


# ------------------------------------------------------------------------------------------- what llama.cpp can hold


def unsupported_options(config: GPTConfig) -> list[str]:
    """Each option of `config` that its family's llama.cpp architecture cannot express, as "option: why; fix"."""
    family = family_of(config)
    target = family.gguf_target
    return [
        *family.block_problems(config),
        *family.gguf_position_problems(config),
        *family.variant_problems(config, target),
        *family.gguf_problems(config),
    ]


@dataclass
class Checked:
    """What check_gguf_exportable found: the vocabulary to write and notes for the user."""

    vocab: GGUFVocab
    notes: list[str] = field(default_factory=list)


def check_gguf_exportable(model: GPT, tokenizer: Tokenizer | None, chat_template: str | None = None) -> Checked:
    """UserError naming the first thing llama.cpp cannot express (model option or tokenizer), before any writing."""
    config = model.config
    problems = unsupported_options(config)
    if problems:
        raise UserError(f"cannot export to GGUF: {problems[0]}")
    char_eos = least_likely_char(model, tokenizer) if isinstance(tokenizer, CharTokenizer) else None
    vocab = gguf_vocab(tokenizer, config.vocab_size, chat_template, char_eos)
    notes = family_of(config).gguf_notes(config) + ([NFC_NOTE] if vocab.nfc else [])
    if char_eos is not None:
        notes.append(
            f"a char vocabulary has no end-of-text token and llama.cpp needs one: it is "
            f"{tokenizer.chars[char_eos]!r}, the character this model is least likely to write, so "
            "llama.cpp writes on as minigpt's sampler does and stops where the model writes it"
        )
    return Checked(vocab, notes)


@torch.no_grad()
def least_likely_char(model: GPT, tokenizer: CharTokenizer, length: int = 64) -> int:
    """The stand-in end-of-sequence token of a char vocabulary: of the characters that are no letter, digit or
    space where there are any (a stop on 'I' would cut JULIET short), the one whose highest probability over
    `length` positions of the model's own greedy text from a newline (as minigpt's sampler starts) is lowest."""
    was_training = model.training
    model.eval()
    try:
        ids = generate(
            model,
            torch.tensor([prompt_ids(tokenizer, "")], device=model.lm_head.weight.device),
            max_new_tokens=min(length, model.config.block_size - 1),
            temperature=0,
            vocab_size=tokenizer.vocab_size,
        )
        peak = model(ids)[0][0, :, : tokenizer.vocab_size].float().softmax(-1).amax(0)  # (vocab,)
    finally:
        model.train(was_training)
    word_chars = torch.tensor([c.isalnum() or c.isspace() for c in tokenizer.chars], device=peak.device)
    return int((peak + word_chars).argmin())  # probabilities are at most 1: any symbol ranks before a letter


# ------------------------------------------------------------------------------------------------- tensors


def named_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """llama.cpp's tensor names -> float32 CPU tensors, in the layout of the model's family's architecture."""
    config, family = model.config, family_of(model.config)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    if family.all_biases and not config.bias:  # an architecture that needs every bias: zeros compute the same
        state |= {k: v.float() for k, v in zero_biases(model).items()}
    return family.gguf_tensors(state, config)


def gguf_tensors(model: GPT, gguf_type: GGUFType) -> tuple[list[tuple[str, np.ndarray, object]], int, int]:
    """[(name, data, ggml type)] as the file stores them, how many matrices stayed f16 (rows not a multiple of the
    quantization block), and the parameters they hold."""
    gguf = gguf_lib()
    Q = gguf.GGMLQuantizationType
    wanted = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[gguf_type]
    tensors = named_tensors(model)
    output = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    out, kept = [], 0
    n_params = sum(t.numel() for name, t in tensors.items() if name != "rope_freqs.weight")  # factors, not weights
    for name, t in tensors.items():
        data = t.contiguous().numpy()
        qtype = wanted
        if data.ndim == 1 or name == "position_embd.weight":  # as convert_hf_to_gguf: always f32
            qtype = Q.F32
        elif qtype == Q.Q4_0 and name == output:
            qtype = Q.Q8_0
        if qtype in (Q.Q8_0, Q.Q4_0) and data.shape[-1] % BLOCK:
            qtype, kept = Q.F16, kept + 1
        out.append((name, gguf.quants.quantize(data, qtype), qtype))
    return out, kept, n_params


# ------------------------------------------------------------------------------------------------- the file


@dataclass
class GGUFExport:
    """What export_gguf wrote."""

    path: Path
    arch: str
    gguf_type: str
    n_params: int
    kept_f16: int
    vocab: GGUFVocab
    notes: list[str]


def write_metadata(writer, config: GPTConfig, gguf_type: GGUFType, name: str) -> None:
    gguf = gguf_lib()
    writer.add_string(SHA_KEY, "0" * 64)  # second key, after general.architecture: filled in by gguf_file.seal
    writer.add_name(name)
    writer.add_file_type(
        {
            "f32": gguf.LlamaFileType.ALL_F32,
            "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
            "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        }[gguf_type]
    )
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.mlp_hidden)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_kv_head)
    writer.add_vocab_size(config.vocab_size)
    family_of(config).gguf_metadata(writer, config)


def export_gguf(
    model: GPT,
    tokenizer: Tokenizer | None,
    out: str | Path,
    gguf_type: GGUFType = "f32",
    overwrite: bool = False,
    checked: FileState = None,
    chat_template: str | None = None,
    name: str | None = None,
) -> GGUFExport:
    """Write `model` and its tokenizer as one GGUF file at `out` (see the module docstring).

    Refuses, before writing anything, what llama.cpp cannot express and an `out` that exists (unless overwrite,
    and then only an unchanged previous export; `checked`: check_out_file's answer from before the model loaded).
    `chat_template` overrides the tokenizer's own (an imported model's folder template).
    """
    out = Path(out)
    config = model.config
    found = check_gguf_exportable(model, tokenizer, chat_template)
    approved = check_out_file(out, overwrite, checked)
    tensors, kept, n_params = gguf_tensors(model, gguf_type)  # before any file: a failure here leaves nothing behind
    gguf = gguf_lib()
    name, renamed = gguf_name(name or "minigpt", found.vocab)

    def write(path: Path) -> None:
        writer = gguf.GGUFWriter(path, family_of(config).gguf_arch)
        try:
            write_metadata(writer, config, gguf_type, name)
            found.vocab.write(writer)
            for tensor_name, data, qtype in tensors:
                writer.add_tensor(tensor_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()

    write_gguf_file(out, write, approved)
    notes = found.notes + ([renamed] if renamed else [])
    return GGUFExport(out, family_of(config).gguf_arch, gguf_type, n_params, kept, found.vocab, notes)
