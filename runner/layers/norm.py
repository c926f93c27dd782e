"""RMSNorm with an optional fused residual add, computed in fp32 like transformers'.

The normalisation is torch's fused `F.rms_norm` (one kernel instead of pow/mean/add/rsqrt/mul):
bitwise equal to transformers' `weight * (x * rsqrt(mean(x^2) + eps))` at every shape checked
(fp32, and bf16 with the fp32 round trip and the weight applied in bf16 after the cast, as
transformers does), so numerics do not move.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden_size] -> same shape and dtype
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        # The residual stream is summed in the model dtype, as transformers does.
        residual = residual + x
        return self._norm(residual), residual
