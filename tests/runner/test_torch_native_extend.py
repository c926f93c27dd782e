"""The torch-native backend's extend (prefill) attention, through the paged CPU kernel or gather + SDPA,
equals a naive per-request, per-head causal softmax in float64, for fresh prompts and for chunks after a cached prefix, with requests of unequal
lengths (so the padded batch has query rows that are dropped); fresh batches plan SDPA's is_causal, bit-identical
to the mask plan."""

from __future__ import annotations

import types

import pytest
import torch

from runner.attention.torch_native import TorchNativeAttnBackend
from runner.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context
from runner.memory.kv_pool import TokenToKVPool
from tests.needs import needs_cpu_kernels


def _setup(dtype, hq, hkv, prefix, new, seed, slots=128, kernel=False, d=16):
    gen = torch.Generator().manual_seed(seed)
    pool = TokenToKVPool(slots, dtype, 1, hkv, d, "cpu")
    pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=gen).to(dtype))
    pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=gen).to(dtype))
    seq = [p + n for p, n in zip(prefix, new)]
    bs = len(seq)
    width = max(seq)
    req_to_token = torch.zeros(bs + 1, width, dtype=torch.int64)
    perm = torch.randperm(slots - 1, generator=gen) + 1  # scattered slots, never the padding slot 0
    for b, n in enumerate(seq):
        start = sum(seq[:b])
        req_to_token[b + 1, :n] = perm[start:start + n]
    runner = types.SimpleNamespace(device=torch.device("cpu"),
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token))
    backend = TorchNativeAttnBackend(runner, decode_kernel=kernel)
    assert (backend.decode_op is not None) == kernel
    fb = ForwardBatch(ForwardMode.EXTEND, bs, torch.zeros(sum(new), dtype=torch.int64),
                      torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)]),
                      torch.arange(1, bs + 1), torch.tensor(seq), torch.zeros(sum(new), dtype=torch.int64), seq,
                      extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=list(new))
    layer = types.SimpleNamespace(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=d, scaling=d**-0.5)
    q = torch.randn(sum(new), hq, d, generator=gen).to(dtype)
    return pool, req_to_token, backend, fb, layer, q


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_cpu_kernels)], ids=["sdpa", "kernel"])
@pytest.mark.parametrize("d", [16, 48], ids=lambda d: f"d{d}")  # 48: no kernel instance, SDPA either way
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 1), (6, 2), (3, 3), (14, 2)])
@pytest.mark.parametrize("prefix", [[0, 0, 0], [0, 4, 0], [17, 3, 40]], ids=["fresh", "prefixed", "all-prefixed"])
def test_extend_attention_matches_naive_causal_softmax(dtype, heads, prefix, d, kernel):
    """New token i of a request (position prefix + i) attends softmax(q . K / sqrt(d)) V over exactly its
    keys 0..prefix + i, read from KV head h // (num_heads / num_kv_heads)."""
    hq, hkv = heads
    new = [5, 1, 9]  # unequal lengths: padded query rows exist in the batch
    pool, req_to_token, backend, fb, layer, q = _setup(dtype, hq, hkv, prefix, new, seed=hq * 10 + hkv,
                                                       kernel=kernel, d=d)
    backend.init_forward_metadata(fb)
    with forward_context(ForwardContext(backend, pool, None)):
        out = backend.forward_extend(q, layer, fb)  # [num_tokens, hq, d]
    assert out.shape == q.shape and out.dtype == dtype
    start = 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b, (p, n) in enumerate(zip(prefix, new)):
        locs = req_to_token[b + 1, :p + n]
        k, v = pool.k_buffer[0, locs].double(), pool.v_buffer[0, locs].double()  # [p + n, hkv, d]
        for i in range(n):
            seen = p + i + 1
            for h in range(hq):
                kv = h // (hq // hkv)
                w = torch.softmax(k[:seen, kv] @ q[start + i, h].double() * d**-0.5, dim=0)
                torch.testing.assert_close(out[start + i, h].double(), w @ v[:seen, kv], rtol=tol, atol=tol)
        start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new", [[7, 3, 12], [700, 45, 1030]], ids=["short", "past-kernel-blocks"])
def test_fresh_prompts_plan_is_causal_and_equal_the_mask_plan_bitwise(dtype, new):
    """A batch with no cached prefix plans SDPA's is_causal (no mask); its rows are bit-identical to the
    explicit-mask plan of the same batch, also where the kernel skips whole key blocks above the diagonal."""
    pool, _, backend, fb, layer, q = _setup(dtype, 4, 2, [0] * len(new), new, seed=7, slots=2 * sum(new) + 8)
    with forward_context(ForwardContext(backend, pool, None)):
        backend.init_forward_metadata(fb)
        md = backend.forward_metadata
        assert md.causal and md.mask is None
        fast = backend.forward_extend(q, layer, fb)
        # The mask the prefixed path would build: causal, within each length, key 0 for padded rows.
        bs, max_q = fb.batch_size, md.max_q_len
        pos = torch.arange(max_q)
        valid = pos.view(1, max_q) < fb.seq_lens.view(bs, 1)  # [bs, max_kv]
        mask = (pos.view(1, 1, max_q) <= pos.view(1, max_q, 1)) & valid.view(bs, 1, max_q)
        mask[:, :, 0] = True
        md.mask, md.causal = mask.unsqueeze(1), False
        masked = backend.forward_extend(q, layer, fb)
    assert torch.equal(fast, masked)


def test_prefixed_batches_keep_the_mask_plan():
    """One cached prefix anywhere in the batch (a continued chunk, a prefix-cache hit) keeps the mask."""
    pool, _, backend, fb, layer, q = _setup(torch.float32, 4, 2, [0, 3, 0], [4, 2, 5], seed=3)
    backend.init_forward_metadata(fb)
    assert not backend.forward_metadata.causal and backend.forward_metadata.mask is not None
