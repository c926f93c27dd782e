"""RMSNorm with an optional fused residual add, computed in fp32 like transformers'.

Two implementations of the same arithmetic. On the CPU, when the engine's kernels are loaded
(`cpu_ops`, set by the runner from RunnerConfig.cpu_kernels; runner/cpu_kernels.py), one C++ pass per
row does the residual add and the norm (runner/csrc/rms_norm.cpp): at decode sizes torch's op chain
cost 15-25 us per call on its own and 50-90 us inside a step here, the kernel ~1-3 us. Its variance is
summed in another order, so a value can differ by an ulp. Otherwise, and always under
rl_on_policy_target="fsdp" or inside a compiled graph (inductor fuses the ops itself), torch's
`F.rms_norm`: bitwise equal to transformers' `weight * (x * rsqrt(mean(x^2) + eps))` at every shape
checked (fp32, and bf16 with the fp32 round trip and the weight applied in bf16 after the cast, as
transformers does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner import cpu_kernels, hf_numerics


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.cpu_ops = None  # torch.ops.rollout_cpu when the runner enables the CPU kernels

    def _kernel(self, x: torch.Tensor):
        ops = self.cpu_ops
        if (ops is None or x.dtype != self.weight.dtype or x.dtype not in cpu_kernels.DTYPES or x.device.type != "cpu"
                or hf_numerics.is_enabled() or torch.compiler.is_compiling()):
            return None
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return None  # the kernel has no backward: a trainer differentiating through the module gets torch's ops
        return ops

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden_size] -> same shape and dtype
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = self._kernel(x)
        if residual is None:
            return self._norm(x) if ops is None else ops.rms_norm(x, self.weight, self.eps)
        if ops is not None:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)  # (normed, residual + x)
        # The residual stream is summed in the model dtype, as transformers does.
        residual = residual + x
        return self._norm(residual), residual
