"""Token embedding and LM head. A tied LM head shares the embedding's Parameter object."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner.layers.linear import default_weight_loader, packed_linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    packed = None  # see runner.cpu_prepack

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # see Linear.forward
            from runner.cpu_graph_runner import opaque_linear

            return opaque_linear(self, hidden)
        if self.packed is not None and hidden.dim() == 2:
            return packed_linear(hidden, self.packed)
        return F.linear(hidden, self.weight)
