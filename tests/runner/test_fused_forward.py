"""The fused CPU forward (runner/models/fused_layer.py, runner/csrc/decoder_layer.cpp) gives bitwise the logits
of the modules' forward, so Engine outputs are identical with it on and off; it steps aside where it must."""

from __future__ import annotations

import logging

import pytest
import torch

from runner.layers import prepack
from runner.models import fused_layer
from tests.needs import needs_cpu_kernels
from tests.rollout.oracle import EnginePool, hf_generate, random_prompts

pytestmark = needs_cpu_kernels


@pytest.fixture
def make_engine():
    pool = EnginePool()
    yield pool
    pool.close()


def _set_fused(engine, on: bool) -> None:
    model = engine.runner.model
    fused_layer.enable(model, engine.runner.attn_backend.decode_op if on else None)


def _count_runs(monkeypatch, engine) -> list[int]:
    """[whole-model op calls], counted on the engine's FusedModel (the forward alone, or with the sampler)."""
    fm = engine.runner.model.fused_model
    calls = [0]
    inner, inner_sample = fm.run, fm.run_sample

    def run(args):
        calls[0] += 1
        return inner(args)

    def run_sample(*args):
        calls[0] += 1
        return inner_sample(*args)

    monkeypatch.setattr(fm, "run", run)
    monkeypatch.setattr(fm, "run_sample", run_sample)
    return calls


def _generate(engine, prompts, params, **kw):
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, **kw)
    return [(o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs]


CASES = [("llama", torch.float32, False), ("mistral", torch.float32, False), ("qwen2", torch.float32, True),
         ("qwen3", torch.float32, True), ("qwen2", torch.bfloat16, True), ("qwen3", torch.bfloat16, False),
         ("llama", torch.bfloat16, True)]


@pytest.mark.parametrize("arch,dtype,packed", CASES, ids=[f"{a}-{str(d)[6:]}-{'packed' if p else 'dense'}"
                                                          for a, d, p in CASES])
def test_fused_forward_equals_module_forward_bitwise(make_engine, ckpt_factory, monkeypatch, arch, dtype, packed):
    """Prefill in 16-token chunks, shared prefixes (prefix-cache hits), n=2 seeded samples and greedy
    requests, prepacked (oneDNN, gated MLP epilogues) or dense linears, q/k norms and qkv biases: the
    fused op's tokens and logprobs equal the modules' exactly, on the same engine."""
    if packed:
        monkeypatch.setattr(prepack, "MIN_PACK_NUMEL", 0)  # pack every linear, LM head included
    path = ckpt_factory(arch, tie_word_embeddings=arch == "qwen2")
    engine = make_engine(path, dtype="bfloat16" if dtype == torch.bfloat16 else "float32", chunked_prefill_size=16)
    assert engine.runner.model.fused_model is not None
    linears = engine.runner.model.fused_model.linears
    assert all(m.packed is not None for m in linears) == packed
    base = random_prompts([30], seed=1)[0]
    prompts = [base + tail for tail in random_prompts([2, 7], seed=2)] + random_prompts([45, 3], seed=3)
    sampled = dict(max_new_tokens=12, temperature=0.9, n=2, seed=5, ignore_eos=True)
    greedy = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    calls = _count_runs(monkeypatch, engine)
    engine.flush_cache()
    fused = (_generate(engine, prompts, sampled), _generate(engine, prompts, greedy))
    assert calls[0] > 0
    _set_fused(engine, False)
    engine.flush_cache()
    modules = (_generate(engine, prompts, sampled), _generate(engine, prompts, greedy))
    assert fused == modules


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prefill_mlp_in_row_blocks_equals_module_forward_bitwise(make_engine, ckpt_factory, monkeypatch, dtype):
    """A prefill step of more than 512 tokens runs the prepacked MLP over 512-row blocks (decoder_layer.cpp,
    kMlpRowBlock): 1,250 prompt tokens in one step (three prompts up to the 512-token context), uneven last block; tokens
    and logprobs equal the modules' (whole-batch MLP) exactly."""
    monkeypatch.setattr(prepack, "MIN_PACK_NUMEL", 0)
    path = ckpt_factory("qwen2")
    engine = make_engine(path, dtype=dtype, chunked_prefill_size=2048, max_total_tokens=4096)
    assert all(m.packed is not None for m in engine.runner.model.fused_model.linears)
    prompts = random_prompts([500, 483, 267], seed=12)
    params = dict(max_new_tokens=6, temperature=0.9, seed=2, ignore_eos=True)
    calls = _count_runs(monkeypatch, engine)
    fused = _generate(engine, prompts, params)
    assert calls[0] > 0
    _set_fused(engine, False)
    engine.flush_cache()
    assert _generate(engine, prompts, params) == fused


def test_fused_greedy_decode_matches_hf_generate(make_engine, ckpt_factory):
    """Through the fused op (the default on an AVX-512 or AVX2 CPU), greedy tokens are HF generate's and the
    logprobs are within float rounding of HF's."""
    from transformers import AutoModelForCausalLM

    path = ckpt_factory("qwen3")
    engine = make_engine(path)
    assert engine.runner.model.fused_model is not None
    prompts = random_prompts([4, 19, 37], seed=6)
    got = _generate(engine, prompts, dict(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for prompt, (ids, lps) in zip(prompts, got):
        hf_ids, hf_lps = hf_generate(model, prompt, 16)
        assert ids == hf_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(hf_lps), rtol=0, atol=1e-4)


def test_per_layer_fusion_equals_modules_when_the_whole_model_is_not_fused(make_engine, ckpt_factory, monkeypatch):
    """With no whole-model op (as for an MoE model's dense layers), each covered layer runs as one op inside
    the modules' forward, again bitwise the Python layers."""
    path = ckpt_factory("qwen3")
    engine = make_engine(path, chunked_prefill_size=8)
    engine.runner.model.fused_model = None
    calls = [0, 0]
    inner = fused_layer.call

    def call(*args):
        out = inner(*args)
        calls[out is None] += 1
        return out

    monkeypatch.setattr(fused_layer, "call", call)
    prompts = random_prompts([11, 25], seed=7)
    params = dict(max_new_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    per_layer = _generate(engine, prompts, params)
    assert calls[0] > 0 and calls[1] == 0
    _set_fused(engine, False)
    engine.flush_cache()  # the same chunks as the first run: a cached prefix would change the matmul shapes
    assert _generate(engine, prompts, params) == per_layer


def test_prompt_logprobs_take_the_module_path_and_agree(make_engine, ckpt_factory, monkeypatch):
    """A prefill that needs every position's logits (input logprobs) runs through the modules, its decode
    steps through the op; the outputs equal an engine without the op."""
    path = ckpt_factory("llama")
    engine = make_engine(path, num_continuous_decode_steps=1)  # a decode step per op call, to count them
    calls = _count_runs(monkeypatch, engine)
    prompts = random_prompts([9, 14], seed=8)
    params = dict(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    decode_calls = calls[0]
    assert decode_calls == 5  # the 5 decode steps; the prefill, which scores the prompt, ran the modules
    _set_fused(engine, False)
    engine.flush_cache()
    second = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    for a, b in zip(first, second):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["input_token_logprobs"] == b["meta_info"]["input_token_logprobs"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_a_failing_fused_op_falls_back_to_the_modules_once_and_loses_nothing(make_engine, ckpt_factory, caplog):
    """If the op raises, the step reruns through the modules, the fused path is turned off with one warning,
    and the requests finish with the tokens the modules give."""
    path = ckpt_factory("qwen2")
    engine = make_engine(path)
    prompts = random_prompts([8, 20], seed=9)
    params = dict(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    fm = engine.runner.model.fused_model

    def broken(*args):
        raise RuntimeError("simulated defect in the fused op")

    fm.run = fm.run_sample = broken
    with caplog.at_level(logging.WARNING, logger="runner.model_runner"):
        got = _generate(engine, prompts, params)
    assert engine.runner.model.fused_model is None
    warnings = [r for r in caplog.records if "fused CPU forward failed" in r.getMessage()]
    assert len(warnings) == 1 and "simulated defect" in warnings[0].getMessage()
    engine.flush_cache()
    assert _generate(engine, prompts, params) == got
    assert all(len(ids) == 8 for ids, _ in got)


def test_model_forward_rejects_partial_layer_lists_by_name(cpu_ops, cpu_direct):
    """The op checks its flattened layer description before touching the pool: a list that is not whole
    layers is refused, naming the counts, through torch.ops and through the direct call alike (a
    RuntimeError with the message alone, no C++ backtrace)."""
    x = torch.zeros(2, dtype=torch.int64)
    buf = torch.zeros(1, 4, 1, 16)
    table, norm, head = torch.zeros(4, 16), torch.ones(16), [torch.zeros(8, 16), None]
    plan = (torch.zeros(1, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), x, None)
    with pytest.raises(RuntimeError, match=r"do not describe whole layers"):
        cpu_ops.model_forward(x, x, torch.zeros(8, 16), table, table, [None] * 13, [0, 0, 0, 0], 1e-6, 0.0, norm,
                              head, 0, None, buf, buf, x, *plan, 1, 1, 0.25)
    weights = cpu_direct.FusedWeights([None] * 13, [0, 0, 0, 0], head, 0, 1e-6, 0.0, 1, 1, 0.25)
    with pytest.raises(RuntimeError, match=r"^model_forward: 13 layer params and 4 kinds do not describe whole"):
        cpu_direct.model_forward(weights, x, x, torch.zeros(8, 16), table, table, norm, None, buf, buf, x, *plan)


def test_fused_forward_reads_weights_updated_and_repacked_since(make_engine, ckpt_factory, monkeypatch):
    """After update_weights_from_tensor (which repacks the prepacked shadows), the fused op computes with
    the new weights: its outputs change, and equal the modules' on the same updated engine."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(prepack, "MIN_PACK_NUMEL", 0)
    path = ckpt_factory("qwen2")
    engine = make_engine(path)
    prompts = random_prompts([6, 13], seed=12)
    params = dict(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    before = _generate(engine, prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    update = [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in hf.state_dict().items()
              if n.endswith(("q_proj.weight", "down_proj.weight", "lm_head.weight"))]
    ok, msg = engine.update_weights_from_tensor(update)
    assert ok, msg
    after = _generate(engine, prompts, params)
    assert after != before
    _set_fused(engine, False)
    engine.flush_cache()
    assert _generate(engine, prompts, params) == after


def test_forward_and_sampling_in_one_call_equal_the_two_calls_bitwise(make_engine, ckpt_factory):
    """ModelRunner.forward_sample (what the overlap schedule's worker runs per decode step: input ids filled
    from the step before, the fused forward and the plain sampler in one GIL-free call) gives bitwise the
    logits, ids and logprobs of `forward` then `sample` on the same batch, with and without a row gather."""
    from runner.forward_batch import LogitsOutput

    path = ckpt_factory("qwen2", tie_word_embeddings=True)
    engine = make_engine(path, disable_overlap_schedule=True, num_continuous_decode_steps=1)  # every decode step
    runner, sched = engine.runner, engine.scheduler
    inner = sched._forward_sample_device
    checked: list[int] = []

    def compare(fb, reqs, prepared=None, fill=None):
        if fb.forward_mode.is_decode() and fill is None:
            if fb.sampling_info is None:
                fb.sampling_info = sched._sampling_info(reqs)
            prepared = runner.prepare_forward(fb)
            ids = fb.input_ids.clone()
            logits = runner.forward(fb, prepared=prepared).next_token_logits.clone()
            ref = runner.sample(LogitsOutput(logits), fb)
            perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(len(checked)))
            for fill_from, index in ((ids[perm], torch.argsort(perm)), (ids.clone(), None)):
                fb.input_ids.zero_()  # the placeholder the overlap schedule builds the step with
                got_logits, got = runner.forward_sample(fb, prepared, fill_from, index)
                assert torch.equal(fb.input_ids, ids)
                assert torch.equal(got_logits.next_token_logits, logits)
                assert torch.equal(got.next_token_ids, ref.next_token_ids)
                assert got.logprobs is not None and torch.equal(got.logprobs, ref.logprobs)
            checked.append(len(ids))
        return inner(fb, reqs, prepared=prepared, fill=fill)

    sched._forward_sample_device = compare
    prompts = random_prompts([5, 11, 23, 8], seed=4)
    params = [dict(max_new_tokens=6, temperature=t, seed=3, ignore_eos=True) for t in (0.8, 0.0, 1.0, 1.3)]
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert checked and max(checked) == 4
    assert all(len(o["output_ids"]) == 6 for o in outs)
