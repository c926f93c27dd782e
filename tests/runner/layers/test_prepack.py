"""The CPU prepacked-linear fast path (fp32, bf16 native or as an fp32 shadow) is an accelerator only: outputs match the plain path, and
no weight write can leave a stale packed copy behind."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rollout import Engine
from runner.layers import prepack
from runner.layers.ops import GatedPacked

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _run(engine):
    engine.flush_cache()
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SP, return_logprob=True)
    return [o["output_ids"] for o in outs], torch.tensor(
        [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs])


def _packed(engine) -> list[bool]:
    flags = [m.packed is not None for m in prepack.packable_modules(engine.runner.model)]
    assert flags, "no packable module: the test would prove nothing"
    return flags


@pytest.fixture(autouse=True)
def pack_tiny_layers(monkeypatch):
    """The tiny test models are below the size threshold; pack every linear here."""
    monkeypatch.setattr(prepack, "MIN_PACK_NUMEL", 0)


def test_prepacked_equals_plain_linear(ckpt_factory):
    """Greedy tokens are equal and logprobs within 1e-5 with and without prepacking."""
    path = ckpt_factory("qwen2")
    with Engine(str(path), show_progress=False) as packed, \
            Engine(str(path), show_progress=False, cpu_prepack=False) as plain:
        assert all(_packed(packed)) and not any(_packed(plain))
        (ids_a, lp_a), (ids_b, lp_b) = _run(packed), _run(plain)
        assert ids_a == ids_b
        assert torch.allclose(lp_a, lp_b, atol=1e-5)


def test_updates_and_release_never_leave_stale_packs(ckpt_factory):
    """A subset update repacks exactly what it wrote; release drops the packs; resume with backup
    repacks; after each step the engine equals one that never prepacks."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    sd_b = load_file(str(b / "model.safetensors"))
    subset = [(n, t) for n, t in sd_b.items() if ".layers.1." in n or n == "lm_head.weight"]
    kw = dict(show_progress=False, enable_memory_saver=True, enable_weights_cpu_backup=True)
    with Engine(str(a), **kw) as packed, Engine(str(a), cpu_prepack=False, **kw) as plain:
        for engine in (packed, plain):
            assert engine.update_weights_from_tensor(subset)[0]
        assert _run(packed)[0] == _run(plain)[0]
        assert torch.allclose(_run(packed)[1], _run(plain)[1], atol=1e-5)
        packed.release_memory_occupation()
        assert not any(_packed(packed))
        packed.resume_memory_occupation()
        assert all(_packed(packed))
        assert _run(packed)[0] == _run(plain)[0]
        assert torch.allclose(_run(packed)[1], _run(plain)[1], atol=1e-5)


@pytest.fixture(params=["native", "fp32-shadow"])
def bf16_shadow(request, monkeypatch):
    """Both bf16 routes: native oneDNN bf16 (where this CPU has it) and the fp32 shadow of AVX2-only CPUs
    (forced here on any CPU)."""
    if request.param == "native":
        if not prepack.native_bf16():
            pytest.skip("this CPU has no native oneDNN bf16 (AVX512-BF16, AMX or AVX-NE-CONVERT)")
        return torch.bfloat16
    monkeypatch.setattr(prepack, "native_bf16", lambda: False)
    return torch.float32


def test_bf16_prepacked_matches_plain_bf16(ckpt_factory, bf16_shadow):
    """bf16 is prepacked too (native, or as an fp32 shadow): its logits stay within bf16 rounding of
    F.linear's, and the shadow has the dtype prepack.pack_dtype names."""
    from tests.runner.driver import RunnerDriver, make_runner

    path = ckpt_factory("qwen2")
    logits = []
    for packed in (True, False):
        runner = make_runner(path, dtype="bfloat16", cpu_prepack=packed)
        assert all(_packed_runner(runner)) == packed
        if packed:
            pairs = [p for m in prepack.packable_modules(runner.model)
                     for p in (m.packed if isinstance(m.packed, GatedPacked) else [m.packed])]
            assert {w.dtype for w, _ in pairs} == {bf16_shadow}
        drv = RunnerDriver(runner)
        logits.append(drv.extend([drv.new_request()], [PROMPTS[2]], return_all_logits=True).all_logits)
    assert logits[0].dtype == logits[1].dtype
    assert (logits[0] - logits[1]).abs().max() < 0.1  # logits have std ~2.4; bf16 has 8 mantissa bits
    assert logits[0].abs().max() > 1.0  # not trivially equal


def test_fp32_shadow_of_bf16_is_exact_fp32_math_rounded_once(monkeypatch):
    """With an fp32 shadow a bf16 linear equals the float64 product of the bf16 values, rounded to bf16
    (at most one bf16 ulp off), and returns bf16."""
    from runner.layers.linear import Linear

    monkeypatch.setattr(prepack, "native_bf16", lambda: False)
    gen = torch.Generator().manual_seed(0)
    lin = Linear(64, 48, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen))
        lin.bias.copy_(torch.randn(48, generator=gen))
    prepack.pack(lin)
    assert lin.packed[0].dtype == torch.float32 and lin.packed[1].dtype == torch.float32
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)[:, ::1]
    got = lin(x)
    want = (x.double() @ lin.weight.double().T + lin.bias.double()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 48)
    ulp = want.double().abs() * 2.0 ** -7  # bf16: 8 significant bits
    assert ((got.double() - want.double()).abs() <= ulp + 1e-6).all()
    assert not torch.equal(got, torch.zeros_like(got))


def _packed_runner(runner) -> list[bool]:
    return [m.packed is not None for m in prepack.packable_modules(runner.model)]


@pytest.mark.parametrize("dtype,native", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_gated_mlp_epilogues_match_silu_and_mul(dtype, native, monkeypatch):
    """A prepacked gate|up runs SiLU-and-mul in its linears' epilogues: equal to silu(x Wg^T) * (x Wu^T)
    in float64 to fp32 rounding (fp32) or bf16 rounding (bf16), and its whole output is still gate|up."""
    import torch.nn.functional as F

    from runner.layers.activation import gated_silu_and_mul
    from runner.layers.linear import MergedLinear

    if dtype == torch.bfloat16 and native and not prepack.native_bf16():
        pytest.skip("this CPU has no native oneDNN bf16 support")
    if not native:
        monkeypatch.setattr(prepack, "native_bf16", lambda: False)  # the fp32 shadow of AVX2-only CPUs
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 64, 96
    proj = MergedLinear(hidden, {0: inter, 1: inter}).to(dtype)
    proj.gated = True
    with torch.no_grad():
        proj.weight.copy_(torch.randn(2 * inter, hidden, generator=gen) * 0.2)
    prepack.pack(proj)
    assert isinstance(proj.packed, GatedPacked)
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    w = proj.weight.double()
    want = F.silu(x.double() @ w[:inter].T) * (x.double() @ w[inter:].T)  # [5, inter]
    got = gated_silu_and_mul(proj, x)
    assert got.shape == (5, inter) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    whole = proj(x)  # the LoRA / captured-step route: both halves side by side
    torch.testing.assert_close(whole.double(), x.double() @ w.T, rtol=tol, atol=tol)
