"""One adapted runner module (qkv_proj, o_proj, gate_up_proj, down_proj) and its batched LoRA matmuls.

A module holds the device buffers of every loaded adapter in slot layout: A as [slots, k, R, in] and B
as [slots, k, R, out], where k is the number of PEFT targets fused in the module (q|k|v: 3, gate|up: 2),
R is max_lora_rank (smaller ranks are zero-padded, which changes no value) and B is block-diagonal:
target j's rows write only its own output columns. A step gathers the slots of its adapters once
(cached while the batch's adapter set is unchanged), each B scaled by its adapter's scaling. The step's
adapted rows, grouped by adapter (a `LoRABatch`, one stable sort per step in the manager), are laid out
as g segments of L rows (padded with zeroed rows), and every module adds

    y += scatter(bmm(bmm(x[gather].view(g, L, in), A_g) * valid, B_g))    # segment j uses adapter j

two batched matmuls over the grouped rows (SGLang's csgmv and punica work on the same sorted layout):
no loop over requests or adapters, and unlike a mask over every adapter the cost does not grow with the
number of adapters in the batch. Base-model rows are not computed. When padding would more than double
the rows (very uneven prefills) each segment is one matmul instead (at most max_loras_per_batch).
This segmented formulation is the default (1.04-1.14x the masked one at CPU decode batch 16 over 4
adapters, bench/lora.py). The manager's `segmented = False` selects the masked formulation instead,
every row against every adapter of the batch with a 0/1 mask (three ops per module).

Tensor parallelism: a column-parallel module holds this rank's rows of B
(A whole); a row-parallel one this rank's columns of A (B whole), and its LoRA term is added before the
all-reduce, whose sum over ranks completes x @ A^T.

It does not parse adapters (runner/lora/adapter.py) or choose slots (runner/lora/manager.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRATarget:
    """One PEFT target inside a runner module, with the part of its HF tensors this rank holds."""

    name: str  # "q_proj", ...
    in_features: int  # HF A is [r, in_features]
    out_features: int  # HF B is [out_features, r]
    out_offset: int  # first column of this target in the module's (local) output
    out_size: int  # local output columns
    b_rows: tuple[int, int] | None  # (start, size) of HF B's rows on this rank (column parallel)
    a_cols: tuple[int, int] | None  # (start, size) of HF A's columns on this rank (row parallel)


class LoRAModule:
    def __init__(self, layer_id: int, name: str, targets: list[LoRATarget], in_local: int, out_local: int,
                 num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layer_id, self.name, self.targets = layer_id, name, targets
        self.in_local, self.out_local, self.max_rank = in_local, out_local, max_rank
        k = len(targets)
        self.a_pool = torch.zeros(num_slots, k, max_rank, in_local, dtype=dtype, device=device)
        self.b_pool = torch.zeros(num_slots, k, max_rank, out_local, dtype=dtype, device=device)
        self.a_batch: torch.Tensor | None = None  # [g, in_local, k * R], the step's g adapters
        self.b_batch: torch.Tensor | None = None  # [g, k * R, out_local], scaled
        self.a_flat: torch.Tensor | None = None  # [g * k * R, in_local]

    def tensors(self) -> list[torch.Tensor]:
        return [self.a_pool, self.b_pool]

    def staged_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers of one slot ([k, R, in_local], [k, R, out_local]) an adapter is staged into."""
        k = len(self.targets)
        return (torch.zeros(k, self.max_rank, self.in_local, dtype=self.a_pool.dtype),
                torch.zeros(k, self.max_rank, self.out_local, dtype=self.b_pool.dtype))

    def write_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a_pool[slot].copy_(a)
        self.b_pool[slot].copy_(b)

    def gather(self, slots: torch.Tensor, scalings: torch.Tensor) -> None:
        """Cache the step's adapters (pool slots `slots`, [g] int64, and their scalings [g], on the device)."""
        g, kr = slots.numel(), len(self.targets) * self.max_rank
        a = self.a_pool.index_select(0, slots).reshape(g, kr, -1)  # [g, kR, in]
        b = self.b_pool.index_select(0, slots).reshape(g, kr, -1) * scalings.view(g, 1, 1)  # [g, kR, out]
        self.a_batch = a.transpose(1, 2).contiguous()  # [g, in, kR]
        self.b_batch = b.contiguous()
        self.a_flat = a.reshape(g * kr, -1)  # [g * kR, in]: the masked formulation's layout

    def drop_batch(self) -> None:
        self.a_batch = self.b_batch = self.a_flat = None

    def apply(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """y + every adapted row's LoRA term. x: [n, in_local], y: [n, out_local]."""
        if batch.masked is not None:
            return self._apply_masked(x, y, batch.masked)
        g = self.a_batch.shape[0]
        if batch.seg_len is None:  # segments too uneven to pad: one matmul per segment
            xs = x.index_select(0, batch.rows)  # [m, in_local], grouped by adapter
            xa = torch.cat([xs[s:e] @ self.a_batch[j] for j, (s, e) in enumerate(batch.segments)])  # [m, kR]
            d = torch.cat([xa[s:e] @ self.b_batch[j] for j, (s, e) in enumerate(batch.segments)])  # [m, out_local]
            return y.index_add_(0, batch.rows, d)
        xs = x if batch.gather is None else x.index_select(0, batch.gather)  # [g * L, in_local]
        xa = torch.bmm(xs.view(g, batch.seg_len, -1), self.a_batch)  # [g, L, kR]
        if batch.valid is not None:
            # Padding rows give exact zeros, even where the row they copied is inf/NaN (an adapter whose own
            # activations overflowed): a product with 0 would keep the NaN and pass it to the base rows
            # scattered from padding.
            xa = torch.where(batch.valid, xa, 0.0)
        d = torch.bmm(xa, self.b_batch).view(-1, y.shape[1])  # [g * L, out_local]
        return y.add_(d if batch.scatter is None else d.index_select(0, batch.scatter))

    def _apply_masked(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, g = x.shape[0], mask.shape[1]
        xa = x @ self.a_flat.t()  # [n, g * kR]: every row against every adapter of the batch
        xa = torch.where(mask.unsqueeze(-1), xa.view(n, g, -1), 0.0).view(n, -1)  # NaN-safe, as `valid` above
        return y.addmm_(xa, self.b_batch.view(-1, y.shape[1]))  # [n, out_local]


@dataclass(frozen=True)
class LoRABatch:
    """The step's adapted rows grouped by adapter (built once per step, read by every LoRAModule).

    Padded layout (the usual one): segment j holds adapter j's rows, padded to L rows, so both matmuls are
    one batched matmul each; `gather` picks x's rows in that layout, `valid` zeroes the padding and
    `scatter` maps each token row back to its padded position (a base-model row to a zero padding row).
    None means identity / no padding. When padding would more than double the rows (uneven prefills),
    `seg_len` is None and each segment is one matmul over `rows` instead.
    """

    seg_len: int | None = None  # L
    gather: torch.Tensor | None = None  # [g * L] int64 token rows (padding: row 0)
    valid: torch.Tensor | None = None  # [g, L, 1] bool: True for a real row, False for padding
    scatter: torch.Tensor | None = None  # [n] int64 position of each token row in the padded layout
    rows: torch.Tensor | None = None  # [m] int64 adapted token rows, grouped by adapter (per-segment path)
    segments: tuple[tuple[int, int], ...] = ()  # (start, end) of each adapter's rows in `rows`
    masked: torch.Tensor | None = None  # [n, g] bool: the masked formulation (the default) instead
