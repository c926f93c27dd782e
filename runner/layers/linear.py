"""Linear layers whose parameters know how to take Hugging Face checkpoint tensors.

Every parameter carries a `weight_loader(param, loaded, shard_id)` and, for fused parameters
(`qkv_proj` = q|k|v, `gate_up_proj` = gate|up stacked on dim 0), a `shard_offsets` table. The loader
and the weight-update paths use `shard_view()` to find the exact slice an HF tensor lands in, so
shapes can be checked for every tensor before any byte is written.

Tensor parallelism (runner/tp): `ColumnParallel` layers hold this rank's rows of each shard (fused
q|k|v and gate|up split per shard, KV heads replicated when there are fewer than ranks) and
`RowParallelLinear` this rank's input columns, summed across ranks by an all-reduce. Each such
parameter carries `tp_slices[shard_id] = (dim, start, size, full)`: which part of the full HF tensor
this rank holds, so the loader checks the HF shape and narrows with `tp_narrow`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner import batch_invariant
from runner.forward_batch import current_lora_batch
from runner.layers.ops import opaque_linear, packed_linear


def shard_view(param: torch.Tensor, shard_id: str | int | None) -> torch.Tensor:
    """The slice of `param` that HF shard `shard_id` fills (the whole param for None)."""
    if shard_id is None:
        return param.data
    view_shard = getattr(param, "view_shard", None)
    if view_shard is not None:  # a param with its own layout, e.g. stacked experts: (expert_id, "gate")
        return view_shard(param.data, shard_id)
    start, size = param.shard_offsets[shard_id]
    return param.data.narrow(0, start, size)


def tp_slice(param: torch.Tensor, shard_id) -> tuple[int, int, int, int] | None:
    """(dim, start, size, full) of the HF tensor this rank holds for `shard_id`; None: all of it."""
    slices = getattr(param, "tp_slices", None)
    return None if slices is None else slices.get(shard_id)


def tp_hf_shape(param: torch.Tensor, shard_id, view_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the whole HF tensor whose slice fills `view_shape`."""
    spec = tp_slice(param, shard_id)
    if spec is None:
        return tuple(view_shape)
    dim, _, _, full = spec
    return (*view_shape[:dim], full, *view_shape[dim + 1:])


def tp_narrow(param: torch.Tensor, shard_id, tensor: torch.Tensor, view_shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's part of a whole HF tensor, zero-padded to the local extent (a padded vocab)."""
    spec = tp_slice(param, shard_id)
    if spec is None:
        return tensor
    dim, start, size, _ = spec
    part = tensor.narrow(dim, start, size)
    pad = view_shape[dim] - size
    if pad:
        zeros = part.new_zeros((*part.shape[:dim], pad, *part.shape[dim + 1:]))
        part = torch.cat([part, zeros], dim)
    return part


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    shard_view(param, shard_id).copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b). Parameters named like HF's so most weights load by identity."""

    packed = None  # set by runner.layers.prepack: a oneDNN copy of the weight (CPU fp32 fast path)
    lora = None  # set by runner.lora.manager: this projection's adapter slots (runner/lora/layer.py)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = default_weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Inside a captured step the prepacked copy is read at run time through an opaque op,
            # so a repack after a weight update needs no recapture (runner/layers/ops.py).
            return opaque_linear(self, x)
        return self._add_lora(x, self._base(x))

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.is_enabled():  # fixed-shape row tiles (runner/batch_invariant.py)
            return batch_invariant.linear(x, self.weight, self.bias)
        if self.packed is not None and x.dim() == 2:
            return packed_linear(x, self.packed)
        return F.linear(x, self.weight, self.bias)

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter term when this step has adapters (runner/lora/layer.py)."""
        if self.lora is None:
            return y
        batch = current_lora_batch()
        return y if batch is None else self.lora.apply(x, y, batch)


class MergedLinear(Linear):
    """Several HF projections of the same input stacked on the output dim (e.g. gate|up)."""

    def __init__(self, in_features: int, shards: dict, bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        offsets, start = {}, 0
        for shard_id, size in shards.items():
            offsets[shard_id] = (start, size)
            start += size
        self.output_sizes = dict(shards)
        for p in self.parameters():
            p.shard_offsets = offsets


class QKVLinear(MergedLinear):
    """q|k|v projections fused into one matmul; shard ids "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        super().__init__(
            hidden_size,
            {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim},
            bias,
        )


def _even_split(full: int, tp) -> tuple[int, int]:
    if full % tp.size:
        raise ValueError(f"size {full} does not split evenly over tp_size={tp.size}")
    size = full // tp.size
    return tp.rank * size, size


class ColumnParallelLinear(MergedLinear):
    """Output rows split over the ranks, per shard: rank r computes its rows of every shard.

    `shards` maps shard id -> (full HF rows, this rank's start row, rows). No communication: the
    caller consumes the local rows (attention heads, SiLU-and-mul) and a RowParallelLinear reduces.
    """

    def __init__(self, in_features: int, shards: dict, bias: bool = False) -> None:
        super().__init__(in_features, {k: size for k, (_, _, size) in shards.items()}, bias)
        slices = {k: (0, start, size, full) for k, (full, start, size) in shards.items()}
        for p in self.parameters():
            p.tp_slices = slices


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v with this rank's query heads and their KV heads (a KV head is replicated on the
    tp_size / num_kv_heads ranks whose query heads read it when there are fewer KV heads than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp) -> None:
        q_start, q_size = _even_split(num_heads * head_dim, tp)
        local_kv = max(1, num_kv_heads // tp.size)
        kv_start = (tp.rank * num_kv_heads // tp.size) * head_dim
        kv = (num_kv_heads * head_dim, kv_start, local_kv * head_dim)
        super().__init__(hidden_size, {"q": (num_heads * head_dim, q_start, q_size), "k": kv, "v": kv}, bias)


class RowParallelLinear(Linear):
    """Input columns split over the ranks; the partial products are summed by an all-reduce, then
    the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp) -> None:
        start, size = _even_split(in_features, tp)
        super().__init__(size, out_features, bias)
        self.tp = tp
        for p in self.parameters():
            if p.dim() == 2:
                p.tp_slices = {None: (1, start, size, in_features)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The LoRA term of this rank's input columns goes in before the all-reduce, which sums it too.
        if self.bias is None:
            return self.tp.all_reduce(super().forward(x))
        # Not the packed call: its fused bias would be added once per rank.
        return self.tp.all_reduce(self._add_lora(x, F.linear(x, self.weight))) + self.bias
