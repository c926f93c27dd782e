"""The torch-native backend's decode attention, on either path (the paged CPU kernel, or gather + SDPA with
query heads grouped per KV head), equals a naive per-request, per-head softmax over that request's own
keys, in float64, for fp32 and bf16 pools."""

from __future__ import annotations

import types

import pytest
import torch

from runner.attention.torch_native import TorchNativeAttnBackend
from runner.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context
from runner.memory.kv_pool import TokenToKVPool
from tests.needs import needs_cpu_kernels


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_cpu_kernels)], ids=["sdpa", "kernel"])
@pytest.mark.parametrize("d", [16, 64, 48], ids=lambda d: f"d{d}")  # 48: no kernel instance, SDPA either way
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 1), (6, 2), (3, 3), (14, 2)])
def test_decode_attention_matches_naive_per_head_softmax(dtype, heads, d, kernel):
    """Each request's output head h is softmax(q_h . K / sqrt(d)) V over exactly its own seq_len keys,
    read from KV head h // (num_heads / num_kv_heads)."""
    hq, hkv = heads
    bs, slots = 3, 64
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    pool = TokenToKVPool(slots, dtype, 1, hkv, d, "cpu")
    pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=gen).to(dtype))
    pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=gen).to(dtype))
    seq = [5, 1, 11]
    req_to_token = torch.zeros(4, 16, dtype=torch.int64)
    perm = torch.randperm(slots, generator=gen) + 1  # scattered slots, never the padding slot 0
    for b, n in enumerate(seq):
        req_to_token[b + 1, :n] = perm[b * 16:b * 16 + n]
    runner = types.SimpleNamespace(device=torch.device("cpu"),
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token))
    backend = TorchNativeAttnBackend(runner, decode_kernel=kernel)
    assert (backend.decode_op is not None) == kernel
    rows = torch.tensor([1, 2, 3])
    fb = ForwardBatch(ForwardMode.DECODE, bs, torch.zeros(bs, dtype=torch.int64), torch.tensor(seq) - 1, rows,
                      torch.tensor(seq), torch.zeros(bs, dtype=torch.int64), seq)
    backend.init_forward_metadata(fb)
    layer = types.SimpleNamespace(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=d, scaling=d**-0.5)
    q = torch.randn(bs, hq, d, generator=gen).to(dtype)
    with forward_context(ForwardContext(backend, pool, None)):
        out = backend.forward_decode(q, layer, fb)  # [bs, hq, d]
    assert out.shape == (bs, hq, d) and out.dtype == dtype
    for b, n in enumerate(seq):
        locs = req_to_token[b + 1, :n]
        k, v = pool.k_buffer[0, locs].double(), pool.v_buffer[0, locs].double()  # [n, hkv, d]
        for h in range(hq):
            kv = h // (hq // hkv)
            p = torch.softmax(k[:, kv] @ q[b, h].double() * d**-0.5, dim=0)
            want = p @ v[:, kv]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[b, h].double(), want, rtol=tol, atol=tol)
