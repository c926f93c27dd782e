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
@pytest.mark.parametrize("heads", [(1, 1), (4, 1), (7, 1), (14, 2), (8, 8)])
def test_kernel_matches_float64_softmax(op, dtype, d, heads):
    """Every (request, head): softmax(q.K * scale) V over its own seq_len slots, read in place; lengths on
    and off the 16-lane boundary; GQA groups of 1, 4 and 7 (two chunks of the kernel's 4 heads)."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, heads", [(64, (14, 2)), (128, (4, 4)), (16, (7, 1)), (96, (6, 2))])
def test_extend_is_bitwise_the_decode_op_per_token(op, dtype, d, heads):
    """Each new token of an extend gets exactly the bits the decode op gives it attended alone over its own
    prefix (so a sequence's KV does not depend on whether its tokens were prefilled or decoded): runs of
    1-3 new tokens, 4-8, long chunks, prefixes shared and not."""
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


@pytest.mark.parametrize("ext, message", [
    ([4, 5], r"extend_lens\[0\] = 4 is outside \[1, seq_lens\[0\] = 3\]"),
    ([0, 5], r"extend_lens\[0\] = 0 is outside"),
    ([1, 1], r"q has 8 rows but the requests' new tokens sum to 2"),
])
def test_extend_kernel_rejects_inconsistent_lengths(op, ext, message):
    """extend_lens that exceed a request's length or do not add up to q's rows are refused by name."""
    _, k, v, r2t, _, lens = _case(torch.float32, 64, 4, 2, [3, 5], seed=1)
    q = torch.randn(8, 4, 64)
    with pytest.raises(RuntimeError, match=message):
        op.paged_extend_attention(q, k, v, r2t, torch.tensor([0, 1]), lens, torch.tensor(ext), 0.125)


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


def test_the_ninja_package_is_found_off_path(monkeypatch):
    """torch runs `ninja` from PATH; with the environment's bin directory off PATH, the loader puts the ninja
    package's binary on it (the package is a dependency)."""
    import shutil

    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("ninja") is None
    cpu_kernels._put_ninja_on_path()
    assert shutil.which("ninja") is not None
