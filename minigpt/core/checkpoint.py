"""The checkpoint format: written, checked and read here, and nowhere else.

A minigpt checkpoint is a Lightning checkpoint (a dict written by torch.save) with one section of our own:

    ckpt["minigpt"] = {
        "format": 2,
        "model_config": GPTConfig.to_dict(),      # what builds the model
        "tokenizer": Tokenizer.to_dict(),         # plain data: sampling needs no other file
        "weights_prefix": "model.",               # where the GPT's weights sit in ckpt["state_dict"]
        "lora": {"config": ..., "base": ...},     # a LoRA run only: state_dict holds its adapters (core/lora.py)
    }

Everything else (optimizer, schedulers, loop and callback state, the RNG state for exact resume) is
Lightning's.  Format 1 (before the prefix and version were written) is upgraded when read.  Files are read
with torch.load(weights_only=True) after the checks of minigpt.core.torch_files: tensors and plain containers
only, never arbitrary objects, and never more memory than the file's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minigpt.core.config import CUDA_SDPA_BACKENDS, RUNTIME_FIELDS, GPTConfig
from minigpt.core.errors import CheckpointError, UserError, first_line, shown_chars
from minigpt.core.fsutil import atomic_write
from minigpt.core.limits import check_config_size, state_shapes
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer, tokenizer_from_dict
from minigpt.core.torch_files import load_torch_file

FORMAT_VERSION = 2
SECTION = "minigpt"
RNG_STATE_KEY = "RNGState"  # Lightning's callback-state key of callbacks.RNGState (format 1 kept it in SECTION)
DEFAULT_OUT_ROOT = "out"


# --------------------------------------------------------------------------------------------------- writing


def pack(checkpoint: dict[str, Any], owner: nn.Module, model: GPT, tokenizer: Tokenizer | None) -> None:
    """Add our section to a Lightning checkpoint dict (from LightningModule.on_save_checkpoint).

    `owner` is the module whose state_dict Lightning saved; the GPT's prefix in it is found, not assumed.
    """
    prefix = next(name for name, m in owner.named_modules() if m is model)  # StopIteration: not a submodule
    checkpoint[SECTION] = {
        "format": FORMAT_VERSION,
        "model_config": model.config.to_dict(),
        "tokenizer": tokenizer.to_dict() if tokenizer is not None else None,
        "weights_prefix": f"{prefix}." if prefix else "",
    }


def model_checkpoint(model: GPT, tokenizer: Tokenizer, global_step: int = 0) -> dict[str, Any]:
    """A checkpoint dict for a model outside training (a converted or hand-built one): load_model reads it."""
    checkpoint = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "global_step": global_step,
        "epoch": 0,
    }
    holder = nn.Module()
    holder.model = model
    pack(checkpoint, holder, model, tokenizer)
    return checkpoint


def save_file(checkpoint: dict[str, Any], path: str | Path) -> None:
    """torch.save, atomically: a kill at any moment leaves the old file or the new one, never half of one."""

    def write(f: Any) -> None:
        try:
            torch.save(checkpoint, f)
        except RuntimeError as e:  # a failed write (full disk) makes torch's zip writer fail again as it closes:
            if isinstance(e.__context__, OSError):  # that RuntimeError hides the OSError that says why
                raise e.__context__ from None
            raise

    atomic_write(path, write)


# --------------------------------------------------------------------------------------------------- reading


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint file with weights_only=True, check that it is ours, upgrade it to the current format."""
    path = Path(path)
    for problem in file_problems(path):
        raise CheckpointError(problem)
    ckpt = load_torch_file(
        path,
        fix="only load checkpoints written by minigpt",
        damaged_fix="use another checkpoint file",
        map_location=map_location,
    )
    for problem in section_problems(ckpt, path):
        raise CheckpointError(problem)
    return _upgrade(ckpt)


def file_problems(path: Path) -> Iterator[str]:
    """Why the file at `path` is no checkpoint, seen before it is read: torch.save writes a zip archive (in its
    legacy format, a bare pickle, which starts with 0x80)."""
    if not path.is_file():
        yield f"checkpoint not found: {path}; pass a .ckpt file or a run directory"
        return
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:1] == b"\x80":
        yield (
            f"refusing to load {path}: it is a bare pickle (torch's legacy format), which minigpt never writes; "
            "only load checkpoints written by minigpt"
        )
    elif not head.startswith(b"PK\x03\x04"):
        yield f"{path} is not a checkpoint (not a file written by torch.save); pass a .ckpt file or a run directory"


def section_problems(ckpt: Any, path: Path) -> Iterator[str]:
    """Why a loaded file is no minigpt checkpoint this version reads (format 1 is read, and upgraded)."""
    section = ckpt.get(SECTION) if isinstance(ckpt, dict) and isinstance(ckpt.get("state_dict"), dict) else None
    if not isinstance(section, dict):
        yield f"{path} is not a minigpt checkpoint (no model weights/config in it); pass a .ckpt written by train.py"
    elif (version := section.get("format", 1)) not in (1, FORMAT_VERSION):
        yield (
            f"{path} has checkpoint format {version!r}, and this minigpt reads format {FORMAT_VERSION}; load it "
            "with the minigpt version that wrote it"
        )
    elif not isinstance(section.get("model_config"), dict):
        yield f"{path} is not a usable minigpt checkpoint (no model config in it); pass a .ckpt written by train.py"


def _upgrade(ckpt: dict[str, Any]) -> dict[str, Any]:
    section = ckpt[SECTION]
    if section.get("format", 1) == 1:  # weights were always under "model."; the RNG state sat in our section
        section["weights_prefix"] = "model."
        if (rng := section.pop("rng", None)) is not None:
            ckpt.setdefault("callbacks", {}).setdefault(RNG_STATE_KEY, rng)
        section["format"] = FORMAT_VERSION
    return ckpt


def model_config(ckpt: dict[str, Any], **overrides: Any) -> GPTConfig:
    return GPTConfig.from_dict({**ckpt[SECTION]["model_config"], **overrides})


def model_state_dict(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The GPT's own weights, without the prefix of the module that held it during training."""
    prefix = ckpt[SECTION]["weights_prefix"]
    return {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}


def build_model(ckpt: dict[str, Any], **config_overrides: Any) -> GPT:
    """The GPT a checkpoint describes, with its weights (on the CPU, in train mode).  The config is checked for
    plausible sizes and against the weights' shapes (on the meta device: nothing allocated) before building."""
    config = model_config(ckpt, **config_overrides)
    skeleton = check_config_size(config, "its config", CheckpointError)  # the one meta model of this load
    weights = model_state_dict(ckpt)
    expected = {k: tuple(v) for k, v in state_shapes(skeleton).items()}
    found = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
    if expected != found:
        key = next((k for k in expected if expected[k] != found.get(k)), None) or next(
            k for k in found if k not in expected
        )
        raise CheckpointError(
            f"its weights do not match its config ({key}: config gives {expected.get(key)}, "
            f"weights hold {found.get(key)}); the checkpoint is damaged or from another program"
        )
    # the checkpoint's tensors themselves, in the skeleton measured above: no random init to overwrite
    return GPT.from_weights(config, weights, skeleton)


def checkpoint_tokenizer(ckpt: dict[str, Any]) -> Tokenizer | None:
    d = ckpt[SECTION].get("tokenizer")
    return tokenizer_from_dict(d) if d is not None else None


def run_checkpoints(run_dir: Path) -> tuple[Path, ...]:
    """Where a run directory keeps its checkpoints, in the order load_model prefers them.  Last, those an
    --overwrite run killed before its first checkpoint left set aside (.checkpoints.old-PID/checkpoints/, which the
    next train.py puts back): until then they are still the run's, and every reader finds them."""
    aside = sorted(Path(run_dir).glob(".checkpoints.old-*/checkpoints/*.ckpt"), key=lambda p: p.name)  # best, last
    return (
        run_dir / "checkpoints" / "best.ckpt",
        run_dir / "checkpoints" / "last.ckpt",
        run_dir / "best.ckpt",
        run_dir / "last.ckpt",
        *aside,
    )


def find_checkpoint(path: str | Path | None = None, out_root: str | Path = DEFAULT_OUT_ROOT) -> Path:
    """A .ckpt file as given; a run directory -> its best checkpoint (else last); None -> the newest run."""
    if path is None:
        runs = Path(out_root)  # each run's checkpoints, and those set aside (see run_checkpoints)
        found = sorted(
            [*runs.glob("*/checkpoints/*.ckpt"), *runs.glob("*/.checkpoints.old-*/checkpoints/*.ckpt")],
            key=lambda p: p.stat().st_mtime,
        )
        if found:
            return find_checkpoint(Path(out_root) / found[-1].relative_to(out_root).parts[0])
        missing = f"no checkpoint found under {out_root}/; train one with `python train.py` or name a checkpoint"
    elif (path := Path(path)).is_dir():
        if candidate := next((c for c in run_checkpoints(path) if c.is_file()), None):
            return candidate
        missing = (
            f"{path} holds PEFT adapters (adapter_config.json), not a whole model; pass the LoRA run they were "
            "exported from, or load them with peft on their base folder"
            if (path / "adapter_config.json").is_file()
            else f"no checkpoint in run directory {path}; expected checkpoints/best.ckpt or checkpoints/last.ckpt "
            "(or, for a Hugging Face model, config.json and its weights)"
        )
    elif path.exists():
        return path
    else:
        missing = (
            f"checkpoint not found: {path}; pass a .ckpt file, a run directory, a Hugging Face model folder or "
            "hf:ORG/NAME"
        )
    raise CheckpointError(missing)


def checkpoint_summary(ckpt: dict[str, Any], path: Path) -> str:
    """What a checkpoint holds, in a few words: 'step N', and for a run's best.ckpt 'val loss X, the run's best'
    (from the state of train.py's best-checkpoint callback, a Lightning ModelCheckpoint, saved inside the file)."""
    step = ckpt.get("global_step")
    words = [f"step {step}"] if isinstance(step, int) else []
    for state in (ckpt.get("callbacks") or {}).values():
        if (
            isinstance(state, dict)
            and state.get("monitor") == "val_loss"
            and Path(str(state.get("best_model_path"))).name == path.name
            and isinstance(score := state.get("best_model_score"), torch.Tensor)
        ):
            words.append(f"val loss {score.item():.4f}, the run's best")
            break
    return ", ".join(words)


def load_checkpoint(
    source: str | Path | None = None, device: str | torch.device = "cpu", attention: str | None = None
) -> tuple[GPT, Tokenizer]:
    """A checkpoint file, a run directory, or None (the newest run under out/) -> (model in eval mode, tokenizer).
    minigpt.load_model also reads Hugging Face models; this reads minigpt's own format only.

    `attention` picks another attention path for the same weights (same outputs; e.g. 'manual' to get the
    attention weights).
    """
    path = find_checkpoint(source)
    return checkpoint_model(read_checkpoint(path, map_location="cpu"), path, device, attention)


def checkpoint_model(
    ckpt: dict[str, Any],
    path: Path,
    device: str | torch.device = "cpu",
    attention: str | None = None,
    build: Callable[..., GPT] = build_model,
) -> tuple[GPT, Tokenizer]:
    """load_checkpoint for a checkpoint already read: `build(ckpt, **config_overrides)` makes its model (a LoRA
    run's is its base with the adapters merged: minigpt.loading)."""
    overrides: dict[str, Any] = {"attention": attention} if attention is not None else {}
    if torch.device(device).type != "cuda" and ckpt[SECTION]["model_config"].get("sdpa_backend") in CUDA_SDPA_BACKENDS:
        overrides["sdpa_backend"] = None  # trained on a GPU's kernel: here torch picks (same function)
    try:
        tokenizer = checkpoint_tokenizer(ckpt)
        model = build(ckpt, **overrides)
        problem = next(pair_problems(model.config, tokenizer), None)
    except UserError as e:  # a bad config or tokenizer inside the file, a LoRA run's base (its fix at the end)
        problem = first_line(e, limit=2000)
    except (KeyError, TypeError, AttributeError, RuntimeError) as e:  # a damaged or foreign dict
        problem = (
            f"not a usable minigpt checkpoint ({type(e).__name__}: {first_line(e, 160)}); pass a .ckpt "
            "written by train.py"
        )
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    return model.to(device).eval(), tokenizer


def pair_problems(config: GPTConfig, tokenizer: Tokenizer | None) -> Iterator[str]:
    """Why a checkpoint's model and tokenizer do not go together."""
    if tokenizer is None:
        yield "it has no tokenizer in it; pass a .ckpt written by train.py"
    elif tokenizer.vocab_size > config.vocab_size:
        yield (
            f"tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}; the checkpoint "
            "is inconsistent"
        )
    # train.py makes a char model's vocabulary exactly its characters: any other count is a tampered tokenizer
    elif tokenizer.name == "char" and tokenizer.vocab_size != config.vocab_size:
        yield (
            f"its char tokenizer has {tokenizer.vocab_size} characters but the model {config.vocab_size} tokens; "
            "the checkpoint is inconsistent or was edited"
        )


def check_resumable(ckpt: dict[str, Any], config: GPTConfig, tokenizer: Tokenizer | None, path: Path) -> None:
    """A run resumes only with the same tokenizer (the same vocabulary size with other characters would
    silently shift every id) and the model it was trained with (the attention path and dropout may change)."""
    for problem in resume_problems(ckpt, config, tokenizer, path):
        raise UserError(problem)


def tokenizer_label(saved: dict[str, Any]) -> str:
    """A saved tokenizer's name, and whether a chat template wraps it (a chat run's: "char -> char" said nothing)."""
    return f"{saved.get('name')}{' with a chat template' * (saved.get('type') == 'chat')}"


def resume_problems(ckpt: dict[str, Any], config: GPTConfig, tokenizer: Tokenizer | None, path: Path) -> Iterator[str]:
    saved_tok = ckpt[SECTION].get("tokenizer")
    if tokenizer is not None and saved_tok is not None and saved_tok != tokenizer.to_dict():
        what = f"{tokenizer_label(saved_tok)} -> {tokenizer_label(tokenizer.to_dict())}"
        if saved_tok.get("type") == "char" and isinstance(getattr(tokenizer, "chars", None), str):
            old, new = set(saved_tok.get("chars", "")), set(tokenizer.chars)
            what = (
                f"char vocabulary: {len(new - old)} character(s) added ({shown_chars(sorted(new - old), 5)}), "
                f"{len(old - new)} removed ({shown_chars(sorted(old - new), 5)})"
            )
        yield (
            f"{path} was trained on data with another tokenizer ({what}); the corpus or tokenizer changed since, "
            "so token ids would mean other things: resume on the same data, or start a new run in another out_dir"
        )
    saved, current = ckpt[SECTION]["model_config"], config.to_dict()
    diff = [
        f"{k}={saved[k]!r} (this run's config gives {current[k]!r})"
        for k in saved
        if k in current and k not in RUNTIME_FIELDS and saved[k] != current[k]
    ]
    if diff:
        yield (
            f"{path} was trained with " + ", ".join(diff) + "; remove the conflicting model settings to resume, "
            "or start a new run in another out_dir"
        )
