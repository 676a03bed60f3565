"""The KV cache: keys and values of one layer for the positions already seen, so decoding a token costs O(S), not
O(S^2).

A batch's rows are written from `input_pos` on: one start for every row (an int: generate, ChatSession), or one
start per row (a (B,) tensor: a server's batch, whose requests are at different lengths).  A cache may hold more
rows than the batch run through it; the batch uses rows 0..B-1 (the server keeps its running requests there).
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """One layer's keys and values, (rows, nkv, capacity, hs) each.

    The buffers grow with the sequence (to what is written, doubling past that, never beyond max_len): eight
    tokens from a model with a 128k context hold eight positions, not the whole context's gigabytes."""

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        n_kv_head: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.max_len = max_len
        self.k = torch.zeros((batch_size, n_kv_head, 0, head_dim), device=device, dtype=dtype)  # (B, nkv, capacity, hs)
        self.v = torch.zeros_like(self.k)

    def reserve(self, length: int) -> None:
        """Make room for positions 0..length-1: amortised O(1) copies per position."""
        if length > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; position {length - 1} is past it")
        if length > self.k.size(2):
            extra = min(self.max_len, max(length, 2 * self.k.size(2))) - self.k.size(2)
            self.k = torch.cat((self.k, self.k.new_zeros(*self.k.shape[:2], extra, self.k.size(3))), dim=2)
            self.v = torch.cat((self.v, self.v.new_zeros(*self.v.shape[:2], extra, self.v.size(3))), dim=2)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, input_pos: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hs) at positions input_pos.. of rows 0..B-1 -> the rows' keys and values so far,
        (B, nkv, S, hs) each.  With per-row starts S is the longest row's end: a shorter row's later keys are
        stale, and the attention mask hides them."""
        B, T = k.size(0), k.size(2)
        if isinstance(input_pos, torch.Tensor):
            end = int(input_pos.max()) + T
            self.reserve(end)
            rows = torch.arange(B, device=k.device)[:, None]  # (B, 1)
            cols = input_pos[:, None] + torch.arange(T, device=k.device)  # (B, T): row b's own positions
            self.k[rows, :, cols] = k.transpose(1, 2)  # indexed as (B, T, nkv, hs)
            self.v[rows, :, cols] = v.transpose(1, 2)
        else:
            end = input_pos + T
            self.reserve(end)
            self.k[:B, :, input_pos:end] = k
            self.v[:B, :, input_pos:end] = v
        return self.k[:B, :, :end], self.v[:B, :, :end]

    def copy_row(self, row: int, source: KVCache, source_row: int, length: int) -> None:
        """Positions 0..length-1 of `source`'s row -> this cache's `row` (a prefilled request joins a running batch,
        or a batch closes the gap a finished request left)."""
        self.reserve(length)
        self.k[row, :, :length] = source.k[source_row, :, :length]
        self.v[row, :, :length] = source.v[source_row, :, :length]
