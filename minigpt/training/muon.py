"""Muon for the blocks' matrices, beside AdamW for the rest: torch.optim.Muon's update with its Newton-Schulz
iteration batched over same-shaped matrices, in a dtype chosen for the device, per projection of a stacked weight."""

from __future__ import annotations

import math

import torch

from minigpt.core.precision import has_native_bf16


def newton_schulz(
    grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration, as torch.optim.Muon computes it, in `dtype`: ~U V^T for G = U S V^T.

    grad: one matrix (m, n), or a stack of same-shaped matrices (k, m, n), each orthogonalised on its own in one
    batched matmul per product (what many small matrices need on a CPU)."""
    a, b, c = coefficients
    addmm = torch.addmm if grad.dim() == 2 else torch.baddbmm
    x = grad.to(dtype)
    tall = grad.size(-2) > grad.size(-1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def evaluate(closure) -> torch.Tensor | None:
    """An optimizer step's closure (Lightning's forward and backward) run with gradients on, as torch's optimizers
    run it; its loss, or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Muon(torch.optim.Muon):
    """torch.optim.Muon with the Newton-Schulz iteration in a dtype chosen for the parameters' device, batched over
    same-shaped matrices, and run on each projection of a stacked weight on its own.

    torch's iteration is always bfloat16: right on GPUs and CPUs with native bf16, but on a CPU without it (AVX2)
    a bf16 matmul is ~150x slower than float32, and torch's Muon made the CPU recipe's step 6x slower (620 ms vs
    104 ms with the iteration in float32).
    row_splits: {weight: rows of each projection} for weights that stack several projections (fused q/k/v,
    SwiGLU's gate/up): each is orthogonalised, and its learning rate scaled, as the matrix it is, as if the
    projections were separate parameters (as Muon's authors do).  Without row_splits, and with no two matrices
    of one shape, each update is torch's to the bit.
    Everything else is torch's Muon: the update, its hyper-parameters, state (momentum_buffer) and checkpoints.
    """

    ns_dtype: torch.dtype | None = None  # decided at the first step, from where the parameters live

    def __init__(self, params, *args, row_splits: dict[torch.Tensor, list[int]] | None = None, **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        self.row_splits = dict(row_splits or {})  # keyed by the parameter object (tensors hash by identity)

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate(closure)
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if self.ns_dtype is None:
                self.ns_dtype = torch.bfloat16 if has_native_bf16(params[0].device) else torch.float32
            # the element-wise updates one foreach call each over the group (on a GPU a few launches, not one per
            # matrix: a small model's optimizer step is the host launching kernels)
            grads = [p.grad for p in params]
            bufs = [self.momentum_buffer(p) for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            decay = 1 - lr * group["weight_decay"]  # decoupled weight decay
            if params[0].dtype == torch.float32:
                torch._foreach_mul_(params, decay)
            else:  # bf16 weights (bf16-true): a CPU's foreach rounds the scalar to bf16 first, mul_ does not
                for p in params:
                    p.mul_(decay)
            by_shape: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (weight rows, update rows)
            for p, update in zip(params, updates):
                rows = self.row_splits.get(p)
                for piece in zip(p.split(rows), update.split(rows)) if rows else [(p, update)]:
                    by_shape.setdefault(piece[0].shape, []).append(piece)
            for shape, pieces in by_shape.items():
                single = len(pieces) == 1  # a lone matrix takes torch's own 2-D path
                ortho = newton_schulz(
                    pieces[0][1] if single else torch.stack([u for _, u in pieces]),
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                    self.ns_dtype,
                )
                alpha = -lr * muon_lr_ratio(group["adjust_lr_fn"], shape)
                weights = [weight for weight, _ in pieces]  # the parameters, or views of their rows
                if weights[0].dtype == torch.float32:  # exact (from bf16 or float32): one dtype and layout throughout
                    ortho = ortho.to(torch.float32, memory_format=torch.contiguous_format)  # keeps foreach's fast path
                if isinstance(alpha, torch.Tensor):  # a learning rate on the device (GraphedStep): no scalar alpha
                    ortho = (ortho.float() * alpha).to(ortho.dtype)  # the product in float32, as alpha= computes it
                    alpha = 1.0
                torch._foreach_add_(weights, [ortho] if single else list(ortho.unbind()), alpha=alpha)
        return loss

    def momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


def muon_lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-matrix learning-rate scale: "original" sqrt(max(1, A/B)), or "match_rms_adamw"
    0.2 sqrt(max(A, B)), which gives the update AdamW's RMS so the two can share one learning rate."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else 1.0


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the blocks' 2-D weights, AdamW for everything else, as one optimizer: Lightning's automatic
    optimization (clipping, accumulation, LR schedulers, checkpoints) then drives both unchanged.

    The two inner optimizers share this optimizer's param_groups and state dicts, so state_dict(),
    load_state_dict() and an LR scheduler see all groups at once.
    """

    def __init__(
        self,
        muon_groups: list[dict],
        adamw_groups: list[dict],
        lr: float,
        betas: tuple[float, float],
        fused: bool,
        ns_steps: int = 5,
        row_splits: dict[torch.Tensor, list[int]] | None = None,
    ) -> None:
        # match_rms_adamw scales Muon's update to AdamW's size, so one learning rate serves both
        self.muon = Muon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw", ns_steps=ns_steps, row_splits=row_splits)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, fused=fused)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, defaults={"lr": lr})
        self._share()

    def _share(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces the group and state dicts: share the new ones
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.muon.step(closure)  # evaluates the closure (Lightning's forward + backward) first
        self.adamw.step()
        return loss
