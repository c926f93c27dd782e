"""The CPU paged decode-attention kernel (runner/csrc/, runner/attention/cpu_decode.py) equals a float64 softmax over each
request's own slots, refuses bad input by name, and the Engine decodes with it as HF `generate` does."""

from __future__ import annotations

import logging
import pathlib

import pytest
import torch

from runner import cpu_kernels
from runner.attention import cpu_decode
from tests.needs import needs_cpu_kernels
from tests.rollout.oracle import EnginePool, hf_generate, random_prompts


@pytest.fixture(scope="module")
def op(cpu_ops):
    return cpu_ops  # tests/conftest.py


def _case(dtype, d, hq, hkv, lens, seed=0, slots_per_req=None, share_prefix=0):
    """A pool with scattered slots; requests on permuted req_to_token rows; the first `share_prefix` slots
    of every request are the same slots (n samples of one prompt)."""
    gen = torch.Generator().manual_seed(seed)
    bs, width = len(lens), max(lens) + 3
    num_slots = bs * width + 1
    k = torch.randn(num_slots, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_slots, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    r2t = torch.zeros(bs + 2, width, dtype=torch.int64)
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    for b in range(bs):
        r2t[rows[b], :width] = perm[b * width:(b + 1) * width]
        r2t[rows[b], :share_prefix] = perm[:share_prefix]
    q = torch.randn(bs, hq, d, generator=gen).to(dtype)
    return q, k, v, r2t, rows, torch.tensor(lens)


def _decode(ops, *args):
    """The decode entry point: one new token per request."""
    return cpu_decode.paged_attention(ops, *args[:-1], None, args[-1])


def _oracle(q, k, v, r2t, rows, lens, scale):
    bs, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.empty(bs, hq, d, dtype=torch.float64)
    for b in range(bs):
        slots = r2t[rows[b], :lens[b]]
        kb, vb = k[slots].double(), v[slots].double()  # [n, hkv, d]
        for h in range(hq):
            p = torch.softmax(kb[:, h // group] @ q[b, h].double() * scale, dim=0)
            out[b, h] = p @ vb[:, h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", cpu_decode.HEAD_DIMS)
@pytest.mark.parametrize("heads", [(1, 1), (4, 1), (6, 1), (7, 1), (14, 2), (16, 2), (10, 1), (8, 8)])
def test_kernel_matches_float64_softmax(op, dtype, d, heads):
    """Every (request, head): softmax(q.K * scale) V over its own seq_len slots, read in place; lengths on
    and off the 16-lane boundary; GQA groups of 1, 4, 6, 7, 8 and 10 (the decode's head chunks hold up to 8
    heads on AVX-512, 2 on AVX2: one chunk, a full one, and a full one plus a remainder)."""
    hq, hkv = heads
    q, k, v, r2t, rows, lens = _case(dtype, d, hq, hkv, [1, 15, 16, 17, 70], seed=d + hq, share_prefix=1)
    out = _decode(op, q, k, v, r2t, rows, lens, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    want = _oracle(q, k, v, r2t, rows, lens, d**-0.5)
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding (2^-8 relative)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_kernel_long_context_and_shared_prefix(op):
    """1000-key contexts, 900 keys shared by every request: each output still equals the oracle."""
    q, k, v, r2t, rows, lens = _case(torch.float32, 64, 14, 2, [1000, 950, 1000, 901], seed=3, share_prefix=900)
    out = _decode(op, q, k, v, r2t, rows, lens, 0.125)
    torch.testing.assert_close(out.double(), _oracle(q, k, v, r2t, rows, lens, 0.125), rtol=2e-6, atol=2e-6)


def test_kernel_softmax_extremes(op):
    """Scores ~1e4 apart give exactly the winning key's V row (the others underflow to 0, no NaN);
    equal scores give the mean of the V rows."""
    q, k, v, r2t, rows, lens = _case(torch.float32, 32, 4, 1, [40, 33], seed=5)
    out = _decode(op, q * 1e3, k, v, r2t, rows, lens, 1.0)
    want = _oracle(q * 1e3, k, v, r2t, rows, lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    flat = _decode(op, torch.zeros_like(q), k, v, r2t, rows, lens, 1.0)
    for b in range(2):
        mean = v[r2t[rows[b], :lens[b]]].double().mean(0)  # [hkv, d]
        torch.testing.assert_close(flat[b].double(), mean.expand(4, 32), rtol=1e-6, atol=1e-6)


def test_kernel_is_independent_of_the_batch(op):
    """A request's output bits are the same alone and in a batch (one work item per request and KV head)."""
    q, k, v, r2t, rows, lens = _case(torch.bfloat16, 64, 8, 2, [30, 64, 5], seed=9)
    batch = _decode(op, q, k, v, r2t, rows, lens, 0.125)
    for b in range(3):
        alone = _decode(op, q[b:b + 1], k, v, r2t, rows[b:b + 1], lens[b:b + 1], 0.125)
        assert torch.equal(alone[0], batch[b])


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(seq_lens=torch.tensor([0, 5])), r"seq_lens\[0\] = 0 is outside \[1, "),
    (lambda a: a.update(seq_lens=torch.tensor([3, 999])), r"seq_lens\[1\] = 999 is outside"),
    (lambda a: a.update(req_pool_indices=torch.tensor([0, 7])), r"req_pool_indices\[1\] = 7 is outside"),
    (lambda a: a["req_to_token"].__setitem__((0, 1), 10_000), r"request 0 has a KV slot outside the pool"),
    (lambda a: a.update(q=a["q"].double()), r"share one dtype"),
    (lambda a: a.update(q=a["q"].half(), k_cache=a["k_cache"].half(), v_cache=a["v_cache"].half()),
     r"not supported \(float32, bfloat16\)"),
    (lambda a: a.update(q=a["q"][..., :48].contiguous(), k_cache=a["k_cache"][..., :48].contiguous(),
                        v_cache=a["v_cache"][..., :48].contiguous()), r"head_dim 48 not compiled"),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)), r"contiguous"),
    (lambda a: a.update(req_to_token=a["req_to_token"].int()), r"req_to_token must be int64"),
    (lambda a: a.update(q=a["q"][:, :3].contiguous()), r"multiple of KV heads"),
])
def test_kernel_rejects_bad_input_by_name(op, change, message):
    """Each malformed argument is refused with a message naming it; the pool is not written."""
    q, k, v, r2t, rows, lens = _case(torch.float32, 64, 4, 2, [3, 5], seed=1)
    args = dict(q=q, k_cache=k, v_cache=v, req_to_token=r2t, req_pool_indices=torch.tensor([0, 1]), seq_lens=lens)
    args["req_to_token"] = r2t.clone()
    change(args)
    k_before = args["k_cache"].clone()
    with pytest.raises(RuntimeError, match=message):
        op.paged_decode_attention(args["q"], args["k_cache"], args["v_cache"], args["req_to_token"], args["req_pool_indices"],
           args["seq_lens"], 0.125)
    assert torch.equal(args["k_cache"], k_before)


def test_loader_falls_back_with_a_reason_or_raises_when_required(monkeypatch, caplog):
    """A CPU with neither AVX-512 nor AVX2 (nothing built) or a failed build: None and one log line saying
    why; required=True raises it; False never builds."""
    def broken():
        raise OSError("no compiler here")

    def never():
        raise AssertionError("built without a vector path")

    for isa, build, reason in [("avx2", broken, "no compiler here"), (None, never, "neither AVX-512")]:
        monkeypatch.setattr(cpu_kernels, "_state", {})
        monkeypatch.setattr(cpu_kernels, "_build", build)
        monkeypatch.setattr(cpu_kernels, "kernel_isa", lambda isa=isa: isa)
        with caplog.at_level(logging.INFO, logger="runner.cpu_kernels"):
            assert cpu_kernels.load() is None
        assert reason in caplog.text
        with pytest.raises(RuntimeError, match=f"cpu_kernels=True.*{reason}"):
            cpu_kernels.load(required=True)
        assert cpu_kernels.enabled(False, torch.device("cpu")) is None  # False never builds
        caplog.clear()


def test_build_step_says_which_path_or_why_not(monkeypatch, capsys):
    """`cpu_kernels.main()` (.ci/run's build step) names the vector path it built, or the reason the kernels
    are off, and does not raise either way."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "kernel_isa", lambda: None)
    cpu_kernels.main()
    assert "CPU kernels off" in capsys.readouterr().out and "neither AVX-512" in cpu_kernels._state["reason"]
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "kernel_isa", lambda: "avx2")
    monkeypatch.setattr(cpu_kernels, "_build", lambda: (object(), object()))
    cpu_kernels.main()
    assert "CPU kernels ready: the avx2 path" in capsys.readouterr().out


@pytest.fixture
def make_engine():
    pool = EnginePool()
    yield pool
    pool.close()


@needs_cpu_kernels
@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # head_dim 32 (and q/k norms) and head_dim 16
def test_engine_with_kernel_matches_hf_generate(make_engine, ckpt_factory, arch):
    """Greedy decode through the kernel gives HF generate's tokens, and logprobs within float rounding of
    both HF's and the engine's own gather + SDPA path, for a batch of unequal prompts."""
    from transformers import AutoModelForCausalLM

    path = ckpt_factory(arch)
    prompts = random_prompts([5, 17, 33], seed=4)
    params = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    with_kernel = make_engine(path, cpu_kernels=True)
    assert with_kernel.runner.attn_backend.decode_op is not None
    without = make_engine(path, cpu_kernels=False)
    assert without.runner.attn_backend.decode_op is None
    got = with_kernel.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    ref = without.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for prompt, out, base in zip(prompts, got, ref):
        hf_tokens, hf_lp = hf_generate(model, prompt, 24)
        assert out["output_ids"] == hf_tokens == base["output_ids"]
        lp = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        base_lp = [e[0] for e in base["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(hf_lp), rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(base_lp), rtol=0, atol=1e-5)


def test_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A lock file left by a build killed midway (older than STALE_LOCK_S) is removed, so the next load does
    not wait on it forever; a lock as young as a running build is left alone."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    lock = pathlib.Path(_get_build_directory("probe", False)) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    cpu_kernels._clear_stale_lock("probe")
    assert lock.exists()
    old = time.time() - cpu_kernels.STALE_LOCK_S - 10
    os.utime(lock, (old, old))
    cpu_kernels._clear_stale_lock("probe")
    assert not lock.exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_kernel_is_causal_over_prefix_and_new_tokens(op, dtype):
    """New token j of a request with p cached tokens equals the float64 softmax over its first p + j + 1
    slots: fresh prompts, a chunk after a long prefix, one-token extends, prefixes shared between requests."""
    lens, new = [40, 700, 3, 260], [40, 150, 1, 60]
    q, k, v, r2t, rows, seq = _case(dtype, 64, 14, 2, lens, seed=11, share_prefix=200)
    q = torch.randn(sum(new), 14, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = cpu_decode.paged_attention(op, q, k, v, r2t, rows, seq, torch.tensor(new), 0.125)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    start = 0
    for b, (n_all, n) in enumerate(zip(lens, new)):
        for j in range(n):
            seen = n_all - n + j + 1
            one = _oracle(q[start + j:start + j + 1], k, v, r2t, rows[b:b + 1], torch.tensor([seen]), 0.125)
            torch.testing.assert_close(out[start + j].double(), one[0], rtol=tol, atol=tol)
        start += n


@pytest.fixture
def sdpa_from(op):
    """Sets the extend's SDPA route threshold for one test (0: the kernel only), restoring the machine's own."""
    before = op.set_extend_sdpa_min_tokens(0)
    op.set_extend_sdpa_min_tokens(before)
    yield op.set_extend_sdpa_min_tokens
    op.set_extend_sdpa_min_tokens(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, heads", [(64, (14, 2)), (128, (4, 4)), (16, (7, 1)), (96, (6, 2)), (32, (10, 1))])
def test_extend_is_bitwise_the_decode_op_per_token(op, sdpa_from, dtype, d, heads):
    """On the kernel route, each new token of an extend gets exactly the bits the decode op gives it attended
    alone over its own prefix (so a sequence's KV does not depend on whether its tokens were prefilled or
    decoded): runs of 1-3 new tokens, 4-8, long chunks, prefixes shared and not."""
    sdpa_from(0)
    hq, hkv = heads
    lens, new = [40, 300, 3, 77, 19, 5], [40, 131, 2, 21, 4, 1]
    q, k, v, r2t, rows, seq = _case(dtype, d, hq, hkv, lens, seed=5, share_prefix=3)
    q = torch.randn(sum(new), hq, d, generator=torch.Generator().manual_seed(6)).to(dtype)
    out = cpu_decode.paged_attention(op, q, k, v, r2t, rows, seq, torch.tensor(new), 0.125)
    start = 0
    for b, (n_all, n) in enumerate(zip(lens, new)):
        for j in range(n):
            seen = torch.tensor([n_all - n + j + 1])
            one = _decode(op, q[start + j:start + j + 1], k, v, r2t, rows[b:b + 1], seen, 0.125)
            assert torch.equal(out[start + j], one[0]), f"request {b}, new token {j}"
        start += n


def _extend_oracle(q, k, v, r2t, rows, seq, new, scale):
    """Every new token's float64 softmax over its own first p + j + 1 slots: [num_tokens, hq, d]."""
    out, start = [], 0
    for b, (n_all, n) in enumerate(zip(seq.tolist(), new)):
        for j in range(n):
            seen = torch.tensor([n_all - n + j + 1])
            out.append(_oracle(q[start + j:start + j + 1], k, v, r2t, rows[b:b + 1], seen, scale)[0])
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("d, heads", [(64, (14, 2)), (128, (4, 4)), (32, (7, 1))])
def test_extend_sdpa_route_matches_float64_softmax(op, sdpa_from, d, heads):
    """bf16 extends of at least the threshold's new tokens go through torch's SDPA, the rest through the kernel,
    in one call: fresh prompts (causal), chunks after a cached prefix (the prefix fully visible), prefixes shared
    between requests, short extends beside long ones; every row equals the float64 oracle to bf16 rounding, and
    the short requests' rows are the kernel's bits."""
    hq, hkv = heads
    lens, new = [40, 300, 3, 260, 90], [40, 150, 1, 60, 90]
    q, k, v, r2t, rows, seq = _case(torch.bfloat16, d, hq, hkv, lens, seed=21, share_prefix=30)
    q = torch.randn(sum(new), hq, d, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    args = (q, k, v, r2t, rows, seq, torch.tensor(new), 0.125)
    sdpa_from(0)
    kernel = cpu_decode.paged_attention(op, *args)
    sdpa_from(50)  # requests 1, 3, 4 on SDPA; 0 (40 new) and 2 (1 new) on the kernel
    routed = cpu_decode.paged_attention(op, *args)
    assert routed.shape == q.shape and routed.dtype == torch.bfloat16
    torch.testing.assert_close(routed.double(), _extend_oracle(*args), rtol=1e-2, atol=1e-2)
    starts = [0, 40, 190, 191, 251]
    for b in (0, 2):
        rows_b = slice(starts[b], starts[b] + new[b])
        assert torch.equal(routed[rows_b], kernel[rows_b])
    assert not torch.equal(routed[40:190], kernel[40:190])  # request 1 did take the other route


def test_extend_sdpa_route_is_per_request_and_bf16_only(op, sdpa_from):
    """A request's extend output is the same bits alone as in any batch on the SDPA route too (the route
    depends on its own new-token count only), and fp32 extends always stay on the kernel."""
    lens, new = [200, 64, 130], [200, 10, 100]
    q, k, v, r2t, rows, seq = _case(torch.bfloat16, 64, 8, 2, lens, seed=12)
    q = torch.randn(sum(new), 8, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sdpa_from(64)
    batch = cpu_decode.paged_attention(op, q, k, v, r2t, rows, seq, torch.tensor(new), 0.125)
    start = 0
    for b, n in enumerate(new):
        alone = cpu_decode.paged_attention(op, q[start:start + n], k, v, r2t, rows[b:b + 1], seq[b:b + 1],
                                           torch.tensor([n]), 0.125)
        assert torch.equal(alone, batch[start:start + n]), f"request {b}"
        start += n
    q32, k32, v32 = q.float(), k.float(), v.float()
    on = cpu_decode.paged_attention(op, q32, k32, v32, r2t, rows, seq, torch.tensor(new), 0.125)
    sdpa_from(0)
    assert torch.equal(on, cpu_decode.paged_attention(op, q32, k32, v32, r2t, rows, seq, torch.tensor(new), 0.125))


def test_extend_after_a_long_prefix_keeps_the_kernel_over_the_mask_cap(op, sdpa_from):
    """A prefixed extend whose [new tokens, seq_len] mask would pass 2^24 elements (200 new tokens after 84,000
    cached) stays on the kernel: its rows are the kernel's bits, and match the oracle; a fresh extend needs no
    mask and takes SDPA at any length."""
    gen = torch.Generator().manual_seed(17)
    hq, hkv, d, prefix, n = 2, 1, 16, 84_000, 200
    k = torch.randn(prefix + n + 1, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(prefix + n + 1, hkv, d, generator=gen).to(torch.bfloat16)
    r2t = torch.arange(1, prefix + n + 1).unsqueeze(0)
    q = torch.randn(n, hq, d, generator=gen).to(torch.bfloat16)
    args = (q, k, v, r2t, torch.tensor([0]), torch.tensor([prefix + n]), torch.tensor([n]), 0.25)
    sdpa_from(0)
    kernel = cpu_decode.paged_attention(op, *args)
    sdpa_from(16)
    assert torch.equal(cpu_decode.paged_attention(op, *args), kernel)
    rows = slice(n - 3, n)  # the oracle on the last rows only: 84k keys each
    sub = (q[rows], k, v, r2t, torch.tensor([0]), torch.tensor([prefix + n]), [3], 0.25)
    torch.testing.assert_close(kernel[rows].double(), _extend_oracle(*sub), rtol=1e-2, atol=1e-2)
    fresh = (q, k, v, r2t, torch.tensor([0]), torch.tensor([n]), torch.tensor([n]), 0.25)
    sdpa_from(0)
    fresh_kernel = cpu_decode.paged_attention(op, *fresh)
    sdpa_from(16)
    assert not torch.equal(cpu_decode.paged_attention(op, *fresh), fresh_kernel)  # no mask: SDPA takes it


def test_extend_sdpa_threshold_setting_and_machine_default(op, sdpa_from, monkeypatch):
    """The threshold op returns the previous value and refuses a negative one by name; the loader turns the
    route on (at EXTEND_SDPA_MIN_TOKENS) only on a CPU with AMX tiles and native bf16."""
    sdpa_from(7)
    assert sdpa_from(9) == 7
    with pytest.raises(RuntimeError, match="min_tokens must be >= 0"):
        sdpa_from(-1)
    assert sdpa_from(9) == 9
    for amx, bf16, want in [(True, True, cpu_kernels.EXTEND_SDPA_MIN_TOKENS), (False, True, 0), (True, False, 0)]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda bf16=bf16: bf16)
        assert cpu_kernels.extend_sdpa_min_tokens() == want


@pytest.mark.parametrize("sdpa_min", [0, 2])
@pytest.mark.parametrize("ext, message", [
    ([4, 5], r"extend_lens\[0\] = 4 is outside \[1, seq_lens\[0\] = 3\]"),
    ([0, 5], r"extend_lens\[0\] = 0 is outside"),
    ([1, 1], r"q has 8 rows but the requests' new tokens sum to 2"),
])
def test_extend_kernel_rejects_inconsistent_lengths(op, sdpa_from, sdpa_min, ext, message):
    """extend_lens that exceed a request's length or do not add up to q's rows, and slots outside the pool, are
    refused by name before any work, on either route (bf16 with the SDPA route on, fp32)."""
    sdpa_from(sdpa_min)
    for dtype in (torch.float32, torch.bfloat16):
        _, k, v, r2t, _, lens = _case(dtype, 64, 4, 2, [3, 5], seed=1)
        q = torch.randn(8, 4, 64).to(dtype)
        with pytest.raises(RuntimeError, match=message):
            op.paged_extend_attention(q, k, v, r2t, torch.tensor([0, 1]), lens, torch.tensor(ext), 0.125)
        r2t[1, 2] = 10_000
        with pytest.raises(RuntimeError, match="request 1 has a KV slot outside the pool"):
            op.paged_extend_attention(q, k, v, r2t, torch.tensor([0, 1]), lens, torch.tensor([3, 5]), 0.125)


@needs_cpu_kernels
def test_engine_fp16_model_keeps_torch_ops_where_no_kernel_exists(make_engine, ckpt_factory):
    """An fp16 model (no fp16 kernels) decodes on torch's attention and norm with the kernels loaded, giving
    the tokens and logprobs of the engine with them off."""
    path = ckpt_factory("qwen3")
    params = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([6, 11], seed=5)
    outs = []
    for setting in (True, False):
        engine = make_engine(path, dtype="float16", cpu_kernels=setting)
        outs.append(engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True))
    for on, off in zip(*outs):
        assert on["output_ids"] == off["output_ids"]
        assert on["meta_info"]["output_token_logprobs"] == off["meta_info"]["output_token_logprobs"]


@needs_cpu_kernels
def test_engine_kernel_path_equals_sdpa_path_under_chunking_sharing_and_sampling(make_engine, ckpt_factory):
    """Small prefill chunks (prefixed extends), prompts that share prefixes (prefix-cache hits), n=3 seeded
    samples per prompt and mixed lengths: the kernel path gives the SDPA path's tokens, logprobs to float
    rounding."""
    path = ckpt_factory("qwen3")
    base = random_prompts([40], seed=8)[0]
    prompts = [base + tail for tail in random_prompts([3, 9, 1], seed=9)] + random_prompts([70, 2], seed=10)
    params = dict(max_new_tokens=20, temperature=0.8, n=3, seed=11, ignore_eos=True)
    outs = []
    for setting in (True, False):
        engine = make_engine(path, cpu_kernels=setting, chunked_prefill_size=16)
        outs.append(engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True))
    assert len(outs[0]) == len(prompts) * 3
    for on, off in zip(*outs):
        assert on["output_ids"] == off["output_ids"]
        lp_on = [e[0] for e in on["meta_info"]["output_token_logprobs"]]
        lp_off = [e[0] for e in off["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(lp_on), torch.tensor(lp_off), rtol=0, atol=1e-4)
    assert any(o["meta_info"]["cached_tokens"] > 0 for o in outs[0])  # the shared prefix was reused


@needs_cpu_kernels
def test_engine_sdpa_extend_route_scores_prompts_as_the_fp32_oracle(make_engine, ckpt_factory, sdpa_from):
    """A bf16 engine with the SDPA extend route on (forced at 16 tokens here, whatever the CPU), fresh prompts
    and 48-token chunks after a cached prefix: every prompt token's logprob is within bf16 noise of HF's fp32
    forward over the same (bf16-valued) weights, as close as the kernel route is."""
    from transformers import AutoModelForCausalLM

    path = ckpt_factory("qwen3", dtype=torch.bfloat16, hidden_size=128)
    prompts = random_prompts([150, 20, 97], seed=13)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    errors = {}
    for route_from in (16, 0):
        sdpa_from(route_from)
        engine = make_engine(path, dtype="bfloat16", chunked_prefill_size=48)
        outs = engine.generate(input_ids=prompts, sampling_params=dict(max_new_tokens=1, temperature=0.0),
                               return_logprob=True, logprob_start_len=0)
        worst = 0.0
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)
            got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]  # position p scores p + 1
            ref = [want[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]
            worst = max(worst, (torch.tensor(got) - torch.tensor(ref)).abs().max().item())
        errors[route_from] = worst
        engine.shutdown()
    print(f"max |logprob - fp32 oracle|: SDPA route {errors[16]:.4f}, kernel route {errors[0]:.4f}")
    assert errors[16] < 0.5 and errors[16] <= 1.5 * errors[0] + 0.02


def test_the_ninja_package_is_found_off_path(monkeypatch):
    """torch runs `ninja` from PATH; with the environment's bin directory off PATH, the loader puts the ninja
    package's binary on it (the package is a dependency)."""
    import shutil

    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("ninja") is None
    cpu_kernels._put_ninja_on_path()
    assert shutil.which("ninja") is not None
