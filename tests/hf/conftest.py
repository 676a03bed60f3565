"""Fixtures the Hugging Face tests share."""

import pytest


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty huggingface_hub cache, offline (the variables as huggingface_hub read them at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache
