"""The layers' opaque ops: calls a compiled (captured) CPU decode step makes without tracing into them.

torch.compile traces everything between the matmuls; these stay opaque, read at run time:
- `rollout::linear`: the module's oneDNN-prepacked weight (runner/layers/prepack.py) or its dense one.
  Repacks after a weight update are seen without recapture, and the dense parameters are graph
  inputs, so in-place weight writes (every update route, release/resume with backup) are too.
- `rollout::decode_attention`: writes this step's K/V into the paged pool and attends through the
  backend's plan; the pool and the per-step KV length never become graph shapes.
Modules are found by a small integer key (a graph constant) given by `register_opaque`, which the
CPU graph runner (runner/graphs/cpu_graph_runner.py) calls on every Linear, LMHead and PagedAttention.

This module sits below both the layers and the graph runner (it imports neither), so they can use it
without an import circle. It does not decide when a step is compiled; that is the graph runner's.
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from runner.forward_batch import get_forward_context

# Weak references, so a dropped model is not kept alive by a key a captured step still holds.
_MODULES: dict[int, weakref.ref] = {}
_next_key = itertools.count()


class GatedPacked(NamedTuple):
    """The prepacked shadow of a fused gate|up projection, kept as its two halves so the SiLU and the
    product can run inside the linears' epilogues (`packed_silu_and_mul`); each is (weight, bias)."""

    gate: tuple
    up: tuple


def packed_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """Linear over a oneDNN-prepacked weight (see runner.layers.prepack).
    x: [num_tokens, in_features] dense -> [num_tokens, out_features] dense."""
    if isinstance(packed, GatedPacked):  # the whole gate|up output, for callers that need it (LoRA)
        return torch.cat([packed_linear(x, packed.gate), packed_linear(x, packed.up)], dim=-1)
    weight, bias = packed
    # An fp32 shadow of bf16 weights (runner/layers/prepack.py) upcasts x and rounds once; else no-op casts.
    y = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype).contiguous(), weight, bias, "none", [], "")
    return y.to(x.dtype)


def packed_silu_and_mul(x: torch.Tensor, packed: GatedPacked) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) as two oneDNN linears with fused epilogues: SiLU on the gate's fp32
    accumulator, then the up projection's accumulator times that gate. No [num_tokens, 2 * inter]
    intermediate and no separate elementwise passes (each a parallel region: on a shared 2-core
    machine a region waits for both threads, so every one avoided matters). Rounds once per
    projection instead of after each op, so it differs from silu_and_mul by bf16 rounding only.
    x: [num_tokens, hidden] -> [num_tokens, inter]."""
    (gw, gb), (uw, ub) = packed
    dtype = x.dtype
    x = x.to(gw.dtype).contiguous()  # an fp32 shadow of bf16 weights: the SiLU and product in fp32 too
    gate = torch.ops.mkldnn._linear_pointwise(x, gw, gb, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, gate, uw, ub, "mul").to(dtype)


def register_opaque(module: nn.Module) -> None:
    if getattr(module, "opaque_key", None) is None:
        module.opaque_key = next(_next_key)
        _MODULES[module.opaque_key] = weakref.ref(module)


def _module(key: int) -> nn.Module:
    module = _MODULES[key]()
    if module is None:
        raise RuntimeError(f"captured step refers to a dropped module (key {key}); the graph runner was not reset")
    return module


@torch.library.custom_op("rollout::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    module = _module(key)
    if module.packed is not None:
        return packed_linear(x, module.packed)
    return F.linear(x, weight, getattr(module, "bias", None))


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("rollout::decode_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_cache_loc: torch.Tensor,
                  key: int) -> torch.Tensor:
    layer = _module(key)
    ctx = get_forward_context()
    ctx.token_to_kv_pool.set_kv(layer.layer_id, out_cache_loc, k, v)
    return ctx.attn_backend.forward_decode(q, layer, None).clone()  # a fresh tensor, as custom ops must return


@_attention_op.register_fake
def _(q, k, v, out_cache_loc, key):
    return torch.empty_like(q)


def opaque_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _linear_op(x, module.weight, module.opaque_key)


def opaque_attention(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out_cache_loc: torch.Tensor) -> torch.Tensor:
    # q: [bs, num_heads, head_dim] -> [bs, num_heads, head_dim]
    return _attention_op(q, k, v, out_cache_loc, layer.opaque_key)
