"""Token embedding and LM head. A tied LM head shares the embedding's Parameter object.

With tensor parallelism (`tp` given) both are vocab-parallel: rank r holds rows
[r * per_rank, (r + 1) * per_rank) of the vocabulary (per_rank = ceil(vocab / tp_size), the last rank's
tail zero-padded); the embedding looks up the ids it holds and all-reduces, the LM head all-gathers its
logits and drops the padding. Every rank gets the full logits; only rank 0 samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner import batch_invariant
from runner.layers.linear import default_weight_loader
from runner.layers.ops import opaque_linear, packed_linear


def _vocab_rows(vocab_size: int, tp) -> tuple[int, int, int]:
    """(first row, rows held, rows allocated) of this rank's vocabulary slice."""
    if tp is None:
        return 0, vocab_size, vocab_size
    per_rank = -(-vocab_size // tp.size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp=None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start, held, rows = _vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.weight.weight_loader = default_weight_loader
        if tp is not None:
            self.weight.tp_slices = {None: (0, self.vocab_start, held, vocab_size)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        hidden = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # [num_tokens, hidden]
        return self.tp.all_reduce(hidden * mine.unsqueeze(-1).to(hidden.dtype))


class LMHead(nn.Module):
    packed = None  # see runner.layers.prepack
    fp32 = False  # enable_fp32_lm_head: project in fp32 whatever the weight dtype (set by the runner)

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None, tp=None) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            start, held, rows = _vocab_rows(vocab_size, tp)
            self.weight = nn.Parameter(torch.empty(rows, hidden_size))
            self.weight.weight_loader = default_weight_loader
            if tp is not None:
                self.weight.tp_slices = {None: (0, start, held, vocab_size)}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_tokens, hidden_size] -> logits [num_tokens, vocab] (fp32 with self.fp32)
        if self.fp32 and self.weight.dtype != torch.float32:
            # An upcast copy of the weight per call, never kept: it can never go stale after an update.
            hidden, weight = hidden.float(), self.weight.float()
            fn = batch_invariant.linear if batch_invariant.is_enabled() else F.linear
            logits = fn(hidden, weight)
        elif torch.compiler.is_compiling():  # see Linear.forward
            return opaque_linear(self, hidden)
        elif batch_invariant.is_enabled():  # fixed-shape row tiles (runner/batch_invariant.py)
            logits = batch_invariant.linear(hidden, self.weight)
        elif self.packed is not None and hidden.dim() == 2:
            logits = packed_linear(hidden, self.packed)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp is None:
            return logits
        # [num_tokens, per_rank] on each rank -> [num_tokens, vocab] on every rank
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]
