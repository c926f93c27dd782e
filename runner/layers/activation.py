"""SiLU-and-mul: the gated activation of Llama-family MLPs on a fused gate|up output."""

import torch
import torch.nn.functional as F

from runner import batch_invariant, hf_numerics


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    if batch_invariant.is_enabled():  # F.silu's bits depend on the tensor size (runner/batch_invariant.py)
        return batch_invariant.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    if hf_numerics.is_enabled():  # HF's gate_proj/up_proj outputs are contiguous tensors of their own
        return F.silu(gate.contiguous()) * up.contiguous()
    return F.silu(gate) * up
