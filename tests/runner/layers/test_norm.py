"""RMSNorm's CPU kernel (runner/csrc/rms_norm.cpp) computes transformers' RMSNorm: equal to a float64 oracle
within fp32 rounding, to torch's path within one bf16 ulp, and the residual add bit for bit; the module
uses it only where the runner enabled it and never under rl_on_policy_target="fsdp"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner import hf_numerics
from runner.layers.norm import RMSNorm
from tests.needs import needs_cpu_kernels


@pytest.fixture(scope="module")
def ops(cpu_ops):
    return cpu_ops  # tests/conftest.py


def _hf(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, verbatim in its arithmetic."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    return x, r, (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)


SHAPES = [(16, 512), (16, 896), (1, 17), (5, 100), (3, 7, 32), (4096, 64)]  # 4096 rows: the threaded path


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_matches_float64_oracle(ops, shape):
    """fp32: within a few ulps of the float64 computation of weight * x / sqrt(mean(x^2) + eps)."""
    x, r, w = _inputs(shape, torch.float32, len(shape) * shape[-1])
    want = w.double() * (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6).double(), want, rtol=2e-6, atol=1e-6)
    normed, residual = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(residual, r + x)
    s = (r + x).double()
    want = w.double() * (s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(normed.double(), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bf16_matches_transformers_within_one_ulp(ops, shape):
    """bf16: HF's fp32 norm, rounded, times the bf16 weight; off by at most one bf16 ulp where the fp32
    variance rounds the other way, and the residual is HF's bf16 add bit for bit."""
    x, r, w = _inputs(shape, torch.bfloat16, shape[-1])
    for got, ref in [(ops.rms_norm(x, w, 1e-5), _hf(x, w, 1e-5)), (ops.add_rms_norm(x, r, w, 1e-5)[0], _hf(r + x, w, 1e-5))]:
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        ulp = ref.float().abs().clamp_min(1e-30) * 2.0**-7
        assert ((got.float() - ref.float()).abs() <= ulp).all()
        assert (got == ref).float().mean() > 0.99
    assert torch.equal(ops.add_rms_norm(x, r, w, 1e-5)[1], r + x)


def test_strided_input_and_non_finite_values(ops):
    """A head view out of a fused qkv (not contiguous) and rows with inf/NaN give what torch's path gives."""
    qkv = torch.randn(4, 3 * 64)
    q = qkv[:, :128].view(4, 2, 64)
    w = torch.rand(64) + 0.5
    torch.testing.assert_close(ops.rms_norm(q, w, 1e-6), F.rms_norm(q, (64,), w, 1e-6), rtol=2e-6, atol=1e-6)
    x = torch.randn(3, 32)
    x[0, 3], x[1, 5] = float("inf"), float("nan")
    got, want = ops.rms_norm(x, torch.ones(32), 1e-6), F.rms_norm(x, (32,), torch.ones(32), 1e-6)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got[2], want[2])


@pytest.mark.parametrize("call, message", [
    (lambda o: o.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-6), r"weight \[9\] does not match x's last dimension 8"),
    (lambda o: o.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6), r"both be float32 or both bfloat16"),
    (lambda o: o.rms_norm(torch.randn(2, 8).half(), torch.ones(8).half(), 1e-6), r"both be float32 or both bfloat16"),
    (lambda o: o.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6), r"residual .* must match x"),
])
def test_rejects_mismatched_input_by_name(ops, call, message):
    """A weight, dtype or residual that does not fit is refused with a message naming it."""
    with pytest.raises(RuntimeError, match=message):
        call(ops)


def test_module_uses_the_kernel_only_where_enabled(ops, monkeypatch):
    """RMSNorm calls the kernel when the runner set cpu_ops, and torch's path without it, for a dtype the
    weight does not share, under rl_on_policy_target's HF numerics, and when autograd records the call."""
    calls = []
    recording = type("Rec", (), {"rms_norm": lambda self, *a: calls.append("norm") or ops.rms_norm(*a),
                                 "add_rms_norm": lambda self, *a: calls.append("add") or ops.add_rms_norm(*a)})()
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32) + 0.5)
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    with torch.no_grad():
        plain, (plain_n, plain_r) = norm(x), norm(x, r)
        norm.cpu_ops = recording
        got, (got_n, got_r) = norm(x), norm(x, r)
    assert calls == ["norm", "add"]
    torch.testing.assert_close(got, plain, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got_n, plain_n, rtol=2e-6, atol=1e-6)
    assert torch.equal(got_r, plain_r)
    with hf_numerics.mode(), torch.no_grad():
        assert torch.equal(norm(x), plain)
    with torch.no_grad():
        norm(x.double())  # the weight is fp32: torch's path
        half = RMSNorm(32, 1e-6).half()
        half.cpu_ops = recording
        torch.testing.assert_close(half(x.half()), F.rms_norm(x.half(), (32,), half.weight, 1e-6))  # no fp16 kernel
    assert calls == ["norm", "add"]
    xg = x.clone().requires_grad_()
    norm(xg).sum().backward()  # a trainer differentiating through the module: torch's path, with grads
    assert calls == ["norm", "add"] and xg.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        norm(x)
    assert calls == ["norm", "add", "norm"]


@pytest.mark.parametrize("setting, target, on", [
    pytest.param(None, None, True, marks=needs_cpu_kernels), pytest.param(True, None, True, marks=needs_cpu_kernels),
    (False, None, False), (None, "fsdp", False)])
def test_runner_enables_kernels_per_config(tiny_qwen3, setting, target, on):
    """Every RMSNorm of the model (q/k norms included) and its rotary get the kernels exactly when cpu_kernels
    allows and rl_on_policy_target does not ask for torch's ops."""
    from tests.runner.driver import make_runner

    runner = make_runner(tiny_qwen3, cpu_kernels=setting, rl_on_policy_target=target)
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 * runner.model_config.num_hidden_layers + 1  # input, post-attention, q, k; final
    assert all((m.cpu_ops is not None) == on for m in norms)
    assert (runner.model.model.rotary_emb.cpu_ops is not None) == on  # the fused rotary too
    assert (runner.attn_backend.decode_op is not None) == (on and target is None)
