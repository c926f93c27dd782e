"""enable_mixed_chunk (SGLang's --enable-mixed-chunk): a step that admits prompts also decodes the running
requests. Every request's tokens and logprobs still equal what it gets run alone (under chunked prefill,
prefix hits, retractions and requests joining mid-run), mixed steps really ran, and the option is off
wherever it must be (the overlap schedule, the deterministic mode) or refused when malformed."""

from __future__ import annotations

import pytest
import torch

from rollout.scheduler import SchedulerConfig
from tests.rollout.test_scheduling_invariance import _assert_same, _workload, solo_results  # noqa: F401

MIXED = dict(enable_mixed_chunk=True, disable_overlap_schedule=True)


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["radix", "no-radix"])
def test_mixed_steps_equal_solo(disable_radix_cache, tiny_llama, make_engine, solo_results):  # noqa: F811
    """At most 5 running of 12, chunks of 16, a pool that forces retractions: tokens/logprobs equal solo, and
    prompts were admitted in mixed steps."""
    engine = make_engine(tiny_llama, chunked_prefill_size=16, max_total_tokens=128, max_running_requests=5,
                         disable_radix_cache=disable_radix_cache, **MIXED)
    assert engine.scheduler.mix
    prompts, params = _workload()
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    _assert_same(outs, solo_results)
    info = engine.get_server_info()
    assert info["num_mixed_steps"] > 0, info
    assert info["num_mixed_steps"] <= info["num_prefill_steps"]


def test_mixed_step_carries_every_running_request(tiny_llama):
    """Driven step by step: once A runs, admitting B is one forward in which A also gets its next token,
    and both get the tokens a plain scheduler gives them."""
    from rollout.request import Req
    from rollout.sampling_params import SamplingParams
    from rollout.scheduler import Scheduler
    from tests.runner.driver import make_runner

    runner = make_runner(tiny_llama)
    results = {}
    for mix in (False, True):
        sched = Scheduler(runner, SchedulerConfig(enable_mixed_chunk=mix, disable_overlap_schedule=True,
                                                  num_continuous_decode_steps=1), [],
                          lambda req: None)
        greedy = SamplingParams.from_dict({"max_new_tokens": 5, "ignore_eos": True, "temperature": 0})
        a, b = Req("a", [5, 6, 7, 8], greedy, seed=0), Req("b", [9, 10, 11], greedy, seed=1)
        sched.add_request(a)
        sched.step()  # A's prefill
        sched.step()  # A decodes
        assert len(a.output_ids) == 2
        sched.add_request(b)
        before = dict(sched.stats)
        updated = sched.step()
        if mix:
            assert {r.rid for r in updated} == {"a", "b"}
            assert len(a.output_ids) == 3 and len(b.output_ids) == 1
            assert sched.stats["num_mixed_steps"] == before["num_mixed_steps"] + 1
            assert sched.stats["num_decode_steps"] == before["num_decode_steps"]
            assert sched.stats["num_prefill_tokens"] == before["num_prefill_tokens"] + 3  # B's prompt only
        else:
            assert [r.rid for r in updated] == ["b"] and len(a.output_ids) == 2  # A waited through B's prefill
        while sched.has_work():
            sched.step()
        results[mix] = (a.output_ids, b.output_ids)
        sched.close()
        assert sched.kv.is_idle()
    assert results[True] == results[False]


def test_extend_locs_gathers_one_token_rows_as_slices_would(tiny_llama, make_engine):
    """KVManager.extend_locs (a gather per run of one-token rows) equals slicing each row."""
    engine = make_engine(tiny_llama)
    kv = engine.scheduler.kv
    rows = kv.req_pool.req_to_token
    table = torch.arange(rows.numel(), dtype=rows.dtype).view_as(rows) % 997
    rows.copy_(table)

    class R:
        def __init__(self, idx):
            self.req_pool_idx = idx

    items = [(R(1), 3, 1), (R(2), 0, 5), (R(0), 7, 1), (R(3), 2, 1), (R(1), 9, 4), (R(2), 11, 1)]
    want = torch.cat([table[r.req_pool_idx, s : s + n] for r, s, n in items])
    assert torch.equal(kv.extend_locs(items), want)
    rows.zero_()


def test_mixed_is_off_with_overlap_or_deterministic(tiny_llama, make_engine):
    """The overlap schedule keeps its own decode steps; the deterministic mode never mixes."""
    assert not make_engine(tiny_llama, enable_mixed_chunk=True, disable_overlap_schedule=False).scheduler.mix
    assert not make_engine(tiny_llama, enable_deterministic_inference=True, **MIXED).scheduler.mix
    assert not make_engine(tiny_llama, disable_overlap_schedule=True).scheduler.mix


def test_config_refuses_a_non_bool():
    """enable_mixed_chunk must be a bool, and the error names it."""
    with pytest.raises(ValueError, match="enable_mixed_chunk"):
        SchedulerConfig(enable_mixed_chunk="yes")
