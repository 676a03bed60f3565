"""The attention lab: captured weights, per-head metrics, the offline page (opened in headless Chromium), the PNG
figures, the .npz, the TensorBoard images during training, and attention.py's one-line errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[2]  # the repository root
from minigpt import GPT, GPTConfig, attention_maps
from benchmarks.browser import chromium_path, open_page, screenshot
from minigpt.cli.attention import main as attention_main
from minigpt.lab.figures import CELL_INCHES, DPI, MARGIN_INCHES, grid_image, save_figures
from minigpt.lab.html import write_html
from minigpt.lab.capture import capture_attention, head_metrics, induction_scores, random_repeated_ids
from minigpt.training.callbacks import AttentionImages
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.errors import UserError
from minigpt.core.tokenizers import CharTokenizer

CHARS = "\n !',./:;<>?abcdefghijklmnopqrstuvwxyz"  # no "Z": a prompt with it must be refused
PROMPT = "a // b </script> c, a // b\nd"  # "//" and "</script>" must not leak into the page's markup


def random_model(arch: str = "gpt", n_layer: int = 2, n_head: int = 4, n_kv_head: int | None = None,
                 block_size: int = 32, vocab_size: int = len(CHARS), seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(arch=arch, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head or n_head, n_embd=32,
                    block_size=block_size, vocab_size=vocab_size, attention="sdpa")
    model = GPT(cfg)
    with torch.no_grad():  # larger than init, so attention is far from uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 2 / math.sqrt(p.shape[-1]))
    return model.eval()


def hand_built(scale: float = 10.0) -> GPT:
    """One layer, two heads, by hand: head 0 attends to the previous token, head 1 to the first token.
    Token embeddings are zero and position p is the one-hot vector e_p, so q and k see positions only."""
    T, C = 16, 32
    model = GPT(GPTConfig(arch="gpt", n_layer=1, n_head=2, n_embd=C, block_size=T, vocab_size=8, bias=True))
    hs = C // 2
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.transformer.h[0].ln_1, model.transformer.h[0].ln_2, model.transformer.ln_f):
            norm.weight.fill_(1.0)
        model.transformer.wpe.weight[:, :T] = torch.eye(T)
        attn = model.transformer.h[0].attn.c_attn  # rows: q head 0, q head 1, k head 0, k head 1, v
        for t in range(1, T):
            attn.weight[t - 1, t] = scale  # head 0's query at position t points at key direction t - 1
        for s in range(T):
            attn.weight[2 * hs + s, s] = scale  # head 0's key at position s: direction s
        attn.bias[hs] = scale  # head 1's query: the same direction everywhere
        attn.weight[3 * hs, 0] = scale  # head 1's key: large at position 0 only
    return model.eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "checkpoints" / "best.ckpt"
    path.parent.mkdir(parents=True)
    save_file(model_checkpoint(random_model("llama", n_head=4, n_kv_head=2), CharTokenizer(CHARS)), path)
    return path


# ---------------------------------------------------------------------------------------------------
# Capture and metrics


@pytest.mark.parametrize("arch,n_kv_head", [("gpt", 4), ("llama", 2)])
def test_captured_weights_are_the_manual_paths_own(arch, n_kv_head):
    model = random_model(arch, n_kv_head=n_kv_head)  # runs the sdpa path
    tok = CharTokenizer(CHARS)
    tokens, weights = attention_maps(model, tok, PROMPT)
    T = len(PROMPT)
    assert tokens == list(PROMPT) and weights.shape == (2, 4, T, T) and weights.dtype == torch.float32

    model.set_attention("manual")
    own: list[torch.Tensor] = []
    with torch.no_grad():
        model(torch.tensor([tok.encode(PROMPT)]), attn_weights=own)
    assert torch.equal(weights, torch.stack(own)[:, 0])
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, T), atol=1e-5)
    assert torch.all(weights.triu(1) == 0)
    if n_kv_head < 4:  # heads sharing a key/value head still have their own queries
        assert not torch.allclose(weights[:, 0], weights[:, 1])


def test_metrics_on_hand_built_weights():
    T = 6
    prev = torch.zeros(T, T)
    prev[0, 0] = 1
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1
    first = torch.zeros(T, T)
    first[:, 0] = 1
    uniform = torch.ones(T, T).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    m = head_metrics(torch.stack([prev, first, uniform]))
    assert m["previous"].tolist() == [1.0, pytest.approx(0.2), pytest.approx(np.mean([1 / (t + 1) for t in range(1, T)]))]
    assert m["first"].tolist()[:2] == [pytest.approx(0.2), 1.0]  # query 1's previous token is the first
    assert m["entropy"][:2].tolist() == [0.0, 0.0]
    assert m["entropy"][2].item() == pytest.approx(np.mean([math.log(t + 1) for t in range(1, T)]), rel=1e-5)
    assert m["distance"].tolist()[:2] == [1.0, pytest.approx(np.mean(range(1, T)))]

    n = 4  # [r, r]: an induction head looks from position i to i - n + 1
    induction = torch.zeros(2 * n, 2 * n)
    induction[0, 0] = 1
    for i in range(1, 2 * n):
        induction[i, i - n + 1 if i >= n else i - 1] = 1
    sink = torch.zeros(2 * n, 2 * n)
    sink[:, 0] = 1  # a first-token head never looks at i - n + 1 >= 1
    assert induction_scores(torch.stack([induction, sink]), n).tolist() == [1.0, 0.0]


def test_hand_built_model_has_a_previous_token_head_and_a_sink_head():
    capture = capture_attention(hand_built(), CharTokenizer("abcdefgh"), "abcdefghabcdefgh")  # 16 = block_size
    m = capture.metrics
    assert m["previous"][0, 0] > 0.99 and m["first"][0, 1] > 0.99
    assert m["first"][0, 0] < 0.2 and m["previous"][0, 1] < 0.2
    assert m["distance"][0, 0] == pytest.approx(1.0, abs=1e-3)
    assert capture.induction_tokens == 8 and m["induction"].max() < 0.1  # no induction head here


def test_induction_run_is_a_repeated_random_sequence_without_end_of_text():
    tok = CharTokenizer("".join(map(chr, range(200, 456))))
    tok.eot_id = 7  # as a BPE tokenizer has one
    ids = random_repeated_ids(tok, 50, seed=3)
    assert ids[:50] == ids[50:] and len(set(ids)) > 40 and tok.eot_id not in ids
    assert ids == random_repeated_ids(tok, 50, seed=3) != random_repeated_ids(tok, 50, seed=4)


# ---------------------------------------------------------------------------------------------------
# Outputs: page, figures, npz


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

    image = grid_image(capture.weights, min_cell=48, gap=2)  # the TensorBoard picture
    cell = len(PROMPT) * math.ceil(48 / len(PROMPT))
    assert image.shape == (L * cell + (L + 1) * 2, H * cell + (H + 1) * 2, 3) and image.dtype == np.uint8


def test_attention_py_writes_every_file(ckpt, tmp_path, capsys):
    attention_main(["--ckpt", str(ckpt), "--prompt", PROMPT, "--out", str(tmp_path / "lab")])
    out = capsys.readouterr().out
    assert f"captured 2 layers x 4 heads over {len(PROMPT)} tokens" in out
    names = sorted(p.name for p in (tmp_path / "lab").iterdir())
    assert names == ["attention.html", "attention.npz", "attention_grid.png", "attention_layer0.png",
                     "attention_layer1.png"]


# ---------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2


@pytest.mark.parametrize("args,message", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "a" * 33], "the prompt is 33 tokens but the model reads at most block_size=32"),
    (["--prompt", "abcZ"], "1 character(s) outside the model's char vocabulary: 'Z'"),
    (["--prompt-file", "nonexistent.txt"], "prompt file not found"),
])
def test_bad_prompts_are_one_line_errors(ckpt, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        attention_main(["--ckpt", str(ckpt), "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err



def test_a_capture_over_the_memory_budget_is_refused_before_running(monkeypatch):
    """The (L, H, T, T) weights are computed in full or not at all: a TinyLlama shape over 1,900 tokens would take
    10 GB, so a prompt over the budget is one line naming the size and the longest prompt that fits."""
    from minigpt.lab import capture

    model = random_model()  # 2 layers x 4 heads
    monkeypatch.setattr(capture, "WEIGHTS_BUDGET", 2 * 4 * 10 ** 2 * 4)  # exactly 10 tokens' weights
    assert attention_maps(model, CharTokenizer(CHARS), "a" * 10)[1].shape[-1] == 10
    monkeypatch.setattr(model, "attention_weights", lambda *a, **k: pytest.fail("computed despite the budget"))
    with pytest.raises(UserError, match=r"the prompt is 11 tokens: its attention weights \(2 layers x 4 heads x "
                                        r"11\^2 floats\) .* shorten it to 10 tokens or fewer"):
        attention_maps(model, CharTokenizer(CHARS), "a" * 11)

def test_missing_checkpoint_is_one_line_without_traceback(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "attention.py"), "--ckpt", str(tmp_path / "nope.ckpt"),
                           "--prompt", "abc"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_library_call_raises_user_error_for_an_empty_prompt():
    with pytest.raises(UserError, match="empty"):
        attention_maps(random_model(), CharTokenizer(CHARS), "")


# ---------------------------------------------------------------------------------------------------
# Training: a TensorBoard image at each validation


def test_training_logs_the_attention_grid_to_tensorboard(tiny_run_args, corpus, data_root, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from minigpt.cli.train import main as train_main

    train_main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=10))  # 1 layer x 2 heads: auto = on
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"images": 0}).Reload()
    assert "attention" in events.Tags()["images"], events.Tags()
    image = events.Images("attention")[-1]
    cell = image.height - 2 * 2  # one row (layer) of two heatmaps (heads), 2-pixel gaps
    assert image.step == 10 and cell >= 48 and image.width == 2 * cell + 3 * 2


def test_attention_images_switch():
    assert AttentionImages("auto").active_for(8, 8) and not AttentionImages("auto").active_for(12, 12)
    assert AttentionImages(True).active_for(12, 12) and not AttentionImages(False).active_for(1, 1)
    probe = AttentionImages().probe_ids(CharTokenizer("abcdef "), block_size=5)
    assert 0 < len(probe) <= 5  # characters outside the vocabulary are left out, the probe cropped
