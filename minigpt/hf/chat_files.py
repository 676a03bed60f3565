"""A Hugging Face model's own chat template, as transformers finds it: chat_template.jinja beside the tokenizer
(transformers 4.43+ saves it there), else tokenizer_config.json's "chat_template" (a string, or a list of named
templates, of which "default" is the one apply_chat_template uses)."""

from __future__ import annotations

from pathlib import Path

from minigpt.core.errors import CheckpointError, first_line
from minigpt.hf.files import read_json_object

__all__ = ["read_chat_template"]


def read_chat_template(model_dir: Path) -> str | None:
    """The folder's chat template, or None when it has none."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read {jinja} ({first_line(e)}); download the model again") from None
    config_path = model_dir / "tokenizer_config.json"
    template = read_json_object(config_path).get("chat_template") if config_path.is_file() else None
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{config_path}: its chat_template is not a Jinja template string; download the model "
                              "again")
    return template
