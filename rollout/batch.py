"""Build the runner's ForwardBatch (and SamplingBatchInfo) from scheduled requests.

Host-side lists become device tensors here, once per step; nothing in here reads a device tensor.
The penalty tensors are built only when some request of the batch uses a penalty: token ids go to the
device once per step and one scatter turns them into [bs, vocab] counts (no loop over the vocabulary).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rollout.request import Req
from runner.forward_batch import ForwardBatch, ForwardMode
from runner.sampler import SamplingBatchInfo


def sampling_info(reqs: list[Req], vocab_size: int, eos_ids: list[int], device,
                  step_offset: int = 0) -> SamplingBatchInfo:
    """step_offset: tokens each request has sampled in a step still in flight (rollout.overlap); the
    info samples output position len(output_ids) + step_offset. Penalties read the host tokens, so a
    batch with penalties is only built with step_offset 0."""
    sps = [r.sampling_params for r in reqs]
    info = SamplingBatchInfo.from_lists(
        temperatures=[sp.temperature for sp in sps],
        top_ps=[sp.top_p for sp in sps],
        top_ks=[sp.top_k for sp in sps],
        min_ps=[sp.min_p for sp in sps],
        seeds=[r.seed for r in reqs],
        steps=[len(r.output_ids) + step_offset for r in reqs],
        vocab_size=vocab_size,
        device=device,
        top_logprobs_num=max((r.top_logprobs_num for r in reqs), default=0),
    )
    # min_new_tokens: until reached, eos and stop_token_ids cannot be sampled.
    banned = []
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        if len(r.output_ids) + step_offset < sp.min_new_tokens:
            ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
            banned.extend((i, t) for t in ids if 0 <= t < vocab_size)
    if banned:
        mask = torch.zeros(len(reqs), vocab_size, dtype=torch.bool)
        rows, cols = zip(*banned)
        mask[list(rows), list(cols)] = True
        info.banned_mask = mask.to(device)
    _add_penalties(info, reqs, vocab_size, device)
    if any(sp.logit_bias for sp in sps):
        rows, cols, vals = [], [], []
        for i, sp in enumerate(sps):
            for t, b in sp.logit_bias.items():
                rows.append(i), cols.append(t), vals.append(b)
        bias = torch.zeros(len(reqs), vocab_size, dtype=torch.float32)
        bias[rows, cols] = torch.tensor(vals, dtype=torch.float32)
        info.logit_bias = bias.to(device)
    original = [r.return_original_logprob and not r.return_raw_logprob for r in reqs]  # raw (engine-wide) wins
    if any(r.return_logprob and o for r, o in zip(reqs, original)):
        info.original_rows = torch.tensor(original, dtype=torch.bool, device=device)
    if any(r.return_logprob and r.return_raw_logprob for r in reqs):
        info.raw_rows = torch.tensor([r.return_raw_logprob for r in reqs], dtype=torch.bool, device=device)
    if any(r.return_logprob and r.return_processed_logprob for r in reqs):
        info.processed_rows = torch.tensor([r.return_processed_logprob for r in reqs], dtype=torch.bool,
                                           device=device)
    info.need_logprobs = any(r.return_logprob for r in reqs)
    if any(r.return_logprob and r.token_ids_logprob for r in reqs):
        info.token_ids = _padded([r.token_ids_logprob or [] for r in reqs], 0, device)
    return info


class SamplingInfoCache:
    """sampling_info() with reuse: consecutive steps over the same requests (the same objects, in the same
    order, with the same sampling parameters and logprob options) share every per-request tensor and
    rebuild only `steps`, the output position being sampled.

    Reused only when nothing in the info depends on the tokens so far: no penalties (their counts change
    each step) and no min_new_tokens ban (it lifts as the output grows; an info built without one stays
    valid for later positions: a request's output never shrinks while it is in flight).
    """

    def __init__(self, vocab_size: int, eos_ids: list[int], device) -> None:
        self.vocab_size, self.eos_ids, self.device = vocab_size, eos_ids, device
        self._keys: list[tuple] = []  # holds the requests, so none is freed and its id reused meanwhile
        self._info: SamplingBatchInfo | None = None
        self._positions: list[int] = []  # the output position each row sampled last time

    @staticmethod
    def _key(r: Req) -> tuple:
        # Everything sampling_info() reads of a request but its tokens. Req compares by identity; the
        # sampling params by identity first, then by value (an equal replacement gives an equal info).
        return (r, r.sampling_params, r.seed, r.top_logprobs_num, r.return_logprob, r.return_original_logprob,
                r.return_raw_logprob, r.return_processed_logprob, r.token_ids_logprob)

    def __call__(self, reqs: list[Req], step_offset: int = 0) -> SamplingBatchInfo:
        keys = [self._key(r) for r in reqs]
        positions = [len(r.output_ids) + step_offset for r in reqs]
        last = self._info
        # A step rolled back (rollout.overlap) can sample a position again: reuse only going forward.
        if (last is not None and last.banned_mask is None and last.seen_mask is None and last.output_counts is None
                and keys == self._keys and all(p >= q for p, q in zip(positions, self._positions))):
            info = dataclasses.replace(last, steps=torch.tensor(positions, dtype=torch.int64, device=self.device))
        else:
            info = sampling_info(reqs, self.vocab_size, self.eos_ids, self.device, step_offset)
        self._keys, self._info, self._positions = keys, info, positions
        return info

    def clear(self) -> None:
        self._keys, self._info, self._positions = [], None, []


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)


def _token_counts(rows: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[bs, vocab] fp32 occurrences of each id per row, by one scatter on the device."""
    ids = _padded(rows, vocab_size, device)  # pad goes to an extra column, dropped
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _add_penalties(info: SamplingBatchInfo, reqs: list[Req], vocab_size: int, device) -> None:
    sps = [r.sampling_params for r in reqs]
    if any(sp.repetition_penalty != 1 for sp in sps):
        # HF's definition: every token of the sequence so far (prompt and output); rows at 1 are no-ops.
        seen = [r.fill_ids if sp.repetition_penalty != 1 else [] for r, sp in zip(reqs, sps)]
        info.seen_mask = _token_counts(seen, vocab_size, device) > 0
        info.repetition_penalties = torch.tensor([sp.repetition_penalty for sp in sps], dtype=torch.float32,
                                                 device=device)
    if any(sp.frequency_penalty or sp.presence_penalty for sp in sps):
        used = [r.output_ids if (sp.frequency_penalty or sp.presence_penalty) else [] for r, sp in zip(reqs, sps)]
        info.output_counts = _token_counts(used, vocab_size, device)
        info.frequency_penalties = torch.tensor([sp.frequency_penalty for sp in sps], dtype=torch.float32,
                                                device=device)
        info.presence_penalties = torch.tensor([sp.presence_penalty for sp in sps], dtype=torch.float32,
                                               device=device)


@dataclass
class PromptLogprobRows:
    """Which rows of an EXTEND step's all-position logits score which prompt tokens."""

    rows: torch.Tensor  # [m] int64 into the step's flattened tokens
    targets: torch.Tensor  # [m] int64: the prompt token each row scores (the one after it)
    temperatures: torch.Tensor  # [m] fp32: 1 for greedy rows and original logprobs
    token_ids: torch.Tensor | None  # [m, k] int64 padded, when some request asked for token_ids_logprob
    owners: list[int]  # item index of each row
    positions: list[int]  # prompt position of each row's target


def prompt_logprob_rows(items: list[tuple[Req, int, int]], device) -> PromptLogprobRows | None:
    """The prompt positions the chunks in `items` must score, or None (the step needs no all-position
    logits). Position p is scored by the logits at p - 1, which this chunk computes if start <= p-1 < start+n."""
    rows, targets, temps, ids, owners, positions = [], [], [], [], [], []
    offset = 0
    for b, (req, start, n) in enumerate(items):
        wanted = req.input_logprob_positions
        if req.needs_input_logprobs:
            sp = req.sampling_params
            temp = 1.0 if sp.is_greedy or req.return_original_logprob or req.return_raw_logprob else sp.temperature
            for p in range(max(start, wanted.start - 1), min(start + n, wanted.stop - 1)):
                rows.append(offset + p - start)
                targets.append(req.fill_ids[p + 1])
                temps.append(temp)
                ids.append(req.token_ids_logprob or [])
                owners.append(b)
                positions.append(p + 1)
        offset += n
    if not rows:
        return None
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return PromptLogprobRows(as_t(rows), as_t(targets), torch.tensor(temps, dtype=torch.float32, device=device),
                             _padded(ids, 0, device) if any(ids) else None, owners, positions)


def extend_batch(items: list[tuple[Req, int, int]], out_cache_loc: torch.Tensor, device,
                 return_all_logits: bool = False) -> ForwardBatch:
    """items: (req, start, num_new) — tokens fill_ids[start:start+num_new] are computed this step."""
    input_ids, positions, seq_lens = [], [], []
    for req, start, n in items:
        input_ids.extend(_tokens(req, start, n))
        positions.extend(range(start, start + n))
        seq_lens.append(start + n)
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(items),
        input_ids=as_t(input_ids),
        positions=as_t(positions),
        req_pool_indices=as_t([r.req_pool_idx for r, _, _ in items]),
        seq_lens=as_t(seq_lens),
        out_cache_loc=out_cache_loc.to(device),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=[s for _, s, _ in items],
        extend_seq_lens_cpu=[n for _, _, n in items],
        return_all_logits=return_all_logits,
        lora_ids=_lora_ids([r for r, _, _ in items]),
        final_seq_lens_cpu=[_final_len(r) for r, _, _ in items],
    )


def decode_batch(reqs: list[Req], out_cache_loc: torch.Tensor, device, pending: int = 0) -> ForwardBatch:
    """pending=1: built while the step sampling each request's next token is in flight (rollout.overlap):
    positions are one further on and input_ids are placeholders the worker overwrites with those tokens."""
    seq_lens = [r.seq_len + pending for r in reqs]
    last = [0] * len(reqs) if pending else [r.output_ids[-1] for r in reqs]
    # One host->device tensor for the four index rows (each row a contiguous view): [4, bs]
    rows = torch.tensor([last, [s - 1 for s in seq_lens],
                         [r.req_pool_idx for r in reqs], seq_lens], dtype=torch.int64, device=device)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(reqs),
        input_ids=rows[0],
        positions=rows[1],
        req_pool_indices=rows[2],
        seq_lens=rows[3],
        out_cache_loc=out_cache_loc.to(device),
        seq_lens_cpu=seq_lens,
        lora_ids=_lora_ids(reqs),
        final_seq_lens_cpu=[_final_len(r) for r in reqs],
    )


def _tokens(req: Req, start: int, n: int) -> list[int]:
    """fill_ids[start:start + n] without building fill_ids (a mixed step's running row is one output token)."""
    num_prompt = len(req.prompt_ids)
    if start >= num_prompt:
        return req.output_ids[start - num_prompt : start - num_prompt + n]
    if start + n <= num_prompt:
        return req.prompt_ids[start : start + n]
    return req.fill_ids[start : start + n]


def _lora_ids(reqs: list[Req]) -> list[int | None] | None:
    """Each request's LoRA adapter uid (None: base model), or None when the batch uses none."""
    ids = [r.lora_id for r in reqs]
    return ids if any(i is not None for i in ids) else None


def _final_len(req: Req) -> int | None:
    """The length the request will have if it runs to max_new_tokens (None: no limit set)."""
    limit = req.sampling_params.max_new_tokens
    return None if limit is None else len(req.prompt_ids) + limit
