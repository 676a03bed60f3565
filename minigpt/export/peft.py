"""A LoRA run's adapters in PEFT's files, next to a Hugging Face export of the base they apply to:

    export_peft(model, tokenizer, lora, "hf/my-adapter", "hf/my-adapter-base")
    # then, with peft:  PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("hf/my-adapter-base"),
    #                                             "hf/my-adapter")

The adapter folder holds what PEFT's save_pretrained writes: adapter_config.json and adapter_model.safetensors
(tensors named base_model.model.<HF module>.lora_A.weight / lora_B.weight, A (r, in) and B (out, r) as ours).
The base folder is minigpt.export.hf's export of the frozen weights the run trained on (bfloat16-held weights as
rounded, a grown vocabulary's new rows at their starting mean), so base + adapter computes what the run computes.

Layouts (the model's family names the modules, minigpt.hf.families): Llama-style families keep q/k/v and gate/up
as separate modules, so each of our per-projection adapters is one of PEFT's.  GPT-2's c_attn is one fused module:
our q, k and v adapters become one adapter of rank 3r (A stacked, B block-diagonal) with alpha 3 alpha, the same
scale (rank_pattern / alpha_pattern).  New token rows are PEFT's trainable_token_indices
(`token_adapter.trainable_tokens_delta`, the rows' values).  With lora.train_embeddings every row is one (their
trained values: the base folder's embedding rows are then replaced, whatever they hold), and learned positions are
modules_to_save=["wpe"] (transformer.wpe.weight, the trained table).
"""

from __future__ import annotations

from pathlib import Path

import torch

from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError
from minigpt.core.fsutil import write_json
from minigpt.core.lora import GrownEmbedding, GrownHead, LoRAConfig, LoRALinear, block_pieces, new_rows
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer
from minigpt.export.folder import FolderState, seal_export
from minigpt.export.hf import check_exportable, check_out_dir, export_hf, save_safetensors, write_folder
from minigpt.hf.families import family_of

__all__ = ["ADAPTER_FILES", "adapter_config", "base_of", "check_out_dirs", "export_peft", "peft_tensors"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
PREFIX = "base_model.model."


def lora_layers(model: GPT, i: int) -> dict[str, LoRALinear]:
    block = model.transformer.h[i]
    return {name: block.get_submodule(name) for name in block_pieces(model.config)}


def rows(module: torch.nn.Module) -> torch.Tensor:
    """Every row of an embedding or head: a grown one's base rows, then its new ones."""
    if isinstance(module, (GrownEmbedding, GrownHead)):
        return torch.cat([module.weight, module.new_rows])
    return module.weight


def peft_tensors(model: GPT) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(PEFT's tensors for a LoRA model, the rank of each module whose adapter is not rank r: a fused one's)."""
    config, out, ranks = model.config, {}, {}
    family = family_of(config)
    for i in range(config.n_layer):
        block = PREFIX + family.peft_block.format(i=i)
        for layer_name, layer in lora_layers(model, i).items():
            if not family.peft_fused:  # one HF module per projection
                for piece, a in layer.lora_A.items():
                    module = block + family.peft_modules[piece]
                    out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a, layer.lora_B[piece]
            elif layer.lora_A:  # one HF module: the pieces' adapters side by side (A stacked, B block-diagonal)
                module = block + family.peft_modules[layer_name]
                a, b = layer.stacked()  # (n r, in), (out, n r)
                out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a, b
                if a.size(0) != len(next(iter(layer.lora_A.values()))):
                    ranks[family.peft_modules[layer_name]] = a.size(0)
    embed = family.peft_embedding
    wte, head = model.transformer.wte, model.lm_head
    if wte.weight.requires_grad:  # train_embeddings: every row is a trainable token (base rows, then new ones)
        out[f"{PREFIX}{embed}.token_adapter.trainable_tokens_delta"] = rows(wte)
        if not config.tie_embeddings:
            out[f"{PREFIX}lm_head.token_adapter.trainable_tokens_delta"] = rows(head)
        if "wpe" in model.transformer:  # modules_to_save: PEFT's files name the module's own tensor
            out[f"{PREFIX}{embed.rpartition('.')[0]}.wpe.weight"] = model.transformer.wpe.weight
    elif isinstance(head, GrownHead):
        out[f"{PREFIX}{embed}.token_adapter.trainable_tokens_delta"] = wte.new_rows
        if not config.tie_embeddings:
            out[f"{PREFIX}lm_head.token_adapter.trainable_tokens_delta"] = head.new_rows
    return {k: v.detach().float().cpu().contiguous().clone() for k, v in out.items()}, ranks


def adapter_config(config: GPTConfig, lora: LoRAConfig, base: str, ranks: dict[str, int], n_base_vocab: int) -> dict:
    """adapter_config.json: LoraConfig's fields (those not given keep PEFT's defaults)."""
    family = family_of(config)
    pieces = {p for layer in block_pieces(config).values() for p in layer}
    targeted = [p for p in lora.targets if p in pieces]
    if not family.peft_fused:
        modules = sorted({family.peft_modules[p].rpartition(".")[2] for p in targeted})
    else:
        modules = sorted(
            {
                family.peft_modules[name]
                for name, layer in block_pieces(config).items()
                if any(p in layer for p in targeted)
            }
        )
    new_ids = list(range(0 if lora.train_embeddings else n_base_vocab, config.vocab_size))
    embed = family.peft_embedding.rpartition(".")[2]
    tokens = None if not new_ids else new_ids if config.tie_embeddings else {embed: new_ids, "lm_head": new_ids}
    to_save = ["wpe"] if lora.train_embeddings and config.arch == "gpt" else None  # learned positions
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "fan_in_fan_out": family.fan_in_fan_out,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": to_save,
        "rank_pattern": ranks,
        "alpha_pattern": {k: lora.alpha * r / lora.rank for k, r in ranks.items()},
        "trainable_token_indices": tokens,
    }


@torch.no_grad()
def base_of(model: GPT) -> GPT:
    """The plain GPT the LoRA model's adapters apply to: its frozen weights (float32), new rows at their start."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            state[f"{name}.weight"] = module.weight.float()
        elif isinstance(module, (GrownEmbedding, GrownHead)):
            state[f"{name}.weight"] = torch.cat([module.weight, new_rows(module.weight, len(module.new_rows))])
    state = {k: v for k, v in state.items() if ".lora_" not in k and not k.endswith(".new_rows")}
    if model.config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return GPT.from_weights(model.config, state).eval()


def check_out_dirs(
    out_dir: Path, base_dir: Path, overwrite: bool, checked: tuple[FolderState, FolderState] | None = None
) -> tuple[FolderState, FolderState]:
    """check_out_dir for the adapters' folder and the base's, which must be two folders, neither inside the other:
    the base, written first, would otherwise take the adapters' place (or be deleted by their --overwrite).
    Returns both states as approved."""
    out, base = Path(out_dir).resolve(), Path(base_dir).resolve()
    if out.is_relative_to(base) or base.is_relative_to(out):
        where = "the same folder" if out == base else "one inside the other"
        raise UserError(
            f"--out {out_dir} (the adapters) and --base_out {base_dir} (their base) are {where}; give two "
            f"separate folders, e.g. --base_out {str(out_dir).rstrip('/')}-base"
        )
    return check_out_dir(out_dir, overwrite, checked[0] if checked else None), check_out_dir(
        base_dir, overwrite, checked[1] if checked else None
    )


def export_peft(
    model: GPT,
    tokenizer: Tokenizer | None,
    lora: LoRAConfig,
    out_dir: str | Path,
    base_dir: str | Path,
    overwrite: bool = False,
    checked: tuple[FolderState, FolderState] | None = None,
) -> tuple[Path, Path]:
    """Write the LoRA model's adapters in PEFT's layout to out_dir and its base as a Hugging Face folder to base_dir
    (each whole or not at all, each replaced only if it holds an unchanged previous export and overwrite is set;
    `checked`: the two folders' states as check_out_dir approved them).  Returns (out_dir, base_dir)."""
    out_dir, base_dir = Path(out_dir).resolve(), Path(base_dir).resolve()
    check_exportable(model.config)
    approved, base_approved = check_out_dirs(out_dir, base_dir, overwrite, checked)
    tensors, ranks = peft_tensors(model)
    n_base = model.lm_head.weight.size(0)  # the base's rows: a GrownHead's frozen ones, else all
    config = adapter_config(model.config, lora, str(base_dir), ranks, n_base)
    export_hf(base_of(model), tokenizer, base_dir, overwrite, base_approved)

    def write(folder: Path) -> None:
        write_json(folder / "adapter_config.json", config)
        save_safetensors(tensors, folder / "adapter_model.safetensors")
        seal_export(folder, mode_from="adapter_config.json")

    write_folder(out_dir, approved, write)
    return out_dir, base_dir
