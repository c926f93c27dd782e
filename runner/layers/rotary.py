"""Rotary position embedding (neox / rotate-half layout) with `default` and `llama3` frequencies.

The cos/sin table is a non-persistent buffer, not a parameter: it survives a weight release and
is never part of a weight update. `cos_sin` hands out sin with the sign of rotate-half folded in
(-sin on the first half), so a rotation is `x * cos + x.roll(half) * sin_signed`: two fewer ops per
call than chunk/neg/cat and bitwise the same values (negating a factor commutes with rounding). On the
CPU with the engine's kernels loaded (`cpu_ops`, set by the runner), that expression is one C++ pass
(runner/csrc/rotary.cpp), bitwise equal to it; not inside a compiled graph or under autograd.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from runner import cpu_kernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)
        half = head_dim // 2
        signed = torch.cat((-emb.sin()[:, :half], emb.sin()[:, half:]), dim=-1)  # rotate_half's sign, folded
        self.register_buffer("sin_signed_cached", signed, persistent=False)
        self.cpu_ops = None  # torch.ops.rollout_cpu when the runner enables the CPU kernels

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sign-folded sin), looked up once per forward and shared by every layer: [num_tokens, 1,
        head_dim] each. Only `apply` / `apply_one` take them (the sin is not plain sin)."""
        return (self.cos_cached[positions].to(dtype).unsqueeze(1),
                self.sin_signed_cached[positions].to(dtype).unsqueeze(1))

    def apply(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        return self.apply_one(q, cos, sin_signed), self.apply_one(k, cos, sin_signed)

    def apply_one(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """`apply` on one tensor of heads, e.g. q and k heads side by side: [num_tokens, heads, head_dim].
        roll(half) is cat(x2, x1); with the sign in `sin_signed` it is rotate_half(x) * sin exactly.
        With the CPU kernels loaded, one pass of runner/csrc/rotary.cpp, bitwise the same expression."""
        ops = self.cpu_ops
        if (ops is not None and x.device.type == "cpu" and x.dtype in cpu_kernels.DTYPES and x.dim() == 3
                and x.stride(-1) == 1 and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and x.requires_grad)):
            return ops.rotary(x, cos, sin_signed)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(q, k, *self.cos_sin(positions, q.dtype))
