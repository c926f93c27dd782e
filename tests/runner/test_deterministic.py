"""Deterministic inference (issue 15): with enable_deterministic_inference=True a request's output ids
and logprobs are bitwise equal alone, in batches of 1/3/8/17, under chunked prefill, with the prefix
cache on or off, under forced retraction, and across engines; the batch-invariant ops themselves keep
a row's bits whatever surrounds it and agree with the default ops to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner import batch_invariant
from runner.config import RunnerConfig
from tests.rollout.oracle import EnginePool, random_prompts

DTYPES = ["float32", "bfloat16"]


def _row_results(fn, target: torch.Tensor, counts=(1, 3, 8, 17, 40)) -> list[torch.Tensor]:
    """fn's output row for `target` placed at a middle row of batches of random rows."""
    g = torch.Generator().manual_seed(0)
    outs = []
    for n in counts:
        x = torch.randn(n, *target.shape, generator=g).to(target.dtype)
        x[n // 2] = target
        outs.append(fn(x)[n // 2])
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_is_batch_invariant_and_matches_f_linear(dtype):
    """batch_invariant.linear gives one row the same bits in any batch, and equals F.linear to rounding."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    target = torch.randn(64, generator=g).to(dtype)
    outs = _row_results(lambda x: batch_invariant.linear(x, w, b), target)
    assert all(torch.equal(o, outs[0]) for o in outs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), F.linear(target[None], w, b)[0].float(), atol=tol * 10, rtol=tol)


def _sdpa_reference(q, k, v, pos, scaling):
    """Naive causal attention of one token (float64): q [hq, d], k/v [L, hkv, d]."""
    group = q.shape[0] // k.shape[1]
    keys = k[: pos + 1].double().repeat_interleave(group, dim=1)  # [pos+1, hq, d]
    vals = v[: pos + 1].double().repeat_interleave(group, dim=1)
    w = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), keys) * scaling, dim=-1)
    return torch.einsum("hl,lhd->hd", w, vals)


def test_attention_token_is_batch_invariant_and_matches_naive():
    """A token's attention output has the same bits whatever other tokens/requests share the call, and
    equals naive softmax attention; keys past its position (same block or later blocks) change nothing."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, slots = 4, 2, 16, 600
    k_all = torch.randn(slots, hkv, d, generator=g)
    v_all = torch.randn(slots, hkv, d, generator=g)
    q0 = torch.randn(hq, d, generator=g)
    own = torch.randperm(slots, generator=g)[:150]  # the request's KV slots, spanning 3 blocks
    pos0 = 100
    outs = []
    for num_tokens, width in ((1, 101), (3, 150), (17, 150), (40, 300)):
        q = torch.randn(num_tokens, hq, d, generator=g)
        q[0] = q0
        rows = torch.randint(0, slots, (num_tokens, width), generator=g)
        rows[0, : min(width, 150)] = own[:width]
        positions = torch.randint(0, width, (num_tokens,), generator=g)
        positions[0] = pos0
        outs.append(batch_invariant.attention(q, k_all, v_all, rows, torch.arange(num_tokens), positions, 0.3)[0])
    assert all(torch.equal(o, outs[0]) for o in outs)
    ref = _sdpa_reference(q0, k_all[own], v_all[own], pos0, 0.3)
    torch.testing.assert_close(outs[0].double(), ref, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_matches_default():
    """The tail-safe SiLU equals F.silu * up to rounding (the engine's default activation)."""
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(3)) * 4
    with batch_invariant.mode(True):
        from runner.layers.activation import silu_and_mul

        got = silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=1e-5)


def test_mode_is_per_thread_and_restored():
    """mode() is scoped: off outside, restored after nesting, invisible to other threads."""
    import threading

    seen = []
    assert not batch_invariant.is_enabled()
    with batch_invariant.mode(True):
        t = threading.Thread(target=lambda: seen.append(batch_invariant.is_enabled()))
        t.start()
        t.join(timeout=10)
        with batch_invariant.mode(False):
            assert not batch_invariant.is_enabled()
        assert batch_invariant.is_enabled()
    assert seen == [False] and not batch_invariant.is_enabled()


def test_config_turns_off_row_count_dependent_paths(tiny_llama):
    """Deterministic mode turns off prepacked linears, captured decode and the engine's CPU kernels (the
    deterministic trainer recomputes logprobs with torch's ops), and refuses flashinfer."""
    cfg = RunnerConfig(str(tiny_llama), enable_deterministic_inference=True, cuda_graph_bs=[1, 2])
    assert (cfg.cpu_prepack, cfg.cuda_graph_bs, cfg.disable_cuda_graph, cfg.attention_backend, cfg.cpu_kernels) == \
        (False, None, True, "torch_native", False)
    with pytest.raises(ValueError, match="attention_backend='flashinfer'.*torch_native"):
        RunnerConfig(str(tiny_llama), enable_deterministic_inference=True, attention_backend="flashinfer")


# ---- the engine: bitwise equal outputs under every scheduling ------------------------------------------
SAMPLINGS = [
    {"temperature": 1.0},
    {"temperature": 0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.2, "top_k": 20},
    {"temperature": 0.7, "min_p": 0.05},
]


def _workload():
    """17 requests: lengths 3..90 (some over one 64-key block), a shared 40-token prefix, mixed sampling."""
    prompts = random_prompts([5, 90, 12, 33, 70, 8, 21, 40, 3, 66, 17, 9, 50], seed=21)
    shared = random_prompts([40], seed=22)[0]
    prompts += [shared + [7, 8, 9], shared + [10, 11], shared, prompts[4]]
    params = [{**SAMPLINGS[i % len(SAMPLINGS)], "max_new_tokens": 6 + (5 * i) % 13, "ignore_eos": True,
               "seed": 300 + i} for i in range(len(prompts))]
    return prompts, params


def _ids_and_logprobs(out: dict) -> tuple[list[int], torch.Tensor]:
    return out["output_ids"], torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def _assert_bitwise(outs: list[dict], refs: list[dict], what: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs)):
        ids, lps = _ids_and_logprobs(out)
        ref_ids, ref_lps = _ids_and_logprobs(ref)
        assert ids == ref_ids, f"{what}: request {i} ids"
        assert torch.equal(lps, ref_lps), f"{what}: request {i} logprobs differ by {(lps - ref_lps).abs().max()}"


@pytest.fixture(scope="module", params=DTYPES)
def det_setup(request, tiny_llama):
    """(pool, dtype, solo outputs): each request alone on a deterministic engine, no cache, no chunking."""
    pool = EnginePool()
    dtype = request.param
    engine = pool(tiny_llama, enable_deterministic_inference=True, dtype=dtype, disable_radix_cache=True)
    prompts, params = _workload()
    solo = [engine.generate(input_ids=p, sampling_params=sp, return_logprob=True) for p, sp in zip(prompts, params)]
    yield pool, dtype, solo
    pool.close()


def test_batch_sizes_equal_solo_bitwise(tiny_llama, det_setup):
    """Batches of 1, 3, 8 and 17 requests: every id and logprob is bitwise the solo one (fp32 and bf16)."""
    pool, dtype, solo = det_setup
    engine = pool(tiny_llama, enable_deterministic_inference=True, dtype=dtype, disable_radix_cache=True)
    prompts, params = _workload()
    for bs in (1, 3, 8, 17):
        for start in range(0, len(prompts), bs):
            idx = list(range(start, min(start + bs, len(prompts))))
            outs = engine.generate(input_ids=[prompts[i] for i in idx], sampling_params=[params[i] for i in idx],
                                   return_logprob=True)
            _assert_bitwise(outs, [solo[i] for i in idx], f"bs={bs}")


@pytest.mark.parametrize("chunk,cache", [(7, False), (16, True), (64, True), (33, False)])
def test_chunked_cached_retracted_equal_solo_bitwise(tiny_llama, det_setup, chunk, cache):
    """Chunked prefill (7/16/33/64), prefix cache on/off and forced retractions change no bit."""
    pool, dtype, solo = det_setup
    engine = pool(tiny_llama, enable_deterministic_inference=True, dtype=dtype, chunked_prefill_size=chunk,
                  max_total_tokens=160, disable_radix_cache=not cache)
    prompts, params = _workload()
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    _assert_bitwise(outs, solo, f"chunk={chunk} cache={cache}")
    info = engine.get_server_info()
    assert info["num_retractions"] > 0, "the pool was meant to be too small for the batch"
    if cache:
        assert any(o["meta_info"]["cached_tokens"] > 0 for o in outs)


def test_fresh_engine_same_seed_same_bits(tiny_llama, det_setup):
    """A fresh deterministic engine (another random_seed) reproduces the seeded requests bit for bit."""
    pool, dtype, solo = det_setup
    engine = pool(tiny_llama, enable_deterministic_inference=True, dtype=dtype, random_seed=99)
    prompts, params = _workload()
    outs = engine.generate(input_ids=prompts[:5], sampling_params=params[:5], return_logprob=True)
    _assert_bitwise(outs, solo[:5], "fresh engine")


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_decode_logprobs_equal_prefill_scoring_bitwise(tiny_llama, det_setup, temperature):
    """A generated token's logprob is bitwise the one a prefill scoring of the whole sequence gives it
    (logprob_start_len at the prompt's end, the request's temperature; greedy reports temperature 1),
    greedy rows included, and the top logprobs too."""
    pool, dtype, _ = det_setup
    engine = pool(tiny_llama, enable_deterministic_inference=True, dtype=dtype, disable_radix_cache=True)
    prompt = [5, 9, 13, 17, 21, 25]
    sp = dict(temperature=temperature, max_new_tokens=10, ignore_eos=True, seed=4)
    out = engine.generate(input_ids=prompt, sampling_params=sp, return_logprob=True, top_logprobs_num=3)
    gen = out["output_ids"]
    scored = engine.generate(input_ids=prompt + gen, sampling_params=dict(temperature=temperature or 1.0,
                                                                         max_new_tokens=0),
                             return_logprob=True, top_logprobs_num=3, logprob_start_len=len(prompt) - 1)
    decode = out["meta_info"]["output_token_logprobs"]
    prefill = scored["meta_info"]["input_token_logprobs"][1:]  # the first entry (the prompt's last) is None
    assert [t for _, t, _ in prefill] == gen
    assert [lp for lp, _, _ in prefill] == [lp for lp, _, _ in decode]  # bitwise: == on Python floats
    assert scored["meta_info"]["input_top_logprobs"][1:] == out["meta_info"]["output_top_logprobs"]


def test_deterministic_engine_agrees_with_default_engine(tiny_llama):
    """The deterministic ops compute the same model: greedy ids equal the default engine's, logprobs to 1e-4."""
    pool = EnginePool()
    try:
        det = pool(tiny_llama, enable_deterministic_inference=True)
        default = pool(tiny_llama)
        prompts, _ = _workload()
        sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        outs = det.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
        refs = default.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    finally:
        pool.close()
    for out, ref in zip(outs, refs):
        ids, lps = _ids_and_logprobs(out)
        ref_ids, ref_lps = _ids_and_logprobs(ref)
        assert ids == ref_ids
        torch.testing.assert_close(lps, ref_lps, atol=1e-4, rtol=0)
