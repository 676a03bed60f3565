"""The static decode step that CUDA graphs replay (minigpt.core.decode_graphs), run eagerly on the CPU (the graphs'
fallback): over a cache allocated once, attending over all of it with the mask from the position tensor, it gives
the growing cache's logits and greedy ids, on every attention path, and a padded batch bucket changes no row."""

from __future__ import annotations

import pytest
import torch

import minigpt.core.compiled as compiled
from minigpt.core.decode_graphs import DecodeGraphs, batch_buckets
from minigpt.core.generation import generate
from support import random_ids, varied_gpt

pytestmark = pytest.mark.usefixtures("one_thread")
PATHS = ["sdpa", "manual", "einops"]
BLOCK = 32  # varied_gpt's block_size


def test_batch_buckets_double_up_to_the_largest_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head", [("gpt", 4), ("llama", 2)])
def test_static_step_gives_the_growing_caches_logits_for_rows_at_their_own_positions(arch, n_kv_head, attention):
    """Three rows at different lengths in a cache of five rows: every step runs in bucket 4 (one padding row), and
    each row's logits are those of the plain per-row step over a cache that grows with the sequence."""
    model = varied_gpt(arch, n_kv_head, attention)
    g = torch.Generator().manual_seed(4)
    lengths = [9, 3, 14]
    seqs = [torch.randint(0, 60, (n + 8,), generator=g) for n in lengths]
    graphs = DecodeGraphs(model, rows=5, capacity=BLOCK)
    assert graphs.cache[0].k.size(2) == BLOCK and graphs.cache[0].static
    growing = model.new_kv_cache(3)
    with torch.inference_mode():
        for row, (s, n) in enumerate(zip(seqs, lengths)):
            one = model.new_kv_cache(1)
            model(s[None, :n], kv_cache=one, input_pos=0)
            for layer, static_layer, source in zip(growing, graphs.cache, one):
                layer.copy_row(row, source, 0, n)
                static_layer.copy_row(row, source, 0, n)
        pos = torch.tensor(lengths)
        for _ in range(8):
            idx = torch.stack([s[p : p + 1] for s, p in zip(seqs, pos.tolist())])  # (3, 1)
            expected = model(idx, kv_cache=growing, input_pos=pos)[0][:, -1]
            got = graphs(idx, pos)
            assert got.shape == expected.shape
            assert (got - expected).abs().max().item() <= 1e-5
            pos = pos + 1
    assert graphs.bucket_steps == {1: 0, 2: 0, 4: 8, 5: 0}
    assert not graphs.graphs  # nothing captured on a CPU


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head", [("gpt", 4), ("llama", 2)])
def test_generate_through_the_graph_path_gives_the_plain_loops_greedy_ids(monkeypatch, arch, n_kv_head, attention):
    """generate(compile=True) as it runs on a GPU (static cache, the step at a device position), eagerly: the same
    greedy ids for two rows, also past block_size (the refill prefills the static cache again)."""
    monkeypatch.setattr(compiled, "uses_graphs", lambda model: True)
    model = varied_gpt(arch, n_kv_head, attention)
    idx = random_ids()
    n = 2 * BLOCK
    plain = generate(model, idx, n, temperature=0)
    assert len(set(plain[0, 5:].tolist())) > 4  # varied output, so the comparison means something
    assert torch.equal(generate(model, idx, n, temperature=0, compile=True), plain)
    graphs = compiled.decode_graphs(model, 2, BLOCK)
    assert graphs.bucket_steps[2] == n - 4  # every step but the prefill and three refills ran the static step
    short = generate(model, idx, 9, temperature=0, compile=True)  # 14 positions: a cache of 16, new graphs
    assert torch.equal(short, plain[:, :14])
    assert compiled.decode_graphs(model, 2, 16).bucket_steps[2] == 8


def test_the_models_graphs_are_kept_for_its_next_generation_and_renewed_when_its_weights_move(monkeypatch):
    monkeypatch.setattr(compiled, "uses_graphs", lambda model: True)
    model = varied_gpt("llama", 2)
    idx = random_ids(batch=1)
    first = generate(model, idx, 20, temperature=0, compile=True)
    graphs = compiled.decode_graphs(model, 1, BLOCK)
    assert torch.equal(generate(model, idx, 20, temperature=0, compile=True), first)
    assert compiled.decode_graphs(model, 1, BLOCK) is graphs  # 25 positions round up to 32 both times
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # new memory: new graphs
    assert compiled.decode_graphs(model, 1, BLOCK) is not graphs


def test_a_step_that_cannot_be_captured_runs_eagerly_with_one_note(monkeypatch, capsys):
    def no_capture(self, b):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(DecodeGraphs, "_capture", no_capture)
    model = varied_gpt("llama", 2)
    graphs = DecodeGraphs(model, rows=1, capacity=BLOCK, capture=True)
    growing = model.new_kv_cache(1)
    idx = random_ids(batch=1, length=6)
    with torch.inference_mode():
        for t in range(6):
            expected = model(idx[:, t : t + 1], kv_cache=growing, input_pos=t)[0][:, -1]
            assert torch.allclose(graphs(idx[:, t : t + 1], t), expected, atol=1e-5)
    assert (
        capsys.readouterr().err
        == "note: decoding without CUDA graphs: operation not permitted when stream is capturing\n"
    )
