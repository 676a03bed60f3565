"""Low-rank adapters (LoRA, Hu et al. 2021): fine-tune a model by training a few million parameters beside its frozen
weights.  A targeted projection W (out x in) computes

    y = x W^T + b + alpha / r * (dropout(x) A^T) B^T        A: (r, in), B: (out, r), B starts at zero

so a fresh adapter changes nothing, and merging folds it back in: W' = W + alpha / r * B A.

minigpt's blocks stack projections in one matrix (q/k/v in `c_attn`, SwiGLU's gate/up in `c_fc`); each targeted
projection gets its own (A, B) over its block of rows, as if it were its own layer: what PEFT and litgpt train on
Llama's separate q_proj/k_proj/v_proj, so the adapters export to PEFT's files as they are.

Nothing in model.py changes: `apply_lora` swaps the blocks' nn.Linear modules for LoRALinear (the same `weight` and
`bias` names, so the base's state_dict keys stay) and freezes everything else.  A vocabulary the run grew (chat
tokens) keeps the base's rows frozen and trains only the new rows (GrownEmbedding / GrownHead; PEFT's
trainable_token_indices), unless `train_embeddings` trains every row and the learned positions too.  The frozen
block weights may be held in bfloat16 (`base_dtype`): half their memory, while every matmul still runs in the
training precision (LoRALinear upcasts them on the fly).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt.core.config import GATED_MLPS, RUNTIME_FIELDS, GPTConfig
from minigpt.core.errors import ConfigError
from minigpt.core.model import GPT, attention_flops_per_token

Finetune = Literal["full", "lora"]
Target = Literal["q", "k", "v", "o", "gate", "up", "down"]
BaseDtype = Literal["float32", "bfloat16"]
TARGETS = get_args(Target)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoRAConfig:
    """LoRA adapters, read with --finetune lora only (docs/lora.md)."""

    rank: int = 8
    """Rank r of each adapter, at most the smallest targeted projection's width."""
    alpha: float = 16.0
    """Scale: an adapter adds alpha / rank * B @ A to its projection's weight."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    targets: list[Target] = field(default_factory=lambda: list(TARGETS))
    """Projections that get an adapter: q, k, v, o (attention), gate, up, down (MLP; gate in SwiGLU only)."""
    base_dtype: BaseDtype | None = None
    """Hold the frozen blocks' weights in this dtype (bfloat16: half their memory; matmuls keep the training
    precision); unset = as loaded (float32)."""
    train_embeddings: bool = False
    """Also train the token embeddings in full (every row, and the output head's: tied or not) and the learned
    position embeddings (gpt arch), beside the adapters: PEFT's trainable_token_indices over every token and
    modules_to_save=["wpe"].  For a task whose tokens or positions the base used little (digits in the addition
    SFT demo): frozen, no rank or learning rate closes the gap to full fine-tuning.  The checkpoint holds them too."""

    def __post_init__(self) -> None:
        if isinstance(self.targets, list) and set(self.targets) <= set(TARGETS):  # a set: [v, q, q] is [q, v], so a
            self.targets = [t for t in TARGETS if t in self.targets]  # resume compares the adapters, not the typing
        self.validate()

    def validate(self, model: GPTConfig | None = None) -> None:
        """Raise ConfigError naming the first rule broken, those of the model's sizes too when `model` is given."""
        for name, problem, fix in self.problems(model):
            raise ConfigError(f"lora.{name}: {problem}; {fix}")

    def problems(self, model: GPTConfig | None = None) -> Iterator[tuple[str, str, str]]:
        """(field, problem, fix) for each rule this config breaks (the choices are checked by their Literal types
        on the command line, and here for a config read from a checkpoint); with `model`, also the rank against
        each targeted projection: at most its smaller side (more would train more than the layer holds)."""
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            yield "rank", f"must be a positive integer, got {self.rank!r}", "use e.g. 8"
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            yield "alpha", f"must be a positive number, got {self.alpha!r}", "use e.g. 16 (twice the rank)"
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            yield "dropout", f"must be in [0, 1), got {self.dropout!r}", "use e.g. 0.0 or 0.05"
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            yield (
                "targets",
                f"unknown target {unknown[0]!r}" if unknown else "is empty",
                f"choose from {', '.join(TARGETS)}",
            )
        if not isinstance(self.train_embeddings, bool):
            yield "train_embeddings", f"must be true or false, got {self.train_embeddings!r}", "use true or false"
        if self.base_dtype is not None and self.base_dtype not in DTYPES:
            yield "base_dtype", f"unknown value {self.base_dtype!r}", f"choose {', '.join(DTYPES)} or leave it unset"
        if model is None:
            return
        n_in = {
            "attn.c_attn": model.n_embd,
            "attn.c_proj": model.n_head * model.head_dim,
            "mlp.c_fc": model.n_embd,
            "mlp.c_proj": model.mlp_hidden,
        }
        for layer, pieces in block_pieces(model).items():
            for piece, rows in pieces.items():
                if piece in self.targets and self.rank > min(rows, n_in[layer]):
                    yield (
                        "rank",
                        f"{self.rank} is larger than the {piece} projection ({rows} x {n_in[layer]})",
                        f"choose lora.rank of at most {min(rows, n_in[layer])}",
                    )
                    return

    def check_targets(self, model: GPTConfig) -> None:
        """ConfigError if a target names a projection `model` does not have (gate beside a GELU MLP): it would get
        no adapter, and such targets alone would train nothing.  The full list (the default) means every projection
        the model has.  Checked where a run starts (minigpt.training.finetune_lora), not where a saved run's model
        is rebuilt, so a run saved before this check still loads."""
        have = [piece for pieces in block_pieces(model).values() for piece in pieces]
        missing = [t for t in self.targets if t not in have]
        if missing and set(self.targets) != set(TARGETS):
            raise ConfigError(
                f"lora.targets: this model has no {missing[0]} projection (its MLP, mlp={model.mlp}, is not gated); "
                f"choose from its projections {', '.join(have)}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------- the layers


class UpcastLinear(torch.autograd.Function):
    """x @ W^T + b with W held in a narrower dtype than x: W is upcast for the matmul, and again in the backward,
    so no upcast copy lives between them (autograd would keep one per layer: the memory bfloat16 saved)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return F.linear(x, weight.to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        grad_x = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None  # the base is frozen: no weight or bias gradient


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):  # autocast casts both itself
        return F.linear(x, weight, bias)
    return UpcastLinear.apply(x, weight, bias)


class LoRALinear(nn.Module):
    """A frozen linear layer whose weight stacks `pieces` (name -> rows, in order), and an adapter (A, B) for each
    targeted piece, added to that piece's rows of the output."""

    def __init__(self, linear: nn.Linear, pieces: dict[str, int], cfg: LoRAConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.weight = nn.Parameter(weight.to(dtype) if dtype is not None else weight, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.pieces, self.scaling = dict(pieces), cfg.scaling
        # the adapters, and the merged weight, in the dtype the layer computed in (a frozen base_dtype copy aside)
        self.compute_dtype = weight.dtype
        n_in, like = weight.size(1), {"device": weight.device, "dtype": weight.dtype}
        targeted = [p for p in pieces if p in cfg.targets]
        self.lora_A = nn.ParameterDict({p: nn.Parameter(torch.empty(cfg.rank, n_in, **like)) for p in targeted})
        self.lora_B = nn.ParameterDict({p: nn.Parameter(torch.zeros(pieces[p], cfg.rank, **like)) for p in targeted})
        for a in self.lora_A.values():  # A as nn.Linear initialises its weight, B zero (the paper's, PEFT's)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.dropout = nn.Dropout(cfg.dropout)
        self.disabled = False  # adapters_disabled: the base layer alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = frozen_linear(x, self.weight, self.bias)  # (B, T, out)
        if not self.lora_A or self.disabled:
            return y
        a, b = self.stacked()
        h = (self.dropout(x) if self.dropout.p > 0 else x) @ a.T  # (B, T, n r)
        return torch.addmm(y.flatten(0, -2), h.flatten(0, -2), b.T, alpha=self.scaling).view_as(y)  # y + s h B^T

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The targeted pieces' adapters as one: A (n r, in) stacked, B (out, n r) block-diagonal over the pieces'
        rows (no columns where a piece has no adapter), so B A holds each piece's B_p A_p on its rows."""
        names = [p for p in self.pieces if p in self.lora_A]
        if len(self.pieces) == 1:  # one projection (o, down; GPT's up): its adapter as it is, nothing to build
            return self.lora_A[names[0]], self.lora_B[names[0]]
        empty = self.lora_B[names[0]].new_zeros
        a = torch.cat([self.lora_A[p] for p in names])
        b = torch.block_diag(
            *[self.lora_B[p] if p in self.lora_B else empty(rows, 0) for p, rows in self.pieces.items()]
        )
        return a, b

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """alpha / r * B @ A for each piece (zeros where none), stacked as the weight's rows: (out, in), in float32
        (float64 for a float64 layer)."""
        wide = torch.promote_types(self.compute_dtype, torch.float32)
        if not self.lora_A:
            return self.weight.new_zeros(self.weight.shape, dtype=wide)
        a, b = self.stacked()
        return self.scaling * (b.to(wide) @ a.to(wide))


class GrownEmbedding(nn.Module):
    """An embedding whose rows [0, n) are the base's, frozen, and rows [n, n + new) trained (a grown vocabulary)."""

    def __init__(self, weight: nn.Parameter, new_rows: nn.Parameter) -> None:
        super().__init__()
        self.weight, self.new_rows = weight, new_rows
        self.disabled = False  # adapters_disabled: the new rows as they started (the mean row)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = self.weight.size(0)
        base = F.embedding(idx.clamp(max=n - 1), self.weight)  # (B, T, C)
        rows = new_rows(self.weight, self.new_rows.size(0)) if self.disabled else self.new_rows
        new = F.embedding((idx - n).clamp(min=0), rows)
        return torch.where((idx < n)[..., None], base, new)


class GrownHead(nn.Module):
    """The output head of a grown vocabulary: the base's rows frozen, the new ones trained (logits side by side)."""

    def __init__(self, weight: nn.Parameter, new_rows: nn.Parameter) -> None:
        super().__init__()
        self.weight, self.new_rows = weight, new_rows
        self.disabled = False  # adapters_disabled: the new rows as they started (the mean row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = new_rows(self.weight, self.new_rows.size(0)).to(x.dtype) if self.disabled else self.new_rows
        return torch.cat([frozen_linear(x, self.weight, None), F.linear(x, rows)], dim=-1)  # (B, T, V)


# ------------------------------------------------------------------------------------------------- applying


def block_pieces(config: GPTConfig) -> dict[str, dict[str, int]]:
    """Each block linear layer (by its name in the block) -> its stacked projections and their rows."""
    hs = config.head_dim
    hidden = config.mlp_hidden
    mlp_in = {"gate": hidden, "up": hidden} if config.mlp in GATED_MLPS else {"up": hidden}
    return {
        "attn.c_attn": {"q": config.n_head * hs, "k": config.n_kv_head * hs, "v": config.n_kv_head * hs},
        "attn.c_proj": {"o": config.n_embd},
        "mlp.c_fc": mlp_in,
        "mlp.c_proj": {"down": config.n_embd},
    }


def apply_lora(model: GPT, cfg: LoRAConfig, vocab_size: int | None = None) -> GPT:
    """Freeze `model` and give its blocks adapters, in place; a `vocab_size` larger than the model's adds trained
    rows (starting at the mean row, as a grown full fine-tune's do).  Returns the model."""
    config = model.config
    cfg.validate(config)  # the rank against the projections' sizes
    model.requires_grad_(False)
    if cfg.train_embeddings:  # before a grown vocabulary wraps them: the base's rows train too
        model.transformer.wte.weight.requires_grad_(True)
        model.lm_head.weight.requires_grad_(True)  # the same tensor where tied
        if "wpe" in model.transformer:
            model.transformer.wpe.weight.requires_grad_(True)
    dtype = DTYPES[cfg.base_dtype] if cfg.base_dtype is not None else None
    for block in model.transformer.h:
        for name, pieces in block_pieces(config).items():
            parent, attr = block.get_submodule(name.split(".")[0]), name.split(".")[1]
            setattr(parent, attr, LoRALinear(getattr(parent, attr), pieces, cfg, dtype))
    new = (vocab_size or config.vocab_size) - config.vocab_size
    if new > 0:
        wte, head = model.transformer.wte.weight, model.lm_head.weight
        head_rows = nn.Parameter(new_rows(head, new))
        wte_rows = head_rows if config.tie_embeddings else nn.Parameter(new_rows(wte, new))
        model.transformer.wte = GrownEmbedding(wte, wte_rows)
        model.lm_head = GrownHead(head, head_rows)
        model.config = GPTConfig.from_dict({**config.to_dict(), "vocab_size": vocab_size})
    return model


def new_rows(weight: torch.Tensor, n: int) -> torch.Tensor:
    """Where n rows a grown vocabulary adds start: the mean row (a new token's logit starts near the average one)."""
    return weight.detach().mean(dim=0, keepdim=True).expand(n, -1).clone()


def lora_model(base: GPT, config: GPTConfig, cfg: LoRAConfig) -> GPT:
    """A LoRA model for a run of `config` (the base's, with its runtime fields, a smaller block_size or a larger
    vocabulary) on `base`'s weights.  It takes them: nothing is copied, and `base` is left empty (on the meta
    device), so a bfloat16 base_dtype frees each float32 weight as it casts it."""
    cfg.validate(config)  # before the base is taken
    state = base.state_dict()
    if "transformer.wpe.weight" in state:  # a shorter context: learned positions beyond it are dropped
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: config.block_size]
    base_config = GPTConfig.from_dict({**config.to_dict(), "vocab_size": base.config.vocab_size})
    model = GPT.from_weights(base_config, state)
    del state
    base.to("meta")
    return apply_lora(model, cfg, config.vocab_size)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The LoRA model as its run started, without a copy (PEFT's disable_adapter): every adapter off and a grown
    vocabulary's new rows at their start, the mean row.  Not the start where lora.train_embeddings trains the
    base's own rows."""
    layers = [m for m in model.modules() if isinstance(m, (LoRALinear, GrownEmbedding, GrownHead))]
    for m in layers:
        m.disabled = True
    try:
        yield model
    finally:
        for m in layers:
            m.disabled = False


def adapter_names(model: nn.Module) -> list[str]:
    """The trained tensors' state_dict names: the adapters, a grown vocabulary's new rows and, with
    train_embeddings, the embeddings (both names of a tied one)."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    return [n for n, t in model.state_dict(keep_vars=True).items() if id(t) in trained]


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding these tensors (built on the meta device: nothing allocated, nothing initialised)."""
    with torch.device("meta"):
        linear = nn.Linear(weight.size(1), weight.size(0), bias=bias is not None)
    linear.weight = nn.Parameter(weight)
    if bias is not None:
        linear.bias = nn.Parameter(bias)
    return linear


@torch.no_grad()
def merge_lora(model: GPT) -> GPT:
    """Fold every adapter into its weight (summed in float32 or wider, kept in the layer's compute dtype) and append
    the new rows, in place, one layer at a time (so a large model never holds two copies): the model becomes a
    plain GPT computing what the LoRA model computed."""
    for block in model.transformer.h:
        for name in block_pieces(model.config):
            parent, attr = block.get_submodule(name.split(".")[0]), name.split(".")[1]
            lora = getattr(parent, attr)
            delta = lora.delta()
            merged = (lora.weight.to(delta.dtype) + delta).to(lora.compute_dtype)
            setattr(parent, attr, plain_linear(merged, lora.bias))
    wte, head = model.transformer.wte, model.lm_head
    if isinstance(head, GrownHead):
        head_weight = torch.cat([head.weight, head.new_rows.to(head.weight.dtype)])
        model.lm_head = plain_linear(head_weight, None)
        wte_weight = head_weight if model.config.tie_embeddings else torch.cat([wte.weight, wte.new_rows])
        with torch.device("meta"):
            model.transformer.wte = nn.Embedding(*wte_weight.shape)
        model.transformer.wte.weight = model.lm_head.weight if model.config.tie_embeddings else nn.Parameter(wte_weight)
    return model.requires_grad_(True)


# ------------------------------------------------------------------------------------------------- identity


def fingerprint(model: GPT) -> str:
    """SHA-256 of a model's config (but the fields that change only how it computes) and every weight's bytes: the
    identity of a LoRA run's base (~1.3 GB/s: 4 s for a 1.2B model in float32)."""
    h = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k not in RUNTIME_FIELDS}
    h.update(json.dumps(config, sort_keys=True).encode())
    for name, p in model.named_parameters():  # tied weights once
        t = p.detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def training_flops_per_token(model: GPT, seq_len: int) -> int:
    """GPT.flops_per_token for a LoRA model: a frozen matmul weight costs 4 FLOPs per entry and token (the forward
    and the input's gradient, no weight gradient), a trained one 6 (the adapters, a grown head's new rows, a head
    tied to trained embeddings), and attention's q.k and att.v as in GPT.flops_per_token.  Embedding lookups are
    not matmuls, trained or not."""
    cfg = model.config
    matmuls = [m for m in model.modules() if isinstance(m, (nn.Linear, LoRALinear, GrownHead))]
    weights = {id(m.weight): m.weight for m in matmuls}  # a tied head's weight is the embedding's: counted once
    weights |= {id(m.new_rows): m.new_rows for m in matmuls if isinstance(m, GrownHead)}
    weights |= {
        id(p): p for m in matmuls if isinstance(m, LoRALinear) for p in (*m.lora_A.values(), *m.lora_B.values())
    }
    flops = sum((6 if w.requires_grad else 4) * w.numel() for w in weights.values())
    return flops + attention_flops_per_token(cfg, seq_len or cfg.block_size)


# ------------------------------------------------------------------------------------------------- checkpoints

# A LoRA run's checkpoint holds the tensors it trains (adapter_names) and, in minigpt's section, this entry:
#   ckpt["minigpt"]["lora"] = {"config": LoRAConfig.to_dict(),
#                              "base": {"source": where the base is, "fingerprint": fingerprint(base)}}
SECTION_KEY = "lora"


def checkpoint_lora(ckpt: dict[str, Any]) -> tuple[LoRAConfig, dict[str, str]] | None:
    """(the adapters' config, where their base is and its fingerprint) of a LoRA run's checkpoint; None for any
    other checkpoint."""
    entry = ckpt["minigpt"].get(SECTION_KEY)
    if entry is None:
        return None
    return LoRAConfig(**entry["config"]), dict(entry["base"])
