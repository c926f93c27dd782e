"""Sampler: next-token choice and its log-probability, for a batch of per-request parameters.

Greedy rows take the argmax and report the log-softmax of the raw logits. Sampled rows apply
temperature, then top-k, top-p and min-p (in that order), and draw by inverse CDF from the
renormalised distribution; the logprob reported is the log-softmax of exactly that distribution
(the "distribution actually sampled from"), and optionally also the raw-logit logprob.

Randomness is counter-based: the uniform for a row is a hash of (request seed, output position),
so a request draws the same tokens whatever batch it is in, and after a retraction recomputes the
same ones. It needs one uniform per row, not one per vocabulary entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN  # int64 arithmetic wraps, which is what the mix wants
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A uniform in [0, 1) per row, a pure function of (seed, step). seeds, steps: [bs] int64."""
    h = splitmix64(splitmix64(seeds) ^ steps)
    return (_shr(h, 40).to(torch.float64) + 0.5) / float(1 << 24)


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs] fp32, 0 = greedy
    top_ps: torch.Tensor  # [bs] fp32
    top_ks: torch.Tensor  # [bs] int64, vocab_size when off
    min_ps: torch.Tensor  # [bs] fp32
    seeds: torch.Tensor  # [bs] int64
    steps: torch.Tensor  # [bs] int64, index of the token being sampled within the output
    is_all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    need_temperature: bool = True  # some row has a temperature other than 0 (greedy) or 1
    has_greedy: bool = False  # some (not necessarily all) rows are greedy
    top_logprobs_num: int = 0
    return_raw_logprob: bool = False
    banned_mask: torch.Tensor | None = None  # [bs, vocab] bool: tokens that may not be sampled

    @classmethod
    def from_lists(cls, temperatures, top_ps, top_ks, min_ps, seeds, steps, vocab_size: int, device,
                   top_logprobs_num: int = 0, return_raw_logprob: bool = False) -> SamplingBatchInfo:
        ks = [vocab_size if k is None or k < 0 or k > vocab_size else k for k in top_ks]
        return cls(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            seeds=torch.tensor([_signed(s & _MASK64) for s in seeds], dtype=torch.int64, device=device),
            steps=torch.tensor(steps, dtype=torch.int64, device=device),
            is_all_greedy=all(t == 0 for t in temperatures),
            need_temperature=any(t not in (0, 1) for t in temperatures),
            has_greedy=any(t == 0 for t in temperatures),
            need_top_k=any(k < vocab_size for k in ks),
            need_top_p=any(p < 1.0 for p in top_ps),
            need_min_p=any(p > 0.0 for p in min_ps),
            top_logprobs_num=top_logprobs_num,
            return_raw_logprob=return_raw_logprob,
        )


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor  # [bs] fp32, of the chosen token under the sampled distribution
    raw_logprobs: torch.Tensor | None = None  # [bs] under log_softmax(raw logits)
    top_logprobs: torch.Tensor | None = None  # [bs, k]
    top_logprob_ids: torch.Tensor | None = None  # [bs, k]


def processed_logprobs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """log-softmax of the distribution each row samples from: [bs, vocab], -inf where masked."""
    scaled = logits
    if info.need_temperature:
        greedy = info.temperatures == 0
        temps = torch.where(greedy, torch.ones_like(info.temperatures), info.temperatures)
        scaled = logits / temps.unsqueeze(1)
    if info.need_top_k or info.need_top_p or info.need_min_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if info.need_top_k:
            ranks = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
            drop |= ranks >= info.top_ks.unsqueeze(1)
        if info.need_top_p:
            # Keep the smallest prefix whose mass reaches top_p (a token is dropped when the mass
            # before it already reaches top_p); the first token always stays.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= info.top_ps.unsqueeze(1)
        if info.need_min_p:
            drop |= sorted_probs < info.min_ps.unsqueeze(1) * sorted_probs[:, :1]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    return torch.log_softmax(scaled, dim=-1)


class Sampler:
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        # logits: [bs, vocab] fp32. Full-vocab passes are the cost here, so greedy rows and the raw
        # logprob work on [bs] gathers against one logsumexp instead of a second log_softmax.
        if info.banned_mask is not None:
            logits = logits.masked_fill(info.banned_mask, float("-inf"))
        argmax = logits.argmax(dim=-1)  # [bs]; also the argmax after temperature and truncation
        lse = torch.logsumexp(logits, dim=-1)  # [bs]

        def raw_lp(ids: torch.Tensor) -> torch.Tensor:
            return logits.gather(1, ids.unsqueeze(1)).squeeze(1) - lse

        if info.is_all_greedy:
            out = SampleOutput(argmax, raw_lp(argmax))
            if info.top_logprobs_num > 0:
                vals, out.top_logprob_ids = logits.topk(info.top_logprobs_num, dim=-1)
                out.top_logprobs = vals - lse.unsqueeze(1)
        else:
            logprobs_all = processed_logprobs(logits, info)  # [bs, vocab]
            cdf = logprobs_all.exp().cumsum_(dim=-1)  # [bs, vocab]
            u = seeded_uniform(info.seeds, info.steps).to(cdf.dtype)
            target = (u * cdf[:, -1]).unsqueeze(1)
            ids = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
            del cdf
            # Rounding at the very top of the CDF could land on a masked tail token: take argmax then.
            chosen = logprobs_all.gather(1, ids.unsqueeze(1)).squeeze(1)
            ids = torch.where(chosen > float("-inf"), ids, argmax)
            lp = logprobs_all.gather(1, ids.unsqueeze(1)).squeeze(1)
            greedy = info.temperatures == 0
            if info.has_greedy:
                ids = torch.where(greedy, argmax, ids)
                lp = torch.where(greedy, raw_lp(argmax), lp)
            out = SampleOutput(ids, lp)
            if info.top_logprobs_num > 0:
                vals, top_ids = logprobs_all.topk(info.top_logprobs_num, dim=-1)
                if info.has_greedy:
                    raw_vals, raw_ids = logits.topk(info.top_logprobs_num, dim=-1)
                    vals = torch.where(greedy.unsqueeze(1), raw_vals - lse.unsqueeze(1), vals)
                    top_ids = torch.where(greedy.unsqueeze(1), raw_ids, top_ids)
                out.top_logprobs, out.top_logprob_ids = vals, top_ids
        if info.return_raw_logprob:
            out.raw_logprobs = raw_lp(out.next_token_ids)
        return out
