"""Logits processor: the LM head applied only where logits are needed.

Prefill computes the vocabulary projection for each request's last token (the next-token
distribution) unless all-position logits are asked for (input logprobs, parity tests); decode has
one token per request anyway. Logits come back in fp32.
"""

from __future__ import annotations

import torch

from runner.forward_batch import ForwardBatch, LogitsOutput
from runner.layers.embedding import LMHead


def last_token_indices(forward_batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    lens = forward_batch.extend_seq_lens_cpu
    ends, total = [], 0
    for n in lens:
        total += n
        ends.append(total - 1)
    return torch.tensor(ends, dtype=torch.int64, device=device)


def compute_logits(hidden: torch.Tensor, lm_head: LMHead, forward_batch: ForwardBatch) -> LogitsOutput:
    # hidden: [num_tokens, hidden_size]
    if forward_batch.forward_mode.is_decode():
        return LogitsOutput(lm_head(hidden).float())
    last = last_token_indices(forward_batch, hidden.device)
    if forward_batch.return_all_logits:
        all_logits = lm_head(hidden).float()  # [num_tokens, vocab]
        return LogitsOutput(all_logits[last], all_logits)
    return LogitsOutput(lm_head(hidden[last]).float())
