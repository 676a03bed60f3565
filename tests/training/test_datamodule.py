"""The datamodule's windows: training's are drawn per batch from (seed, rank, batch index), fixed for resumes and
every training figure in the docs; validation's are drawn all at once, so their batching does not change them."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from minigpt.training.datamodule import VAL_STREAM, FixedWindows, RandomWindows, TokenDataModule


def datamodule(corpus, data_root, **overrides) -> TokenDataModule:
    args = {"block_size": 16, "batch_size": 4, "val_batches": 4, "seed": 7} | overrides
    return TokenDataModule(str(corpus), data_root=str(data_root), **args)


def val_windows(data: TokenDataModule) -> list[tuple[int, ...]]:
    """Every window of a validation, in order, whatever the batching."""
    windows, n_batches = data.val_batches_run()
    return [tuple(w.tolist()) for i in range(n_batches) for w in windows[i]]


def test_training_windows_are_drawn_as_before():
    """Resumes and the docs' training figures depend on these offsets: batch i of rank r is drawn from
    rng(seed, r, i), one batch at a time (the expectation was computed before validation's drawing changed)."""
    tokens = np.arange(1000)
    rank0 = RandomWindows(tokens, 8, 4, seed=1337, stream=0, length=1 << 62)
    rank1 = RandomWindows(tokens, 8, 4, seed=1337, stream=1, length=1 << 62)
    assert [rank0[i][:, 0].tolist() for i in range(3)] == [
        [541, 871, 721, 184],
        [889, 475, 837, 638],
        [515, 206, 646, 941],
    ]
    assert [rank1[i][:, 0].tolist() for i in range(2)] == [[199, 976, 183, 977], [702, 478, 375, 43]]
    assert torch.equal(rank0[5][:, :9], rank0[5][:, :1] + torch.arange(9))  # windows of block_size + 1 tokens


def test_training_batches_of_the_datamodule_are_as_before(corpus, data_root):
    """The training DataLoader's first batches on the test corpus, bit for bit as before the change."""
    data = datamodule(corpus, data_root)
    batches = [batch for _, batch in zip(range(3), data.train_dataloader())]
    assert [data.tokenizer.decode(b[0].tolist()) for b in batches] == [
        " on fox while sit",
        "ick brown warm wh",
        "over dog while on",
    ]
    digest = hashlib.sha256(b"".join(b.numpy().tobytes() for b in batches)).hexdigest()
    assert digest == "c648b4572872fdd46b313ca517f3778f05a379c1807f116c29997373d6b7a654"


def test_validation_windows_do_not_depend_on_their_batching(corpus, data_root):
    """4 batches of 6 and 2 of 12 are the same 24 windows in the same order (each batch used to draw its own, and
    the two shared about half of them)."""
    small = datamodule(corpus, data_root, val_batches=4, val_batch_size=6)
    large = datamodule(corpus, data_root, val_batches=2, val_batch_size=12)
    assert [len(b) for b in small.val_dataloader()] == [6] * 4
    assert [len(b) for b in large.val_dataloader()] == [12] * 2
    a, b = val_windows(small), val_windows(large)
    assert len(a) == 24 and a == b
    assert len(set(a)) > 20  # distinct random windows, not one repeated


def test_validation_windows_depend_on_the_seed_and_stay_apart_from_training(corpus, data_root):
    one, again, other = (val_windows(datamodule(corpus, data_root, seed=s)) for s in (7, 7, 8))
    assert one == again and one != other
    tokens = np.arange(1000)
    val = FixedWindows(tokens, 8, 4, seed=1337, stream=VAL_STREAM, length=3)
    assert len(val) == 3
    assert val[0][:, 0].tolist() != RandomWindows(tokens, 8, 4, seed=1337, stream=0, length=1)[0][:, 0].tolist()
    with pytest.raises(IndexError):
        val[3]


@pytest.mark.parametrize("world_size", [2, 4])
def test_an_epoch_is_one_pass_over_the_tokens_whatever_the_ranks(corpus, data_root, world_size):
    """Every rank's batches make one optimizer step: under DDP an epoch has 1/world_size of the steps (each rank
    took the one-process count, and an epoch was world_size passes)."""
    import types

    one = datamodule(corpus, data_root)
    several = datamodule(corpus, data_root)
    trainer = dict(global_rank=0, accumulate_grad_batches=1, global_step=0, strategy=None)
    one.trainer = types.SimpleNamespace(world_size=1, **trainer)
    several.trainer = types.SimpleNamespace(world_size=world_size, **trainer)
    one._on_cuda = several._on_cuda = lambda: False
    steps = len(one.train_dataloader())
    assert steps >= 2 * world_size  # the corpus is big enough for the count to say something
    assert len(several.train_dataloader()) == steps // world_size


def test_a_validation_split_of_fewer_batches_than_devices_is_one_line(tmp_path, data_root):
    """A chat, pair or prompt split whose rows make fewer validation batches than devices left a rank without one:
    two ranks' tracebacks from Lightning ("DataLoader within local rank has zero length"). One line instead."""
    import json
    import types

    from minigpt.core.errors import ConfigError

    rows = [
        {"messages": [{"role": "user", "content": f"{a}?"}, {"role": "assistant", "content": str(a)}]}
        for a in range(20)
    ]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = TokenDataModule(
        str(tmp_path / "chats.jsonl"), data_root=str(data_root), format="chat", val_fraction=0.1, batch_size=4
    )
    data.trainer = types.SimpleNamespace(global_rank=0, world_size=1)
    data.setup("fit")  # one process: its one batch of 2 conversations validates
    data.trainer = types.SimpleNamespace(global_rank=0, world_size=2)
    with pytest.raises(ConfigError) as refused:
        data.setup("fit")
    assert str(refused.value) == (
        "the validation split's 2 conversation(s) make 1 batch(es) of 4, fewer than the 2 devices (each needs one); "
        "set data.val_batch_size 1 or less, or a larger data.val_fraction"
    )
    data.hparams.val_batch_size = 1  # as the line says: every device gets a batch
    data.setup("fit")
    assert list(data.val_dataloader().sampler) == [0]
