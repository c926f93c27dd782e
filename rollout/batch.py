"""Build the runner's ForwardBatch (and SamplingBatchInfo) from scheduled requests.

Host-side lists become device tensors here, once per step; nothing in here reads a device tensor.
"""

from __future__ import annotations

import torch

from rollout.request import Req
from runner.forward_batch import ForwardBatch, ForwardMode
from runner.sampler import SamplingBatchInfo


def sampling_info(reqs: list[Req], vocab_size: int, eos_ids: list[int], device) -> SamplingBatchInfo:
    sps = [r.sampling_params for r in reqs]
    info = SamplingBatchInfo.from_lists(
        temperatures=[sp.temperature for sp in sps],
        top_ps=[sp.top_p for sp in sps],
        top_ks=[sp.top_k for sp in sps],
        min_ps=[sp.min_p for sp in sps],
        seeds=[r.seed for r in reqs],
        steps=[len(r.output_ids) for r in reqs],
        vocab_size=vocab_size,
        device=device,
        top_logprobs_num=max((r.top_logprobs_num for r in reqs), default=0),
    )
    # min_new_tokens: until reached, eos and stop_token_ids cannot be sampled.
    banned = []
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        if len(r.output_ids) < sp.min_new_tokens:
            ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
            banned.extend((i, t) for t in ids if 0 <= t < vocab_size)
    if banned:
        mask = torch.zeros(len(reqs), vocab_size, dtype=torch.bool)
        rows, cols = zip(*banned)
        mask[list(rows), list(cols)] = True
        info.banned_mask = mask.to(device)
    return info


def extend_batch(items: list[tuple[Req, int, int]], out_cache_loc: torch.Tensor, device,
                 return_all_logits: bool = False) -> ForwardBatch:
    """items: (req, start, num_new) — tokens fill_ids[start:start+num_new] are computed this step."""
    input_ids, positions, seq_lens = [], [], []
    for req, start, n in items:
        input_ids.extend(req.fill_ids[start : start + n])
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
    )


def decode_batch(reqs: list[Req], out_cache_loc: torch.Tensor, device) -> ForwardBatch:
    seq_lens = [r.seq_len for r in reqs]
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(reqs),
        input_ids=as_t([r.output_ids[-1] for r in reqs]),
        positions=as_t([s - 1 for s in seq_lens]),
        req_pool_indices=as_t([r.req_pool_idx for r in reqs]),
        seq_lens=as_t(seq_lens),
        out_cache_loc=out_cache_loc.to(device),
        seq_lens_cpu=seq_lens,
    )
