"""EleutherAI's lm-evaluation-harness (the `lm-eval` package, the `eval` extra) on any model minigpt loads.

    lm = MiniGPTLM(model, tokenizer, batch_size=8)
    results = evaluate_tasks(lm, ["hellaswag", "my_tasks/quiz.yaml"], limit=100)   # lm_eval.simple_evaluate
    print(results_table(results))

MiniGPTLM is an `lm_eval` model over minigpt's own forward pass and KV-cache generation, not the harness's HFLM
over the model exported in memory: it runs every model load_model reads, options that no Hugging Face class can
express included (qk_norm, relu2, GQA with the gpt block), on any attention path, with no copy of the weights and
no transformers.  Its requests are cut as HFLM cuts them (the same context windows, truncation and start token),
so its scores equal HFLM's on the export (tests/evaluation/test_harness.py).

Tasks are the harness's names or paths of task YAML files (e.g. `dataset_path: json` with local data_files), read
by minigpt.evaluation.task_files: a task file is code (its `!function` hooks run), loaded only from where it is.
Naming a built-in task makes the harness index its ~15,000 task files (about 15 s on 2 cores); YAML files alone
skip that.  Distributed (Lightning DDP): each rank scores its share of the documents and rank 0 gets the results.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minigpt.core.errors import UserError, first_line
from minigpt.core.fsutil import atomic_write, write_errors
from minigpt.core.generation import generate, prompt_ids
from minigpt.core.model import GPT
from minigpt.core.tokenizers import HFTokenizer, Tokenizer
from minigpt.evaluation.loss import bytes_per_token, memory_budget, text_ids
from minigpt.evaluation.task_files import read_task_file, resolve_tasks

INSTALL = (
    'the lm-evaluation-harness is not installed; install the eval extra: pip install -e ".[eval]" '
    "(or, outside a checkout of minigpt, python3 -m pip install lm-eval==0.4.13)"
)

if find_spec("lm_eval") is None:  # the optional extra; anything else missing is a broken install and keeps its trace
    raise UserError(INSTALL)

from lm_eval.api.model import TemplateLM  # noqa: E402

__all__ = [
    "MiniGPTLM",
    "read_task_file",
    "resolve_tasks",
    "evaluate_tasks",
    "results_table",
    "flat_metrics",
    "write_results",
]

log = logging.getLogger(__name__)


class _Stopped(Exception):
    """Raised from generation's on_token once the text reaches a stop sequence: no more tokens are needed."""


class MiniGPTLM(TemplateLM):
    """A minigpt model and tokenizer as an `lm_eval` LM: loglikelihood, loglikelihood_rolling, generate_until.

    batch_size: requests scored at once (fewer when scoring them would pass 512 MiB); max_gen_toks: the generation
    limit when a task names none.  distributed: take rank and world size from torch.distributed (Lightning DDP).
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer | None,
        batch_size: int = 1,
        max_gen_toks: int = 256,
        distributed: bool = False,
    ) -> None:
        super().__init__()
        if tokenizer is None:
            raise UserError(
                "the model has no tokenizer, and the harness scores text; use a checkpoint written by "
                "train.py or a Hugging Face folder with its tokenizer.json"
            )
        self.model, self.tok, self.batch_size, self.max_gen_toks = model, tokenizer, batch_size, max_gen_toks
        self._device = model.lm_head.weight.device
        if distributed and dist.is_available() and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    # ---------------------------------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int | None:
        return self.tok.eot_id

    @property
    def prefix_token_id(self) -> int:
        """What a text scored from its first token is conditioned on: the tokenizer's BOS, else its end-of-text,
        else the newline (char/byte: the start token their exports register, minigpt.hf.tokenizer_files)."""
        bos = getattr(self.tok, "bos_id", None)
        return bos if bos is not None else prompt_ids(self.tok, "")[0]

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's ids; a Hugging Face tokenizer adds its BOS (as transformers does) unless told not to or
        the text already starts with it (HFLM's rule)."""
        if isinstance(self.tok, HFTokenizer) and self.tok.bos_id is not None:
            if add_special_tokens is None:
                add_special_tokens = not string.startswith(self.tok.decode([self.tok.bos_id]))
            if not add_special_tokens:
                try:
                    return self.tok.encoding(string, add_special_tokens=False).ids
                except UserError:  # text_ids below names the bad characters as a task's
                    pass
        return text_ids(self.tok, string, "a task's text")

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    # ---------------------------------------------------------------------------------------- scoring

    @torch.inference_mode()
    def _loglikelihood_tokens(
        self, requests: list, disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives it) per (key, context, continuation),
        the input cut to the last block_size tokens as HFLM cuts it; longest first, in batches."""
        T = self.max_length
        rows = []
        for key, context, continuation in requests:
            inp = (context + continuation)[-(T + 1) :][:-1]
            if len(continuation) > len(inp):
                # lm-eval's key is (context, continuation) as text: the answer, for a user to find its task
                answer = key[-1].strip() if isinstance(key, tuple) and isinstance(key[-1], str) else ""
                said = f" ({answer if len(answer) <= 40 else answer[:40].rstrip() + '...'!r})" if answer else ""
                raise UserError(
                    f"a continuation of {len(continuation)} tokens{said} does not fit the model's context "
                    f"(block_size={T}); use a task with shorter answers or a model with a longer context"
                )
            rows.append((key, inp, continuation))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][1]))
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        start, budget = 0, memory_budget(self.device) // bytes_per_token(self.model.config)  # tokens a batch holds
        while start < len(order):
            longest = len(rows[order[start]][1])
            fits = max(1, budget // longest)
            batch = order[start : start + min(self.batch_size, fits)]
            start += len(batch)
            x = torch.zeros(len(batch), longest, dtype=torch.long)  # right padding: causal, so it changes nothing
            for b, i in enumerate(batch):
                x[b, : len(rows[i][1])] = torch.tensor(rows[i][1])
            logits, _ = self.model(x.to(self.device))
            for b, i in enumerate(batch):
                key, inp, cont = rows[i]
                picked = logits[b, len(inp) - len(cont) : len(inp)].float().log_softmax(dim=-1)
                target = torch.tensor(cont, device=picked.device)
                score = (float(picked.gather(-1, target[:, None]).sum()), bool((picked.argmax(-1) == target).all()))
                out[i] = score
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, score)
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text in HFLM's windows: the first conditioned on prefix_token_id, each
        later one predicting up to block_size tokens from the tokens before them."""
        from lm_eval import utils

        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            ids = self.tok_encode(string)
            for context, pred in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                ),
            ):
                windows.append((None, context, pred))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (score, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---------------------------------------------------------------------------------------- generation

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """minigpt.core.generation.generate (KV cache) until a stop sequence, end-of-text or max_gen_toks; greedy
        unless the task samples.  The text is cut before the first stop sequence, as HFLM cuts it."""
        outputs = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kwargs.pop("do_sample", False)) and float(kwargs.get("temperature") or 0) > 0
            # HFLM keeps the last block_size - max_new tokens of context; generate() can also go past block_size
            keep = self.max_length - max_new if max_new < self.max_length else self.max_length
            ids = self.tok_encode(context)[-keep:] or [self.prefix_token_id]
            new: list[int] = []

            def stop_at_until(next_ids: torch.Tensor, new: list[int] = new, until: list = until) -> None:
                new.append(int(next_ids[0]))
                if until and any(u in self.tok_decode(new) for u in until):
                    raise _Stopped

            stops = self.tok.stop_ids  # end-of-text and every end a folder lists, as HFLM's generate stops at each
            try:
                generate(
                    self.model,
                    torch.tensor([ids], device=self.device),
                    max_new,
                    temperature=float(kwargs.get("temperature") or 1.0) if sample else 0.0,
                    top_k=kwargs.get("top_k"),
                    top_p=kwargs.get("top_p"),
                    stop_token=stops,
                    on_token=stop_at_until,
                    vocab_size=min(self.tok.vocab_size, self.model.config.vocab_size),
                )
            except _Stopped:
                pass
            if new and new[-1] in stops:
                new.pop()
            text = self.tok.decode_text(new)  # HFLM's text leaves out special tokens (<|user|>, <s>)
            for u in until:
                text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            outputs.append(text)
        return outputs

    # ---------------------------------------------------------------------------------------- distributed

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor.reshape(-1)) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.reshape(-1))
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


# -------------------------------------------------------------------------------------------- tasks


def evaluate_tasks(
    lm: MiniGPTLM,
    tasks: Sequence[str] | tuple[list, Any],
    limit: int | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 100_000,
) -> dict | None:
    """lm_eval.simple_evaluate on `tasks` (names and YAML paths, or what resolve_tasks returned); the harness's
    results dict (None on ranks other than 0 when distributed).  The model is put in eval mode meanwhile.
    limit (>= 1) and num_fewshot (>= 0) are checked where they enter: eval.py's and train.py's parsers."""
    from lm_eval import simple_evaluate

    specs, manager = tasks if isinstance(tasks, tuple) else resolve_tasks(tasks)
    manager.num_fewshot = num_fewshot  # each task's few-shot examples are checked as the harness builds it
    model = lm.model
    was_training = model.training
    model.eval()
    try:
        return simple_evaluate(
            model=lm,
            tasks=list(specs),
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            batch_size=lm.batch_size,
            log_samples=False,
            bootstrap_iters=bootstrap_iters,
        )
    except (FileNotFoundError, ConnectionError) as e:
        # a task's data_files or an uncached dataset; datasets offline (HF_DATASETS_OFFLINE=1) or no network
        missing = (
            "could not be found"
            if isinstance(e, FileNotFoundError)
            else "is not in the local cache and cannot be downloaded"
        )
        raise UserError(
            f"a task's data {missing} ({first_line(e)}); check its dataset_path and data_files, point "
            "it at local files (dataset_path: json), or run once with internet access to cache its "
            "dataset"
        ) from None
    finally:
        model.train(was_training)


# -------------------------------------------------------------------------------------------- results


def results_table(results: dict) -> str:
    """The harness's own table(s) of the results (lm_eval.utils.make_table)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def flat_metrics(results: dict) -> dict[str, float]:
    """{"TASK/METRIC": value} of every numeric metric ("acc,none" -> "acc"; another filter is kept as
    "METRIC_FILTER"); standard errors left out."""
    flat = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")  # metrics are "METRIC,FILTER"; alias, sample_len are not
            if not comma or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            flat[f"{task}/{metric if filt in ('', 'none') else f'{metric}_{filt}'}"] = float(value)
    return flat


def write_results(results: dict, path: str | Path) -> Path:
    """The results as JSON (what the harness's --output_path holds, without samples), written atomically."""
    from lm_eval.utils import handle_non_serializable

    path = Path(path)
    text = json.dumps(
        {k: v for k, v in results.items() if k != "samples"},
        indent=2,
        default=handle_non_serializable,
        ensure_ascii=False,
    )
    with write_errors(path, "free space there or choose another --output", UserError):
        atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    return path
