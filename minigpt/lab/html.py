"""Attention lab, part 3: the self-contained page, attention.html.

One file that opens from disk with no network: the style, the script (minigpt/lab/assets/attention_lab.*) and the
data are inlined.  The weights travel compactly: each head's lower triangle (the causal mask makes the rest
zero) quantised to one byte (weight * 255), zlib-compressed, base64 (URL-safe alphabet); the page inflates
them with the browser's DecompressionStream.  The file never holds "//" (no URL, no // comment): it would
make a page meant for offline use look like it reaches out, and the tests check it.
"""

from __future__ import annotations

import base64
import html
import json
import math
import zlib
from importlib import resources
from pathlib import Path

import numpy as np

from minigpt.lab.capture import METRICS, AttentionCapture

__all__ = ["render_html", "write_html", "pack_weights"]


def _asset(name: str) -> str:
    return resources.files("minigpt.lab").joinpath("assets", name).read_text(encoding="utf-8")


def pack_weights(weights: np.ndarray) -> str:
    """(L, H, T, T) weights -> base64url(zlib(uint8 lower triangles, row by row, head after head))."""
    w = np.asarray(weights, dtype=np.float32)
    rows, cols = np.tril_indices(w.shape[-1])
    quantised = np.round(np.clip(w[..., rows, cols], 0, 1) * 255).astype(np.uint8)  # (L, H, T(T+1)/2)
    return base64.urlsafe_b64encode(zlib.compress(quantised.tobytes(), 6)).decode("ascii")


def _summary(capture: AttentionCapture) -> str:
    c = capture.config
    parts = [f"{c.get('arch', 'gpt')} model", f"{capture.n_layer} layers", f"{capture.n_head} heads"]
    if capture.kv_group > 1:
        parts.append(f"{capture.n_head // capture.kv_group} key/value heads")
    if c.get("n_embd"):
        parts.append(f"n_embd {c['n_embd']}")
    parts.append(f"{len(capture.tokens)} tokens")
    return ", ".join(parts)


def _json_for_script(value: object) -> str:
    """JSON safe inside <script>: "</" cannot close the element, and every "/" is escaped so no "//" appears."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False).replace("/", "\\/").replace("<", "\\u003c")


def render_html(capture: AttentionCapture, title: str = "") -> str:
    """The page for one capture, as a string."""
    metrics = {
        k: [[None if math.isnan(x) else round(float(x), 4) for x in row] for row in v.tolist()]
        for k, v in capture.metrics.items()
    }
    data = {
        "n_layer": capture.n_layer,
        "n_head": capture.n_head,
        "kv_group": capture.kv_group,
        "tokens": capture.tokens,
        "summary": _summary(capture) + (f" \u2014 {title}" if title else ""),
        "metric_names": list(METRICS),
        "metric_titles": [t for t, _ in METRICS.values()],
        "metric_info": [i for _, i in METRICS.values()],
        "metrics": metrics,
        "induction_tokens": capture.induction_tokens,
        "weights": pack_weights(capture.weights.numpy()),
    }
    page = _asset("attention_lab.html")
    for key, value in (
        ("__STYLE__", _asset("attention_lab.css")),
        ("__SCRIPT__", _asset("attention_lab.js")),
        ("__TITLE__", html.escape(title or _summary(capture)).replace("/", "&#47;")),
        ("__DATA__", _json_for_script(data)),
    ):
        page = page.replace(key, value, 1)
    assert "//" not in page, "the page must not hold '//' (see the module docstring)"
    return page


def write_html(capture: AttentionCapture, path: str | Path, title: str = "") -> Path:
    path = Path(path)
    path.write_text(render_html(capture, title), encoding="utf-8")
    return path
