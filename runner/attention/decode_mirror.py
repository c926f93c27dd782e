"""DecodeMirror: the running batch's K/V kept dense and head-major between CPU decode steps.

Why. The torch-native backend reads paged K/V by gathering every request's slots into a dense
[bs, max_kv, kv_heads, head_dim] block, per layer, per step: the whole history is copied again each
step, then read once more by the attention. On the 40M Qwen2 shape (fp32, 16 requests, 2 threads) that
was ~4.7 ms of a ~19 ms decode step. Consecutive decode steps of one batch only add one token per
request, so this keeps a dense copy per layer, [bs * kv_heads, capacity, head_dim], appends each step's
new K/V (one index_copy_ per tensor), and attends over it with two batched matmuls: ~2.2 ms.

Validity. The copy is reused only when this step is exactly the next step of the batch it mirrors: the
same request rows in the same order, each sequence exactly one token longer, within capacity. Anything
else (a request joined, finished or was retracted; the previous step was rolled back or failed; the
pool was released) rebuilds it from the pool in the step's first touch of each layer, and any prefill
(`invalidate`) drops it, since a request row reused by a new request could otherwise look like the old
batch. The pool stays the source of truth: every K/V is written there first.

What not. Decode only, eager CPU steps only (a captured step plans its own static buffers), never in
the deterministic mode (runner/batch_invariant.py has its own fixed-block kernel). It holds at most
`MAX_BYTES`; a larger batch gathers as before.
"""

from __future__ import annotations

import torch

# The mirror's K+V over all layers may use this much host memory; past it, steps gather as before.
MAX_BYTES = 256 << 20
CAPACITY_ALIGN = 64  # capacity grows in these steps: a rebuild once per 64 decode steps at most


class DecodeMirror:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.rows: list[int] | None = None  # request rows of the batch mirrored, in batch order
        self.lens: list[int] | None = None  # their sequence lengths at the last planned step
        self.k: list[torch.Tensor | None] = [None] * num_layers  # per layer [bs * hkv, capacity, d]
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.capacity = 0
        self.stale: set[int] = set()  # layers to rebuild from the pool at their next attention call

    def invalidate(self) -> None:
        """Forget the batch (a prefill ran, or the pool was cleared): the next decode step rebuilds."""
        self.rows = self.lens = None

    def drop(self) -> None:
        """Free the buffers too (the KV cache is released, or the runner shuts down)."""
        self.invalidate()
        self.k = [None] * self.num_layers
        self.v = [None] * self.num_layers
        self.capacity = 0

    def plan(self, rows: list[int], lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device, max_len: int) -> bool:
        """Called once per eager decode step, before any layer runs. Advances the mirror to this step and
        marks every layer stale unless this step continues the mirrored one. False: do not use a mirror
        for this step (it would exceed MAX_BYTES)."""
        bs, longest = len(rows), max(lens)
        follows = (self.rows == rows and self.lens is not None and longest <= self.capacity
                   and all(n == m + 1 for n, m in zip(lens, self.lens, strict=True)))
        self.rows, self.lens = list(rows), list(lens)
        if follows:
            return True
        need = min(max_len, -(-(longest + CAPACITY_ALIGN) // CAPACITY_ALIGN) * CAPACITY_ALIGN)
        if self.capacity < need:  # growing: twice the old capacity, so a long decode rebuilds rarely
            capacity = min(max_len, max(need, 2 * self.capacity))
        else:
            capacity = self.capacity
        shape = (bs * num_kv_heads, capacity, head_dim)
        if 2 * self.num_layers * shape[0] * capacity * head_dim * dtype.itemsize > MAX_BYTES or longest > capacity:
            self.drop()
            return False
        if self.k[0] is None or self.k[0].shape != shape or self.k[0].dtype != dtype:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
            self.capacity = capacity
        self.stale = set(range(self.num_layers))
        return True

    def update(self, layer_id: int, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indices: torch.Tensor,
               new_locs: torch.Tensor, append_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's mirror after this step's K/V (already written to the pool) is in it:
        (k, v), each [bs * hkv, capacity, d]. A stale layer is copied whole from the pool's slots
        (kv_indices [bs, max_kv]); otherwise only the new token of each request (the pool's slots
        new_locs [bs]) goes to its flat row `append_index` [bs * hkv] of [bs * hkv * capacity]."""
        k, v = self.k[layer_id], self.v[layer_id]
        bs, max_kv = kv_indices.shape
        _, hkv, d = k_pool.shape
        if layer_id in self.stale:
            self.stale.discard(layer_id)
            flat = kv_indices.reshape(-1)
            for dst, pool in ((k, k_pool), (v, v_pool)):
                src = pool.index_select(0, flat).view(bs, max_kv, hkv, d).transpose(1, 2)  # [bs, hkv, max_kv, d]
                dense = dst.view(bs, hkv, self.capacity, d)
                dense[:, :, :max_kv].copy_(src)
                # Columns past max_kv are only masked later, never written before they are read: zero
                # them, so a NaN left by an earlier batch cannot poison a masked score (NaN * 0 is NaN).
                dense[:, :, max_kv:].zero_()
            return k, v
        for dst, pool in ((k, k_pool), (v, v_pool)):
            new = pool.index_select(0, new_locs).reshape(bs * hkv, d)  # [bs, hkv, d] -> one row per (request, head)
            dst.view(-1, d).index_copy_(0, append_index, new)
        return k, v

    def append_index(self, lens: list[int], num_kv_heads: int, device: torch.device) -> torch.Tensor:
        """Flat row in [bs * hkv * capacity] of each (request, KV head)'s newest token: [bs * hkv]."""
        bs = len(lens)
        pos = torch.tensor(lens, dtype=torch.int64, device=device) - 1  # [bs]
        base = torch.arange(bs * num_kv_heads, dtype=torch.int64, device=device) * self.capacity
        return base + pos.repeat_interleave(num_kv_heads)
