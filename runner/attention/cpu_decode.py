"""When and how the torch-native backend calls the paged CPU decode-attention kernel
(runner/csrc/paged_decode_attention.cpp; built and loaded by runner/cpu_kernels.py).

Why a kernel. The torch-native decode step gathers every request's K/V out of the paged pool into a
padded [bs, max_kv, kv_heads, d] copy each layer and runs SDPA on it under a length mask; at long
contexts that copy and the kernel's padded work grow with the context. The kernel reads each
request's slots in place through req_to_token, shares each K/V row across the query heads of its
group, and prefetches the scattered rows. Measured on a 2-core Zen 4 (AVX-512), 16 requests, 2
threads, through the backend (bench/decode_attention.py): 2.9-3.8x faster than the gather + SDPA it
replaces at 96 to 2048 keys, fp32 and bf16.

When it is used (`usable`): a step with one new token per request (decode, or an extend of one token
each) of an fp32 or bf16 model (q and cache of one dtype), a head_dim the kernel was compiled for,
outside batch-invariant mode (which has its own fixed-block kernel). Numerics: fp32 accumulation like
SDPA's, in a different summation order, so logits differ from the SDPA path by float rounding (the
tests hold both to a float64 oracle and to HF generate).
"""

from __future__ import annotations

import torch

HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the template instances in the source
DTYPES = (torch.float32, torch.bfloat16)


def usable(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel computes this layer's decode attention (the kernels must be loaded too)."""
    return dtype == cache_dtype and dtype in DTYPES and head_dim in HEAD_DIMS


def paged_decode_attention(ops, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q: [bs, hq, d]; k_cache, v_cache: [slots, hkv, d] (one layer of the pool); req_to_token:
    [max_reqs, max_context] int64; req_pool_indices, seq_lens: [bs] int64, seq_lens counting this
    step's token (already written) -> [bs, hq, d] in q's dtype."""
    return ops.paged_decode_attention(q.contiguous(), k_cache, v_cache, req_to_token, req_pool_indices.contiguous(),
                                      seq_lens.contiguous(), float(scale))
