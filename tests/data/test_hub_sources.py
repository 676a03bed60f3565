"""A datasets hub name with no network is one line at once (minigpt.data.sources.check_hub_reachable): the hub's
host is looked up first, and where it does not resolve `datasets` (which retries for ~25 s, printing each retry)
is never called. Offline mode and proxies skip the look-up. No test here sends anything: the resolver, the hub
settings and datasets.load_dataset are replaced."""

from __future__ import annotations

import logging
import socket
import urllib.request

import datasets
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import logging as hub_logging

from minigpt.core.errors import DataError
from minigpt.data.prepare import prepare_data
from minigpt.data.sources import iter_documents, resolve_source

NAME = "roneneldan/TinyStories"


@pytest.fixture
def online(monkeypatch):
    """The hub settings of a user who has not set offline mode, a proxy or a mirror; the resolver's calls are
    recorded in the list returned, and it fails as with no network or DNS until a test replaces it."""
    looked_up = []

    def no_dns(host, port, *a, **k):
        looked_up.append((host, port))
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # (tests/conftest.py sets offline mode)
    monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_VERBOSITY", raising=False)
    monkeypatch.setattr(urllib.request, "getproxies", dict)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    return looked_up


def _no_load(*a, **k):
    pytest.fail("datasets.load_dataset was called: it retries for ~25 s when the hub cannot be reached")


def test_an_unresolvable_hub_is_one_line_at_once_without_calling_datasets(online, monkeypatch, tmp_path):
    monkeypatch.setattr(datasets, "load_dataset", _no_load)
    with pytest.raises(DataError) as e:  # the whole preparation, as train.py runs it
        prepare_data(NAME, "char", data_root=tmp_path / "data")
    assert str(e.value) == (
        f"cannot reach the Hugging Face Hub (huggingface.co: Name or service not known) to read the dataset {NAME}; "
        "connect to the internet, or set HF_HUB_OFFLINE=1 to read a copy that datasets has cached, or pass a local "
        "file or folder"
    )
    assert online == [("huggingface.co", 443)]
    assert not list((tmp_path / "data").glob("*/*.bin"))

    # a mirror (HF_ENDPOINT) is the host looked up, on its own port, and the message names the setting
    monkeypatch.setattr(constants, "ENDPOINT", "https://hf-mirror.example:8443")
    monkeypatch.setenv("HF_ENDPOINT", "https://hf-mirror.example:8443")
    with pytest.raises(DataError, match=r"\(hf-mirror.example: .*internet \(or check HF_ENDPOINT\)"):
        resolve_source(f"{NAME}:default").load_dataset()
    assert online[-1] == ("hf-mirror.example", 8443)


@pytest.mark.parametrize("setting", ["HF_HUB_OFFLINE", "proxy"])
def test_offline_mode_and_a_proxy_skip_the_look_up(online, monkeypatch, setting):
    """Offline mode reads datasets' cache (no host needed); a proxy resolves the host itself. datasets is called as
    before, and its failure is reported as before."""
    if setting == "proxy":
        monkeypatch.setattr(urllib.request, "getproxies", lambda: {"https": "http://proxy.example:3128"})
    else:
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    calls = []

    def not_cached(*a, **k):
        calls.append(a)
        raise ConnectionError(f"Couldn't reach '{NAME}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", not_cached)
    with pytest.raises(DataError, match=f"corpus not found: {NAME} .*ConnectionError: Couldn't reach"):
        resolve_source(NAME).load_dataset()
    assert online == [] and calls == [(NAME, None)]


def test_a_resolving_hub_loads_as_before_with_retry_warnings_held_back(online, monkeypatch):
    """With the host resolving, datasets loads the name as before; huggingface_hub's warnings (each retry of a
    failed request) are held back during the load only, unless the user set HF_HUB_VERBOSITY."""
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: online.append((host, port)) or [])
    verbosity = []

    def load(name, config, split):
        verbosity.append(hub_logging.get_verbosity())
        return datasets.Dataset.from_dict({"text": ["one story", "", "another story"]})

    monkeypatch.setattr(datasets, "load_dataset", load)
    before = hub_logging.get_verbosity()
    corpus = resolve_source(NAME)
    assert [b"".join(d.chunks) for d in iter_documents(corpus)] == [b"one story", b"another story"]
    assert online == [("huggingface.co", 443)]
    assert verbosity == [logging.ERROR] and hub_logging.get_verbosity() == before

    monkeypatch.setenv("HF_HUB_VERBOSITY", "info")  # the user's choice is kept
    resolve_source(NAME).load_dataset()
    assert verbosity[-1] == before


def test_chat_and_preference_data_from_the_hub_are_checked_as_corpora_are(online, monkeypatch):
    """--data.format chat, preference and prompts read hub names through their own reader (conversations.py)."""
    from minigpt.data.conversations import source_rows

    monkeypatch.setattr(datasets, "load_dataset", _no_load)
    with pytest.raises(DataError, match=r"^cannot reach the Hugging Face Hub \(huggingface.co: .*org/chats; connect"):
        list(source_rows("org/chats"))
    assert online == [("huggingface.co", 443)]
