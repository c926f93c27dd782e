"""The attention layer: writes this step's K/V into the paged pool, then defers to the backend.

It holds no state but its layer id and head geometry; the backend and the KV pool come from the
runner's per-step ForwardContext and the plan lives on the backend, so `model.forward(input_ids,
positions, forward_batch)` stays free of plumbing and never writes into the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.forward_batch import ForwardBatch, get_forward_context
from runner.layers.ops import opaque_attention


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        if torch.compiler.is_compiling():
            # The paged cache and the step's plan change every step: keep them out of the captured
            # graph behind one opaque op that writes K/V and attends (runner/layers/ops.py).
            return opaque_attention(self, q, k, v, fb.out_cache_loc).reshape(q.shape[0], self.num_heads * self.head_dim)
        ctx = get_forward_context()
        ctx.token_to_kv_pool.set_kv(self.layer_id, fb.out_cache_loc, k, v)
        if fb.forward_mode.is_decode():
            out = ctx.attn_backend.forward_decode(q, self, fb)
        else:
            out = ctx.attn_backend.forward_extend(q, self, fb)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)  # [num_tokens, num_heads * head_dim]
