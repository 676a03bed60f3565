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


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """name -> (HF model, its save_pretrained directory), built once for the session (test_load.py, test_hub.py)."""
    from hf_models import MODELS, random_hf_model, save

    out = {}
    for name, make in MODELS.items():
        model = random_hf_model(make())
        out[name] = model, save(model, tmp_path_factory.mktemp(name))
    return out
