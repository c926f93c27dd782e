"""Index tensors flashinfer's paged-KV wrappers plan from, as pure functions (no flashinfer import).

With page size 1 (our KV pool), a "page" is one token slot, so for a batch:

- `kv_indptr`    [bs + 1] int32: request i's KV slots are `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`;
- `kv_indices`   [sum(seq_lens)] int32: `req_to_token[req_pool_indices[i], :seq_lens[i]]`, concatenated;
- `last_page_len` [bs] int32: all ones (every page is full at one token);
- `qo_indptr`    [bs + 1] int32: request i's new tokens are `q[qo_indptr[i]:qo_indptr[i+1]]`.

Indptrs and last-page lengths are built on the host from the batch's CPU lengths, because plan()
reads them on the host anyway (building them on the device would cost a device-to-host sync).
`kv_indices` is gathered on the device from the request-to-token table without reading anything
back: the total length comes from the host lengths. CUDA-graph padding (`pad_decode_batch`) lives
here too: padded rows see one KV slot and write to the reserved padding slot 0.

What this does not do: call flashinfer, allocate its workspace, or decide which wrapper runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _lens_list(lens: Sequence[int] | torch.Tensor, what: str) -> list[int]:
    out = lens.tolist() if isinstance(lens, torch.Tensor) else [int(n) for n in lens]
    bad = [n for n in out if n < 0]
    if bad:
        raise ValueError(f"{what} must be >= 0, got {bad[0]}")
    return out


def indptr(lens: Sequence[int] | torch.Tensor, what: str = "lengths") -> torch.Tensor:
    """`[0, cumsum(lens)]` as a host int32 tensor of size len(lens) + 1."""
    values = _lens_list(lens, what)
    out = torch.zeros(len(values) + 1, dtype=torch.int32)
    if values:
        out[1:] = torch.tensor(values, dtype=torch.int64).cumsum(0)
    return out  # [bs + 1] int32, CPU


def last_page_len(batch_size: int) -> torch.Tensor:
    """Every page holds exactly one token (page size 1)."""
    return torch.ones(batch_size, dtype=torch.int32)  # [bs] int32, CPU


def kv_indices(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, total: int,
    out: torch.Tensor | None = None, max_slot: int | None = None,
) -> torch.Tensor:
    """Concatenated KV slots of every request, gathered on `req_to_token`'s device without a sync.

    req_to_token: [num_rows, max_context] slot table; req_pool_indices, seq_lens: [bs] on the same
    device; `total` must equal sum(seq_lens) (the caller knows it from host lengths). With `out`
    (e.g. a CUDA-graph wrapper's static indices buffer) the result is written into `out[:total]`.
    `max_slot` clamps every index into [0, max_slot]: a padding row reads an entry no request wrote
    (after a torch_memory_saver resume the table's contents are undefined), and a kernel must never
    be handed an out-of-range slot for it.
    """
    if req_pool_indices.shape != seq_lens.shape or req_pool_indices.dim() != 1:
        raise ValueError(f"req_pool_indices {tuple(req_pool_indices.shape)} and seq_lens "
                         f"{tuple(seq_lens.shape)} must be 1-D and of the same length")
    if out is not None and out.numel() < total:
        raise ValueError(f"kv indices buffer holds {out.numel()} slots, the batch needs {total}")
    dev = req_to_token.device
    lens = seq_lens.to(dev, torch.int64)
    starts = torch.cumsum(lens, 0) - lens  # [bs] first flat index of each request
    # output_size makes repeat_interleave skip the sum it would otherwise read back from the device.
    rows = torch.repeat_interleave(req_pool_indices.to(dev, torch.int64), lens, output_size=total)
    cols = torch.arange(total, device=dev) - torch.repeat_interleave(starts, lens, output_size=total)
    gathered = req_to_token[rows, cols]  # [total]
    if max_slot is not None:
        gathered = gathered.clamp(0, max_slot)
    if out is None:
        return gathered.to(torch.int32)
    out[:total].copy_(gathered)
    return out[:total]


def decode_metadata(seq_lens_cpu: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(kv_indptr, last_page_len, total KV tokens) of a decode batch, all from host lengths."""
    ptr = indptr(seq_lens_cpu, "seq_lens")
    return ptr, last_page_len(len(ptr) - 1), int(ptr[-1])


def extend_metadata(
    extend_seq_lens_cpu: Sequence[int], seq_lens_cpu: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(qo_indptr, kv_indptr, last_page_len, total KV tokens) of an extend batch.

    The KV range of each request is its whole sequence (cached prefix + this chunk): the layer writes
    the chunk's K/V before attention runs, so one causal paged prefill covers both.
    """
    q, kv = _lens_list(extend_seq_lens_cpu, "extend_seq_lens"), _lens_list(seq_lens_cpu, "seq_lens")
    if len(q) != len(kv):
        raise ValueError(f"extend_seq_lens has {len(q)} entries, seq_lens {len(kv)}")
    over = [i for i, (a, b) in enumerate(zip(q, kv)) if a > b]
    if over:
        i = over[0]
        raise ValueError(f"request {i}: {q[i]} new tokens but only {kv[i]} tokens in its sequence")
    kv_ptr = indptr(kv, "seq_lens")
    return indptr(q, "extend_seq_lens"), kv_ptr, last_page_len(len(kv)), int(kv_ptr[-1])


def pad_decode_batch(
    seq_lens_cpu: Sequence[int], padded_bs: int
) -> list[int]:
    """Host lengths of a decode batch padded to a captured batch size: padded rows see one slot."""
    lens = _lens_list(seq_lens_cpu, "seq_lens")
    if padded_bs < len(lens):
        raise ValueError(f"cannot pad a batch of {len(lens)} down to {padded_bs}")
    return lens + [1] * (padded_bs - len(lens))
