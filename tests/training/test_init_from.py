"""Fine-tuning with init_from: a new run starts from another run's (or a Hugging Face model's) weights, model
config and tokenizer, on another corpus."""

import importlib.util
import json
import math

import pytest
import torch

from minigpt.cli.errors import run_cli
from minigpt.cli.train import main
from minigpt.core.checkpoint import model_state_dict, read_checkpoint
from minigpt.core.errors import UserError
from minigpt.loading import load_model


@pytest.fixture(scope="module")
def source_run(tiny_run_args, corpus, data_root, tmp_path_factory):
    """A tiny scratch run: the model every test here fine-tunes."""
    out = tmp_path_factory.mktemp("source") / "run"
    main(tiny_run_args(corpus, data_root, out, steps=20))
    return out


@pytest.fixture(scope="module")
def other_corpus(make_corpus, tmp_path_factory):
    """Another corpus written with the source's characters (its words shuffled differently)."""
    return make_corpus(tmp_path_factory.mktemp("other") / "other.txt", n_lines=300, seed=1)


@pytest.fixture(scope="module")
def finetune_args(tiny_run_args):
    def build(corpus, data_root, out, source, steps=10, **overrides):
        """tiny_run_args without model keys (the model comes from the source), in float32 so losses compare
        exactly."""
        args = tiny_run_args(corpus, data_root, out, steps=steps, trainer__precision="32-true")
        pairs = [(k, v) for k, v in zip(args[::2], args[1::2]) if not k.startswith("--model.")]
        pairs += [(f"--{k.replace('__', '.')}", str(v)) for k, v in overrides.items()]
        return [x for pair in pairs for x in pair] + ["--init_from", str(source)]

    return build


def test_init_from_starts_from_the_source_weights_and_tokenizer(
    record_training_losses, finetune_args, source_run, other_corpus, data_root, tmp_path, monkeypatch
):
    seen = record_training_losses(monkeypatch)
    out = tmp_path / "ft"
    trainer = main(finetune_args(other_corpus, data_root, out, source_run, steps=5))
    assert trainer.global_step == 5

    source, source_tok = load_model(source_run)
    batch, first_loss = seen[0]
    with torch.no_grad():
        _, loss = source(batch[:, :-1], batch[:, 1:])
    assert first_loss == pytest.approx(loss.item(), abs=1e-5), "the first step must see the source's weights"
    assert first_loss < math.log(source.config.vocab_size) - 0.5  # far below a random model's loss

    # the tokenizer is the source's, not one rebuilt from the new corpus; the model config too
    ckpt = read_checkpoint(out / "checkpoints" / "last.ckpt")
    assert ckpt["minigpt"]["tokenizer"] == source_tok.to_dict()
    assert ckpt["minigpt"]["model_config"] == source.config.to_dict()
    assert json.loads((out / "tokenizer.json").read_text()) == source_tok.to_dict()
    assert "init_from:" in (out / "config.yaml").read_text()


def test_init_from_may_change_attention_dropout_and_shorten_block_size(
    finetune_args, source_run, other_corpus, data_root, tmp_path
):
    trainer = main(
        finetune_args(
            other_corpus,
            data_root,
            tmp_path / "ft",
            source_run,
            steps=3,
            model__attention="einops",
            model__dropout=0.1,
            model__block_size=16,
        )
    )
    cfg = trainer.lightning_module.config
    assert (cfg.attention, cfg.dropout, cfg.block_size, cfg.n_embd) == ("einops", 0.1, 16, 32)
    assert trainer.datamodule.hparams.block_size == 16
    source, _ = load_model(source_run)
    wpe = model_state_dict(read_checkpoint(tmp_path / "ft" / "checkpoints" / "last.ckpt"))["transformer.wpe.weight"]
    assert wpe.shape == (16, 32) and source.transformer.wpe.weight.shape == (32, 32)


@pytest.mark.parametrize(
    "attention,precision", [("sdpa", "32-true"), ("manual", "bf16-mixed"), ("einops", "bf16-mixed")]
)
def test_every_attention_path_and_precision_fine_tunes(
    record_training_losses,
    finetune_args,
    source_run,
    other_corpus,
    data_root,
    tmp_path,
    monkeypatch,
    attention,
    precision,
):
    seen = record_training_losses(monkeypatch)
    trainer = main(
        finetune_args(
            other_corpus,
            data_root,
            tmp_path / "ft",
            source_run,
            steps=2,
            model__attention=attention,
            trainer__precision=precision,
        )
    )
    assert trainer.lightning_module.config.attention == attention and trainer.global_step == 2
    source, _ = load_model(source_run)
    with torch.no_grad():
        _, loss = source(seen[0][0][:, :-1], seen[0][0][:, 1:])
    assert seen[0][1] == pytest.approx(loss.item(), abs=0.05 if precision == "bf16-mixed" else 1e-5)


def test_init_from_refuses_a_conflicting_model_setting(
    finetune_args, source_run, other_corpus, data_root, tmp_path, capsys
):
    with pytest.raises(
        UserError,
        match=r"init_from .*: the model comes from the source, but this run sets "
        r"model.n_layer=2 \(the source has 1\); remove these model settings",
    ):
        main(finetune_args(other_corpus, data_root, tmp_path / "ft", source_run, model__n_layer=2))
    with pytest.raises(UserError, match=r"model.block_size=64 is larger than the source's 32"):
        main(finetune_args(other_corpus, data_root, tmp_path / "ft", source_run, model__block_size=64))
    with pytest.raises(UserError, match=r"data.tokenizer is set \(byte\), but a fine-tuning run uses its source's"):
        main(finetune_args(other_corpus, data_root, tmp_path / "ft", source_run, data__tokenizer="byte"))
    with pytest.raises(UserError, match=r"^init_from: checkpoint not found: .*nowhere"):
        main(finetune_args(other_corpus, data_root, tmp_path / "ft", tmp_path / "nowhere"))


def test_a_setting_the_run_may_change_is_checked_before_the_data_is_prepared(
    finetune_args, source_run, other_corpus, tmp_path
):
    """dropout and block_size join the source's config in init_from: checked there, as a scratch run's are at parse
    time (they were checked only when the model was built, after the corpus was prepared; block_size 0 was named
    data.block_size)."""
    data_root = tmp_path / "data"
    with pytest.raises(UserError, match=r"^model.dropout: must be in \[0, 1\), got 1.5; use e.g. 0.0 or 0.1$"):
        main(finetune_args(other_corpus, data_root, tmp_path / "ft", source_run, model__dropout=1.5))
    assert not data_root.exists()
    with pytest.raises(UserError, match=r"^model.block_size: must be a positive integer, got 0; set it to 1 or more$"):
        main(finetune_args(other_corpus, data_root, tmp_path / "ft", source_run, model__block_size=0))


def test_a_refused_finetuning_run_writes_nothing_into_out_dir(
    finetune_args, source_run, other_corpus, data_root, tmp_path
):
    """A run refused because out_dir holds another run leaves that run's tokenizer.json as it was, and a source
    folder given as its own out_dir is refused before anything is written into it."""
    other = tmp_path / "other-run"
    main(finetune_args(other_corpus, data_root, other, source_run, steps=1))
    (other / "tokenizer.json").write_text("the other run's own file")
    with pytest.raises(UserError, match="already holds a run"):
        main(finetune_args(other_corpus, data_root, other, source_run, steps=1))
    assert (other / "tokenizer.json").read_text() == "the other run's own file"
    before = {p.name: p.read_bytes() for p in source_run.iterdir() if p.is_file()}
    with pytest.raises(UserError, match="is out_dir itself"):
        main(finetune_args(other_corpus, data_root, source_run, source_run, steps=1))
    assert {p.name: p.read_bytes() for p in source_run.iterdir() if p.is_file()} == before


def test_model_keys_from_a_config_file_count_as_set(finetune_args, source_run, other_corpus, data_root, tmp_path):
    config = tmp_path / "ft.yaml"
    config.write_text("model:\n  block_size: 16\n  n_head: 4\n  n_embd: 32\n")  # n_embd agrees with the source
    with pytest.raises(UserError, match=r"this run sets model.n_head=4 \(the source has 2\); remove"):
        main(["--config", str(config)] + finetune_args(other_corpus, data_root, tmp_path / "ft", source_run))
    config.write_text("model:\n  block_size: 16\n")
    trainer = main(
        ["--config", str(config)] + finetune_args(other_corpus, data_root, tmp_path / "ft", source_run, steps=1)
    )
    assert trainer.lightning_module.config.block_size == 16


def test_print_config_of_a_finetune_fed_back_is_the_same_run(
    finetune_args, source_run, other_corpus, data_root, tmp_path, capsys
):
    """--print_config of a fine-tune leaves out the model settings and data.tokenizer the source fills (those the
    user did not set): fed back as --config it trains the same run, not one refused for the defaults it printed."""
    args = finetune_args(other_corpus, data_root, tmp_path / "ft", source_run, steps=2, model__dropout=0.1)
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "tokenizer:" not in printed and "n_layer" not in printed and "  dropout: 0.1" in printed
    (tmp_path / "printed.yaml").write_text(printed)
    main(["--config", str(tmp_path / "printed.yaml"), "--out_dir", str(tmp_path / "again")])
    main(args)
    state, again = (
        model_state_dict(read_checkpoint(tmp_path / d / "checkpoints" / "last.ckpt")) for d in ("ft", "again")
    )
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)


def test_a_character_the_source_lacks_is_one_line(finetune_args, source_run, data_root, tmp_path, capsys):
    text = tmp_path / "new.txt"
    text.write_text("the quick brown fox says Zzz!\n" * 200)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main(finetune_args(text, data_root, tmp_path / "ft", source_run)))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and err.startswith("error: ")
        and err.endswith(
            "new.txt has 2 character(s) not in the char tokenizer's vocabulary: '!', 'Z'; remove them, use a char "
            "tokenizer made from text that has them, or the byte tokenizer, which encodes any text"
        )
    ), err


def test_resume_continues_a_finetuning_run_exactly(
    finetune_args, source_run, other_corpus, data_root, tmp_path, monkeypatch
):
    def args(out, steps):
        return finetune_args(
            other_corpus, data_root, tmp_path / out, source_run, steps=steps, optim__decay_steps=12, model__dropout=0.1
        )

    main(args("straight", 12))
    main(args("resumed", 6))
    # resuming must not read the source again (nor load its weights over the checkpoint)
    monkeypatch.setattr("minigpt.training.init_from.load_model", lambda *a, **k: pytest.fail("source read on --resume"))
    trainer = main(args("resumed", 12) + ["--resume", "true"])
    assert trainer.global_step == 12
    a = model_state_dict(read_checkpoint(tmp_path / "straight" / "checkpoints" / "last.ckpt"))
    b = model_state_dict(read_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.ckpt"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_that_names_another_source_is_refused_and_the_runs_record_kept(
    finetune_args, tiny_run_args, source_run, other_corpus, corpus, data_root, tmp_path
):
    """--resume --init_from OTHER was accepted: the run went on from its checkpoint, and config.yaml was rewritten
    to name OTHER as where it started (a scratch run resumed with an init_from, too)."""
    out, scratch = tmp_path / "tuned", tmp_path / "scratch"
    main(finetune_args(other_corpus, data_root, out, source_run, steps=2))
    main(tiny_run_args(corpus, data_root, scratch, steps=2))
    record = (out / "config.yaml").read_text()
    other = finetune_args(other_corpus, data_root, out, scratch, steps=4) + ["--resume", "true"]
    with pytest.raises(UserError, match=f"was started from init_from {source_run} .* names init_from {scratch}; "):
        main(other)
    with pytest.raises(UserError, match="was started from scratch .*; resume without --init_from"):
        main(finetune_args(corpus, data_root, scratch, source_run, steps=4) + ["--resume", "true"])
    assert (out / "config.yaml").read_text() == record
    assert main(finetune_args(other_corpus, data_root, out, source_run, steps=4) + ["--resume", "true"])


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("minigpt.hf.load") is None,
    reason="needs transformers and minigpt.hf.load (the Hugging Face import)",
)
def test_init_from_a_hugging_face_gpt2_directory(
    record_training_losses, finetune_args, other_corpus, data_root, tmp_path, monkeypatch
):
    """A small random GPT-2 saved with save_pretrained, with a char-level tokenizer.json of ours."""
    import transformers

    from minigpt.core.tokenizers import CharTokenizer
    from minigpt.hf.tokenizer_files import save_hf_tokenizer

    tok = CharTokenizer(other_corpus.read_text())
    config = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    hf_dir = tmp_path / "hf-gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(hf_dir)
    save_hf_tokenizer(tok, hf_dir)

    seen = record_training_losses(monkeypatch)
    trainer = main(finetune_args(other_corpus, data_root, tmp_path / "ft", hf_dir, steps=3))
    assert trainer.global_step == 3
    batch, first_loss = seen[0]
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = hf_model(batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    assert first_loss == pytest.approx(expected.item(), abs=1e-4), "the first step must see the HF weights"


def test_init_from_parses_the_settings_once(finetune_args, source_run, other_corpus, data_root, tmp_path, monkeypatch):
    """Which settings the user gave (a config file's keys, the flags) comes from the one parse (issue 44): no
    second parser, and the config file's keys still count as set."""
    from minigpt.cli import train as train_cli

    parsers = []
    real_init = train_cli.TrainArgumentParser.__init__

    def init(self, *args, **kwargs):
        parsers.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(train_cli.TrainArgumentParser, "__init__", init)
    config = tmp_path / "ft.yaml"
    config.write_text("model:\n  block_size: 16\n  dropout: 0.0\n")
    argv = ["--config", str(config)] + finetune_args(other_corpus, data_root, tmp_path / "ft", source_run)
    cli = train_cli.parse(argv + ["--model.attention", "manual"])
    assert len(parsers) == 1
    assert {"model.block_size", "model.dropout", "model.attention", "init_from"} <= cli.given
    assert "model.n_layer" not in cli.given  # a default, which the source decides
    assert (cli.model.config.block_size, cli.model.config.attention) == (16, "manual")
