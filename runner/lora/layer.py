"""One adapted runner module (qkv_proj, o_proj, gate_up_proj, down_proj) and its batched LoRA matmul.

A module holds the device buffers of every loaded adapter in slot layout: A as [slots, k, R, in] and B
as [slots, k, R, out], where k is the number of PEFT targets fused in the module (q|k|v: 3, gate|up: 2),
R is max_lora_rank (smaller ranks are zero-padded, which changes no value) and B is block-diagonal:
target j's rows write only its own output columns. A step gathers the slots of its adapters once
(cached while the batch's adapter set is unchanged) and adds, for every row at once,

    y += ((x @ A_batch^T) * mask) @ B_batch        # mask: [num_tokens, num_adapters] scaling, 0 elsewhere

which is every row's own adapter (rows on the base model have a zero mask row): two matmuls over the
batch, no loop over requests or adapters. Tensor parallelism: a column-parallel module holds this rank's
rows of B (A whole); a row-parallel one this rank's columns of A (B whole), and its LoRA term is added
before the all-reduce, whose sum over ranks completes x @ A^T.

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
        self.a_batch: torch.Tensor | None = None  # [s * k * R, in_local], the step's adapters
        self.b_batch: torch.Tensor | None = None  # [s * k * R, out_local]

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

    def gather(self, slots: torch.Tensor) -> None:
        """Cache the step's adapters (pool slots `slots`, [s] int64 on the device) as flat matrices."""
        s = slots.numel()
        self.a_batch = self.a_pool.index_select(0, slots).reshape(s * len(self.targets) * self.max_rank, -1)
        self.b_batch = self.b_pool.index_select(0, slots).reshape(s * len(self.targets) * self.max_rank, -1)

    def drop_batch(self) -> None:
        self.a_batch = self.b_batch = None

    def apply(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """y + every row's LoRA term. x: [n, in_local], y: [n, out_local], mask: [n, s]."""
        n, s = x.shape[0], mask.shape[1]
        xa = x @ self.a_batch.t()  # [n, s * k * R]
        xa = (xa.view(n, s, -1) * mask.unsqueeze(-1)).view(n, -1)
        return y.addmm_(xa, self.b_batch)  # [n, out_local]
