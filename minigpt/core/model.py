"""A decoder-only transformer, read top to bottom.

GPT-2 block: LayerNorm, learned positions, GELU MLP.  Llama block: RMSNorm, rotary positions (RoPE),
grouped-query attention (GQA), SwiGLU MLP.  One `CausalSelfAttention` computes the same function three
ways (`sdpa`, `manual`, `einops`), chosen by `GPTConfig.attention`; the paths share every parameter, so a
checkpoint trained with one runs with the others.  A layer may attend within a sliding window (config.layer_window:
Mistral's, Gemma 3's local layers), its RoPE with a base of its own (rope_local_base); RoPE may rotate only the first
dims of each head (partial_rotary_factor: Phi-3's).  Gemma's variants are options too: token embeddings scaled by
sqrt(C) (scale_embeddings), a GELU-gated MLP (mlp geglu), each sublayer's output normalised before the residual add
(post_norms), and the softmax scale taken from attn_scale_dim instead of hs.

Shapes: B batch, T query length, S key length (T, or cached + T while decoding), C n_embd,
nh query heads, nkv key/value heads, g = nh // nkv query heads per key/value head, hs head size.

Decoding with the KV cache (minigpt.core.kv_cache), `input_pos` is where idx starts: one int for every row, or a
(B,) tensor, one start per row, so a server can decode requests of different lengths as one batch.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import einsum, rearrange
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from minigpt.core import inductor_cache
from minigpt.core.config import GATED_MLPS, GPTConfig
from minigpt.core.kv_cache import KVCache

inductor_cache.key_compiled_graphs_by_cpu_kind()  # before any model compiles: graphs cached per CPU kind

SDPA_BACKEND = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


# --------------------------------------------------------------------------------------------------
# Rotary position embeddings: rotate each (x_i, x_{i+hs/2}) pair of q and k by an angle pos * base^(-2i/hs),
# so q.k depends only on the distance between positions.


def rope_cache(
    seq_len: int, head_dim: int, base: float = 10000.0, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hs/2,)
    magnitude, kind = 1.0, None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        # Phi-3's LongRoPE within its original context: each frequency divided by its factor, and cos/sin scaled
        inv_freq = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
        magnitude = scaling["attention_factor"]
    elif kind == "linear":  # position interpolation: position p rotates as p / factor
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = llama3_scaled_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hs): pair i and i + hs/2 share an angle
    return angles.cos() * magnitude, angles.sin() * magnitude


def llama3_scaled_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's long-context RoPE: wavelengths longer than the original context / low_freq_factor are
    stretched by `factor`, those shorter than context / high_freq_factor are kept, and the band between is
    interpolated smoothly."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0 = stretch fully, 1 = keep
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def attention_flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token of attention's q.k and att.v (forward + backward: 12 per query dim and key): a
    query reads seq_len keys, or on a sliding layer at most its window (PaLM's count, the causal half kept)."""
    keys = sum(min(config.layer_window(i) or seq_len, seq_len) for i in range(config.n_layer))
    return 12 * config.n_head * config.head_dim * keys


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rd = cos.size(-1) dims of x (B, nh, T, hs); partial rotary (rd < hs) passes the rest."""
    rd = cos.size(-1)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot.chunk(2, dim=-1)  # (B, nh, T, rd/2) each
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (x_rot * cos + rotated * sin).type_as(x)
    return out if rd == x.size(-1) else torch.cat((out, x_pass), dim=-1)


def causal_mask(
    T: int,
    S: int,
    input_pos: int | torch.Tensor = 0,
    device: torch.device | str | None = None,
    window: int | None = None,
    key_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T, S) bool, True where query t (at absolute position input_pos + t) may see key s (at position key_pos[s],
    default s): key_pos <= input_pos + t, and with a sliding window, fewer than `window` positions back.  With
    per-row starts, input_pos (B,), or per-row key positions (a ring cache's, (B, S)) it is (B, 1, T, S), one mask
    per row, broadcast over the heads.
    Built per call, not stored per layer: a long-context model would otherwise hold n_layer x block_size^2."""
    per_row = isinstance(input_pos, torch.Tensor)
    if not per_row and window is None and key_pos is None:
        return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=input_pos)
    query_pos = torch.arange(T, device=device) + (input_pos[:, None] if per_row else input_pos)  # (T,) or (B, T)
    if key_pos is None:
        key_pos = torch.arange(S, device=device)  # (S,)
    behind = query_pos[..., :, None] - key_pos[..., None, :]  # (T, S) or (B, T, S): how far back each key is
    mask = behind >= 0
    if window is not None:
        mask &= behind < window
    return mask[:, None] if mask.dim() == 3 else mask


# --------------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, window: int | None = None) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.window = window  # sliding window (config.layer_window), None = full causal attention
        self.attention = config.attention
        self.sdpa_backend = config.sdpa_backend
        self.dropout = config.dropout
        self.scale = (config.attn_scale_dim or self.head_dim) ** -0.5  # scores are q.k * scale
        # q, k and v in one matmul, stacked by rows; with GQA k and v have fewer heads than q
        self.qkv_rows = [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim]
        self.c_attn = nn.Linear(config.n_embd, sum(self.qkv_rows), bias=config.bias or config.qkv_bias)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: KVCache | None = None,
        input_pos: int | torch.Tensor = 0,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        hs = self.head_dim
        q, k, v = self.c_attn(x).split(self.qkv_rows, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        key_pos = None  # the keys' positions: 0..S-1, or a ring cache's (B, S) (a sliding layer's last window)
        if kv_cache is not None:
            # (B, nkv, S, hs): S = input_pos + T (per row: the longest); a ring's S = its capacity (+ T when T > 1)
            k, v, key_pos = kv_cache.update(k, v, input_pos)
        # sdpa's is_causal covers training and prefill, and one new token with one start sees every cached key;
        # every other case gets an explicit mask: (T, S), or (B, 1, T, S) per row (own starts, a ring's keys).  A
        # sliding window needs it only where some key is `window` or more back: a ring's keys, or S > window.
        S = k.size(2)
        one_start = not isinstance(input_pos, torch.Tensor)
        window = self.window if self.window is not None and (key_pos is not None or S > self.window) else None
        mask = (
            None
            if self.attention == "sdpa" and one_start and window is None and (T == 1 or T == S)
            else causal_mask(T, S, input_pos, x.device, window, key_pos)
        )

        if return_weights and self.attention == "sdpa":
            raise ValueError(
                "attention weights are not available from the 'sdpa' path (the fused kernel "
                "never forms them); use attention='manual' or 'einops' to inspect them"
            )
        path = {"sdpa": self._sdpa, "manual": self._manual, "einops": self._einops}[self.attention]
        y, weights = path(q, k, v, mask)  # y: (B, nh, T, hs)

        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs)  # re-assemble heads: (B, T, nh*hs)
        y = self.resid_dropout(self.c_proj(y))
        return (y, weights) if return_weights else y

    # The three paths, side by side: same inputs, same output.  q: (B, nh, T, hs), k and v: (B, nkv, S, hs).

    def _sdpa(self, q, k, v, mask):
        T = q.size(2)
        # is_causal=True aligns the triangle top-left, which is right only when queries and keys start at
        # the same position (training, prefill: T == S); one new token (T == 1) sees every key, no mask at all.
        # Decided from T alone: a compiled decode step's S is symbolic, and sdpa takes a plain bool.
        is_causal = mask is None and T > 1
        # enable_gqa lets the kernel read each K/V head for its g query heads without copying K/V g times; the
        # memory-efficient kernel takes no GQA (torch 2.11 refuses it: "No available kernel"): K/V copied for it
        gqa = self.n_kv_head != self.n_head
        if gqa and self.sdpa_backend == "efficient":
            g = self.n_head // self.n_kv_head
            k, v, gqa = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), False
        kwargs = dict(
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            enable_gqa=gqa,
            scale=self.scale,
        )
        if self.sdpa_backend is None:  # let torch pick flash / memory-efficient / math
            return F.scaled_dot_product_attention(q, k, v, **kwargs), None
        with sdpa_kernel(SDPA_BACKEND[self.sdpa_backend]):
            return F.scaled_dot_product_attention(q, k, v, **kwargs), None

    def _manual(self, q, k, v, mask):
        g = self.n_head // self.n_kv_head
        # one explicit K/V expansion: query head h reads key/value head h // g
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, nh, S, hs)
        att = (q @ k.transpose(-2, -1)) * self.scale  # (B, nh, T, S)
        att = att.masked_fill(~mask, float("-inf"))
        # a softmax in float32 at least: bf16 sums lose the small terms (a float64 model keeps its float64)
        att = att.softmax(dim=-1, dtype=torch.promote_types(att.dtype, torch.float32)).to(q.dtype)
        y = F.dropout(att, self.dropout, self.training) @ v  # (B, nh, T, hs)
        return y, att

    def _einops(self, q, k, v, mask):
        # named axes make GQA a broadcast over g: no K/V copy
        q = rearrange(q, "b (kv g) t d -> b kv g t d", kv=self.n_kv_head)
        scores = einsum(q, k, "b kv g t d, b kv s d -> b kv g t s") * self.scale
        if mask.dim() == 4:  # one mask per row, (B, 1, T, S): give it the g axis too
            mask = mask[:, :, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        att = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
        y = einsum(F.dropout(att, self.dropout, self.training), v, "b kv g t s, b kv s d -> b kv g t d")
        y = rearrange(y, "b kv g t d -> b (kv g) t d")  # (B, nh, T, hs)
        return y, rearrange(att, "b kv g t s -> b (kv g) t s")


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.kind = config.mlp
        self.gelu_approximate = config.gelu_approximate
        n_in = 2 * config.mlp_hidden if self.kind in GATED_MLPS else config.mlp_hidden  # gated: gate and up fused
        self.c_fc = nn.Linear(config.n_embd, n_in, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.kind in GATED_MLPS:
            gate, up = h.chunk(2, dim=-1)  # (B, T, mlp_hidden) each
            act = F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate=self.gelu_approximate)
            h = act * up
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.dropout(self.c_proj(h))


def make_norm(config: GPTConfig, dim: int) -> nn.Module:
    if config.arch == "llama":
        return nn.RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """Pre-norm residual block; `arch` picks LayerNorm (gpt) or RMSNorm (llama), `mlp` the MLP.  With post_norms
    each sublayer's output is normalised too before it joins the residual stream (a "sandwich", Gemma's)."""

    def __init__(self, config: GPTConfig, window: int | None = None) -> None:
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config, window)
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)
        # post_norms: each sublayer's output normalised before the residual add (Identity: not)
        self.post_attn_norm = make_norm(config, config.n_embd) if config.post_norms else nn.Identity()
        self.post_mlp_norm = make_norm(config, config.n_embd) if config.post_norms else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        rope=None,
        kv_cache: KVCache | None = None,
        input_pos: int | torch.Tensor = 0,
        attn_weights: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if attn_weights is None:
            y = self.attn(self.ln_1(x), rope, kv_cache, input_pos)
        else:  # inspection: keep this layer's (B, nh, T, S) weights
            y, weights = self.attn(self.ln_1(x), rope, kv_cache, input_pos, return_weights=True)
            attn_weights.append(weights)
        x = x + self.post_attn_norm(y)
        return x + self.post_mlp_norm(self.mlp(self.ln_2(x)))


def building_shapes_only() -> bool:
    """Inside `with torch.device("meta")` (state_shapes, from_weights): tensors hold no values, so nothing is
    initialised; normal_ on meta would also import torch's compiler, 1.5 s of a sampler's start."""
    return torch.get_default_device().type == "meta"


def embedding(num: int, dim: int) -> nn.Embedding:
    if building_shapes_only():  # from_pretrained skips the normal_ init that nn.Embedding runs
        return nn.Embedding.from_pretrained(torch.empty(num, dim), freeze=False)
    return nn.Embedding(num, dim)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config = replace(config)  # its own: the caller's (shared by other models) stays as it was
        self.transformer = nn.ModuleDict(
            dict(
                wte=embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, config.layer_window(i)) for i in range(config.n_layer)),
                ln_f=make_norm(config, config.n_embd),
            )
        )
        if config.arch == "gpt":  # learned absolute positions; llama rotates q and k instead
            self.transformer["wpe"] = embedding(config.block_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        for name, table in self.rope_tables().items():  # (block_size, rotary dims) each
            self.register_buffer(name, table, persistent=False)
        if not building_shapes_only():
            self.init_weights()

    def init_weights(self) -> None:
        config = self.config
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the residual stream's variance
        # does not grow with depth; zero_init_proj starts every block as the identity instead.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                if config.zero_init_proj:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @classmethod
    def state_shapes(cls, config: GPTConfig) -> dict[str, torch.Size]:
        """The state_dict's names and shapes for `config`, from a model on the meta device (nothing allocated)."""
        with torch.device("meta"):
            return {name: t.shape for name, t in cls(config).state_dict().items()}

    @classmethod
    def from_weights(cls, config: GPTConfig, state: dict[str, torch.Tensor], skeleton: GPT | None = None) -> GPT:
        """A GPT holding exactly `state`'s tensors, never allocating (or initialising) weights of its own: built
        on the meta device, then the tensors are assigned in, so a large import holds its weights once.
        skeleton: that meta model already built (check_config_size's), filled here rather than built again."""
        with torch.device("meta"):
            model = skeleton if skeleton is not None else cls(config)
        model.load_state_dict(state, assign=True)
        if config.tie_embeddings:  # assign gave the two names two Parameters: make them one again
            model.transformer.wte.weight = model.lm_head.weight
        for name, table in model.rope_tables().items():  # non-persistent buffers are not in a state dict
            setattr(model, name, table)
        return model

    def rope_tables(self) -> dict[str, torch.Tensor]:
        """The RoPE buffers (llama): cos and sin of every position, (block_size, rotary_dim) each, and the sliding
        layers' own where they have another base (rope_local_base).  Empty on the meta device (from_weights)."""
        c = self.config
        if c.arch != "llama":
            return {}
        bases = {"rope": (c.rope_base, c.rope_scaling)}
        if c.rope_local_base is not None:
            bases["rope_local"] = (c.rope_local_base, None)  # Gemma 3: the local base, never scaled
        tables = {}
        for name, (base, scaling) in bases.items():
            if building_shapes_only():  # from_weights computes them for real
                cos = sin = torch.empty(c.block_size, c.rotary_dim)
            else:
                cos, sin = rope_cache(c.block_size, c.rotary_dim, base, scaling)
            tables[f"{name}_cos"], tables[f"{name}_sin"] = cos, sin
        return tables

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        kv_cache: list[KVCache] | None = None,
        input_pos: int | torch.Tensor = 0,
        attn_weights: list[torch.Tensor] | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, vocab), and the mean cross-entropy if targets (B, T) are given
        (in float32, or the model's float64; a target of -1 is not scored: a prompt's or padding's position).
        last_only: the last position's logits only, (B, 1, vocab), which is all generating needs (the head over
        every position of a 512-token prompt would be a third of a GPT-2-124M prefill's work).

        With `kv_cache` (from `new_kv_cache`), idx holds positions input_pos .. input_pos + T - 1 and the
        keys/values of the earlier positions come from the cache; input_pos (B,) gives each row its own start.
        With a list as `attn_weights`, each layer appends its attention weights (B, nh, T, S) to it (manual and
        einops paths only; see `attention_weights`).
        """
        B, T = idx.shape
        per_row = isinstance(input_pos, torch.Tensor)
        if kv_cache is None and (per_row or input_pos != 0):  # without a cache every query would see idx's ends
            raise ValueError("input_pos needs kv_cache (positions after a cached prefix); without one, idx starts at 0")
        if not per_row and input_pos < 0:
            raise ValueError(f"input_pos must be >= 0, got {input_pos}")
        # a static cache's step (a CUDA graph's) leaves its positions on the device, bounded by the cache's size
        static = per_row and kv_cache is not None and kv_cache[0].static
        end = 0 if static else (int(input_pos.max()) if per_row else input_pos) + T
        if end > self.config.block_size:
            raise ValueError(
                f"sequence of {end} tokens is longer than block_size="
                f"{self.config.block_size}; crop it to the last {self.config.block_size} tokens"
            )
        pos = torch.arange(T, device=idx.device) + (input_pos[:, None] if per_row else input_pos)  # (T,) or (B, T)
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.scale_embeddings:  # sqrt(C) rounded to x's dtype first, as Gemma's reference does; made on
            # x's device: a CPU tensor in a traced graph would keep it from being recorded as a CUDA graph
            x = x * torch.full((), self.config.n_embd**0.5, dtype=x.dtype, device=x.device)
        rope = local_rope = None
        if self.config.arch == "gpt":
            x = x + self.transformer.wpe(pos)
        else:  # (T, rd), or (B, 1, T, rd) to broadcast over the heads of each row
            rope = local_rope = self.rope_at(pos, "rope")
            if self.config.rope_local_base is not None:  # the sliding layers' own base
                local_rope = self.rope_at(pos, "rope_local")
        x = self.transformer.drop(x)
        # Activation checkpointing: each block keeps only its input for the backward pass and runs its forward
        # again there. Only where a backward will follow (training, grad on) and the block has no side effects
        # (a KV cache written twice, attention weights kept twice). Non-reentrant: it handles a frozen base (LoRA)
        # whose inputs need no grad, restores the RNG so dropout draws the same masks, and torch.compile traces it.
        recompute = (
            self.config.activation_checkpointing
            and self.training
            and torch.is_grad_enabled()
            and kv_cache is None
            and attn_weights is None
        )
        for i, block in enumerate(self.transformer.h):
            block_rope = local_rope if block.attn.window is not None else rope
            if recompute:
                x = checkpoint(block, x, block_rope, None, input_pos, use_reentrant=False)
            else:
                x = block(x, block_rope, kv_cache[i] if kv_cache is not None else None, input_pos, attn_weights)
        if last_only:
            x = x[:, -1:]  # (B, 1, C)
        return self.head(x, targets)

    def rope_at(self, pos: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of table `name` at positions pos (T,) -> (T, rd), or pos (B, T) -> (B, 1, T, rd)."""
        cos, sin = getattr(self, f"{name}_cos")[pos], getattr(self, f"{name}_sin")[pos]
        return (cos, sin) if pos.dim() == 1 else (cos[:, None], sin[:, None])

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last hidden states (B, T, C) -> logits (B, T, vocab), and the mean cross-entropy against targets."""
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 up to float32; float64 kept
            loss = F.cross_entropy(wide.flatten(0, 1), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """An empty cache per layer for `batch_size` sequences of up to `max_len` (default block_size) tokens; it
        allocates as positions are written (a sliding layer's: up to its window, a ring buffer)."""
        p = self.transformer.ln_f.weight  # a float tensor also where the linear weights are int8 (core/quantize)
        c, max_len = self.config, max_len or self.config.block_size
        return [
            KVCache(
                batch_size,
                max_len,
                c.n_kv_head,
                c.head_dim,
                device=p.device,
                dtype=p.dtype,
                # a sliding layer keeps its last `window` positions, where the sequence can outgrow them
                window=block.attn.window if block.attn.window is not None and block.attn.window < max_len else None,
            )
            for block in self.transformer.h
        ]

    def set_attention(self, attention: str) -> None:
        """Switch every layer to another attention path; the weights are shared, so outputs stay the same."""
        self.config = replace(self.config, attention=attention)  # checked first: a refused path changes nothing
        for block in self.transformer.h:
            block.attn.attention = attention

    @torch.no_grad()
    def attention_weights(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> every layer's attention weights, (n_layer, B, n_head, T, T), in float32, eval mode.

        Formed through the manual path whatever path the model runs: the three compute the same function
        from the same weights, and only the manual one materialises the (T, T) matrix.
        """
        attention, was_training = self.config.attention, self.training
        self.set_attention("manual")
        self.eval()
        try:
            weights: list[torch.Tensor] = []
            self(idx, attn_weights=weights)
        finally:
            self.set_attention(attention)
            self.train(was_training)
        return torch.stack([w.float() for w in weights])  # (L, B, nh, T, T)

    def stacked_projections(self) -> dict[nn.Parameter, list[int]]:
        """Weights that stack several projections by rows -> each projection's row count: the attention's fused
        q/k/v and a gated MLP's fused gate/up (an optimizer that treats matrices as wholes, Muon, needs the pieces)."""
        stacked = {}
        for block in self.transformer.h:
            stacked[block.attn.c_attn.weight] = block.attn.qkv_rows
            if block.mlp.kind in GATED_MLPS:
                stacked[block.mlp.c_fc.weight] = [self.config.mlp_hidden] * 2
        return stacked

    def num_params(self, exclude_position_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if exclude_position_embeddings and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 per matmul weight, plus attention's q.k and att.v.

        Counted as in the PaLM paper / nanoGPT: the causal mask's skipped half of the attention is not
        subtracted.  Only matmul weights count: embedding lookups, biases and norm gains are not matmuls; a
        tied embedding is counted once, as the head.  (Checked against torch's FlopCounterMode in the tests.)
        """
        n_matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * n_matmul + attention_flops_per_token(self.config, seq_len or self.config.block_size)
