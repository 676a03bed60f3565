"""hf:ORG/NAME from the Hugging Face hub: the model's snapshot in huggingface_hub's cache, fetched if absent.

    folder = download_hf("openai-community/gpt2")   # the cache's snapshot directory

A model already complete in the cache is used without asking the network anything.  Otherwise every request
phase (connect, read, write, pool) waits at most HUB_TIMEOUT_S (or HF_HUB_ETAG_TIMEOUT when set), so a hub or
proxy that accepts and never answers cannot hang a command, and any failure (offline, a stall, a captive
portal's HTML, an answer that is not the hub's) is one CheckpointError line naming the endpoint and the way out.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from minigpt.core.errors import CheckpointError, first_line
from minigpt.hf.files import weight_files

__all__ = ["HUB_TIMEOUT_S", "download_hf"]

# hub files worth fetching: the config, the tokenizer, and one of the two weight formats (safetensors first)
META_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # where transformers 4.43+ saves the chat template (minigpt.hf.chat_files reads it)
]
SAFETENSORS_FILES = ["model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors"]
BIN_FILES = ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin"]

HUB_TIMEOUT_S = 15  # per request phase; with huggingface_hub's own 3 s probe, a dead hub costs about 20 s in all


def hub_timeout() -> float:
    """Seconds a hub request phase may wait: HF_HUB_ETAG_TIMEOUT (huggingface_hub's setting) when the user set it,
    for a slow network, else HUB_TIMEOUT_S."""
    from huggingface_hub import constants

    return constants.HF_HUB_ETAG_TIMEOUT if os.environ.get("HF_HUB_ETAG_TIMEOUT") else HUB_TIMEOUT_S


def _bounded_timeouts(request: Any) -> None:
    """An httpx request hook: huggingface_hub asks for no timeout (None) on its metadata calls; give each phase
    (connect, read, write, pool) hub_timeout() instead, through the request's documented `timeout` extension."""
    asked, limit = request.extensions.get("timeout") or {}, hub_timeout()
    request.extensions["timeout"] = {phase: asked.get(phase) or limit for phase in ("connect", "read", "write", "pool")}


def _hub_cache() -> str:
    """Where huggingface_hub keeps downloads, as the variable that sets it."""
    from huggingface_hub import constants

    if Path(constants.HF_HUB_CACHE) == Path(constants.HF_HOME) / "hub":
        return f"HF_HOME={constants.HF_HOME}"
    return f"HF_HUB_CACHE={constants.HF_HUB_CACHE}"


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The model's snapshot when the cache already holds its config and every weight file (all the shards its
    index lists): used without the network.  A partial one goes back to the hub to be completed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                local_files_only=True,
                allow_patterns=META_FILES + SAFETENSORS_FILES + BIN_FILES,
            )
        )
        weight_files(path)
    except (LocalEntryNotFoundError, CheckpointError, OSError, ValueError):
        return None
    return path if (path / "config.json").is_file() else None


def download_hf(repo_id: str, revision: str | None = None) -> Path:
    """hf:ORG/NAME -> the local snapshot directory in huggingface_hub's cache (downloaded if absent and online).
    Only the config, tokenizer and one weight format are fetched (safetensors when the repository has it)."""
    import httpx2
    from huggingface_hub import get_session, snapshot_download

    where = f"hf:{repo_id}" + (f"@{revision}" if revision else "")
    if (cached := _cached_snapshot(repo_id, revision)) is not None:
        return cached
    hooks = get_session().event_hooks  # huggingface_hub's shared client: waits forever unless bounded
    if _bounded_timeouts not in hooks["request"]:
        get_session().event_hooks = {**hooks, "request": [*hooks["request"], _bounded_timeouts]}
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=META_FILES + SAFETENSORS_FILES))
        if not any(path.glob("model*.safetensors")):  # an older repository: PyTorch weights only
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=META_FILES + BIN_FILES))
    except (ValueError, KeyError, TypeError, httpx2.HTTPError, OSError) as e:  # the hub's errors are of these kinds
        raise CheckpointError(_download_failure(e, where, repo_id, revision)) from None
    return path


def _download_failure(e: Exception, where: str, repo_id: str, revision: str | None) -> str:
    """The one-line message for a failed download, by the kind of failure (checked in this order: the hub's own
    errors subclass the generic ones below them)."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    waited = f"{hub_timeout():g} s"
    beforehand = (
        f"set HF_HUB_OFFLINE=1 to use the cache only, or download the model beforehand with "
        f"`hf download {repo_id}` (or pass a local model directory)"
    )
    match e:
        case HFValidationError():  # also what hf:NAME with characters a hub id cannot hold ends in
            return (
                f"{where} is not a hub model id; write hf:ORG/NAME, e.g. hf:openai-community/gpt2 (the hub says: "
                f"{first_line(e, 200)})"
            )
        case GatedRepoError():
            return (
                f"{where} is gated: accept its license on huggingface.co and log in with `hf auth login`, then "
                "try again"
            )
        case RepositoryNotFoundError():
            return (
                f"{where} was not found on the Hugging Face hub (or is private); check the name, or log in with "
                "`hf auth login` for a private model"
            )
        case RevisionNotFoundError():
            return f"{where}: the repository has no revision {revision!r}; leave out @REVISION for the newest"
        case LocalEntryNotFoundError():  # offline (HF_HUB_OFFLINE=1 or no network) and not in the cache
            reach = (
                "HF_HUB_OFFLINE is set"
                if constants.HF_HUB_OFFLINE
                else f"the hub at {constants.ENDPOINT} cannot be reached or did not answer in {waited}: offline? "
                "check HF_ENDPOINT (HF_HUB_ETAG_TIMEOUT=SECONDS waits longer)"
            )
            return (
                f"{where} is not in the Hugging Face cache ({_hub_cache()}) and {reach}; download it beforehand "
                f"with `hf download {repo_id}` (or run this once online), or pass a local model directory"
            )
        case httpx2.TimeoutException():
            return (
                f"the hub at {constants.ENDPOINT} did not answer for {where} within {waited} (check HF_ENDPOINT "
                f"and the network; HF_HUB_ETAG_TIMEOUT=SECONDS waits longer); {beforehand}"
            )
        case ValueError() | KeyError() | TypeError() | httpx2.HTTPError():  # a captive portal's HTML, `{}`, cut
            return (
                f"the hub at {constants.ENDPOINT} gave an answer for {where} that is not the hub's "
                f"({type(e).__name__}; a proxy or captive portal? check HF_ENDPOINT); {beforehand}"
            )
        case _:  # OSError: HTTP errors are OSErrors too: the hub is down, a proxy refuses, the disk is full
            return (
                f"cannot download {where} ({first_line(e, 160)}); try again, or download it with "
                f"`hf download {repo_id}` and pass the directory"
            )
