"""The bad-input table: every user mistake the commands must answer with one `error:` line, exit code 2.

One list, three readers: `tests/cli/bad_inputs.py` runs each case through the real commands and prints the
table in docs/errors.md; `tests/cli/test_bad_inputs.py` runs each case in-process, checks the expected
fragments, and checks that docs/errors.md's table holds exactly these cases with those fragments.

A case's arguments may name files of the scratch folder that `make_workdir` fills: {w} is that folder,
{corpus} a small text, {run} a trained tiny run, {ckpt} its last checkpoint.
"""

from __future__ import annotations

import gzip
import json
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TINY = [
    "--model.n_layer",
    "1",
    "--model.n_head",
    "2",
    "--model.n_embd",
    "32",
    "--model.block_size",
    "32",
    "--data.batch_size",
    "8",
    "--data.val_batches",
    "2",
    "--trainer.max_steps",
    "10",
    "--trainer.val_check_interval",
    "10",
    "--trainer.enable_progress_bar",
    "false",
    "--sample_tokens",
    "0",
]


@dataclass
class Case:
    command: str  # train.py | sample.py | eval.py | attention.py | export.py
    case: str  # what the user did wrong, as docs/errors.md's table says it
    args: list[str]
    expect: list[str]  # fragments of the one error line
    stdin: str | None = None
    network: bool = False  # the answer depends on having no network (not run by the tests)
    base: bool = True  # train.py: start from the tiny run's settings and a new out_dir

    def argv(self, w: Path) -> list[str]:
        names = dict(
            w=str(w), corpus=str(w / "words.txt"), run=str(w / "run"), ckpt=str(w / "run" / "checkpoints" / "last.ckpt")
        )
        args = [a.format(**names) for a in self.args]
        if self.command == "train.py" and self.base:
            base = [
                "--data.source",
                names["corpus"],
                "--data.data_root",
                str(w / "data"),
                *TINY,
                "--out_dir",
                str(w / "new"),
            ]
            return base + args  # later flags win
        return args


def train(case: str, *args: str, expect: list[str], **kw) -> Case:
    return Case("train.py", case, list(args), expect, **kw)


def sample(case: str, *args: str, expect: list[str], **kw) -> Case:
    return Case("sample.py", case, list(args), expect, **kw)


def evaluate(case: str, *args: str, expect: list[str], **kw) -> Case:
    return Case("eval.py", case, list(args), expect, **kw)


def attention(case: str, *args: str, expect: list[str], **kw) -> Case:
    return Case("attention.py", case, list(args), expect, **kw)


def export(case: str, *args: str, expect: list[str], **kw) -> Case:
    return Case("export.py", case, list(args), expect, **kw)


# a GRPO run on the tiny run's checkpoint, small enough that a reward runs within a second of the first step
GRPO = [
    "--init_from",
    "{ckpt}",
    "--data.format",
    "prompts",
    "--data.source",
    "{w}/prompts.jsonl",
    "--data.batch_size",
    "2",
    "--grpo.group_size",
    "2",
    "--grpo.max_new_tokens",
    "4",
]

CASES: list[Case] = [
    train("missing corpus path", "--data.source", "{w}/no_such_corpus.txt", expect=["corpus not found"]),
    train("empty corpus", "--data.source", "{w}/empty.txt", expect=["corpus is empty"]),
    train(
        "corpus shorter than one window",
        "--data.source",
        "{w}/short.txt",
        expect=["fewer than one window of block_size + 1 = 33"],
    ),
    train(
        "binary file with the char tokenizer",
        "--data.source",
        "{w}/blob.bin",
        expect=["not UTF-8 text", "byte tokenizer"],
    ),
    train("empty data source (an unset shell variable)", "--data.source", "", expect=["the data source is empty"]),
    train("truncated .gz corpus", "--data.source", "{w}/cut.txt.gz", expect=["not a valid .gz file"]),
    train(
        "prepared data as the corpus",
        "--data.source",
        "{w}/prepared/train.bin",
        expect=["prepared/train.bin is prepared data", "pass the corpus it was prepared from"],
    ),
    train("unknown tokenizer", "--data.tokenizer", "gpt5_bpe", expect=["gpt5_bpe", "char", "byte"]),
    train(
        "tiktoken encoding not downloadable offline",
        "--data.tokenizer",
        "o200k_base",
        expect=["o200k_base", "TIKTOKEN_CACHE_DIR"],
        network=True,
    ),
    train("unknown config key", "--model.n_layers", "2", expect=["--model.n_layers", "did you mean --model.n_layer?"]),
    train("a setting without its section", "--max_steps", "20", expect=["did you mean --trainer.max_steps?"]),
    train("wrong value type", "--trainer.max_steps", "ten", expect=['"trainer.max_steps"']),
    train(
        "unknown key in a --config file",
        "--config",
        "{w}/typo.yaml",
        expect=["typo.yaml: unknown key model.n_layers; did you mean model.n_layer?"],
    ),
    train("--config file that is not UTF-8", "--config", "{w}/latin1.yaml", expect=["latin1.yaml: not UTF-8 text"]),
    train(
        "YAML syntax error in a --config file",
        "--config",
        "{w}/broken.yaml",
        expect=["broken.yaml: Problems parsing config", "at line 3, column 10"],
    ),
    train("empty --config file", "--config", "{w}/empty.yaml", expect=["empty.yaml: holds no settings"]),
    train(
        "a section of a --config file left empty",
        "--config",
        "{w}/bare_section.yaml",
        expect=["bare_section.yaml: section lora: is empty"],
    ),
    train(
        "a shell variable in a --config file's path",
        "--config",
        "{w}/variable.yaml",
        expect=["variable.yaml: out_dir: '$HOME/runs/x' holds $HOME", '--out_dir "$HOME/runs/x"'],
    ),
    train(
        "--config empty (an unset shell variable)",
        "--config",
        "",
        expect=["--config '' names no file (an unset shell variable?)"],
    ),
    train(
        "a section given twice in a --config file",
        "--config",
        "{w}/twice.yaml",
        expect=["twice.yaml:", "'model' is given twice (lines 1 and 5)", "merge them"],
    ),
    train(
        "unknown arch",
        "--model.arch",
        "mamba",
        expect=["model.arch: unknown value 'mamba'", "choose one of gpt, llama"],
    ),
    train("unknown attention", "--model.attention", "flash3", expect=["model.attention", "sdpa, manual, einops"]),
    train(
        "a model.family the model cannot be exported as",
        "--model.arch",
        "llama",
        "--model.family",
        "gpt2",
        expect=["model.family: this model would not export as gpt2", "train with arch gpt"],
    ),
    train(
        "16-true precision (float16 AdamW state diverges)",
        "--trainer.precision",
        "16-true",
        expect=["trainer.precision: 16-true trains float16 weights without loss scaling", "use 16-mixed or bf16-true"],
    ),
    train(
        "Lightning's fast_dev_run",
        "--trainer.fast_dev_run",
        "true",
        expect=["trainer.fast_dev_run: a run always saves", "--trainer.max_steps 1"],
    ),
    train(
        "a GPU's attention kernel on a CPU",
        "--model.sdpa_backend",
        "cudnn",
        "--trainer.accelerator",
        "cpu",
        expect=["model.sdpa_backend: cudnn is a CUDA kernel and this run is on cpu", "flash or math"],
    ),
    train(
        "unknown compile mode",
        "--compile_mode",
        "fast",
        expect=[
            "compile_mode: unknown value 'fast'",
            "default, reduce-overhead, max-autotune-no-cudagraphs, cudagraphs, graphed",
        ],
    ),
    train(
        "n_embd % n_head != 0",
        "--model.n_embd",
        "30",
        "--model.n_head",
        "4",
        expect=["model.n_embd: 30 is not divisible by n_head=4"],
    ),
    train(
        "n_head % n_kv_head != 0",
        "--model.n_head",
        "4",
        "--model.n_kv_head",
        "3",
        "--model.n_embd",
        "64",
        expect=["model.n_kv_head", "divisor of n_head"],
    ),
    train(
        "odd head dim with RoPE",
        "--model.arch",
        "llama",
        "--model.n_embd",
        "36",
        "--model.n_head",
        "4",
        expect=["odd", "RoPE"],
    ),
    train(
        "sliding_window below 1",
        "--model.sliding_window",
        "0",
        expect=["model.sliding_window: must be a positive integer, got 0"],
    ),
    train(
        "layer_types of the wrong length",
        "--model.sliding_window",
        "8",
        "--model.layer_types",
        "[sliding_attention, full_attention]",
        expect=["model.layer_types: needs one entry per layer (1), got 2"],
    ),
    train(
        "unknown layer type",
        "--model.sliding_window",
        "8",
        "--model.layer_types",
        "[local]",
        expect=['"model.layer_types"', "full_attention", "sliding_attention", "local"],
    ),
    train(
        "partial_rotary_factor outside (0, 1]",
        "--model.arch",
        "llama",
        "--model.partial_rotary_factor",
        "1.5",
        expect=["model.partial_rotary_factor: must be in (0, 1], got 1.5"],
    ),
    train(
        "partial rotary of an odd number of dims",
        "--model.arch",
        "llama",
        "--model.partial_rotary_factor",
        "0.1875",
        expect=["model.partial_rotary_factor: rotates 3 of each head's 16 dims, but RoPE rotates pairs"],
    ),
    train(
        "longrope RoPE past its original context",
        "--model.arch",
        "llama",
        "--model.rope_scaling",
        "{{rope_type: longrope, short_factor: [1, 1, 1, 1, 2, 2, 2, 2], long_factor: [2, 2, 2, 2, 4, 4, 4, 4], "
        "original_max_position_embeddings: 16, attention_factor: 1.2}}",  # {{ }}: the arguments are str.format-ted
        expect=["model.block_size: 32 is past longrope's original_max_position_embeddings 16", "at most 16"],
    ),
    train(
        "`rope_scaling` linear with a factor not above 0",
        "--model.arch",
        "llama",
        "--model.rope_scaling",
        "{{rope_type: linear, factor: 0}}",
        expect=["model.rope_scaling: linear needs factor > 0, got 0"],
    ),
    train(
        "attn_scale_dim below 1",
        "--model.arch",
        "llama",
        "--model.attn_scale_dim",
        "0",
        expect=["model.attn_scale_dim: must be a positive integer, got 0"],
    ),
    train("vocab_size given (it comes from the data)", "--model.vocab_size", "100", expect=["model.vocab_size"]),
    train(
        "a linked setting in a --config file (data.block_size)",
        "--config",
        "{w}/linked.yaml",
        expect=["linked.yaml: data.block_size is not a setting: it is taken from model.block_size; remove it there"],
    ),
    train(
        "negative learning rate",
        "--optim.learning_rate",
        "-0.001",
        expect=["optim.learning_rate: must be a positive number"],
    ),
    train("min_lr_ratio below 0", "--optim.min_lr_ratio", "-0.5", expect=["optim.min_lr_ratio: must be in [0, 1]"]),
    train(
        "early stopping patience 0",
        "--early_stopping.patience",
        "0",
        expect=["early_stopping.patience: must be >= 1 or null, got 0"],
    ),
    train(
        "early stopping min_delta below 0",
        "--early_stopping.patience",
        "2",
        "--early_stopping.min_delta",
        "-0.1",
        expect=["early_stopping.min_delta: must be >= 0, got -0.1"],
    ),
    train(
        "a spawning strategy",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp_spawn",
        expect=["trainer.strategy=ddp_spawn hands back only the weights, not the run; use ddp"],
    ),
    train(
        "a strategy class that spawns",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy.class_path",
        "DDPStrategy",
        "--trainer.strategy.init_args.start_method",
        "spawn",
        expect=["trainer.strategy: start_method spawn hands back only the weights", "leave start_method popen"],
    ),
    train(
        "FSDP saving sharded checkpoints",
        "--trainer.strategy.class_path",
        "FSDPStrategy",
        "--trainer.strategy.init_args.state_dict_type",
        "sharded",
        expect=["trainer.strategy: state_dict_type sharded saves each checkpoint as a folder", "leave state_dict_type"],
    ),
    train(
        "a precision whose package is missing",
        "--trainer.precision",
        "transformer-engine",
        expect=["trainer: Requirement 'transformer_engine", "pip install"],
    ),
    train("batch_size 0", "--data.batch_size", "0", expect=["data.batch_size: must be >= 1"]),
    train("val_batches 0", "--data.val_batches", "0", expect=["data.val_batches: must be >= 1"]),
    train("val_batch_size 0", "--data.val_batch_size", "0", expect=["data.val_batch_size: must be >= 1"]),
    train("val_fraction outside (0, 1)", "--data.val_fraction", "1.5", expect=["data.val_fraction: must be between"]),
    train("num_workers below 0", "--data.num_workers", "-1", expect=["data.num_workers: must be >= 0"]),
    train("seed below 0", "--seed", "-1", expect=["--seed must be in [0, 4294967295]"]),
    train(
        "val_check_interval 0", "--trainer.val_check_interval", "0", expect=["trainer.val_check_interval must be > 0"]
    ),
    train(
        "accumulate_grad_batches 0",
        "--trainer.accumulate_grad_batches",
        "0",
        expect=["trainer.accumulate_grad_batches must be >= 1"],
    ),
    train("max_time not in DD:HH:MM:SS", "--trainer.max_time", "1h", expect=["'1h'", "DD:HH:MM:SS"]),
    train("max_time of zero", "--trainer.max_time", "00:00:00:00", expect=["max_time=00:00:00:00 trains nothing"]),
    train("GPU asked for on a machine without one", "--trainer.accelerator", "gpu", expect=["trainer:", "gpu"]),
    train("devices 0", "--trainer.devices", "0", expect=["trainer:", "devices"]),
    train("FSDP asked for on a CPU", "--trainer.strategy", "fsdp", expect=["trainer:", "fsdp", "requires a GPU"]),
    train("checkpoint_every below 1", "--checkpoint_every", "-1", expect=['"checkpoint_every"']),
    train("--resume with no run there", "--resume", expect=["--resume: no checkpoint at"]),
    train(
        "resume after the corpus changed (same vocabulary size)",
        "--out_dir",
        "{run}",
        "--resume",
        "--data.source",
        "{w}/shifted.txt",
        expect=["another tokenizer", "char vocabulary"],
    ),
    train(
        "--resume where last.ckpt is gone and best.ckpt is not",
        "--out_dir",
        "{w}/only_best",
        "--resume",
        expect=["--resume: no checkpoint at", "copy checkpoints/best.ckpt", "--overwrite"],
    ),
    train(
        "--resume from a truncated last.ckpt",
        "--out_dir",
        "{w}/broken",
        "--resume",
        expect=["--resume:", "truncated", "best.ckpt", "--overwrite"],
    ),
    train(
        "checkpoint shape disagrees with the config",
        "--out_dir",
        "{run}",
        "--resume",
        "true",
        "--model.n_layer",
        "2",
        expect=["n_layer=1 (this run's config gives 2)"],
    ),
    train(
        "--resume of a finished run, max_steps not raised",
        "--out_dir",
        "{run}",
        "--resume",
        expect=["is at step 10, so --trainer.max_steps 10 trains nothing", "above 10"],
    ),
    train(
        "--resume with --overwrite", "--out_dir", "{run}", "--resume", "--overwrite", expect=["pass only one of them"]
    ),
    train("existing run, neither --resume nor --overwrite", "--out_dir", "{run}", expect=["already holds a run"]),
    train("out_dir cannot be written", "--out_dir", "{w}/a-file/run", expect=["cannot write to out_dir"]),
    train(
        "a logger's save_dir cannot be written",
        "--trainer.logger",
        "CSVLogger",
        "--trainer.logger.save_dir",
        "{w}/a-file/logs",
        expect=["cannot write to CSVLogger's save_dir", "--trainer.logger.save_dir"],
    ),
    train(
        "data_root is a file",
        "--data.data_root",
        "{w}/a-file",
        expect=["a-file is a file, not a folder", "--data.data_root"],
    ),
    sample("missing checkpoint", "--ckpt", "{w}/nope.ckpt", expect=["checkpoint not found"]),
    sample("truncated checkpoint", "--ckpt", "{w}/truncated.ckpt", expect=["truncated"]),
    sample("not a checkpoint", "--ckpt", "{w}/notes.txt", expect=["is not a checkpoint"]),
    sample(
        "checkpoint that runs code when unpickled",
        "--ckpt",
        "{w}/evil.ckpt",
        expect=["refusing to load", "only load checkpoints written by minigpt"],
    ),
    sample(
        "checkpoint whose config is implausible (n_layer=10**7)",
        "--ckpt",
        "{w}/huge.ckpt",
        expect=["n_layer=10000000, over the plausible limit"],
    ),
    sample(
        "checkpoint whose char tokenizer lists a character twice",
        "--ckpt",
        "{w}/dup_chars.ckpt",
        expect=["listed twice"],
    ),
    sample(
        "checkpoint whose char tokenizer lost characters",
        "--ckpt",
        "{w}/few_chars.ckpt",
        expect=["char tokenizer has", "characters but the model"],
    ),
    sample(
        "LoRA run whose base was moved",
        "--ckpt",
        "{w}/moved_base_lora.ckpt",
        expect=["is a LoRA run whose base", "cannot be loaded", "put the base it was trained on back there"],
    ),
    sample(
        "prompt characters outside the char vocabulary",
        "--ckpt",
        "{ckpt}",
        "--prompt",
        "Zebra ©",
        expect=["outside the model's char vocabulary", "'©'"],
    ),
    sample("temperature < 0", "--ckpt", "{ckpt}", "--temperature", "-1", expect=["temperature must be >= 0"]),
    sample("top_k < 1", "--ckpt", "{ckpt}", "--top_k", "0", expect=["top_k must be >= 1"]),
    sample("top_p outside (0, 1]", "--ckpt", "{ckpt}", "--top_p", "1.5", expect=["top_p must be in (0, 1]"]),
    sample(
        "negative max_new_tokens", "--ckpt", "{ckpt}", "--max_new_tokens", "-5", expect=["max_new_tokens must be >= 0"]
    ),
    sample(
        "unknown attention path",
        "--ckpt",
        "{ckpt}",
        "--attention",
        "flash",
        expect=["attention: unknown value 'flash'"],
    ),
    sample(
        "unknown --quantize",
        "--ckpt",
        "{ckpt}",
        "--quantize",
        "int4",
        expect=["quantize: unknown value 'int4'; choose one of int8"],
    ),
    sample("a device this machine lacks", "--ckpt", "{ckpt}", "--device", "mps", expect=["device mps"]),
    sample("seed below 0", "--ckpt", "{ckpt}", "--seed", "-1", expect=["--seed must be in [0, 4294967295]"]),
    sample(
        "a --prompt that is not UTF-8 (argv bytes)",
        "--ckpt",
        "{ckpt}",
        "--prompt",
        "ab\udcffcd",  # the byte 0xff as Python's argv holds it (surrogateescape)
        expect=["--prompt is not UTF-8 text (a byte that is not UTF-8 at character 2); pass UTF-8 text"],
    ),
    sample("--system without --chat", "--ckpt", "{ckpt}", "--system", "Be brief.", expect=["add --chat, or drop"]),
    sample(
        "--compile with --no-kv-cache",
        "--ckpt",
        "{ckpt}",
        "--compile",
        "--no-kv-cache",
        expect=["--compile compiles the KV-cache decode step, which --no-kv-cache turns off"],
    ),
    evaluate(
        "batch_size below 1",
        "--ckpt",
        "{ckpt}",
        "--text",
        "{corpus}",
        "--batch_size",
        "-1",
        expect=["batch_size must be >= 1"],
    ),
    evaluate("missing text file", "--ckpt", "{ckpt}", "--text", "{w}/nope.txt", expect=["nope.txt"]),
    evaluate(
        "unknown --quantize",
        "--ckpt",
        "{ckpt}",
        "--text",
        "{corpus}",
        "--quantize",
        "fp8",
        expect=["quantize: unknown value 'fp8'; choose one of int8"],
    ),
    evaluate(
        "text outside the char vocabulary",
        "--ckpt",
        "{ckpt}",
        "--text",
        "{w}/other.txt",
        expect=["outside the model's char vocabulary"],
    ),
    train(
        "init_from with a model setting that differs from the source's",
        "--init_from",
        "{run}",
        "--model.n_layer",
        "2",
        expect=["init_from", "model.n_layer=2", "the source has 1"],
    ),
    train(
        "init_from with a model setting it may change, out of range",
        "--init_from",
        "{run}",
        "--model.block_size",
        "0",
        expect=["model.block_size: must be a positive integer, got 0", "set it to 1 or more"],
    ),
    sample(
        "Hugging Face directory of an unsupported architecture",
        "--ckpt",
        "{w}/hf_bert",
        expect=["BertForMaskedLM", "GPT2LMHeadModel"],
    ),
    sample(
        "Qwen2 directory with sliding-window attention",
        "--ckpt",
        "{w}/hf_qwen_sliding",
        expect=["hf_qwen_sliding", "use_sliding_window=true", "use_sliding_window false"],
    ),
    sample(
        "Phi-3 directory whose partial_rotary_factor is not a number",
        "--ckpt",
        "{w}/hf_phi3_partial",
        expect=["hf_phi3_partial", "partial_rotary_factor is '0.75'", "fix the field"],
    ),
    sample(
        "Gemma 3 directory with RoPE scaling on its sliding layers, or other than linear on its full ones",
        "--ckpt",
        "{w}/hf_gemma_rope",
        expect=["hf_gemma_rope", "its RoPE scaling on sliding_attention layers is 'linear'", "plain or linear RoPE"],
    ),
    sample(
        "Gemma3ForConditionalGeneration directory without a `text_config` object",
        "--ckpt",
        "{w}/hf_gemma_mm",
        expect=["hf_gemma_mm", "(Gemma3ForConditionalGeneration) has no text_config object"],
    ),
    sample(
        "Gemma3ForConditionalGeneration directory whose `text_config` has a field of the wrong type",
        "--ckpt",
        "{w}/hf_gemma_mm_field",
        expect=["hf_gemma_mm_field", "its text_config: field 'hidden_size' is a string (\"64\")"],
    ),
    sample(
        "Gemma 3 directory with logit soft-capping",
        "--ckpt",
        "{w}/hf_gemma_softcap",
        expect=["hf_gemma_softcap", "final_logit_softcapping=30.0", "does not compute"],
    ),
    sample(
        "Gemma 3 directory whose `layer_types` is not a known kind for each layer",
        "--ckpt",
        "{w}/hf_gemma_layer_types",
        expect=["hf_gemma_layer_types", "layer_types (['sliding_attention'])", "each of its 2 layers", "fix the field"],
    ),
    sample(
        "Gemma 3 directory whose `sliding_window_pattern` is not an integer",
        "--ckpt",
        "{w}/hf_gemma_pattern",
        expect=["hf_gemma_pattern", "field 'sliding_window_pattern' is a string (\"6\")", "an integer or null"],
    ),
    sample(
        "Hugging Face directory without its weight files", "--ckpt", "{w}/hf_no_weights", expect=["model.safetensors"]
    ),
    attention(
        "prompt longer than block_size",
        "--ckpt",
        "{ckpt}",
        "--prompt",
        "a" * 40,
        "--out",
        "{w}/lab",
        expect=["40 tokens", "block_size=32"],
    ),
    attention("empty prompt", "--ckpt", "{ckpt}", "--prompt", "", "--out", "{w}/lab", expect=["prompt is empty"]),
    attention(
        "empty --out", "--ckpt", "{ckpt}", "--prompt", "def", "--out", "", expect=["--out is empty; give the folder"]
    ),
    export("no --out", "--ckpt", "{ckpt}", expect=["--out is required (see `export.py --help`)"]),
    export(
        "--out already holds files",
        "--ckpt",
        "{ckpt}",
        "--out",
        "{w}/occupied",
        expect=["already holds files", "--overwrite"],
    ),
    train("--finetune lora without init_from", "--finetune", "lora", expect=["--finetune lora", "--init_from"]),
    train(
        "LoRA rank 0",
        "--init_from",
        "{run}",
        "--finetune",
        "lora",
        "--lora.rank",
        "0",
        expect=["lora.rank: must be a positive integer, got 0"],
    ),
    train(
        "LoRA rank larger than the layer",
        "--init_from",
        "{run}",
        "--finetune",
        "lora",
        "--lora.rank",
        "64",
        expect=["lora.rank: 64 is larger than the q projection (32 x 32)", "at most 32"],
    ),
    train(
        "LoRA alpha not positive",
        "--init_from",
        "{run}",
        "--finetune",
        "lora",
        "--lora.alpha",
        "0",
        expect=["lora.alpha: must be a positive number"],
    ),
    train(
        "unknown LoRA target",
        "--init_from",
        "{run}",
        "--finetune",
        "lora",
        "--lora.targets",
        "[q,ffn]",
        expect=['"lora.targets"', "ffn"],
    ),
    train(
        "LoRA target the model does not have",
        "--init_from",
        "{run}",
        "--finetune",
        "lora",
        "--lora.targets",
        "[gate]",
        expect=["lora.targets: this model has no gate projection", "its projections q, k, v, o, up, down"],
    ),
    train(
        "resuming a LoRA run as a full one",
        "--out_dir",
        "{w}/lora_run",
        "--init_from",
        "{run}",
        "--resume",
        expect=["is a LoRA run", "--finetune lora"],
    ),
    train(
        "resuming a LoRA run on another base",
        "--out_dir",
        "{w}/lora_run",
        "--init_from",
        "{w}/other_base.ckpt",
        "--finetune",
        "lora",
        "--resume",
        expect=["was trained on the base", "is another model", "--init_from"],
    ),
    export(
        "--format peft of a run without adapters",
        "--ckpt",
        "{ckpt}",
        "--format",
        "peft",
        "--out",
        "{w}/adapter",
        expect=["is not a LoRA run", "--finetune lora"],
    ),
    export(
        "--format peft of a Hugging Face model",
        "--ckpt",
        "{w}/hf_no_weights",
        "--format",
        "peft",
        "--out",
        "{w}/adapter",
        expect=["hf_no_weights is a Hugging Face model, not a LoRA run", "--finetune lora"],
    ),
    export(
        "--format peft with --base_out the same folder as --out",
        "--ckpt",
        "{w}/lora_run",
        "--format",
        "peft",
        "--out",
        "{w}/adapter",
        "--base_out",
        "{w}/adapter",
        expect=["(the adapters) and --base_out", "are the same folder", "two separate folders"],
    ),
    # user data is bounded where it is read: JSON depth, template render budget, file kinds, memory (issue 40)
    train(
        "chat data with no --data.source (the default corpus is text)",
        "--data.format",
        "chat",
        "--data.source",
        "stdlib",
        expect=["chat data (--data.format chat) needs --data.source", "built-in plain-text corpus"],
    ),
    train(
        "chat data nested 100,000 deep",
        "--data.format",
        "chat",
        "--data.source",
        "{w}/deep.jsonl",
        expect=["deep.jsonl line 1: not JSON", "nested more than 100 levels deep"],
    ),
    train(
        "a JSON file nested 100,000 deep as the corpus",
        "--data.source",
        "{w}/deep.json",
        expect=["could not read", "nested more than 100 levels deep"],
    ),
    train(
        "a tokenizer file nested 100,000 deep",
        "--data.tokenizer",
        "{w}/deep.json",
        expect=["tokenizer file", "nested more than 100 levels deep"],
    ),
    train("bpe:VOCAB in Unicode digits", "--data.tokenizer", "bpe:²⁵⁸", expect=["'bpe:²⁵⁸'", "in the digits 0-9"]),
    train(
        "a BPE trained on a 1 MB run of one character",
        "--data.source",
        "{w}/one_run.txt",
        "--data.tokenizer",
        "bpe:4096",
        expect=["bpe:4096", "fills only", "ask for bpe:"],
    ),
    train(
        "chat template with loops of 10**10 steps",
        "--data.format",
        "chat",
        "--data.source",
        "{w}/chats.jsonl",
        "--data.chat_template",
        "{w}/loops.jinja",
        expect=["loops.jinja", "render budget of 1,000,000 steps"],
    ),
    train(
        "chat template that builds 300 MB",
        "--data.format",
        "chat",
        "--data.source",
        "{w}/chats.jsonl",
        "--data.chat_template",
        "{w}/huge.jinja",
        expect=["builds a text of 300,000,000 characters"],
    ),
    train(
        "/dev/zero as the chat template",
        "--data.format",
        "chat",
        "--data.source",
        "{w}/chats.jsonl",
        "--data.chat_template",
        "/dev/zero",
        expect=["cannot read /dev/zero", "character device"],
    ),
    sample("--config nested 100,000 deep", "--config", "{w}/deep.yaml", expect=["nested more than 100 levels deep"]),
    sample(  # was "unknown key trainer.precision" alone
        "a run's config.yaml (train.py's) as --config",
        "--config",
        "{run}/config.yaml",
        expect=["config.yaml: unknown key", "this is train.py's config; name the run with --ckpt instead"],
    ),
    sample(
        "/dev/zero as the prompt file",
        "--ckpt",
        "{ckpt}",
        "--prompt-file",
        "/dev/zero",
        expect=["cannot read prompt file /dev/zero", "character device"],
    ),
    sample(
        "--num_samples past this machine's memory",
        "--ckpt",
        "{ckpt}",
        "--num_samples",
        "100000000",
        expect=["generating 100,000,000 sequence(s)", "draw fewer samples"],
    ),
    sample("an empty --prompt-file", "--ckpt", "{ckpt}", "--prompt-file", "", expect=["--prompt_file is empty"]),
    evaluate("an empty --text", "--ckpt", "{ckpt}", "--text", "", expect=["--text is empty; give the text file"]),
    evaluate(
        "an empty --output",
        "--ckpt",
        "{ckpt}",
        "--tasks",
        "{w}/quiz.yaml",
        "--output",
        "",
        expect=["--output is empty; give the path of the JSON file"],
    ),
    evaluate(
        "--num_fewshot past a task's documents",
        "--ckpt",
        "{ckpt}",
        "--tasks",
        "{w}/shots.yaml",
        "--num_fewshot",
        "1000",
        expect=["num_fewshot=1000", "task shots has 4 document(s)", "(its test split, less the question itself)"],
    ),
    evaluate(
        "--num_fewshot on a task that has only the documents it evaluates (a question would see its own answer)",
        "--ckpt",
        "{ckpt}",
        "--tasks",
        "{w}/quiz.yaml",
        "--num_fewshot",
        "2",
        expect=["num_fewshot=2: task quiz has 0 document(s)", "set `fewshot_split: test` in its YAML"],
    ),
    evaluate(
        "--tasks' --output where it cannot be written (checked before the tasks run)",
        "--ckpt",
        "{ckpt}",
        "--tasks",
        "{w}/quiz.yaml",
        "--output",
        "{w}/a-file/results.json",
        expect=["cannot write --output", "a-file/results.json (", "a-file is a file, not a folder", "choose a path"],
    ),
    evaluate(
        "a --tasks setting with --text",
        "--ckpt",
        "{ckpt}",
        "--text",
        "{corpus}",
        "--limit",
        "3",
        expect=["--limit is a setting of --tasks, which --text does not read; drop --limit"],
    ),
    evaluate(
        "a task's !function hook that raises",
        "--ckpt",
        "{ckpt}",
        "--tasks",
        "{w}/hooked.yaml",
        expect=["task hooked: its hook !function hooks.broken", "ZeroDivisionError"],
    ),
    evaluate(
        "a task hook from outside the task file's folder",
        "--ckpt",
        "{ckpt}",
        "--tasks",
        "{w}/outside.yaml",
        expect=["!function os.system", "the one place task hooks are read from"],
    ),
    train(
        "an --eval_tasks task whose answers do not fit the context (found when scored: the run stops there, saved)",
        "--eval_tasks",
        "{w}/long.yaml",
        "--out_dir",
        "{w}/tasks_run",  # the run is saved: not the other cases' out_dir
        expect=[
            "a continuation of",
            "does not fit the model's context (block_size=32)",
            "the run stopped at that validation (step 10) and saved",
            "continue it with --resume once the task works",
        ],
    ),
    train(
        "eval_limit 0",
        "--eval_tasks",
        "{w}/quiz.yaml",
        "--eval_limit",
        "0",
        expect=["eval_limit: must be >= 1 or null (every example), got 0; use e.g. 100"],
    ),
    # DPO (--data.format preference, issue 47): each pair is checked where it is read, beta where it is declared
    train(
        "DPO pair without a rejected answer",
        "--init_from",
        "{ckpt}",
        "--data.format",
        "preference",
        "--data.source",
        "{w}/no_rejected.jsonl",
        expect=["no_rejected.jsonl line 2", "no 'rejected'", '"prompt", "chosen" and "rejected"'],
    ),
    train(
        "DPO pair whose chosen and rejected are the same",
        "--init_from",
        "{ckpt}",
        "--data.format",
        "preference",
        "--data.source",
        "{w}/same_pair.jsonl",
        expect=["same_pair.jsonl line 1", "chosen and rejected are the same answer", "drop the row"],
    ),
    train(
        "DPO prompt that fills the context",
        "--init_from",
        "{ckpt}",
        "--data.format",
        "preference",
        "--data.source",
        "{w}/long_prompt.jsonl",
        expect=["long_prompt.jsonl line 2", "leaves no room for an answer in block_size=32", "shorten the prompt"],
    ),
    train(
        "DPO beta below 0",
        "--init_from",
        "{ckpt}",
        "--data.format",
        "preference",
        "--data.source",
        "{w}/pairs.jsonl",
        "--dpo.beta",
        "-0.1",
        expect=["dpo.beta", "-0.1"],
    ),
    train(
        "DPO rpo_alpha below 0",
        "--init_from",
        "{ckpt}",
        "--data.format",
        "preference",
        "--data.source",
        "{w}/pairs.jsonl",
        "--dpo.rpo_alpha",
        "-1",
        expect=["dpo.rpo_alpha", "-1"],
    ),
    train(
        "DPO without init_from",
        "--data.format",
        "preference",
        "--data.source",
        "{w}/pairs.jsonl",
        expect=["--data.format preference (DPO)", "name it with --init_from"],
    ),
    # GRPO (--data.format prompts, issue 47): rows checked where they are read, the reward where it runs
    train(
        "GRPO prompt row without an answer",
        *GRPO,
        "--data.source",
        "{w}/no_answer.jsonl",
        expect=["no_answer.jsonl line 2", "no 'answer'", 'each row needs "prompt"'],
    ),
    train(
        "GRPO prompt row with a blank answer",
        *GRPO,
        "--data.source",
        "{w}/blank_answer.jsonl",
        expect=["blank_answer.jsonl line 2", '"answer" is empty', "give the answer the reward checks"],
    ),
    train(
        "GRPO prompt that fills the context",
        *GRPO,
        "--data.source",
        "{w}/long_prompts.jsonl",
        expect=["long_prompts.jsonl line 2", "leaves no room for a completion in block_size=32", "shorten the prompt"],
    ),
    train(
        "GRPO reward function that raises",
        *GRPO,
        "--grpo.reward",
        "{w}/rewards.py:raises",
        expect=["the reward function failed on the prompt of", "prompts.jsonl line", "ZeroDivisionError"],
    ),
    train(
        "GRPO reward function that returns NaN",
        *GRPO,
        "--grpo.reward",
        "{w}/rewards.py:nan",
        expect=["the reward function returned nan for the prompt of", "not a finite number"],
    ),
    train(
        "GRPO reward function that returns infinity",
        *GRPO,
        "--grpo.reward",
        "{w}/rewards.py:inf",
        expect=["the reward function returned inf for the prompt of", "not a finite number"],
    ),
    train(
        "GRPO reward function that returns text",
        *GRPO,
        "--grpo.reward",
        "{w}/rewards.py:text",
        expect=["the reward function returned 'yes' for the prompt of", "return a float"],
    ),
    train(
        "GRPO reward file that does not exist",
        *GRPO,
        "--grpo.reward",
        "{w}/no_rewards.py:score",
        expect=["no such file", "no_rewards.py", "path/to/file.py:function_name"],
    ),
    train(
        "GRPO reward file without the function",
        *GRPO,
        "--grpo.reward",
        "{w}/rewards.py:missing",
        expect=["has no function missing"],
    ),
    train(
        "GRPO reward file that exits when loaded",
        *GRPO,
        "--grpo.reward",
        "{w}/exiting_rewards.py:score",
        expect=["exiting_rewards.py failed to load (SystemExit: 3)", "fix the file"],
    ),
    train("GRPO group size below 2", *GRPO, "--grpo.group_size", "1", expect=["grpo.group_size", "v>=2"]),
    train("GRPO beta below 0", *GRPO, "--grpo.beta", "-0.1", expect=["grpo.beta", "-0.1"]),
    train(
        "GRPO without init_from",
        "--data.format",
        "prompts",
        "--data.source",
        "{w}/prompts.jsonl",
        expect=["--data.format prompts (GRPO)", "name it with --init_from"],
    ),
]


class _RunsCode:
    """Unpickling this calls open(marker, 'w'): a stand-in for a checkpoint crafted to run code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _write_huge_config_checkpoint(src: Path, dest: Path) -> None:
    from minigpt.core.checkpoint import read_checkpoint, save_file

    ckpt = read_checkpoint(src)
    ckpt["minigpt"]["model_config"]["n_layer"] = 10**7  # builds for minutes if believed
    save_file(ckpt, dest)


def _write_edited_tokenizer_checkpoint(src: Path, dest: Path, edit: Callable[[str], str]) -> None:
    from minigpt.core.checkpoint import read_checkpoint, save_file

    ckpt = read_checkpoint(src)
    tok = ckpt["minigpt"]["tokenizer"]
    tok["chars"] = edit(tok["chars"])
    save_file(ckpt, dest)


def _write_other_base(src: Path, dest: Path) -> None:
    """The tiny run with one weight changed: another model of the same shape (a LoRA run's wrong base)."""
    from minigpt.core.checkpoint import read_checkpoint, save_file

    ckpt = read_checkpoint(src)
    ckpt["state_dict"]["model.lm_head.weight"][0, 0] += 1.0
    save_file(ckpt, dest)


def _write_lora_run_on_a_moved_base(src: Path, dest: Path) -> None:
    """The tiny LoRA run's checkpoint, its base recorded at a path where nothing is now (the base moved)."""
    from minigpt.core.checkpoint import read_checkpoint, save_file

    ckpt = read_checkpoint(src)
    ckpt["minigpt"]["lora"]["base"]["source"] = str(dest.parent / "moved_base" / "checkpoints" / "best.ckpt")
    save_file(ckpt, dest)


def _write_hostile_inputs(w: Path) -> None:
    """The files of issue 40's cases: JSON and YAML nested 100,000 deep, a 1 MB run of one character, chat data
    with templates that loop or grow without end, and harness tasks (few documents, hooks that fail or come from
    elsewhere)."""
    deep = 100_000
    (w / "deep.jsonl").write_text("[" * deep + "]" * deep + "\n")
    (w / "deep.json").write_text('{"a":' * deep + "1" + "}" * deep)  # a tokenizer.json's shape, gone deep
    (w / "deep.yaml").write_text("seed: " + "[" * deep + "]" * deep + "\n")
    (w / "one_run.txt").write_text("a" * 1_000_000)
    (w / "chats.jsonl").write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"{a} + {a}?"}, {"role": "assistant", "content": str(2 * a)}]}
            )
            + "\n"
            for a in range(8)
        )
    )
    (w / "loops.jinja").write_text(
        "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}<|im_end|>"
    )
    (w / "huge.jinja").write_text("{{ 'x' * 3*10**8 }}<|im_end|>")
    (w / "quiz.jsonl").write_text(
        "".join(json.dumps({"question": f"the {i}", "choices": ["fox", "dog"], "answer": 0}) + "\n" for i in range(5))
    )
    quiz = (
        f"task: quiz\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {w / 'quiz.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    higher_is_better: true\n"
    )
    (w / "quiz.yaml").write_text(quiz)
    (w / "shots.yaml").write_text(quiz.replace("task: quiz", "task: shots\nfewshot_split: test"))
    (w / "hooked.yaml").write_text(quiz.replace("task: quiz", "task: hooked\nprocess_docs: !function hooks.broken"))
    (w / "hooks.py").write_text("def broken(docs):\n    return 1 / 0\n")
    (w / "outside.yaml").write_text(quiz.replace("task: quiz", "task: outside\nprocess_docs: !function os.system"))
    long = [{"question": "the fox", "choices": ["the quick brown fox jumps over the lazy dog", "fox"], "answer": 0}]
    (w / "long.jsonl").write_text(json.dumps(long[0]) + "\n")
    (w / "long.yaml").write_text(quiz.replace("task: quiz", "task: long").replace("quiz.jsonl", "long.jsonl"))


def make_workdir(w: Path, train_tiny_run: Callable[[list[str]], None]) -> Path:
    """Write the files the cases name, and train the tiny run with train_tiny_run(argv)."""
    (w / "words.txt").write_text("\n".join(f"the quick brown fox {i % 7} jumps over the lazy dog" for i in range(2000)))
    (w / "empty.txt").write_text("")
    (w / "short.txt").write_text("far fewer characters than one window\n")
    (w / "blob.bin").write_bytes(bytes(range(256)) * 64)
    (w / "cut.txt.gz").write_bytes(gzip.compress((w / "words.txt").read_bytes())[:-100])
    (w / "other.txt").write_text("ZEBRAS & QUAGGAS\n")
    # the same number of distinct characters as words.txt, one of them different: a shifted char-to-id mapping
    (w / "shifted.txt").write_text((w / "words.txt").read_text().replace("q", "Q"))
    (w / "notes.txt").write_text("not a checkpoint\n")
    (w / "a-file").write_text("not a folder\n")  # a path under a file: unwritable even for root
    (w / "occupied").mkdir()
    (w / "typo.yaml").write_text("model:\n  n_layers: 2\n")
    (w / "latin1.yaml").write_bytes("model:\n  n_layer: 2  # défaut\n".encode("latin-1"))
    (w / "broken.yaml").write_text("model:\n  n_layer: 2\n   n_head: 2\n")  # n_head indented one space too far
    (w / "empty.yaml").write_text("# every line commented out\n")
    (w / "bare_section.yaml").write_text("lora:\n#  rank: 4\n")  # a traceback at the run's start
    (w / "variable.yaml").write_text("out_dir: $HOME/runs/x\n")  # made a folder named "$HOME"
    (w / "twice.yaml").write_text("model:\n  n_layer: 1\noptim:\n  learning_rate: 0.01\nmodel:\n  n_head: 2\n")
    (w / "linked.yaml").write_text("model:\n  block_size: 32\ndata:\n  block_size: 64\n")  # 64 was dropped unsaid
    pair = {"prompt": "the quick fox", "chosen": "jumps", "rejected": "sleeps"}
    for name, rows in (
        ("pairs.jsonl", [pair, pair]),
        ("no_rejected.jsonl", [pair, {"prompt": "the dog", "chosen": "naps"}]),
        ("same_pair.jsonl", [{**pair, "rejected": pair["chosen"]}, pair]),
        ("long_prompt.jsonl", [pair, {**pair, "prompt": "the lazy dog " * 5}]),
    ):
        (w / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompt = {"prompt": "a fox", "answer": "3"}
    for name, rows in (
        ("prompts.jsonl", [prompt, {**prompt, "prompt": "the dog"}, {**prompt, "answer": "4"}]),
        ("no_answer.jsonl", [prompt, {"prompt": "the dog"}]),
        ("blank_answer.jsonl", [prompt, {"prompt": "the dog", "answer": " "}]),
        ("long_prompts.jsonl", [prompt, {**prompt, "prompt": "the lazy dog " * 2}]),
    ):
        (w / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (w / "rewards.py").write_text(
        "def raises(prompt, completion, answer):\n    return 1 / 0\n"
        "def nan(prompt, completion, answer):\n    return float('nan')\n"
        "def inf(prompt, completion, answer):\n    return float('inf')\n"
        "def text(prompt, completion, answer):\n    return 'yes'\n"
    )
    (w / "exiting_rewards.py").write_text("import sys\n\nsys.exit(3)\n")  # at its top level, as it is read
    (w / "occupied" / "notes.txt").write_text("a user's file: export.py must not touch it\n")
    for name, config in (
        ("hf_bert", {"architectures": ["BertForMaskedLM"], "model_type": "bert"}),
        (
            "hf_qwen_sliding",
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "vocab_size": 64,
                "use_sliding_window": True,
                "sliding_window": 16,
            },
        ),
        (
            "hf_phi3_partial",
            {
                "architectures": ["Phi3ForCausalLM"],
                "model_type": "phi3",
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "vocab_size": 64,
                "partial_rotary_factor": "0.75",
            },
        ),
        (
            "hf_gemma_rope",
            {
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "vocab_size": 64,
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
                },
            },
        ),
        ("hf_gemma_mm", {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}),
        (
            "hf_gemma_mm_field",
            {
                "architectures": ["Gemma3ForConditionalGeneration"],
                "model_type": "gemma3",
                "text_config": {"hidden_size": "64"},
            },
        ),
        (
            "hf_gemma_softcap",
            {
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "vocab_size": 64,
                "final_logit_softcapping": 30.0,
            },
        ),
        *(
            (
                name,
                {
                    "architectures": ["Gemma3ForCausalLM"],
                    "model_type": "gemma3_text",
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "vocab_size": 64,
                    **field,
                },
            )
            for name, field in (
                ("hf_gemma_layer_types", {"layer_types": ["sliding_attention"]}),
                ("hf_gemma_pattern", {"sliding_window_pattern": "6"}),
            )
        ),
        (
            "hf_no_weights",
            {
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "n_layer": 1,
                "n_head": 2,
                "n_embd": 32,
                "n_positions": 32,
                "vocab_size": 64,
            },
        ),
    ):
        (w / name).mkdir()
        (w / name / "config.json").write_text(json.dumps(config))
    train_tiny_run(
        ["--data.source", str(w / "words.txt"), "--data.data_root", str(w / "data"), *TINY, "--out_dir", str(w / "run")]
    )
    shutil.copytree(next((w / "data").glob("words-char-*")), w / "prepared")  # the run's prepared data
    ckpt = w / "run" / "checkpoints" / "last.ckpt"
    (w / "truncated.ckpt").write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    (w / "broken" / "checkpoints").mkdir(parents=True)
    (w / "broken" / "checkpoints" / "last.ckpt").write_bytes((w / "truncated.ckpt").read_bytes())
    (w / "only_best" / "checkpoints").mkdir(parents=True)  # a run whose last.ckpt was deleted
    (w / "only_best" / "checkpoints" / "best.ckpt").write_bytes(ckpt.read_bytes())
    (w / "evil.ckpt").write_bytes(pickle.dumps({"state_dict": _RunsCode(str(w / "PWNED"))}))
    _write_huge_config_checkpoint(ckpt, w / "huge.ckpt")
    _write_edited_tokenizer_checkpoint(ckpt, w / "dup_chars.ckpt", lambda chars: chars[:-1] + chars[0])
    _write_edited_tokenizer_checkpoint(ckpt, w / "few_chars.ckpt", lambda chars: chars[:-1])
    _write_hostile_inputs(w)
    _write_other_base(ckpt, w / "other_base.ckpt")
    train_tiny_run(
        [
            "--data.source",
            str(w / "words.txt"),
            "--data.data_root",
            str(w / "data"),
            *TINY,
            "--out_dir",
            str(w / "lora_run"),
            "--init_from",
            str(w / "run"),
            "--finetune",
            "lora",
        ]
    )
    _write_lora_run_on_a_moved_base(w / "lora_run" / "checkpoints" / "last.ckpt", w / "moved_base_lora.ckpt")
    return w
