"""Linear layers whose parameters know how to take Hugging Face checkpoint tensors.

Every parameter carries a `weight_loader(param, loaded, shard_id)` and, for fused parameters
(`qkv_proj` = q|k|v, `gate_up_proj` = gate|up stacked on dim 0), a `shard_offsets` table. The loader
and the weight-update paths use `shard_view()` to find the exact slice an HF tensor lands in, so
shapes can be checked for every tensor before any byte is written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def packed_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """Linear over a oneDNN-prepacked weight (see runner.cpu_prepack).
    x: [num_tokens, in_features] dense -> [num_tokens, out_features] dense."""
    weight, bias = packed
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def shard_view(param: torch.Tensor, shard_id: str | int | None) -> torch.Tensor:
    """The slice of `param` that HF shard `shard_id` fills (the whole param for None)."""
    if shard_id is None:
        return param.data
    view_shard = getattr(param, "view_shard", None)
    if view_shard is not None:  # a param with its own layout, e.g. stacked experts: (expert_id, "gate")
        return view_shard(param.data, shard_id)
    start, size = param.shard_offsets[shard_id]
    return param.data.narrow(0, start, size)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    shard_view(param, shard_id).copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b). Parameters named like HF's so most weights load by identity."""

    packed = None  # set by runner.cpu_prepack: a oneDNN copy of the weight (CPU fp32 fast path)

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
            # so a repack after a weight update needs no recapture (runner/cpu_graph_runner.py).
            from runner.cpu_graph_runner import opaque_linear

            return opaque_linear(self, x)
        if self.packed is not None and x.dim() == 2:
            return packed_linear(x, self.packed)
        return F.linear(x, self.weight, self.bias)


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
