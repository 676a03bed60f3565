"""The attention lab's figures (minigpt.lab.figures): the PNGs have the grid's size, the .npz holds everything, and
the TensorBoard picture's shape."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from minigpt.core.tokenizers import CharTokenizer
from minigpt.lab.capture import capture_attention
from minigpt.lab.figures import CELL_INCHES, DPI, MARGIN_INCHES, grid_image, save_figures
from support import LAB_CHARS as CHARS
from support import LAB_PROMPT as PROMPT
from support import lab_model as random_model

REPO = Path(__file__).resolve().parents[2]  # the repository root: its minigpt is the one imported


def test_pngs_have_the_grid_size_and_npz_holds_everything(tmp_path):
    L, H = 3, 2
    model = random_model(n_layer=L, n_head=H)
    capture = capture_attention(model, CharTokenizer(CHARS), PROMPT)
    paths = save_figures(capture.weights, capture.tokens, tmp_path)
    assert [p.name for p in paths] == ["attention_grid.png"] + [f"attention_layer{i}.png" for i in range(L)]
    left, top = MARGIN_INCHES
    with Image.open(paths[0]) as grid:
        assert grid.size == (round((H * CELL_INCHES + left) * DPI), round((L * CELL_INCHES + top) * DPI))
    for p in paths[1:]:
        with Image.open(p) as im:
            assert np.asarray(im.convert("L")).std() > 10

    from minigpt.lab.capture import save_npz

    with np.load(save_npz(capture, tmp_path / "attention.npz")) as npz:  # no pickles needed
        assert npz["weights"].dtype == np.float32 and np.array_equal(npz["weights"], capture.weights.numpy())
        assert npz["tokens"].tolist() == list(PROMPT) and npz["ids"].tolist() == capture.ids
        assert json.loads(str(npz["config"]))["n_layer"] == L
        assert npz["metric_previous"].shape == (L, H)

    # a smaller model's capture into the same folder: the bigger one's extra layer figure goes, the user's files stay
    (tmp_path / "attention_layer_notes.png").write_bytes(b"mine")
    smaller = capture_attention(random_model(n_layer=1, n_head=H), CharTokenizer(CHARS), PROMPT)
    save_figures(smaller.weights, smaller.tokens, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "attention_grid.png",
        "attention_layer0.png",
        "attention_layer_notes.png",
    ]

    image = grid_image(capture.weights, min_cell=48, gap=2)  # the TensorBoard picture
    cell = len(PROMPT) * math.ceil(48 / len(PROMPT))
    assert image.shape == (L * cell + (L + 1) * 2, H * cell + (H + 1) * 2, 3) and image.dtype == np.uint8


def test_drawing_leaves_the_users_matplotlib_as_it_was(tmp_path):
    """A notebook's backend (inline) and its open figures stay as they were: importing the module once switched
    the process to Agg, so the user's later plots no longer showed, and it left a warning filter installed."""
    code = (
        "import matplotlib, torch, warnings\nmatplotlib.use('svg')\nimport matplotlib.pyplot as plt\nplt.figure()\n"
        "filters = list(warnings.filters)\nfrom minigpt.lab.figures import save_figures\n"
        f"save_figures(torch.full((1, 1, 2, 2), 0.5), ['\u4e2d', 'b'], {str(tmp_path)!r})\n"
        "print(matplotlib.get_backend(), plt.get_fignums(), warnings.filters == filters)"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["svg", "[1]", "True"]
    assert "Glyph" not in ran.stderr  # the CJK label the font lacks is a box, without a warning
    assert (tmp_path / "attention_layer0.png").is_file()
