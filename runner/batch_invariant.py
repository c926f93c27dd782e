"""Batch-invariant ops: a token's result does not depend on which other tokens share its step.

With `enable_deterministic_inference=True` the runner runs every forward inside `mode(True)`, and the
layers' hooks send their math here instead of to the default kernels. The rules each op keeps, all
checked empirically on this CPU (AVX512, MKL/oneDNN, torch 2.13, 1 and 2 threads):

- **Linear layers** run over fixed tiles of TILE_ROWS tokens (the last tile zero-padded) as one bmm,
  so every GEMM has the shape [TILE_ROWS, in] x [in, out] whatever the batch. MKL's result for a row
  changed with the row count M (M = 1..39 gave 3 distinct bit patterns for one row), but not with the
  row's position inside a fixed-M tile nor with the number of tiles in the bmm.
- **Attention** is per token over exactly its own request's keys, in fixed blocks of KV_BLOCK keys
  combined by an online softmax in block order. The scores and P.V products are bmms of one fixed
  shape per model ([group, head_dim] x [head_dim, KV_BLOCK], batched over tokens x kv heads); masked
  keys are zeroed and scored -inf, so a block past a token's position is an exact no-op (alpha = 1,
  p = 0). A token therefore gets the same bits in a prefill chunk, after a cache hit, or as a decode
  step. Computed in fp32, like the default CPU path.
- **SiLU** is `x / (1 + exp(-x))` in separate ops: F.silu's vectorized and scalar-tail paths gave
  different bits for ~4% of inputs, and which elements take the tail depends on the tensor's size.
  exp, add, div, rsqrt and the row-wise reductions (mean, logsumexp, log_softmax, cumsum, argmax,
  sort) gave one result per row whatever the row count, so RMSNorm and the sampler keep their ops.

Everything here is differentiable, so a trainer can run the runner's own model code under autograd
in this mode and get logprobs bitwise equal to the engine's (trainers/deterministic.py). What this
does not do: make CUDA kernels batch-invariant (the GPU path keeps its default kernels), or make
different thread counts or CPUs agree with each other.
"""

from __future__ import annotations

import torch

from runner.thread_flag import ThreadFlag

TILE_ROWS = 16  # rows per linear-layer GEMM: the decode-sized shape, shared by prefill and decode
KV_BLOCK = 64  # keys per attention block

# Per thread (each engine's scheduler thread, the forward worker, the trainer's thread): `with mode():`.
_flag = ThreadFlag()
is_enabled = _flag.is_enabled
mode = _flag.mode


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) over fixed tiles of TILE_ROWS rows. x: [..., in] -> [..., out]."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)  # [num_rows, in]
    n = rows.shape[0]
    num_tiles = max(1, -(-n // TILE_ROWS))
    pad = num_tiles * TILE_ROWS - n
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    tiles = rows.contiguous().view(num_tiles, TILE_ROWS, k)  # one layout, so one kernel, for any count
    out = torch.bmm(tiles, weight.t().unsqueeze(0).expand(num_tiles, k, weight.shape[0]))
    out = out.reshape(num_tiles * TILE_ROWS, weight.shape[0])[:n]  # [num_rows, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    gate, up = x.chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


def token_request_index(seq_lens_per_request: list[int], device: torch.device) -> torch.Tensor:
    """[num_tokens] int64: the request (row of kv_rows) each flattened new token belongs to."""
    counts = torch.tensor(seq_lens_per_request, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(seq_lens_per_request)), counts).to(device)


def attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, kv_rows: torch.Tensor,
              token_req: torch.Tensor, positions: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of each new token over its own request's keys, in fixed KV blocks.

    q: [T, hq, d] new tokens; k_all, v_all: [S, hkv, d] the slots keys are read from (the KV pool's
    layer buffer, or a trainer's own K/V); kv_rows: [bs, >= max_len] int64 slot of each position of
    each request; token_req: [T] row of kv_rows per token; positions: [T] absolute position of each
    token (it attends to positions 0..position). Returns [T, hq, d] in q's dtype.
    """
    num_tokens, hq, d = q.shape
    hkv = k_all.shape[1]
    group = hq // hkv
    num_blocks = max(1, -(-(int(kv_rows.shape[1])) // KV_BLOCK))
    width = num_blocks * KV_BLOCK
    if kv_rows.shape[1] < width:
        kv_rows = torch.cat([kv_rows, kv_rows.new_zeros(kv_rows.shape[0], width - kv_rows.shape[1])], dim=1)
    qg = q.float().view(num_tokens, hkv, group, d)
    m = qg.new_full((num_tokens, hkv, group, 1), float("-inf"))
    denom = qg.new_zeros((num_tokens, hkv, group, 1))
    acc = qg.new_zeros((num_tokens, hkv, group, d))
    key_pos = torch.arange(KV_BLOCK, device=q.device)
    tok_rows = kv_rows[token_req]  # [T, width]
    for j in range(num_blocks):
        start = j * KV_BLOCK
        valid = (key_pos + start).unsqueeze(0) <= positions.unsqueeze(1)  # [T, KV_BLOCK]
        idx = tok_rows[:, start:start + KV_BLOCK]
        keep = valid.view(num_tokens, KV_BLOCK, 1, 1)
        kb = torch.where(keep, k_all[idx].float(), 0.0)  # [T, KV_BLOCK, hkv, d]
        vb = torch.where(keep, v_all[idx].float(), 0.0)
        # .contiguous(): for one token reshape returns a transposed view, and bmm picks another kernel.
        kt = kb.permute(0, 2, 3, 1).reshape(num_tokens * hkv, d, KV_BLOCK).contiguous()
        scores = torch.bmm(qg.reshape(num_tokens * hkv, group, d), kt).view(num_tokens, hkv, group, KV_BLOCK)
        scores = scores * scaling  # [T, hkv, group, KV_BLOCK]
        scores = scores.masked_fill(~valid.view(num_tokens, 1, 1, KV_BLOCK), float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        p = torch.exp(scores - m_new)
        alpha = torch.exp(m - m_new)
        denom = denom * alpha + p.sum(dim=-1, keepdim=True)
        vt = vb.permute(0, 2, 1, 3).reshape(num_tokens * hkv, KV_BLOCK, d).contiguous()
        pv = torch.bmm(p.reshape(num_tokens * hkv, group, KV_BLOCK), vt).view(num_tokens, hkv, group, d)
        acc = acc * alpha + pv  # [T, hkv, group, d]
        m = m_new
    return (acc / denom).reshape(num_tokens, hq, d).to(q.dtype)
