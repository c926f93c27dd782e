"""Rotary embedding: the sign-folded roll form equals HF's rotate_half form, and the CPU kernel
(runner/csrc/rotary.cpp) equals that torch expression bit for bit, also on strided q|k views."""

from __future__ import annotations

import pytest
import torch

from runner.layers.rotary import RotaryEmbedding, rotate_half
from tests.needs import needs_cpu_kernels


@pytest.fixture(scope="module")
def ops(cpu_ops):
    return cpu_ops  # tests/conftest.py


def _case(dtype, n, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    rot = RotaryEmbedding(d, 4096, 10000.0, None)
    qkv = torch.randn(n, (h + 2) * d, generator=g).to(dtype)
    x = qkv[:, : h * d].view(n, h, d)  # a view with the fused projection's row stride, as the model has
    pos = torch.randint(0, 4096, (n,), generator=g)
    return rot, x, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roll_form_equals_hf_rotate_half(dtype):
    """x * cos + roll(x) * sin_signed is HF's q * cos + rotate_half(q) * sin, bitwise (the torch path)."""
    rot, x, pos = _case(dtype, 9, 3, 64, 1)
    cos, sin_signed = rot.cos_sin(pos, dtype)
    hf = x * rot.cos_cached[pos].to(dtype).unsqueeze(1) + rotate_half(x) * rot.sin_cached[pos].to(dtype).unsqueeze(1)
    assert torch.equal(rot.apply_one(x, cos, sin_signed), hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 16, 64), (2048, 16, 64), (3, 5, 32), (7, 3, 80), (4, 2, 128), (1, 1, 16)], ids=str)
def test_kernel_is_bitwise_the_torch_expression(ops, dtype, shape):
    """Every element of the kernel's output is the torch expression's (products rounded, then the sum)."""
    n, h, d = shape
    rot, x, pos = _case(dtype, n, h, d, n * h + d)
    cos, sin_signed = rot.cos_sin(pos, dtype)
    got = ops.rotary(x, cos, sin_signed)
    assert got.is_contiguous() and got.shape == x.shape
    assert torch.equal(got, x * cos + x.roll(d // 2, -1) * sin_signed)


@needs_cpu_kernels
def test_module_uses_the_kernel_only_where_it_may(ops):
    """With cpu_ops set, apply_one runs the kernel (same bits); under autograd, or for fp16, torch's ops."""
    rot, x, pos = _case(torch.float32, 5, 4, 32, 3)
    cos, sin_signed = rot.cos_sin(pos, torch.float32)
    calls = []
    rot.cpu_ops = type("Rec", (), {"rotary": lambda self, *a: calls.append(1) or ops.rotary(*a)})()
    with torch.no_grad():
        plain = x * cos + x.roll(16, -1) * sin_signed
        assert torch.equal(rot.apply_one(x, cos, sin_signed), plain) and calls == [1]
        h16 = x.half()
        c16, s16 = rot.cos_sin(pos, torch.float16)
        rot.apply_one(h16, c16, s16)
    xg = x.detach().clone().requires_grad_()
    rot.apply_one(xg, cos, sin_signed).sum().backward()
    assert calls == [1] and xg.grad is not None


def test_kernel_rejects_mismatched_tables(ops):
    """cos/sin for another token count or dtype, or an odd head_dim, are refused by name."""
    rot, x, pos = _case(torch.float32, 4, 2, 32, 5)
    cos, sin_signed = rot.cos_sin(pos, torch.float32)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[num_tokens, 1, head_dim\] = \[3, 1, 32\]"):
        ops.rotary(x[:3], cos, sin_signed)
    with pytest.raises(RuntimeError, match=r"in x's dtype"):
        ops.rotary(x, cos.bfloat16(), sin_signed)
    with pytest.raises(RuntimeError, match=r"head_dim 31 must be even"):
        ops.rotary(torch.randn(4, 2, 31), torch.randn(4, 1, 31), torch.randn(4, 1, 31))
