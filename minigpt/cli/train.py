"""`train.py`: LightningCLI gives YAML configs, a flag for every key, --help and --print_config.

    python train.py                                  # configs/default.yaml
    python train.py --config configs/X.yaml --model.attention manual --trainer.max_steps 500
    python train.py --out_dir out/run1 --resume true # continue a run from its last checkpoint
    python train.py --config configs/finetune_shakespeare.yaml  # fine-tune: init_from another model's weights
    python train.py --config configs/sft_addition.yaml --finetune lora  # adapters only (minigpt.core.lora)

How a setting travels: each field of GPTConfig (section `model`) and OptimConfig (section `optim`) is a YAML key
and a `--model.FIELD` / `--optim.FIELD` flag because jsonargparse reads the dataclasses themselves (types, defaults,
docstrings), instantiated and handed to GPTLightningModule as they are.  Shared values are linked, not copied:
model.block_size -> data.block_size, seed -> data.seed, and the data's tokenizer -> model.vocab_size.

Fine-tuning (`init_from: SRC`, anything minigpt.loading.load_model reads) takes the model config, the weights
and the tokenizer from SRC (minigpt.training.init_from): the tokenizer becomes data.tokenizer, so the corpus is
prepared with it; the model keys a run sets must agree with SRC, except minigpt.core.config.FINETUNE_FIELDS.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Literal, get_args

from jsonargparse import ActionYesNo, Namespace
from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from minigpt.cli.parsing import OneLineErrors, flag_values, literal_choices, misplaced_setting, read_field_docs
from minigpt.cli.train_flags import note_unread_flags
from minigpt.configs import default_config
from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError, first_line
from minigpt.core.fsutil import atomic_write
from minigpt.core.lora import Finetune, LoRAConfig
from minigpt.core.model import GPT
from minigpt.core.precision import resolve_precision
from minigpt.core.seed import check_seed
from minigpt.hf.families import check_family_set
from minigpt.training.callbacks import CompileMode, harness_callbacks, seconds_since_launch
from minigpt.training.checkpoint_io import SafeCheckpointIO
from minigpt.training.datamodule import TokenDataModule
from minigpt.training.dpo import DPOConfig, check_dpo_resumable, frozen_reference
from minigpt.training.finetune_lora import check_finetune_resumable, load_base, lora_run_model
from minigpt.training.grpo import GRPOConfig, check_grpo_resumable
from minigpt.training.init_from import check_source_is_not_out_dir, init_from_source, load_init_weights, read_last
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.objectives import objective, objective_problem
from minigpt.training.optim import OptimConfig
from minigpt.training.run_dir import (
    SIGNALS,
    already_a_run,
    check_resume,
    check_writable,
    holds_run,
    lock_run_dir,
    nothing_to_resume,
    recover,
    refuse_taken,
    replacing,
    stop_at_once,
    stop_on_signals,
)
from minigpt.training.run_end import end_of_run, failed_tasks_end, full_split_end
from minigpt.training.trainer import (
    TRAINER_DEFAULTS,
    EarlyStoppingConfig,
    LastCheckpoint,
    MiniGPTTrainer,
    RunConfigFile,
    run_callbacks,
    strategy_problem,
    uncount_unfinished_epoch,
)

IMPORTED = seconds_since_launch()  # the start-up report's first part: Python, torch, Lightning and minigpt loaded


class _DropAdverts(logging.Filter):
    """Lightning prints tips advertising its cloud products at every run; keep the console for our output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropAdverts())

# settings a link fills (target: its source); a user who sets one is told where it comes from
LINKS = {
    "data.block_size": "model.block_size",
    "data.seed": "seed",
    "seed_everything": "seed",
    "model.vocab_size": "data.vocab_size",
}


class TrainArgumentParser(OneLineErrors, LightningArgumentParser):
    """LightningCLI's parser, with parse mistakes as one line.  It notes the keys each --config file sets, for
    init_from (which must tell a user's setting from a default): jsonargparse reads a --config file through
    parse_string without defaults, so what it returns there is what the file itself says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.file_keys: set[str] = set()

    def parse_string(self, *args: Any, **kwargs: Any) -> Namespace:
        parsed = super().parse_string(*args, **kwargs)
        if kwargs.get("defaults") is False:  # a --config file (the default config is read as defaults, elsewhere)
            self.file_keys.update(parsed.keys())
        return parsed


class MiniGPTCLI(LightningCLI):
    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_default_arguments_to_parser(parser)  # seed_everything, which LINKS fills from --seed
        parser.add_argument("--seed", type=int, default=1337, help="Fixes data order, initialisation and dropout.")
        parser.add_argument(
            "--out_dir",
            type=str,
            default="out/default",
            help="Run directory: checkpoints/, TensorBoard logs, config.yaml.",
        )
        parser.add_argument(
            "--resume",
            action=ActionYesNo,
            nargs="?",
            default=False,
            help="Continue the run in out_dir from checkpoints/last.ckpt.",
        )
        parser.add_argument(
            "--overwrite",
            action=ActionYesNo,
            nargs="?",
            default=False,
            help="Start a new run in an out_dir that already holds one: its checkpoints and config.yaml "
            "are replaced once the new run has a checkpoint (other files stay).",
        )
        parser.add_argument(
            "--eval_full",
            action=ActionYesNo,
            nargs="?",
            default=True,
            help="At the end, report the loss over the whole validation split (one device only).",
        )
        parser.add_argument(
            "--checkpoint_every",
            type=PositiveInt,
            default=100,
            help="Optimizer steps between saves of checkpoints/last.ckpt.",
        )
        parser.add_argument(
            "--compile",
            action=ActionYesNo,
            nargs="?",
            default=False,
            help="torch.compile the model; compiled on a dummy batch before the training clock starts.",
        )
        parser.add_argument(
            "--compile_regions",
            action=ActionYesNo,
            nargs="?",
            default=True,
            help="With --compile: compile the repeated block once (every layer reuses its code) and the head, "
            "not the whole model as one graph: several times quicker to start (docs/performance.md).",
        )
        parser.add_argument(
            "--compile_mode",
            type=CompileMode,
            default="default",
            help="With --compile: torch.compile's mode. reduce-overhead replays the compiled graphs as CUDA graphs "
            "on a GPU (one launch each, for small models whose step waits on the host); cudagraphs records the "
            "traced graphs' own kernels as CUDA graphs (a compile of seconds); graphed records the uncompiled "
            "model's training step as CUDA graphs (no compile); see docs/options.md.",
        )
        parser.add_argument(
            "--sample_tokens",
            type=NonNegativeInt,
            default=200,
            help="Tokens generated and logged as text at each validation (0 = none), drawn with --seed.",
        )
        parser.add_argument(
            "--attention_images",
            type=bool | Literal["auto"],
            default="auto",
            help="Log the attention maps of a probe text as a TensorBoard image at each validation "
            "(auto = for models of at most 64 heads in all, n_layer * n_head).",
        )
        parser.add_argument(
            "--eval_tasks",
            type=str | None,
            default=None,
            help="lm-evaluation-harness tasks run at each validation and logged as eval/TASK/METRIC: "
            'names or task YAML paths, comma-separated (needs pip install -e ".[eval]").',
        )
        parser.add_argument(
            "--eval_limit",
            type=int | None,  # checked with the tasks (harness_callbacks): jsonargparse's words for a union are a page
            default=100,
            help="--eval_tasks: examples per task at each validation (null = all of them).",
        )
        parser.add_argument(
            "--init_from",
            type=str | None,
            default=None,
            help="Fine-tune: start from this model's weights, config and tokenizer (a .ckpt, a run "
            "directory, a Hugging Face model directory or hf:ORG/NAME).",
        )
        parser.add_argument(
            "--finetune",
            type=Finetune,
            default="full",
            help="With init_from: full (every weight trains) or lora (the source stays frozen and "
            "low-rank adapters train: settings in the lora section; docs/lora.md).",
        )

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items()})
        parser.add_class_arguments(GPTConfig, "model")  # every field of the dataclass, as declared there
        parser.add_class_arguments(OptimConfig, "optim")
        parser.add_class_arguments(LoRAConfig, "lora")  # read with --finetune lora only
        parser.add_class_arguments(EarlyStoppingConfig, "early_stopping")
        parser.add_class_arguments(DPOConfig, "dpo")  # read with --data.format preference only (docs/dpo.md)
        parser.add_class_arguments(GRPOConfig, "grpo")  # read with --data.format prompts only (docs/grpo.md)
        parser.add_lightning_class_args(TokenDataModule, "data")

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for target, source in LINKS.items():
            parser.link_arguments(source, target, apply_on="instantiate" if target == "model.vocab_size" else "parse")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        given = sys.argv[1:] if args is None else list(args)
        # what jsonargparse would refuse in words of its own: checked here, where the values are known
        choices = (
            literal_choices("model", GPTConfig)
            | literal_choices("optim", OptimConfig)
            | {
                "finetune": ("full", "lora"),
                "lora.base_dtype": ("float32", "bfloat16", None),
                "dpo.reference": ("model", "precomputed"),
                "compile_mode": get_args(CompileMode),
            }
        )
        if problem := misplaced_setting(given, choices, LINKS):
            parser.error(problem)
        parser.flag_keys = {key for key, _ in flag_values(given)}  # for --print_config of a fine-tune (as_given)
        super().parse_arguments(parser, args)
        check_seed(self.config["seed"])  # Lightning seeds everything with it next (seed_everything is linked to it)
        if self.config.get("init_from") is not None and not str(self.config["init_from"]).strip():
            parser.error(
                "init_from is empty (an unset shell variable?); name a .ckpt, a run directory, a Hugging "
                "Face model directory or hf:ORG/NAME, or leave init_from out to train from scratch"
            )
        if self.config["finetune"] == "lora" and not self.config.get("init_from"):
            parser.error(
                "--finetune lora trains adapters on a model: name it with --init_from (a .ckpt, a run "
                "directory, a Hugging Face model directory or hf:ORG/NAME), or drop --finetune lora"
            )
        if self.config["resume"] and self.config["overwrite"]:
            parser.error("--resume continues the run in out_dir and --overwrite starts it over; pass only one of them")
        if not self.config.get("init_from"):  # refused before the data is prepared (a fine-tune's is its source's)
            check_family_set(GPTConfig(**{**self.config["model"].as_dict(), "vocab_size": 1}))  # vocab: the data's
        # DPO's and GRPO's settings that cannot work together, and a strategy whose run no command could read
        if problem := objective_problem(self.config) or strategy_problem(self.config["trainer"]):
            parser.error(problem)
        note_unread_flags(given, self.config)
        # init_from needs to know which settings the user gave, not their defaults: the keys of the --config files
        # and of the flags (one parse: the files' keys were noted as jsonargparse read them)
        self.given = parser.file_keys | {key for key, _ in flag_values(given)}

    def instantiate_classes(self) -> None:
        out_dir = Path(self.config["out_dir"])
        if self.config.get("init_from") and not self.config["resume"]:
            check_source_is_not_out_dir(self.config["init_from"], out_dir)
        refuse_taken(out_dir, self.config["resume"], self.config["overwrite"])  # before the data is prepared
        source_config, source_model, self.picked = None, None, ""  # picked: init_from's checkpoint, in words
        last = out_dir / "checkpoints" / "last.ckpt"
        # --resume reads the run's last checkpoint once: its checks, init_from and Lightning's restore share it
        self.resume_checkpoint = read_last(last) if self.config["resume"] and last.is_file() else None
        lora = LoRAConfig(**self.config["lora"]) if self.config["finetune"] == "lora" else None
        module, objective_settings = objective(self.config)  # SFT/pretraining, DPO or GRPO, from data.format
        dpo, grpo = objective_settings.get("dpo"), objective_settings.get("grpo")
        if self.resume_checkpoint is not None:  # before the source is read: a LoRA run resumes as one, and back
            check_finetune_resumable(self.resume_checkpoint, lora, last)
            check_dpo_resumable(self.resume_checkpoint, dpo, last)
            check_grpo_resumable(self.resume_checkpoint, grpo, last)
        if self.config.get("init_from"):  # fills the model section and data.tokenizer from the source
            source_config, source_model, self.picked = init_from_source(self.config, self.given, self.resume_checkpoint)
        self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self.config_init["data"]
        config = self.config_init["model"]
        if source_config is not None:  # the source's vocabulary may be larger than its tokenizer's (padded), or
            # smaller than a chat tokenizer's (added tokens: load_init_weights grows it)
            vocab_size = max(source_config.vocab_size, self.datamodule.vocab_size)
            config = GPTConfig.from_dict({**config.to_dict(), "vocab_size": vocab_size})
        model, entry = None, None
        if lora is not None:  # the source's own tensors, frozen, with adapters (a resumed run reads it again)
            base = source_model if source_model is not None else load_base(self.config["init_from"])
            source_model = None  # lora_run_model takes the weights: no reference here may keep them
            model, entry = lora_run_model(self.config["init_from"], base, config, lora, self.resume_checkpoint, last)
        self.model = module(
            config,
            self.config_init["optim"],
            tokenizer=self.datamodule.tokenizer,
            model=model,
            lora=entry,
            **objective_settings,
        )
        if source_model is not None:
            load_init_weights(self.model.model, source_model)
        # a full run's frozen reference: DPO's (dpo.reference model), GRPO's (for the KL: grpo.beta > 0)
        key = "dpo" if dpo is not None and dpo.reference == "model" else "grpo" if grpo and grpo.beta > 0 else None
        if key is not None and lora is None:
            start = self.model.model
            if source_model is None:  # resumed: the starting weights, read from init_from again
                start = GPT(config)
                load_init_weights(start, load_base(self.config["init_from"]), self.config["init_from"])
            self.model.use_reference(frozen_reference(start, self.resume_checkpoint, self.config["init_from"], key))
        self.trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        out_dir = Path(self.config["out_dir"])
        trainer_config = self.config["trainer"]
        if trainer_config.get("logger") in (None, True):
            # save_dir/name/version flattened: events and config.yaml sit in out_dir itself
            kwargs["logger"] = TensorBoardLogger(save_dir=str(out_dir), name="", version="")
        kwargs["default_root_dir"] = str(out_dir)
        last = out_dir / "checkpoints" / "last.ckpt"
        kwargs["plugins"] = [SafeCheckpointIO({str(last): self.resume_checkpoint} if self.resume_checkpoint else None)]
        user_callbacks = self.config_init["trainer"].get("callbacks") or []
        kwargs["callbacks"] = (
            list(user_callbacks)
            + run_callbacks(self.config, self.datamodule.hparams.batch_size, IMPORTED, given=user_callbacks)
            + harness_callbacks(self.config)
        )
        # resolved here, where the attention path is known (bf16 does not pay for sdpa on a CPU)
        kwargs["precision"], reason = resolve_precision(
            trainer_config.get("precision"), trainer_config.get("accelerator"), self.model.config.attention
        )
        if trainer_config.get("precision") == "auto" or reason.startswith("note:"):
            rank_zero_info(reason)
        try:
            trainer = super().instantiate_trainer(**kwargs)
        # Lightning's words for a setting that cannot work (ModuleNotFoundError: a precision's missing package)
        except (MisconfigurationException, ValueError, ModuleNotFoundError) as e:
            raise UserError(f"trainer: {first_line(e, 300)}") from None
        self.model.config.check_device(trainer.strategy.root_device.type)
        return trainer


def parse(argv: list[str] | None = None) -> MiniGPTCLI:
    """Parse the config and flags and build the datamodule, the module and the trainer (nothing is trained)."""
    given = sys.argv[1:] if argv is None else argv
    read_field_docs(given)
    parser_kwargs: dict[str, Any] = {"prog": "train.py", "links": LINKS}
    if not any(a in ("-c", "--config") or a.startswith("--config=") for a in given):
        parser_kwargs["default_config_files"] = [str(default_config())]  # shipped in the package, never skipped
    with warnings.catch_warnings():  # args given as a list (tests, scripts) is intended, not a mistake
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return MiniGPTCLI(
            GPTLightningModule,
            TokenDataModule,
            trainer_class=MiniGPTTrainer,
            parser_class=TrainArgumentParser,
            args=argv,
            run=False,
            trainer_defaults=TRAINER_DEFAULTS,
            parser_kwargs=parser_kwargs,
            save_config_callback=RunConfigFile,
            auto_configure_optimizers=False,
        )


def main(argv: list[str] | None = None) -> Trainer:
    """Parse the config and flags, train, save the final state; returns the Trainer (for tests and scripts)."""
    cli = parse(argv)
    out_dir = Path(cli.config["out_dir"])
    check_writable(out_dir, cli.config["resume"], cli.trainer.loggers)
    lock = lock_run_dir(out_dir)
    try:
        if lock is not None:  # this process owns the run directory: finish what a killed --overwrite left
            recover(out_dir)
        return _train(cli, out_dir)
    finally:  # released here too, not only at exit: in-process callers (tests, notebooks) run main again
        if lock is not None:
            lock.close()


def _train(cli: MiniGPTCLI, out_dir: Path) -> Trainer:
    last = out_dir / "checkpoints" / "last.ckpt"
    ckpt_path, overwrite = None, False
    if cli.config["resume"]:
        if not last.is_file():
            raise nothing_to_resume(last)
        # read at parse time, unless the run was restored since (recover: a killed --overwrite put it back)
        saved = cli.resume_checkpoint or read_last(last)
        check_resume(saved, cli.model, cli.datamodule, cli.trainer, last)
        ckpt_path = str(last)
    elif holds_run(out_dir):
        if not cli.config["overwrite"]:
            raise already_a_run(out_dir)
        overwrite = cli.trainer.is_global_zero
    trainer = cli.trainer
    if cli.config.get("init_from") and trainer.is_global_zero:  # the run is accepted: now out_dir gets its tokenizer
        sys.stderr.write(cli.picked)  # which checkpoint a run directory meant, as the other commands say it
        text = Path(cli.config["data"]["tokenizer"]).read_bytes()
        if not (out_dir / "tokenizer.json").is_file() or (out_dir / "tokenizer.json").read_bytes() != text:
            atomic_write(out_dir / "tokenizer.json", lambda f: f.write(text))
    with replacing(out_dir, overwrite), stop_on_signals(trainer) as stopped_by, stop_at_once(stopped_by, last):
        try:
            trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path, weights_only=True)
        except SIGTERMException:  # Lightning's: raised between steps after a SIGTERM, the state is whole
            stopped_by.append("SIGTERM")
        # the final state, whatever step the run stopped at; unless LastCheckpoint saved it at the validation that
        # ended the run (a step on the validation grid, where a save after fit would resume its logs a step late)
        saver = next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint)), None)
        untrained = bool(stopped_by) and trainer.global_step == 0  # stopped before its first step: no checkpoint
        if not untrained and (saver is None or saver.saved_at_stop != trainer.global_step):
            uncount_unfinished_epoch(trainer)
            trainer.save_checkpoint(last, weights_only=False)
    if trainer.is_global_zero and not untrained:
        end_of_run(trainer, last)
    if stopped_by:
        when = "before the first step; nothing saved" if untrained else f"at step {trainer.global_step}; saved {last}"
        stop = f"stopped by {stopped_by[0]}{' (Ctrl-C)' * (stopped_by[0] == 'SIGINT')} {when}" + (
            "" if untrained else "; continue the run with --resume"
        )
        # SIGTERM is from outside (a scheduler's): an error, the run did not end as configured; Ctrl-C is a stop the
        # user asked for.  Every rank stops at the same step: rank 0 says it
        error = stopped_by[0] != "SIGINT"
        if trainer.is_global_zero:
            print(f"{'error: ' * error}{stop}", file=sys.stderr)
        raise SystemExit(128 + SIGNALS[stopped_by[0]])
    failed_tasks_end(trainer, last)
    if cli.config["eval_full"]:
        full_split_end(trainer, cli.model, cli.datamodule, last)
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    remaining = timer.time_remaining() if timer is not None else None  # None: no max_time
    budget_ended = remaining is not None and remaining <= 0 and not 0 < trainer.max_steps <= trainer.global_step
    if trainer.is_global_zero and budget_ended:  # the time budget ended the run, not max_steps
        of = f" of {trainer.max_steps:,}" if trainer.max_steps > 0 else ""
        print(f"stopped by max_time ({cli.config['trainer']['max_time']}) after {trainer.global_step:,}{of} steps")
    return trainer
