"""Deterministic inference on MoE models: the expert path is batch-invariant, so a request's ids and
logprobs are bitwise equal alone and in batches of 3/8/17 (Qwen3-MoE fp32/bf16, Mixtral), as the dense path
is in test_deterministic.py; the batch-invariant expert math equals the default path to rounding."""

from __future__ import annotations

import pytest
import torch

from runner import batch_invariant
from runner.layers.moe import fused_experts, select_experts
from tests.moe_checkpoints import make_moe_checkpoint
from tests.rollout.oracle import EnginePool
from tests.runner.test_deterministic import _assert_bitwise, _workload


def test_fused_experts_row_is_batch_invariant_and_matches_default():
    """One token's expert output has the same bits among 0..39 other tokens (which change every expert's
    group size), and equals the default grouped path to rounding."""
    g = torch.Generator().manual_seed(5)
    num_experts, hidden, inter, top_k = 8, 48, 40, 2
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.1
    gate = torch.randn(num_experts, hidden, generator=g)
    target = torch.randn(hidden, generator=g)
    outs = []
    for n in (1, 3, 8, 17, 40):
        x = torch.randn(n, hidden, generator=g)
        x[n // 2] = target
        with batch_invariant.mode(True):
            weights, ids = select_experts(batch_invariant.linear(x, gate), top_k, True)
            outs.append(fused_experts(x, w13, w2, weights, ids)[n // 2])
    assert all(torch.equal(o, outs[0]) for o in outs), max((o - outs[0]).abs().max().item() for o in outs)
    weights, ids = select_experts(target[None] @ gate.t(), top_k, True)
    torch.testing.assert_close(outs[0], fused_experts(target[None], w13, w2, weights, ids)[0], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=[("qwen3_moe", "float32"), ("qwen3_moe", "bfloat16"), ("mixtral", "float32")],
                ids=lambda p: "-".join(p))
def moe_det(request, tmp_path_factory):
    """(pool, checkpoint, solo outputs): each request alone on a deterministic MoE engine."""
    arch, dtype = request.param
    path = make_moe_checkpoint(tmp_path_factory.mktemp(f"det-{arch}"), arch)
    pool = EnginePool()
    engine = pool(path, enable_deterministic_inference=True, disable_radix_cache=True, dtype=dtype)
    prompts, params = _workload()
    solo = [engine.generate(input_ids=p, sampling_params=sp, return_logprob=True) for p, sp in zip(prompts, params)]
    yield pool, path, solo, dtype
    pool.close()


def test_moe_batch_sizes_equal_solo_bitwise(moe_det):
    """Batches of 3, 8 and 17 requests on an MoE model: every id and logprob is bitwise the solo one."""
    pool, path, solo, dtype = moe_det
    engine = pool(path, enable_deterministic_inference=True, disable_radix_cache=True, dtype=dtype)
    prompts, params = _workload()
    for bs in (3, 8, 17):
        for start in range(0, len(prompts), bs):
            idx = list(range(start, min(start + bs, len(prompts))))
            outs = engine.generate(input_ids=[prompts[i] for i in idx], sampling_params=[params[i] for i in idx],
                                   return_logprob=True)
            _assert_bitwise(outs, [solo[i] for i in idx], f"bs={bs}")


def test_moe_chunked_prefill_equals_solo_bitwise(moe_det):
    """Chunked prefill (chunks of 16 tokens mixing requests) changes no bit on an MoE model."""
    pool, path, solo, dtype = moe_det
    engine = pool(path, enable_deterministic_inference=True, chunked_prefill_size=16, disable_radix_cache=True,
                  dtype=dtype)
    prompts, params = _workload()
    _assert_bitwise(engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True), solo, "chunk=16")
