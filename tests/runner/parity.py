"""What the runner-vs-HF logits parity tests (test_model_parity.py, test_moe_parity.py) share: the ragged
prompt lengths and their seeded prompts, HF's logits for one prompt, and the tolerance check that records
each case's largest difference (printed when the module ends, to see how close to ATOL a case runs).

What it does not do: build runners or checkpoints (driver.py, tests/checkpoints.py), or pick the cases.
"""

from __future__ import annotations

import torch

ATOL = 1e-4  # fp32 on the CPU
PROMPT_LENS = (3, 9, 17)


def ragged_prompts(seed: int = 0) -> list[list[int]]:
    """One seeded random prompt per PROMPT_LENS entry (ids from 4, past the special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def hf_logits(hf, ids: list[int] | None = None, embeds: torch.Tensor | None = None) -> torch.Tensor:
    """HF's logits at every position of one prompt, given as ids or as input embeddings."""
    if embeds is not None:
        return hf(inputs_embeds=embeds.unsqueeze(0)).logits[0]  # [len, vocab]
    return hf(torch.tensor([ids])).logits[0]  # [len, vocab]


class MaxDiffs:
    """The largest |runner - HF| seen per (case, what), asserted against ATOL as it is recorded."""

    def __init__(self) -> None:
        self.by_case: dict[str, dict[str, float]] = {}

    def check(self, name: str, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """Assert max |got - want| <= ATOL and record it under [name][what]."""
        assert got.shape == want.shape, (what, got.shape, want.shape)
        diff = (got - want).abs().max().item()
        diffs = self.by_case.setdefault(name, {})
        diffs[what] = max(diff, diffs.get(what, 0.0))
        assert diff <= ATOL, f"[{name}] {what}: max |runner - HF| = {diff:.3e} > {ATOL}"

    def report(self) -> None:
        for name, diffs in self.by_case.items():
            print(f"\nmax |runner - HF| logits [{name}]: " + ", ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
