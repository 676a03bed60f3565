"""train.py --finetune lora end to end on tiny models: the base stays byte for byte, checkpoints hold the adapters
and where the base is, load_model merges them, resume is exact, chat data grows trained rows, and every refusal
(full vs LoRA resume, another base, other adapter shapes) is one line that leaves the run as it was."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from minigpt.cli.sample import main as sample_main
from minigpt.cli.train import main
from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.checkpoint import model_state_dict, read_checkpoint
from minigpt.core.errors import UserError
from minigpt.core.lora import SECTION_KEY, LoRAConfig, LoRALinear, adapter_names, fingerprint
from minigpt.loading import load_lora_run, load_model
from minigpt.training.finetune_lora import check_finetune_resumable
from support import flags


@pytest.fixture(scope="module")
def source_run(tiny_run_args, corpus, data_root, tmp_path_factory):
    """A tiny scratch run (block_size 64, for the chat rows): the base every test here adapts."""
    out = tmp_path_factory.mktemp("source") / "run"
    main(tiny_run_args(corpus, data_root, out, steps=20, model__block_size=64))
    return out


@pytest.fixture(scope="module")
def lora_args(tiny_run_args):
    def build(corpus, data_root, out, source, steps=10, **overrides):
        """tiny_run_args without model keys (the model comes from the source), float32, rank 4."""
        args = tiny_run_args(
            corpus,
            data_root,
            out,
            steps=steps,
            trainer__precision="32-true",
            optim__learning_rate=0.02,
            optim__decay_steps=20,
            sample_tokens=0,
        )
        pairs = [(k, v) for k, v in zip(args[::2], args[1::2]) if not k.startswith("--model.")]
        pairs += [(f"--{k.replace('__', '.')}", str(v)) for k, v in {"lora__rank": 4, **overrides}.items()]
        return [x for pair in pairs for x in pair] + ["--init_from", str(source), "--finetune", "lora"]

    return build


def test_a_lora_run_trains_adapters_only_and_load_model_merges_them(
    lora_args, source_run, corpus, data_root, tmp_path, record_training_losses, monkeypatch
):
    seen = record_training_losses(monkeypatch)
    out = tmp_path / "lora"
    trainer = main(lora_args(corpus, data_root, out, source_run))
    source, _ = load_model(source_run)
    model = trainer.lightning_module.model.eval()

    batch, first_loss = seen[0]  # fresh adapters: the first step sees the source's function
    with torch.no_grad():
        _, loss = source(batch[:, :-1], batch[:, 1:])
    assert first_loss == pytest.approx(loss.item(), abs=1e-6)

    trained = set(adapter_names(model))
    for name, tensor in source.state_dict().items():  # the base's bytes, after 10 optimizer steps
        assert name in model.state_dict() and torch.equal(model.state_dict()[name], tensor), name
    assert any(
        not torch.equal(model.state_dict()[n], torch.zeros_like(model.state_dict()[n]))
        for n in trained
        if ".lora_B." in n
    )

    ckpt = read_checkpoint(out / "checkpoints" / "last.ckpt")
    assert set(model_state_dict(ckpt)) == trained  # adapters only, and their optimizer state only
    assert len(ckpt["optimizer_states"][0]["state"]) == len(trained)
    base = ckpt["minigpt"]["lora"]["base"]
    assert base["source"] == str((source_run / "checkpoints" / "best.ckpt").resolve())
    assert base["fingerprint"] == fingerprint(source)
    assert ckpt["minigpt"]["lora"]["config"]["rank"] == 4
    size = (out / "checkpoints" / "last.ckpt").stat().st_size
    assert size < (source_run / "checkpoints" / "last.ckpt").stat().st_size / 2

    merged, tokenizer = load_model(out)  # sample.py, eval.py and the server load it this way
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    idx = torch.randint(0, tokenizer.vocab_size, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(merged(idx)[0], model(idx)[0], atol=1e-5, rtol=0)
    unmerged, _, lora = load_lora_run(out)
    assert lora.rank == 4 and any(isinstance(m, LoRALinear) for m in unmerged.modules())


def test_train_embeddings_trains_and_saves_the_embeddings_and_load_model_merges_them(
    lora_args, source_run, corpus, data_root, tmp_path
):
    out = tmp_path / "lora"
    trainer = main(lora_args(corpus, data_root, out, source_run, lora__train_embeddings="true"))
    source, _ = load_model(source_run)
    model = trainer.lightning_module.model.eval()
    trained = set(adapter_names(model))
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= trained
    assert not torch.equal(model.state_dict()["transformer.wte.weight"], source.state_dict()["transformer.wte.weight"])
    ckpt = read_checkpoint(out / "checkpoints" / "last.ckpt")
    assert set(model_state_dict(ckpt)) == trained and ckpt["minigpt"]["lora"]["config"]["train_embeddings"]
    merged, tokenizer = load_model(out)
    idx = torch.randint(0, tokenizer.vocab_size, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(merged(idx)[0], model(idx)[0], atol=1e-5, rtol=0)


def test_a_lora_run_whose_best_is_not_its_end_reports_the_full_split_loss_of_both(
    lora_args, source_run, corpus, data_root, tmp_path, monkeypatch, capsys
):
    """The best checkpoint of a LoRA run holds the adapters only: its full-split line puts them on the live base
    (issue 49 item 3).  The reference: the full split's loss a shorter run printed for its own final adapters, here
    made the longer run's best; the module keeps its final adapters."""
    from minigpt.training import run_end

    main(lora_args(corpus, data_root, tmp_path / "short", source_run, steps=4))
    short = re.search(r"^full val loss ([\d.]+) over all", capsys.readouterr().out, re.M)[1]
    earlier = tmp_path / "short" / "checkpoints" / "last.ckpt"
    monkeypatch.setattr(run_end, "best_checkpoint", lambda trainer, last: (earlier, 4, 0.0))
    trainer = main(lora_args(corpus, data_root, tmp_path / "long", source_run, steps=10))
    out = capsys.readouterr().out
    final = re.search(r"^full val loss ([\d.]+) over all", out, re.M)[1]
    assert re.search(rf"^full val loss of last\.ckpt \(step 4\): {short} over all [\d,]+ validation tokens", out, re.M)
    assert final != short
    saved = model_state_dict(read_checkpoint(tmp_path / "long" / "checkpoints" / "last.ckpt"))
    live = trainer.lightning_module.model.state_dict()
    assert saved.keys() < live.keys() and all(torch.equal(live[k], v) for k, v in saved.items())


def test_a_lora_run_resumes_exactly(lora_args, source_run, corpus, data_root, tmp_path):
    def args(out, steps):
        return lora_args(corpus, data_root, tmp_path / out, source_run, steps=steps, lora__dropout=0.1)

    main(args("straight", 12))
    main(args("resumed", 6))
    trainer = main(args("resumed", 12) + ["--resume", "true"])
    assert trainer.global_step == 12
    a = model_state_dict(read_checkpoint(tmp_path / "straight" / "checkpoints" / "last.ckpt"))
    b = model_state_dict(read_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.ckpt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed must match straight bitwise"


def test_activation_checkpointing_may_be_switched_on_when_a_lora_run_resumes(
    lora_args, source_run, corpus, data_root, tmp_path
):
    """A runtime setting: a LoRA run resumed with --model.activation_checkpointing true (the recompute redraws the
    adapters' dropout masks) ends where the run without it ends."""

    def args(out, steps):
        return lora_args(corpus, data_root, tmp_path / out, source_run, steps=steps, lora__dropout=0.1)

    main(args("straight", 12))
    main(args("resumed", 6))
    trainer = main(args("resumed", 12) + ["--resume", "true", "--model.activation_checkpointing", "true"])
    assert trainer.global_step == 12 and trainer.lightning_module.model.config.activation_checkpointing
    a = model_state_dict(read_checkpoint(tmp_path / "straight" / "checkpoints" / "last.ckpt"))
    b = model_state_dict(read_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.ckpt"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-5, msg=name)


def test_naming_the_default_base_dtype_on_resume_is_no_conflict(tmp_path):
    """base_dtype unset holds the base as loaded, in float32: --lora.base_dtype float32 on resume was refused as a
    setting the run was not trained with."""
    ckpt = {"minigpt": {SECTION_KEY: {"config": LoRAConfig(rank=4).to_dict(), "base": {"source": "b"}}}}
    check_finetune_resumable(ckpt, LoRAConfig(rank=4, base_dtype="float32"), tmp_path / "last.ckpt")
    with pytest.raises(UserError, match=r"lora.base_dtype='float32' \(this run's config gives 'bfloat16'\)"):
        check_finetune_resumable(ckpt, LoRAConfig(rank=4, base_dtype="bfloat16"), tmp_path / "last.ckpt")


def test_resuming_as_another_kind_of_run_or_on_another_base_is_refused(
    lora_args, tiny_run_args, source_run, corpus, data_root, tmp_path
):
    out = tmp_path / "lora"
    main(lora_args(corpus, data_root, out, source_run, steps=4))
    last = out / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    full = [a for a in lora_args(corpus, data_root, out, source_run, steps=8) if a not in ("--finetune", "lora")]
    other_base = tmp_path / "other"
    main(tiny_run_args(corpus, data_root, other_base, steps=3, model__block_size=64))
    refusals = {
        "is a LoRA run .* resume it with --finetune lora": full + ["--resume", "true"],
        r"was trained with lora.rank=4 \(this run's config gives 8\)": lora_args(
            corpus, data_root, out, source_run, steps=8, lora__rank=8
        )
        + ["--resume", "true"],
        "was trained on the base .* and init_from .* is another model .* resume with --init_from": lora_args(
            corpus, data_root, out, other_base, steps=8
        )
        + ["--resume", "true"],
        "is a full fine-tuning run .* resume it without --finetune lora": lora_args(
            corpus, data_root, other_base, source_run, steps=8
        )
        + ["--resume", "true"],
    }
    for match, argv in refusals.items():
        with pytest.raises(UserError, match=match) as e:
            main(argv)
        assert "\n" not in str(e.value)
    assert last.read_bytes() == before  # nothing written before is lost
    assert load_model(out)[0] is not None
    main(lora_args(corpus, data_root, out, source_run, steps=6, lora__dropout=0.2) + ["--resume", "true"])


def test_resuming_on_a_base_that_changed_in_place_says_to_put_it_back(
    lora_args, source_run, corpus, data_root, tmp_path
):
    """The base retrained where it was: the advice was to resume with --init_from that same path, which fails again."""
    import shutil

    from minigpt.core.checkpoint import save_file

    base = Path(shutil.copytree(source_run, tmp_path / "base"))
    out = tmp_path / "lora"
    main(lora_args(corpus, data_root, out, base, steps=4))
    for ckpt_path in (base / "checkpoints").glob("*.ckpt"):  # the base trained on since
        ckpt = read_checkpoint(ckpt_path)
        name = next(k for k in ckpt["state_dict"] if k.endswith("lm_head.weight"))
        ckpt["state_dict"][name] = ckpt["state_dict"][name] + 1
        save_file(ckpt, ckpt_path)
    with pytest.raises(UserError, match=r"which changed since .*; put the base it was trained on back there"):
        main(lora_args(corpus, data_root, out, base, steps=8) + ["--resume", "true"])


def test_targets_are_a_set_so_a_resume_that_lists_them_in_another_order_is_the_same_run():
    """[v, q] and [q, q, v] train the adapters [q, v] train: a resume given them was refused as another config."""
    assert LoRAConfig(targets=["v", "q", "q"]).targets == ["q", "v"]
    saved = {"minigpt": {SECTION_KEY: {"config": LoRAConfig(targets=["q", "v"]).to_dict(), "base": {}}}}
    check_finetune_resumable(saved, LoRAConfig(targets=["v", "q"]), Path("run/checkpoints/last.ckpt"))
    with pytest.raises(UserError, match=r"lora.targets=\['q', 'v'\] \(this run's config gives \['q', 'k', 'v'\]\)"):
        check_finetune_resumable(saved, LoRAConfig(targets=["v", "k", "q"]), Path("run/checkpoints/last.ckpt"))


@pytest.mark.parametrize("train_embeddings", [False, True])
def test_a_target_the_model_does_not_have_is_refused_before_anything_is_written(
    lora_args, source_run, corpus, data_root, tmp_path, train_embeddings
):
    """gate on a GELU (gpt) model: no adapter could train (a traceback in backward), or with train_embeddings only
    the embedding rows would (silently); refused in one line naming the model's projections, out_dir untouched."""
    out = tmp_path / "lora"
    argv = lora_args(corpus, data_root, out, source_run, steps=2, lora__train_embeddings=train_embeddings)
    with pytest.raises(UserError) as e:
        main([*argv, "--lora.targets", "[gate]"])
    assert str(e.value) == (
        "lora.targets: this model has no gate projection (its MLP, mlp=gelu, is not gated); choose from its "
        "projections q, k, v, o, up, down"
    )
    assert not out.exists()
    with pytest.raises(UserError, match="no gate projection"):  # one target it lacks among others: the same
        main([*argv, "--lora.targets", "[q,gate]"])
    assert not out.exists()


@pytest.mark.slow  # about 15 s: a chat LoRA run on a llama base with a bfloat16 base, then a chat
def test_chat_data_trains_new_token_rows_and_the_run_chats(tiny_run_args, corpus, data_root, tmp_path):
    main(
        tiny_run_args(
            corpus,
            data_root,
            tmp_path / "base",
            steps=5,
            model__block_size=64,
            model__arch="llama",
            model__n_kv_head=1,
            model__tie_embeddings="false",
        )
    )
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} + {a + 1}?"},
                {"role": "assistant", "content": str(2 * a + 1)},
            ]
        }
        for a in range(60)
    ]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {
        "data.source": chats,
        "data.format": "chat",
        "data.data_root": data_root,
        "out_dir": tmp_path / "sft",
        "data.batch_size": 4,
        "data.val_batches": 2,
        "trainer.max_steps": 6,
        "trainer.val_check_interval": 3,
        "trainer.enable_progress_bar": False,
        "sample_tokens": 4,
        "init_from": tmp_path / "base",
        "finetune": "lora",
        "lora.base_dtype": "bfloat16",
        "model.attention": "einops",
    }
    trainer = main(flags(args))
    model = trainer.lightning_module.model
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == torch.bfloat16
    assert {"transformer.wte.new_rows", "lm_head.new_rows"} <= set(adapter_names(model))
    merged, tokenizer = load_model(tmp_path / "sft")
    assert isinstance(tokenizer, ChatTokenizer) and merged.config.vocab_size == tokenizer.vocab_size
    out = io.StringIO()
    sample_main(
        ["--ckpt", str(tmp_path / "sft"), "--chat", "--temperature", "0", "--max_new_tokens", "4"],
        stdout=out,
        stdin=io.StringIO("What is 1 + 2?\n"),
    )
    assert len(out.getvalue().splitlines()) == 1
