"""The attention lab's offline page (minigpt.lab.html), opened in headless Chromium: no link out, every view built."""

import numpy as np
import pytest
from PIL import Image

from browser import chromium_path, open_page, screenshot
from minigpt.core.tokenizers import CharTokenizer
from minigpt.lab.capture import capture_attention
from minigpt.lab.html import write_html
from support import LAB_CHARS as CHARS
from support import LAB_PROMPT as PROMPT
from support import lab_model as random_model


def test_page_is_offline_and_builds_its_views_in_chromium(tmp_path):
    model = random_model("llama", n_layer=2, n_head=4, n_kv_head=2)
    capture = capture_attention(model, CharTokenizer(CHARS), PROMPT)
    page = write_html(capture, tmp_path / "attention.html", title=PROMPT)
    text = page.read_text(encoding="utf-8")
    for bad in ("http://", "https://", "//", "</script> c"):
        assert bad not in text, bad
    if chromium_path() is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    state = open_page(page)
    assert state.ready and state.errors == "[]", state.errors
    L, H, T = 2, 4, len(PROMPT)
    assert state.count(r'class="mv-cell"') == L * H  # model view: one heatmap per layer and head
    tbody = state.dom.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    assert tbody.count("<tr") == L * H  # the heads table
    assert state.count(r'class="tok[ "]') == 2 * T  # head view: the tokens twice
    lines = int(state.dom.split('data-lines="', 1)[1].split('"', 1)[0])
    assert lines >= L * T  # head view: at least one line per query and head of the layer shown
    assert state.count(r'class="group"') == 2 and "share 2 key/value heads" in state.dom  # GQA: 4 heads on 2

    shot = screenshot(page, tmp_path / "screenshot.png")
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert pixels.shape == (1000, 1400) and pixels.std() > 20, "the screenshot is blank"
