"""One adapted runner module (qkv_proj, o_proj, gate_up_proj, down_proj) and its segmented LoRA matmul.

A module holds the device buffers of every loaded adapter in slot layout: A as [slots, k, R, in] and B
as [slots, k, R, out], where k is the number of PEFT targets fused in the module (q|k|v: 3, gate|up: 2),
R is max_lora_rank (smaller ranks are zero-padded, which changes no value) and B is block-diagonal:
target j's rows write only its own output columns. A step gathers the slots of its adapters once
(cached while the batch's adapter set is unchanged), each B scaled by its adapter's scaling, and adds,
over the step's adapted rows grouped by adapter (a `LoRABatch`, built once per step by the manager),

    y[rows] += grouped_mm(grouped_mm(x[rows], A_g^T), B_g)    # segment g of rows uses adapter g

two grouped (segmented) matmuls whose cost is the adapted rows' own, whatever the number of adapters in
the batch, as punica's and SGLang's csgmv kernels do; base-model rows are not touched. Where the grouped
matmul is not available for the device and dtype, each segment is one matmul (at most
max_loras_per_batch of them). `masked` is the older formulation, every row against every adapter of the
batch with a 0/1 mask, kept as a reference for tests and the benchmark. Tensor parallelism: a
column-parallel module holds this rank's rows of B (A whole); a row-parallel one this rank's columns of
A (B whole), and its LoRA term is added before the all-reduce, whose sum over ranks completes x @ A^T.

It does not parse adapters (runner/lora/adapter.py) or choose slots (runner/lora/manager.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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

    def grouped_shapes(self) -> set[tuple[int, int]]:
        """The (K, N) of this module's two grouped matmuls."""
        kr = len(self.targets) * self.max_rank
        return {(self.in_local, kr), (kr, self.out_local)}

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
        xs = x if batch.rows is None else x.index_select(0, batch.rows)  # [m, in_local], grouped by adapter
        d = batch.grouped(batch.grouped(xs, self.a_batch), self.b_batch)  # [m, out_local]
        return y.add_(d) if batch.rows is None else y.index_add_(0, batch.rows, d)

    def _apply_masked(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, g = x.shape[0], mask.shape[1]
        xa = x @ self.a_flat.t()  # [n, g * kR]: every row against every adapter of the batch
        xa = (xa.view(n, g, -1) * mask.unsqueeze(-1)).view(n, -1)
        return y.addmm_(xa, self.b_batch.view(-1, y.shape[1]))  # [n, out_local]


@dataclass(frozen=True)
class LoRABatch:
    """The step's adapted rows, grouped by adapter (built once per step, read by every LoRAModule)."""

    rows: torch.Tensor | None  # [m] int64 token rows, grouped by adapter; None: every row, already grouped
    offs: torch.Tensor  # [g] int32 on the device: end of each adapter's segment in the grouped rows
    offs_cpu: tuple[int, ...]  # the same ends, on the host (the per-segment fallback)
    use_grouped_mm: bool
    masked: torch.Tensor | None = None  # [n, g] 0/1: the masked reference formulation instead

    def grouped(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[m, K] x [g, K, N] -> [m, N], segment j of x's rows times w[j]."""
        if self.use_grouped_mm:
            return F.grouped_mm(x, w, offs=self.offs)
        out = x.new_empty(x.shape[0], w.shape[2])
        start = 0
        for j, end in enumerate(self.offs_cpu):
            torch.mm(x[start:end], w[j], out=out[start:end])
            start = end
        return out


def grouped_mm_works(device: torch.device, dtype: torch.dtype, shapes: set[tuple[int, int]]) -> bool:
    """Whether torch's grouped matmul runs, and is right, for `device`, `dtype` and every (K, N) of `shapes`
    (probed once, at the modules' own sizes: a GPU kernel may refuse some strides)."""
    if not hasattr(F, "grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([2, 5], dtype=torch.int32, device=device)
    for k, n in sorted(shapes):
        x = torch.randint(-2, 3, (5, k), generator=gen).to(device, dtype)  # small integers: exact inputs
        w = torch.randint(-2, 3, (2, k, n), generator=gen).to(device, dtype)
        try:
            got = F.grouped_mm(x, w, offs=offs)
        except Exception:  # not built for this device / dtype / GPU generation / strides
            return False
        want = torch.cat([x[:2].double() @ w[0].double(), x[2:].double() @ w[1].double()])
        if (got.double() - want).abs().max() > 1e-2 * want.abs().max():  # bf16 rounds large sums; a wrong
            return False  # segment is off by far more
    return True
