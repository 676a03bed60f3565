"""Fine-tuning (init_from): a run that starts from another model's weights, model config and tokenizer.

The source is anything minigpt.load_model reads (a .ckpt, a run directory, a Hugging Face model directory or
hf:ORG/NAME).  Its tokenizer becomes data.tokenizer (a file under the data root named by its content), so the
corpus is prepared with it, and out_dir/tokenizer.json once the run is accepted; the model keys a run sets must
agree with the source, except those in FINETUNE_FIELDS.

A chat run (data.format chat) from a Hugging Face model that carries a chat template takes that template with the
tokenizer; a vocabulary the chat format grows (minigpt.training.sft) starts its new rows at the mean embedding.
"""

from __future__ import annotations

import hashlib
import json
import logging
from logging.handlers import BufferingHandler
from pathlib import Path
from typing import Any

import yaml

from minigpt.core import checkpoint
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import read_checkpoint
from minigpt.core.config import FINETUNE_FIELDS, RUNTIME_FIELDS, GPTConfig
from minigpt.core.errors import CheckpointError, UserError, first_line
from minigpt.core.fsutil import atomic_write, write_errors
from minigpt.core.model import GPT
from minigpt.core.tokenizers import Tokenizer
from minigpt.hf.chat_files import read_chat_template
from minigpt.hf.load import resolve_hf_source
from minigpt.loading import is_hf_source, load_model
from minigpt.training.sft import grow_vocabulary

# model fields set by a link rather than by the user (data.vocab_size -> model.vocab_size)
LINKED_MODEL_FIELDS = {"vocab_size"}


def check_source_is_not_out_dir(src: str, out_dir: Path) -> None:
    """A new fine-tune may not write into its source's folder (train.py checks it before anything else of out_dir)."""
    if Path(str(src)).is_dir() and Path(str(src)).resolve() == out_dir.resolve():
        raise UserError(
            f"init_from {src} is out_dir itself: the run would write its files into the source model's "
            "folder; choose another --out_dir"
        )


def init_from_source(
    config: Any, given: set[str], resumed: dict[str, Any] | None = None
) -> tuple[GPTConfig, GPT | None, str]:
    """init_from: fill config's model section from the source and point data.tokenizer at its tokenizer (written
    under the data root, keyed by its content; train.py copies it to out_dir/tokenizer.json once the run is
    accepted, so a refused run writes nothing into out_dir).  Returns the source's config and model; the model is
    None when --resume continues the run (`resumed`: its last checkpoint, already read), whose own checkpoint then
    supplies config and tokenizer (the source's weights are not read again).  `given`: the keys the user set in
    config files and flags ("model.n_layer", "data.tokenizer", ...), whose values are in `config`.  Also returns
    the line load_model logs for a run directory (`using out/RUN/checkpoints/best.ckpt (step S, ...)` and its
    newline; "" for a file or a resume): train.py prints it once the run is accepted, as the commands say it."""
    logger, held = logging.getLogger("minigpt.loading"), BufferingHandler(capacity=100)
    level = logger.level
    logger.addHandler(held)
    logger.setLevel(logging.INFO)
    try:
        source_config, source_model = fill_from_source(config, given, resumed)
    finally:
        logger.removeHandler(held)
        logger.setLevel(level)
    return source_config, source_model, "".join(f"{record.getMessage()}\n" for record in held.buffer)


def fill_from_source(config: Any, given: set[str], resumed: dict[str, Any] | None) -> tuple[GPTConfig, GPT | None]:
    """init_from_source's work."""
    src, out_dir = config["init_from"], Path(config["out_dir"])
    resuming = resumed is not None
    if resuming:
        # a LoRA run's base and a full DPO/GRPO run's reference are checked later, by their fingerprints
        section = resumed[checkpoint.SECTION]
        if "lora" not in section and not any((section.get(k) or {}).get("fingerprint") for k in ("dpo", "grpo")):
            check_same_source(src, out_dir)
        source_model, tokenizer = None, checkpoint.checkpoint_tokenizer(resumed)
        source_config = checkpoint.model_config(resumed)
    else:
        source_model, tokenizer = load_source(src)
        source_config = source_model.config
        if (
            config["data"].get("format") in ("chat", "preference", "prompts")  # every format rendered as chats
            and tokenizer is not None
            and is_hf_source(src)
            and (template := read_chat_template(resolve_hf_source(src)[0])) is not None
        ):
            tokenizer = ChatTokenizer.for_base(tokenizer, template)  # the source's own chat format
    if tokenizer is None:
        raise UserError(f"init_from {src}: it has no tokenizer; fine-tune from a checkpoint written by train.py")
    text = json.dumps(tokenizer.to_dict()).encode()  # the data layer keys its cache by this file's content
    tokenizer_file = Path(config["data"]["data_root"]) / "tokenizers" / f"{hashlib.sha256(text).hexdigest()[:16]}.json"
    given_tokenizer = config["data"]["tokenizer"] if "data.tokenizer" in given else None
    ours = (tokenizer_file.resolve(), (out_dir / "tokenizer.json").resolve())
    source_keys = source_config.to_dict()
    model_keys = (key.removeprefix("model.") for key in given if key.startswith("model."))
    user_keys = {k: config["model"][k] for k in model_keys if config["model"].get(k) is not None}
    conflicts = [
        f"model.{k}={v!r} (the source has {source_keys[k]!r})"
        for k, v in user_keys.items()
        if k in source_keys and k not in (*FINETUNE_FIELDS, *LINKED_MODEL_FIELDS) and v != source_keys[k]
    ]
    block_size = user_keys.get("block_size", source_config.block_size)
    # what the run sets that the source decides: (refused when, the problem and its fix)
    refusals = [
        message
        for refused, message in (
            (
                given_tokenizer is not None and Path(str(given_tokenizer)).resolve() not in ours,
                f"data.tokenizer is set ({given_tokenizer}), but a fine-tuning run uses its source's tokenizer; remove "
                "data.tokenizer",
            ),
            (
                bool(conflicts),
                "the model comes from the source, but this run sets " + ", ".join(conflicts) + "; remove "
                f"these model settings (a fine-tuning run may change only {', '.join(RUNTIME_FIELDS)} and a smaller "
                "block_size)",
            ),
            (
                block_size > source_config.block_size,
                f"model.block_size={block_size} is larger than the source's "
                f"{source_config.block_size}; use a block_size of at most {source_config.block_size}",
            ),
        )
        if refused
    ]
    if refusals:
        raise UserError(f"init_from {src}: {refusals[0]}")
    for key, value in source_keys.items():
        if key not in LINKED_MODEL_FIELDS:
            config["model"][key] = user_keys.get(key, value) if key in FINETUNE_FIELDS else value
    # the settings taken from this run (dropout, block_size, ...) are checked here, where they join the source's
    # (train.py checks a scratch run's at parse time): before the data is prepared, naming the model key
    GPTConfig(**{**config["model"].as_dict(), "vocab_size": source_config.vocab_size})
    config["data"]["block_size"] = block_size  # its link from model.block_size ran at parse time
    if not tokenizer_file.is_file() or tokenizer_file.read_bytes() != text:
        with write_errors(tokenizer_file.parent, "choose a writable --data.data_root"):
            atomic_write(tokenizer_file, lambda f: f.write(text))
    config["data"]["tokenizer"] = str(tokenizer_file)
    return source_config, source_model


def check_same_source(src: str, out_dir: Path) -> None:
    """A resume goes on from the model the run started from, which its config.yaml (written at the start, read here
    before it is written again) names: another init_from was accepted and recorded as the run's origin."""
    try:
        started = yaml.safe_load((out_dir / "config.yaml").read_text(encoding="utf-8")).get("init_from")
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return  # no readable record (removed, or not a mapping): nothing to compare with

    def where(source: str) -> str:  # hf:ORG/NAME as given, a local path wherever it was written from
        return source if source.startswith("hf:") else str(Path(source).expanduser().resolve())

    if started is None or where(str(started)) != where(str(src)):
        origin = f"from init_from {started}" if started is not None else "from scratch"
        fix = f"resume with --init_from {started}" if started is not None else "resume without --init_from"
        raise UserError(
            f"{out_dir} was started {origin} (its config.yaml), and this resume names init_from {src}; {fix}, or "
            "start a new run in another out_dir"
        )


def load_source(src: str) -> tuple[GPT, Tokenizer | None]:
    """The init_from model and its tokenizer; what load_model refuses is one line that names init_from."""
    try:
        return load_model(src)
    except UserError as e:
        raise UserError(f"init_from: {first_line(e, 1000)}") from None


def load_init_weights(model: GPT, source: GPT, src: str | None = None) -> None:
    """Copy the source's weights into the model being trained; learned positions beyond a smaller block_size are
    dropped (nanoGPT's crop_block_size), and tokens a chat format adds get rows at the mean embedding.  `src`: the
    init_from a resumed run reads again, whose weights may not fit the run's model (another one): one UserError."""
    state = grow_vocabulary(source.state_dict(), model.config.vocab_size)
    if "transformer.wpe.weight" in state:
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: model.config.block_size]
    ours = model.state_dict()
    misfit = sorted(ours.keys() ^ state.keys()) or [k for k in ours if ours[k].shape != state[k].shape]
    if misfit and src is not None:
        raise UserError(
            f"init_from {src} is not the model this run started from (its weights do not fit the run's model: "
            f"{misfit[0]}); resume with the init_from it was started with, or start a new run in another out_dir"
        )
    model.load_state_dict(state)


def read_last(last: Path) -> dict[str, Any]:
    """The run's last checkpoint for --resume; a damaged one is a one-line error with the way out."""
    try:
        return read_checkpoint(last)
    except CheckpointError as e:
        raise UserError(
            f"--resume: {first_line(e, 400)}; copy checkpoints/best.ckpt over it to resume from the "
            "best one, or start over with --overwrite"
        ) from None
