"""When and how the torch-native backend calls the paged CPU attention kernels, decode and extend
(runner/csrc/paged_decode_attention.cpp; built and loaded by runner/cpu_kernels.py).

Why a kernel. The torch-native decode step gathers every request's K/V out of the paged pool into a
padded [bs, max_kv, kv_heads, d] copy each layer and runs SDPA on it under a length mask; at long
contexts that copy and the kernel's padded work grow with the context. The kernel reads each
request's slots in place through req_to_token, shares each K/V row across the query heads of its
group, and prefetches the scattered rows. Measured on a 2-core Zen 4 (AVX-512), 16 requests, 2
threads, through the backend (bench/decode_attention.py): 2.9-3.8x faster than the gather + SDPA it
replaces at 96 to 2048 keys, fp32 and bf16.

Extend (prefill, chunked prefill, prefix-cache hits) runs the same per-token loop: new token j of a
request with p cached tokens attends to its first p + j + 1 slots, so no mask or padded query layout
is built. Against torch's CPU flash SDPA on the already-gathered K/V (same machine, 0.5B head layout):
4 x 512 fresh tokens 17.0 vs 33.0 ms per layer in bf16 (13.9 vs 30.6 fp32), one 2048-token prompt
59.4 vs 69.5 ms, 4 x 256 on a 256-token prefix 11.1 vs 16.4 ms.

On a CPU with AMX tiles, bf16 extends of at least `cpu_kernels.EXTEND_SDPA_MIN_TOKENS` new tokens per
request go to torch's flash SDPA instead, inside the same op (the request's K/V gathered out of the pool,
causal from its cached prefix, whose boolean mask is capped at 2^24 elements: past that, the kernel): its bf16 GEMMs run on the tile unit, 2-4x faster than this loop there at
256-2048 tokens (figures in runner/cpu_kernels.py). Those rows then differ from the decode op's by bf16
rounding (SDPA rounds the probabilities to bf16 before they weight V), so on that route a token's KV is not
bitwise the same prefilled and decoded; the rest of the batch, fp32 models, and every CPU without AMX keep
the kernel.

When they are used (`usable`): any step of an fp32 or bf16 model (q and cache of one dtype) with a
head_dim the kernel was compiled for, outside batch-invariant mode (which has its own fixed-block
kernel). Numerics: fp32 accumulation like
SDPA's, in a different summation order, so logits differ from the SDPA path by float rounding (the
tests hold both to a float64 oracle and to HF generate).
"""

from __future__ import annotations

import torch

from runner import cpu_kernels

HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the template instances in the source


def usable(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel computes this layer's decode attention (the kernels must be loaded too)."""
    return dtype == cache_dtype and dtype in cpu_kernels.DTYPES and head_dim in HEAD_DIMS


def paged_attention(ops, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """Decode (extend_lens None; q: [bs, hq, d]) or extend (q: [num_tokens, hq, d], request b's
    extend_lens[b] new tokens in order, causal over its cached prefix and themselves). k_cache,
    v_cache: [slots, hkv, d] (one layer of the pool); req_to_token: [max_reqs, max_context] int64;
    req_pool_indices, seq_lens, extend_lens: [bs] int64, seq_lens counting this step's tokens (already
    written) -> [num_tokens, hq, d] in q's dtype."""
    args = (q.contiguous(), k_cache, v_cache, req_to_token, req_pool_indices.contiguous(), seq_lens.contiguous())
    if extend_lens is None:
        return ops.paged_decode_attention(*args, float(scale))
    return ops.paged_extend_attention(*args, extend_lens, float(scale))
