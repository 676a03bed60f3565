"""A Hugging Face model's own chat template, as transformers finds it: chat_template.jinja beside the tokenizer
(transformers 4.43+ saves it there), else tokenizer_config.json's "chat_template" (a string, or a list of named
templates, of which "default" is the one apply_chat_template uses).  And the other way: a chat tokenizer's added
tokens written into an exported tokenizer.json (minigpt.hf.tokenizer_files adds the template to
tokenizer_config.json)."""

from __future__ import annotations

from pathlib import Path

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.errors import CheckpointError, UserError, first_line
from minigpt.core.hf_tokenizer import tokenizers_library
from minigpt.core.user_files import TEMPLATE_BYTES, read_user_text
from minigpt.hf.files import read_json_object

__all__ = ["read_chat_template", "chat_tokenizer_json"]


def read_chat_template(model_dir: Path) -> str | None:
    """The folder's chat template, or None when it has none."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():  # (a device or FIFO there is refused by read_user_text, not skipped)
        try:
            return read_user_text(jinja, TEMPLATE_BYTES)
        except (OSError, ValueError) as e:  # ValueError: not UTF-8, too large, a device
            raise CheckpointError(f"cannot read {jinja} ({first_line(e)}); download the model again") from None
    config_path = model_dir / "tokenizer_config.json"
    template = read_json_object(config_path).get("chat_template") if config_path.is_file() else None
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(
            f"{config_path}: its chat_template is not a Jinja template string; download the model again"
        )
    return template


def chat_tokenizer_json(tokenizer: ChatTokenizer, base_json: str) -> str:
    """The base's tokenizer.json with the chat tokenizer's added tokens registered at its ids: the turn markers as
    special tokens, a char base's new characters as plain added tokens (both matched before the model's own
    tokenization, as ChatTokenizer matches them)."""
    t = tokenizers_library()
    # base_json holds first_added tokens: ChatTokenizer counts them from the same base (save_hf_tokenizer writes it)
    backend = t.Tokenizer.from_str(base_json)
    for token in tokenizer.added:
        special = token in tokenizer.specials
        added = t.AddedToken(token, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([added])
    for token in tokenizer.specials:  # the base's own markers (an imported model's) are special already
        if backend.token_to_id(token) != tokenizer.token_id(token):
            raise UserError(
                f"the chat token {token!r} did not get id {tokenizer.token_id(token)} in the exported "
                "tokenizer.json; the checkpoint's tokenizer is inconsistent"
            )
    return backend.to_str()
