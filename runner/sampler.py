"""Sampler: next-token choice and its log-probability, for a batch of per-request parameters.

First the logit processors, each skipped (no cost) when no row of the batch uses it: Hugging Face's
repetition penalty over the tokens seen so far, OpenAI/SGLang frequency and presence penalties over the
output tokens (from a [bs, vocab] count tensor built on the device by one scatter per step, no loop over
the vocabulary), the logit bias, and the min_new_tokens ban. Greedy rows then take the argmax and report
the log-softmax of the processed logits. Sampled rows apply temperature, then top-k, top-p and min-p (in
that order), and draw by inverse CDF from the renormalised distribution.

Which logprob is reported (per row; SGLang's default and its two switches, named after vLLM's
`logprobs_mode` values where one matches):
- default (SGLang's): log_softmax(processed logits / temperature) over the whole vocabulary, after the
  penalties, bias and bans but before top-k/top-p/min-p, so a token the truncation removed still has
  a finite logprob; greedy rows at temperature 1 (SGLang turns temperature 0 into 1 with top_k=1);
- `processed_rows` (vLLM's "processed_logprobs"): the log-softmax of exactly the distribution sampled
  from, after top-k/top-p/min-p truncation (removed tokens -inf, kept ones renormalised);
- `original_rows` (SGLang's RETURN_ORIGINAL_LOGPROB): the log-softmax of the processed logits (after the
  penalties, bias and bans, as SGLang applies them before its sampler) without the temperature;
- `raw_rows` (vLLM's "raw_logprobs"): the log-softmax of the model's raw logits, before every processor
  and temperature.
Without truncation the first two are the same tensor (bitwise).
Top logprobs and `token_ids` logprobs come from the same distribution as the token's logprob.

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
    return uniform_from_seed_mix(splitmix64(seeds), steps)


def uniform_from_seed_mix(seed_mix: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """seeded_uniform given `splitmix64(seeds)` [bs], which depends on the request only: a batch info
    reused across decode steps keeps it, so each step pays one mix, not two."""
    h = splitmix64(seed_mix ^ steps)
    return (_shr(h, 40).to(torch.float64) + 0.5) / float(1 << 24)


def below_one(u: torch.Tensor) -> torch.Tensor:
    """u with its values kept under 1 in its own dtype. The largest uniform, 1 - 2^-25, rounds to 1.0 in
    float32 (once in 2^24 draws), and a draw of 1.0 finds no CDF entry above it: inverse_cdf would take the
    last vocabulary id whatever its probability. Clamped to the largest float32 under 1; every other value
    is unchanged (runner/csrc/sampler.cpp clamps alike)."""
    return u.clamp_(max=1.0 - torch.finfo(u.dtype).eps / 2)


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
    # Logit processors; each None when no row uses it, so a batch without them pays nothing.
    seen_mask: torch.Tensor | None = None  # [bs, vocab] bool: in the prompt or output (repetition penalty)
    repetition_penalties: torch.Tensor | None = None  # [bs] fp32, 1 = off
    output_counts: torch.Tensor | None = None  # [bs, vocab] fp32: occurrences in the row's output
    frequency_penalties: torch.Tensor | None = None  # [bs] fp32
    presence_penalties: torch.Tensor | None = None  # [bs] fp32
    logit_bias: torch.Tensor | None = None  # [bs, vocab] fp32
    # [bs] bool: report log_softmax(processed logits), before temperature (SGLang's RETURN_ORIGINAL_LOGPROB)
    original_rows: torch.Tensor | None = None
    raw_rows: torch.Tensor | None = None  # [bs] bool: report log_softmax(raw logits) (vLLM's raw_logprobs)
    processed_rows: torch.Tensor | None = None  # [bs] bool: report the truncated, renormalised distribution
    need_logprobs: bool = True  # False: no row reads its logprobs, so the default ones may be skipped
    token_ids: torch.Tensor | None = None  # [bs, k] int64: ids whose logprobs each row reports (padded)
    seed_mix: torch.Tensor | None = None  # [bs] int64 splitmix64(seeds), filled by the Sampler on first use

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
    # [bs] fp32, of the chosen token under the sampled distribution; None when the info's need_logprobs
    # is False and no top/token_ids logprobs were asked (a greedy batch then skips its logsumexp)
    logprobs: torch.Tensor | None
    raw_logprobs: torch.Tensor | None = None  # [bs] under log_softmax(raw logits)
    top_logprobs: torch.Tensor | None = None  # [bs, k]
    top_logprob_ids: torch.Tensor | None = None  # [bs, k]
    token_ids_logprobs: torch.Tensor | None = None  # [bs, k] at info.token_ids


def apply_logit_processors(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Penalties, bias and bans on [bs, vocab] logits (a new tensor when any applies)."""
    if info.seen_mask is not None:
        # HF RepetitionPenaltyLogitsProcessor: shrink the seen tokens' logits toward 0... or below it.
        p = info.repetition_penalties.unsqueeze(1)
        logits = torch.where(info.seen_mask, torch.where(logits < 0, logits * p, logits / p), logits)
    if info.output_counts is not None:
        counts = info.output_counts
        logits = (logits - info.frequency_penalties.unsqueeze(1) * counts
                  - info.presence_penalties.unsqueeze(1) * (counts > 0).to(logits.dtype))
    if info.logit_bias is not None:
        logits = logits + info.logit_bias
    if info.banned_mask is not None:
        logits = logits.masked_fill(info.banned_mask, float("-inf"))
    return logits


@dataclass
class PromptLogprobs:
    token_logprobs: torch.Tensor  # [m] of each target token
    top_logprobs: torch.Tensor | None = None  # [m, k]
    top_logprob_ids: torch.Tensor | None = None  # [m, k]
    token_ids_logprobs: torch.Tensor | None = None  # [m, k] at the asked ids


def prompt_logprobs(all_logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor,
                    top_logprobs_num: int = 0, token_ids: torch.Tensor | None = None) -> PromptLogprobs:
    """Logprobs at prompt positions: row i of `all_logits[rows]` scores `targets[i]` under
    log_softmax(logits / temperatures[i]) (1 for greedy rows and original logprobs). No penalty or
    truncation applies to prompt positions (as SGLang), so every prompt token has a finite logprob.
    all_logits: [num_tokens, vocab]; rows, targets, temperatures: [m]; token_ids: [m, k]."""
    logits = all_logits.index_select(0, rows)  # [m, vocab]
    lp = torch.log_softmax(logits / temperatures.unsqueeze(1).expand_as(logits), dim=-1)
    out = PromptLogprobs(lp.gather(1, targets.unsqueeze(1)).squeeze(1))
    if top_logprobs_num > 0:
        out.top_logprobs, out.top_logprob_ids = lp.topk(top_logprobs_num, dim=-1)
    if token_ids is not None:
        out.token_ids_logprobs = lp.gather(1, token_ids)
    return out


def temperature_scaled(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """logits / temperature per row ([bs, vocab]; greedy rows at temperature 1)."""
    if not info.need_temperature:
        return logits
    greedy = info.temperatures == 0
    temps = torch.where(greedy, torch.ones_like(info.temperatures), info.temperatures)
    # Expanded to the logits' shape, so a one-row batch never meets torch's scalar-divisor
    # special case: every row takes the same elementwise division whatever the batch size.
    return logits / temps.unsqueeze(1).expand_as(logits)


def needs_truncation(info: SamplingBatchInfo) -> bool:
    return info.need_top_k or info.need_top_p or info.need_min_p


def truncated_logprobs(scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """log-softmax of `scaled` [bs, vocab] after top-k, top-p and min-p: -inf where removed."""
    return torch.log_softmax(truncated_logits(scaled, info), dim=-1)


def truncated_logits(scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """`scaled` [bs, vocab] with the tokens that top-k, top-p and min-p remove set to -inf."""
    if needs_truncation(info):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if info.need_top_k:
            ranks = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
            drop |= ranks >= info.top_ks.unsqueeze(1)
        if info.need_top_p:
            # Keep the smallest prefix whose mass reaches top_p (a token is dropped when the mass
            # before it already reaches top_p); the first token always stays.
            # Rows with top_p = 1 drop nothing even when rounding makes the cumulative mass reach 1
            # early: another row's top_p must not change this row's distribution (batch invariance).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= (mass_before >= info.top_ps.unsqueeze(1)) & (info.top_ps < 1).unsqueeze(1)
        if info.need_min_p:
            drop |= sorted_probs < info.min_ps.unsqueeze(1) * sorted_probs[:, :1]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    return scaled


def processed_logprobs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """log-softmax of the distribution each row samples from: [bs, vocab], -inf where masked."""
    return truncated_logprobs(temperature_scaled(logits, info), info)


# Chunk width of first_argmax: a multiple of the SIMD width; 128 measured best of 64/128/256 here.
_ARGMAX_CHUNK = 128


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of [bs, vocab] (first index of the max; NaN counts as the max), in passes that vectorise.

    torch's CPU argmax kernel is scalar: at [16, 32768] it took 0.22 ms against 0.06 ms for this, at
    [16, 151936] 1.0 ms against 0.15 ms. The max of each 128-wide chunk (amax, vectorised, propagates
    NaN), then the first chunk holding the overall max, then argmax inside that chunk only: the first
    chunk that holds the max holds its first occurrence, so the result is argmax's, ties included."""
    bs, vocab = x.shape
    c = _ARGMAX_CHUNK
    main = vocab - vocab % c
    if x.device.type != "cpu" or not x.is_contiguous() or main == 0:
        return x.argmax(dim=-1)
    chunks = x.as_strided((bs, main // c, c), (vocab, c, 1))  # the first `main` columns, [bs, n_chunks, c]
    chunk_max = chunks.amax(dim=-1)  # [bs, n_chunks]
    best = chunk_max.argmax(dim=-1)  # [bs] first chunk holding the row max
    rows = torch.arange(bs, device=x.device)
    ids = best * c + chunks[rows, best].argmax(dim=-1)
    if main < vocab:  # the ragged tail wins only with a strictly larger value (or the first NaN)
        tail = x[:, main:]
        tail_ids = tail.argmax(dim=-1)
        head_max, tail_max = chunk_max[rows, best], tail[rows, tail_ids]
        take_tail = (tail_max > head_max) | (tail_max.isnan() & ~head_max.isnan())
        ids = torch.where(take_tail, tail_ids + main, ids)
    return ids


def logsumexp_at_argmax(x: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """`torch.logsumexp(x, -1)` of [bs, vocab] given its argmax [bs].

    On the CPU log_softmax is one fused pass, about twice as fast as logsumexp's amax/sub/exp/sum/log
    chain (0.15 vs 0.28 ms at [16, 32768], 0.7 vs 1.4 ms at [16, 151936]). At the argmax,
    log_softmax = -log(sum(exp(x - max))) has no cancellation, so max - that is the logsumexp to
    rounding. Rows whose max is infinite keep logsumexp's answer (the max itself)."""
    if x.device.type != "cpu":
        return torch.logsumexp(x, dim=-1)
    at = argmax.unsqueeze(1)
    top = x.gather(1, at).squeeze(1)  # [bs]
    lse = top - torch.log_softmax(x, dim=-1).gather(1, at).squeeze(1)
    return torch.where(top.isinf(), top, lse)


# Chunk width of inverse_cdf: the chunk sums are one vectorised reduction, and only one chunk per
# row is summed sequentially.
_CDF_CHUNK = 128


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the first index whose running sum of `probs` exceeds u * the row's total: an
    inverse-CDF draw from the (possibly unnormalised) probs [bs, vocab] with uniforms u [bs] in [0, 1).

    In two levels instead of a cumsum over the vocabulary (a sequential pass that cost more than the
    softmax on CPU at [16, 32768] and [16, 151936]): 128-wide chunk sums and their running sum pick
    the chunk, then the running sum inside that one chunk picks the token. The same draw up to the
    rounding of the partial sums; every row takes the same ops whatever the batch, so a row's token
    still depends only on its logits and its uniform. A zero-probability token can be returned only
    at the top of a row whose sums rounded short; callers check (Sampler falls back to argmax)."""
    bs, vocab = probs.shape
    c = _CDF_CHUNK
    n = -(-vocab // c)
    main = (vocab // c) * c
    if main == vocab:
        sums = probs.view(bs, n, c).sum(dim=-1)  # [bs, n]
    else:
        parts = [probs[:, main:].sum(dim=-1, keepdim=True)]
        if main:
            parts.insert(0, probs[:, :main].reshape(bs, n - 1, c).sum(dim=-1))
        sums = torch.cat(parts, dim=1)
    chunk_cdf = sums.cumsum_(dim=-1)  # [bs, n]
    target = (u * chunk_cdf[:, -1]).unsqueeze(1)  # [bs, 1]
    chunk = torch.searchsorted(chunk_cdf, target, right=True).clamp_(max=n - 1)  # [bs, 1]
    before = chunk_cdf.gather(1, (chunk - 1).clamp(min=0)).masked_fill_(chunk == 0, 0.0)  # mass of earlier chunks
    cols = chunk * c + torch.arange(c, device=probs.device)  # [bs, c]
    local = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0)
    local_cdf = local.cumsum_(dim=-1).add_(before)  # [bs, c]
    pos = torch.searchsorted(local_cdf, target, right=True).clamp_(max=c - 1)
    return (chunk * c + pos).squeeze(1).clamp_(max=vocab - 1)


def plain(logits: torch.Tensor, info: SamplingBatchInfo) -> bool:
    """Whether this batch samples on the plain path runner/csrc/sampler.cpp computes: CPU fp32 logits, no
    logit processor, no truncation, only the token's own (default) logprob."""
    bs = logits.shape[0] if logits.dim() == 2 else -1
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and plain_rows(bs, info)


def plain_rows(bs: int, info: SamplingBatchInfo) -> bool:
    """`plain` for the sampling info of `bs` rows, whatever the logits (for a caller that makes CPU fp32
    logits itself: runner/models/fused_layer.py run_sample)."""
    return (bs > 0 and info.temperatures.dtype == torch.float32 and info.seeds.dtype == torch.int64
            and info.steps.dtype == torch.int64 and info.temperatures.shape == info.seeds.shape == info.steps.shape == (bs,)
            and (info.seed_mix is None or (info.seed_mix.dtype == torch.int64 and info.seed_mix.shape == (bs,)))
            and info.seen_mask is None and info.output_counts is None and info.logit_bias is None
            and info.banned_mask is None and not needs_truncation(info) and info.top_logprobs_num == 0
            and info.token_ids is None and info.original_rows is None and info.raw_rows is None
            and not info.return_raw_logprob)


class Sampler:
    # The CPU kernels' direct-call module (runner/cpu_kernels.py direct(), set by the runner): a plain batch
    # then samples in one C++ call, bitwise the Python path below, without the GIL.
    cpu_ops = None
    # Deterministic mode (set by the runner): a greedy row's logprobs are log_softmax(logits) itself, the
    # function prefill scoring applies, so a token's logprob has the same bits as a decode step or scored in
    # a prefill. The default takes them against one logsumexp at the argmax (a [bs] gather, no second
    # full-vocab pass), which rounds differently in the last bits.
    exact_greedy_logprobs = False

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        exact = self.exact_greedy_logprobs and info.need_logprobs and (info.is_all_greedy or info.has_greedy)
        if self.cpu_ops is not None and plain(logits, info) and not exact:
            ids, logprobs = self.cpu_ops.sample_plain(
                logits, info.temperatures, info.seeds, info.seed_mix, info.steps, info.is_all_greedy,
                info.has_greedy, info.need_temperature, info.need_logprobs)
            return SampleOutput(ids, logprobs if info.need_logprobs else None)
        return self._sample(logits, info)

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        # logits: [bs, vocab] fp32. Full-vocab passes are the cost here, so greedy rows and the raw
        # logprob work on [bs] gathers against one logsumexp instead of a second log_softmax; a batch
        # without greedy rows needs neither that logsumexp nor (on the CPU, unless a draw lands on a
        # masked token) the argmax.
        raw = logits
        logits = apply_logit_processors(logits, info)
        any_greedy = info.is_all_greedy or info.has_greedy
        argmax = lse = greedy = greedy_lp = None
        if any_greedy or logits.device.type != "cpu":  # the device would need a sync to decide lazily
            argmax = first_argmax(logits)  # [bs]; also the argmax after temperature and truncation
        # Nothing reads a logprob: the greedy rows' logsumexp (a full-vocab pass, ~2% of a 40M decode
        # step) is skipped and `logprobs` comes back None.
        wants_logprobs = (info.need_logprobs or info.top_logprobs_num > 0 or info.token_ids is not None
                          or info.original_rows is not None or info.raw_rows is not None)
        if any_greedy:
            if wants_logprobs and self.exact_greedy_logprobs:
                greedy_lp = torch.log_softmax(logits, dim=-1)  # [bs, vocab]
            elif wants_logprobs:
                lse = logsumexp_at_argmax(logits, argmax)  # [bs]
            greedy = info.temperatures == 0
        logprobs_all = None  # the reported distribution of the sampled rows, [bs, vocab]
        if info.is_all_greedy:
            ids = argmax
        else:
            scaled = temperature_scaled(logits, info)
            truncate = needs_truncation(info)
            # What is sampled from, as probabilities: one fused softmax pass, which on the CPU costs
            # half of exp() over a log_softmax (0.9 vs 1.8 ms at [16, 151936], 2 threads). The
            # log-distribution is computed only when something reads it.
            masked = truncated_logits(scaled, info)  # `scaled` itself when nothing truncates
            probs = torch.softmax(masked, dim=-1)  # [bs, vocab]; exactly 0 where truncation masked
            if wants_logprobs:
                sample_lp = torch.log_softmax(masked, dim=-1)
                logprobs_all = sample_lp
                if truncate and info.need_logprobs:
                    # SGLang's default reports the untruncated log_softmax(logits / T); rows that asked
                    # for the processed distribution keep the one sampled from.
                    logprobs_all = torch.log_softmax(scaled, dim=-1)
                    if info.processed_rows is not None:
                        logprobs_all = torch.where(info.processed_rows.unsqueeze(1), sample_lp, logprobs_all)
                del sample_lp
            del scaled, masked
            if info.seed_mix is None:
                info.seed_mix = splitmix64(info.seeds)
            u = below_one(uniform_from_seed_mix(info.seed_mix, info.steps).to(probs.dtype))
            ids = inverse_cdf(probs, u)  # [bs], the draw from the distribution sampled from
            # Rounding at the very top of the CDF could land on a masked (or underflowed, zero
            # probability) tail token: take argmax then.
            chosen_ok = probs.gather(1, ids.unsqueeze(1)).squeeze(1) > 0
            del probs
            if argmax is None and not bool(chosen_ok.all()):  # CPU: reading [bs] bools costs nothing
                argmax = first_argmax(logits)
            if argmax is not None:
                ids = torch.where(chosen_ok, ids, argmax)
            if info.has_greedy:
                ids = torch.where(greedy, argmax, ids)
        raw_lse = torch.logsumexp(raw, dim=-1) if info.raw_rows is not None or info.return_raw_logprob else None
        # SGLang's original logprobs: the processed logits' log-softmax, without the temperature
        orig_lse = torch.logsumexp(logits, dim=-1) if info.original_rows is not None else None

        def greedy_at(at: torch.Tensor) -> torch.Tensor:
            return greedy_lp.gather(1, at) if greedy_lp is not None else logits.gather(1, at) - lse.unsqueeze(1)

        def reported(at: torch.Tensor) -> torch.Tensor:
            """[bs, k] logprobs at token ids `at` [bs, k] under each row's reported distribution."""
            if logprobs_all is None:
                vals = greedy_at(at)
            elif info.has_greedy:
                vals = torch.where(greedy.unsqueeze(1), greedy_at(at), logprobs_all.gather(1, at))
            else:
                vals = logprobs_all.gather(1, at)
            if info.original_rows is not None:
                vals = torch.where(info.original_rows.unsqueeze(1), logits.gather(1, at) - orig_lse.unsqueeze(1), vals)
            if info.raw_rows is not None:
                vals = torch.where(info.raw_rows.unsqueeze(1), raw.gather(1, at) - raw_lse.unsqueeze(1), vals)
            return vals

        out = SampleOutput(ids, reported(ids.unsqueeze(1)).squeeze(1) if wants_logprobs else None)
        if info.top_logprobs_num > 0:
            k = info.top_logprobs_num
            if any_greedy and greedy_lp is not None:
                vals, top_ids = greedy_lp.topk(k, dim=-1)
            elif any_greedy:
                vals, top_ids = logits.topk(k, dim=-1)
                vals = vals - lse.unsqueeze(1)
            if logprobs_all is not None:
                s_vals, s_ids = logprobs_all.topk(k, dim=-1)
                if info.has_greedy:
                    s_vals = torch.where(greedy.unsqueeze(1), vals, s_vals)
                    s_ids = torch.where(greedy.unsqueeze(1), top_ids, s_ids)
                vals, top_ids = s_vals, s_ids
            for rows, src, src_lse in ((info.original_rows, logits, orig_lse), (info.raw_rows, raw, raw_lse)):
                if rows is not None:
                    r_vals, r_ids = src.topk(k, dim=-1)
                    vals = torch.where(rows.unsqueeze(1), r_vals - src_lse.unsqueeze(1), vals)
                    top_ids = torch.where(rows.unsqueeze(1), r_ids, top_ids)
            out.top_logprobs, out.top_logprob_ids = vals, top_ids
        if info.token_ids is not None:
            out.token_ids_logprobs = reported(info.token_ids)
        if info.return_raw_logprob:
            out.raw_logprobs = raw.gather(1, ids.unsqueeze(1)).squeeze(1) - raw_lse
        return out
