"""fp32 master weights for a policy held in a low-precision dtype (`--dtype bfloat16`).

The policy's forward and backward stay in its own dtype, so its logprobs are computed as the engine's are (and
`--deterministic` stays bitwise); the optimizer steps fp32 copies of the trainable parameters, and each step
writes their rounding back into the policy. Stepping bf16 parameters directly would round away every update
smaller than half a bf16 step (most of them at RL learning rates): the run stalls, not merely drifts.

What it does not do: touch a parameter already in fp32 (it is stepped in place, as without this), keep masters of
frozen parameters (a LoRA policy's base), or scale losses (bf16 has fp32's exponent range: no overflow to guard).
"""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    """Optimizer param groups over fp32 masters of `param_groups`' low-precision trainable parameters.

    Per step: `grads_to_masters()` after backward (the grads, in fp32), clip `trainable()`'s grads, step the
    optimizer, `masters_to_model()`."""

    def __init__(self, param_groups) -> None:
        groups = [{"params": list(param_groups)}] if not isinstance(next(iter(param_groups), None), dict) else \
            [dict(g, params=list(g["params"])) for g in param_groups]
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the model's parameter, its fp32 master)
        self.groups = []
        for g in groups:
            params = []
            for p in g["params"]:
                if p.requires_grad and p.dtype in LOW_PRECISION:
                    master = p.detach().float().clone().requires_grad_(True)
                    self.pairs.append((p, master))
                    params.append(master)
                else:
                    params.append(p)
            self.groups.append(dict(g, params=params))

    def trainable(self) -> list[torch.Tensor]:
        """What the optimizer steps and the grad-norm clip reads (masters in place of their parameters)."""
        return [p for g in self.groups for p in g["params"] if p.requires_grad]

    def grads_to_masters(self) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)

    def to(self, device) -> None:
        """Move the masters (and their grads) with the optimizer state, where the trainer offloads it."""
        for _, m in self.pairs:
            m.data = m.data.to(device)
            if m.grad is not None:
                m.grad = m.grad.to(device)

    def bytes(self) -> int:
        return sum(m.numel() * m.element_size() for _, m in self.pairs)
