"""SiLU-and-mul: the gated activation of Llama-family MLPs on a fused gate|up output, and
`gated_silu_and_mul`, which runs the gate|up projection too (fused into its linears when prepacked)."""

import torch
import torch.nn.functional as F
from torch import nn

from runner import batch_invariant, hf_numerics
from runner.forward_batch import current_lora_batch
from runner.layers.ops import GatedPacked, packed_silu_and_mul


def gated_silu_and_mul(gate_up_proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(gate_up_proj(x)); with a prepacked gate|up (runner/layers/prepack.py) and nothing
    that needs the projection's own output (a LoRA term, a captured step's opaque linear, the
    deterministic mode's row tiles), the activation runs in the linears' epilogues instead.
    x: [num_tokens, hidden] -> [num_tokens, intermediate]."""
    packed = gate_up_proj.packed
    if (isinstance(packed, GatedPacked) and x.dim() == 2 and not torch.compiler.is_compiling()
            and not batch_invariant.is_enabled() and not hf_numerics.is_enabled()
            and (gate_up_proj.lora is None or current_lora_batch() is None)):
        return packed_silu_and_mul(x, packed)
    return silu_and_mul(gate_up_proj(x))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    if batch_invariant.is_enabled():  # F.silu's bits depend on the tensor size (runner/batch_invariant.py)
        return batch_invariant.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    if hf_numerics.is_enabled():  # HF's gate_proj/up_proj outputs are contiguous tensors of their own
        return F.silu(gate.contiguous()) * up.contiguous()
    return F.silu(gate) * up
