"""SiLU-and-mul: the gated activation of Llama-family MLPs on a fused gate|up output."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
