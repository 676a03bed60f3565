"""Each config field is declared once, in its dataclass, and is a YAML key and a CLI flag from that declaration."""

from __future__ import annotations

import typing
from dataclasses import MISSING, fields

import pytest
import yaml

from minigpt.cli.train import main, parse
from minigpt.core.config import GPTConfig
from minigpt.training.init_from import LINKED_MODEL_FIELDS
from minigpt.training.optim import OptimConfig

SECTIONS = {"model": GPTConfig, "optim": OptimConfig}


def print_config(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def other_value(field) -> object:
    """A valid value of the field's type that differs from its default."""
    tp = typing.get_type_hints(SECTIONS_BY_FIELD[field.name])[field.name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Literal:
        return next(a for a in args if a != field.default)
    if field.name == "sdpa_backend":  # flash takes no mask, which the sliding window set below needs
        return "efficient"
    if args and typing.get_origin(args[0]) is typing.Literal:  # Literal | None
        return next(a for a in typing.get_args(args[0]) if a != field.default)
    base = args[0] if args else tp
    if base is bool:
        return not field.default if field.default is not None else True
    if base is int:
        others = {"n_head": 2, "n_kv_head": 1, "n_embd": 64, "mlp_hidden": 96, "head_dim": 16, "decay_steps": 500}
        return others.get(field.name, (field.default or 1) + 1)
    if base is float:
        return {
            "dropout": 0.25,
            "min_lr_ratio": 0.5,
            "beta1": 0.8,
            "beta2": 0.9,
            "norm_eps": 1e-6,
            "partial_rotary_factor": 0.5,
        }.get(field.name, (field.default or 1.0) * 2)
    if typing.get_origin(base) is list:  # layer_types: one per layer of the n_layer set here
        n_layer = other_value(next(f for f in fields(GPTConfig) if f.name == "n_layer"))
        return ["sliding_attention", "full_attention"] * (n_layer // 2) + ["sliding_attention"] * (n_layer % 2)
    if typing.get_origin(base) is dict:
        return {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    raise AssertionError(f"no test value for {field.name}: {tp}")


SECTIONS_BY_FIELD = {f.name: cls for cls in SECTIONS.values() for f in fields(cls)}


def test_every_config_field_is_a_flag_with_the_dataclass_default(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    printed = print_config(["--config", str(empty)], capsys)  # no default.yaml: the declared defaults
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            if section == "model" and f.name in LINKED_MODEL_FIELDS:
                assert f.name not in printed[section] or printed[section][f.name] is None
                continue
            assert f.default is not MISSING
            assert printed[section][f.name] == f.default, (section, f.name)

    flags, expected = [], {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            if section == "model" and f.name in LINKED_MODEL_FIELDS:
                continue
            value = other_value(f)
            flags += [f"--{section}.{f.name}", str(value).lower() if isinstance(value, bool) else str(value)]
            expected[(section, f.name)] = value
    printed = print_config(["--config", str(empty)] + flags, capsys)
    for (section, name), value in expected.items():
        assert printed[section][name] == value, (section, name, printed[section][name], value)
    # and the dataclasses accept those values together (nothing the CLI accepts fails later)
    GPTConfig(**{n: v for (s, n), v in expected.items() if s == "model"})
    OptimConfig(**{n: v for (s, n), v in expected.items() if s == "optim"})


def test_help_shows_each_fields_own_docstring(tiny_run_args, corpus, data_root, tmp_path, capsys):
    """Also after a launch without --help in the same process: only a launch that prints help reads the docstrings
    (minigpt.cli.parsing.read_field_docs), and each launch decides for itself."""
    parse(tiny_run_args(corpus, data_root, tmp_path / "run"))
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            if section == "model" and f.name in LINKED_MODEL_FIELDS:
                continue
            assert f"--{section}.{f.name}" in out, f.name
    assert "Attention path: sdpa, manual or einops." in out
    assert "Peak learning rate." in out


def test_help_group_headers_are_whole_sentences(capsys):
    """Each section's header in --help is its class's one-line summary: not a dataclass's generated signature (whose
    defaults, n_layer 6 or learning_rate 0.001, are not the ones --help lists), a class repr, or a sentence cut at
    its docstring's first line break (the trainer's, which training.md says explains --trainer.precision)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    headers = [line for line in capsys.readouterr().out.splitlines() if line[:1].isalpha() or line[:1] == "<"]
    assert not [h for h in headers if "Config(" in h or "<class " in h], headers
    assert any('"auto": bf16-mixed where bf16 is native, else 32-true' in h for h in headers), headers
    for summary in ("The model:", "The optimizer", "LoRA adapters", "The corpus, its tokenizer"):
        assert any(h.startswith(summary) for h in headers), (summary, headers)


def test_vocab_size_is_linked_from_the_data_not_a_flag(tiny_run_args, corpus, data_root, tmp_path, capsys):

    with pytest.raises(SystemExit) as exit_info:
        main(tiny_run_args(corpus, data_root, tmp_path / "run") + ["--model.vocab_size", "1000"])
    assert exit_info.value.code == 2
    assert "model.vocab_size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(learning_rate=-1e-3), "optim.learning_rate: must be a positive number"),
        (dict(min_lr_ratio=-0.5), r"optim.min_lr_ratio: must be in \[0, 1\]"),
        (dict(beta2=1.0), r"optim.beta2: must be in \[0, 1\)"),
        (dict(warmup_steps=-1), "optim.warmup_steps: must be >= 0"),
        (dict(muon_ns_steps=0), r"optim.muon_ns_steps: must be in \[1, 10\]"),
        (dict(decay_steps=0), "optim.decay_steps: must be >= 1"),
        (dict(cooldown_fraction=0.0), r"optim.cooldown_fraction: must be in \(0, 1\]"),
        (
            dict(lr_schedule="exp"),
            "optim.lr_schedule: unknown value 'exp'; choose one of cosine, linear, constant, wsd",
        ),
    ],
)
def test_optim_settings_are_range_checked_where_declared(kwargs, match):
    from minigpt.core.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        OptimConfig(**kwargs)


def test_config_from_dict_refuses_unknown_keys():
    from minigpt.core.errors import ConfigError

    d = GPTConfig.from_name("tiny").to_dict()
    assert GPTConfig.from_dict(d) == GPTConfig.from_name("tiny")
    with pytest.raises(ConfigError, match="unknown model config field"):
        GPTConfig.from_dict({**d, "n_layers": 3})
