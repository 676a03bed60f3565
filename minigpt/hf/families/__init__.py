"""The Hugging Face families minigpt imports and exports, one module each (see docs/layout.md, "Adding a model
family"): the registry the import and the exports ask.

    family = family_of(model.config)        # the family an export writes
    family = family_of_hf(config_json)      # the family of a config.json, or None
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from minigpt.core.config import GPTConfig
from minigpt.core.errors import ConfigError
from minigpt.hf.families.base import Family
from minigpt.hf.families.gemma3 import Gemma3
from minigpt.hf.families.gpt2 import GPT2
from minigpt.hf.families.llama import Llama
from minigpt.hf.families.mistral import Mistral
from minigpt.hf.families.phi3 import Phi3
from minigpt.hf.families.qwen2 import Qwen2
from minigpt.hf.families.qwen3 import Qwen3

__all__ = ["FAMILIES", "Family", "check_family_set", "family_field", "family_of", "family_of_hf", "hf_classes"]

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (GPT2(), Llama(), Mistral(), Qwen2(), Qwen3(), Gemma3(), Phi3())
}
# the family a model trained here exports as: the one each block kind was modelled on
BLOCK_DEFAULT = {"gpt": FAMILIES["gpt2"], "llama": FAMILIES["llama"]}


def hf_classes() -> tuple[str, ...]:
    return tuple(name for f in FAMILIES.values() for name in (f.hf_class, *f.reads))


def family_of(config: GPTConfig) -> Family:
    """The family `config`'s exports write: its `family`, else its block's own (block_problems: one of another
    block kind)."""
    return BLOCK_DEFAULT[config.arch] if config.family is None else FAMILIES[config.family]


def check_family_set(config: GPTConfig) -> None:
    """A new model's `family`, set by the user, is the export its run is for: one its other options cannot be
    exported as is refused before training (the export would refuse it after the run)."""
    family = family_of(config)
    if config.family is not None and (
        problem := next(chain(family.block_problems(config), family.export_problems(config)), None)
    ):
        raise ConfigError(f"model.family: this model would not export as {config.family} ({problem})")


def family_field(family: Family) -> str | None:
    """GPTConfig.family for a model of `family`: unset where it is its block's own (a model trained here and one
    imported then compute and export alike, and round trips give back equal configs)."""
    return None if BLOCK_DEFAULT[family.block] is family else family.model_type


def family_of_hf(hf_config: dict[str, Any]) -> Family | None:
    """The family whose class config.json's `architectures` names (else whose model_type it has), or that reads that
    class (Family.reads); None: no family."""
    names, model_type = hf_config.get("architectures"), hf_config.get("model_type")
    if names:
        return next((f for f in FAMILIES.values() if names[0] == f.hf_class or names[0] in f.reads), None)
    return FAMILIES.get(model_type) or next((f for f in FAMILIES.values() if model_type in f.reads.values()), None)
