"""The configs that ship with the package: default.yaml is what `train.py` / `minigpt train` runs with no --config.

It is the same file as the repository's configs/default.yaml (a test keeps them equal), so a non-editable
install trains exactly the README's default from any folder.
"""

from importlib import resources
from pathlib import Path


def default_config() -> Path:
    return Path(str(resources.files(__name__).joinpath("default.yaml")))
