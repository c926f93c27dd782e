"""The overlap schedule (rollout.overlap) changes no output: every workload below gives the same tokens,
finish reasons and (to 1e-5) logprobs with it on and off (disable_overlap_schedule), greedy ones equal
HF generate, steps were really launched ahead when it is on, and the KV pool ends clean (a finished
request's KV is freed once, after the step launched ahead of its last one)."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from tests.rl_surface.conftest import assert_kv_clean, at_step
from tests.rollout.oracle import assert_same_outputs, hf_generate, random_prompts

TIMEOUT = 60.0
PROMPTS = random_prompts([5, 9, 14, 20, 7, 30], seed=23)


def _engines(make_engine, path, **kw):
    return {mode: make_engine(path, disable_overlap_schedule=(mode == "off"), **kw) for mode in ("on", "off")}


def _assert_clean(engine, overlapped: bool) -> None:
    """Nothing in flight, no row or cache lock held, every KV slot free or in the prefix cache; steps were
    launched ahead iff the overlap schedule is on."""
    assert_kv_clean(engine)
    ahead = engine.scheduler.stats["num_overlapped_steps"]
    assert (ahead > 0) if overlapped else (ahead == 0)


def _run_both(engines, **generate_kw) -> dict[str, list[dict]]:
    outs = {mode: e.generate(return_logprob=True, **generate_kw) for mode, e in engines.items()}
    for mode, e in engines.items():
        _assert_clean(e, mode == "on")
    return outs


def test_greedy_with_stops_equals_off_and_hf(tiny_llama, make_engine, hf_models):
    """Greedy requests, some stopped by a stop token mid-way (their last step had one launched ahead),
    give the same tokens on and off, and equal HF generate."""
    engines = _engines(make_engine, tiny_llama)
    ref = engines["off"].generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 24,
                                                                      "ignore_eos": True})
    # Stop each odd request at the token it produces at step 6 (a stop token the schedule cannot foresee).
    params = [{"temperature": 0, "max_new_tokens": 24, "ignore_eos": not i % 2,  # ignore_eos ignores stop ids
               "stop_token_ids": [r["output_ids"][6]] if i % 2 else []} for i, r in enumerate(ref)]
    outs = _run_both(engines, input_ids=PROMPTS, sampling_params=params)
    assert_same_outputs(outs["on"], outs["off"])
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs["on"])
    hf = hf_models(tiny_llama)
    for prompt, out, ref_out in zip(PROMPTS, outs["on"], ref):
        tokens, _ = hf_generate(hf, prompt, 24)
        assert ref_out["output_ids"] == tokens
        assert out["output_ids"] == tokens[: len(out["output_ids"])]


def test_seeded_groups_with_prefix_cache_equal_off(tiny_llama, make_engine):
    """n=4 seeded groups over prompts sharing a prefix (cache hits), with min_new_tokens and top-k/top-p:
    same tokens and logprobs on and off."""
    shared = random_prompts([24], seed=24)[0]
    prompts = [shared + [7, 8], shared + [9], shared + [10, 11, 12], PROMPTS[0]]
    params = [{"n": 4, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 40 + i, "max_new_tokens": 10 + 3 * i,
               "min_new_tokens": 4, "stop_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]} for i in range(len(prompts))]
    engines = _engines(make_engine, tiny_llama)
    outs = _run_both(engines, input_ids=prompts, sampling_params=params)
    assert_same_outputs(outs["on"], outs["off"])
    assert engines["on"].get_server_info()["num_cached_tokens"] > 0


def test_chunked_prefill_and_retraction_equal_off(tiny_llama, make_engine):
    """Chunked prefill (16 tokens a step) and forced retractions (a 112-token KV pool): same outputs on and
    off, and retractions happened."""
    engines = _engines(make_engine, tiny_llama, chunked_prefill_size=16, max_total_tokens=112)
    params = [{"temperature": 0.8, "seed": 60 + i, "max_new_tokens": 12 + 2 * i, "ignore_eos": True}
              for i in range(len(PROMPTS))]
    outs = _run_both(engines, input_ids=PROMPTS, sampling_params=params)
    assert_same_outputs(outs["on"], outs["off"])
    assert engines["on"].get_server_info()["num_retractions"] > 0


def _controlled(engine, path, control: str) -> list[dict]:
    """The PROMPTS batch with `control` applied after step 6, then the batch's outputs."""
    rids = [f"r{i}" for i in range(len(PROMPTS))]

    def act():
        if control == "abort":
            engine.abort_request(rid="r2")
            engine.abort_request(rid="r4")
            return
        mode = {"pause_abort": "abort", "pause_retract": "retract"}.get(control, "in_place")
        engine.pause_generation(mode=mode)
        if control == "update":
            ok, msg, _ = engine.update_weights_from_disk(str(path))
            assert ok, msg
        if control == "release":
            engine.release_memory_occupation()
            engine.resume_memory_occupation()
        engine.continue_generation()

    state = at_step(engine, 6, act)
    params = [{"temperature": 0.9, "seed": 80 + i, "max_new_tokens": 20, "ignore_eos": True} for i in range(len(PROMPTS))]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True, rid=rids)
    assert state["done"].wait(TIMEOUT)
    if "error" in state:
        raise state["error"]
    return outs


@pytest.mark.parametrize("control", ["abort", "pause_abort", "pause_retract", "pause_in_place", "update", "release"])
def test_control_between_steps_equals_off(control, tiny_llama, make_engine):
    """An abort, each pause mode, a weight update and release/resume between steps 6 and 7 give the same
    outputs on and off (a step launched ahead is rolled back, so the control acts at the same boundary)."""
    engines = _engines(make_engine, tiny_llama, enable_memory_saver=True, enable_weights_cpu_backup=True)
    outs = {mode: _controlled(e, tiny_llama, control) for mode, e in engines.items()}
    assert_same_outputs(outs["on"], outs["off"])
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs["on"]]
    if control in ("abort", "pause_abort"):
        assert "abort" in reasons and all(0 < len(o["output_ids"]) < 20 for o, r in zip(outs["on"], reasons)
                                          if r == "abort")
    else:
        assert reasons == ["length"] * len(PROMPTS)
    for mode, e in engines.items():
        _assert_clean(e, mode == "on")


def test_disable_overlap_schedule_is_an_engine_option_and_a_server_flag(tiny_llama, make_engine):
    """SGLang's disable_overlap_schedule: None (the default) is on for CUDA and off on the CPU (where the plain
    schedule's decode blocks measured faster), False turns it on, True off, over the Engine and the server
    flags (--[no-]disable-overlap-schedule); a non-bool is refused by name."""
    from rollout.server.args import parse_args

    assert parse_args(["--model-path", "m", "--disable-overlap-schedule"])[1]["disable_overlap_schedule"] is True
    assert parse_args(["--model-path", "m", "--no-disable-overlap-schedule"])[1]["disable_overlap_schedule"] is False
    assert parse_args(["--model-path", "m"])[1]["disable_overlap_schedule"] is None
    from rollout import scheduler

    assert make_engine(tiny_llama).scheduler.overlap is None
    scheduler_default = scheduler._overlap_by_default
    small = types.SimpleNamespace(fused_model=object(), parameters=lambda: [torch.empty(10)])
    assert not scheduler_default(types.SimpleNamespace(device=torch.device("cpu"), model=small))
    assert scheduler_default(types.SimpleNamespace(device=torch.device("cuda"), model=None))
    assert make_engine(tiny_llama, disable_overlap_schedule=False).scheduler.overlap is not None
    assert make_engine(tiny_llama, disable_overlap_schedule=True).scheduler.overlap is None
    with pytest.raises(ValueError, match="disable_overlap_schedule"):
        make_engine(tiny_llama, disable_overlap_schedule="yes")


def test_decode_forwards_run_on_the_worker_with_one_thread(tiny_llama, make_engine):
    """With the overlap schedule on the CPU, every forward (decode and prefill) runs on the forward worker
    thread, which (tiny CPU model) steps on one intra-op thread: one thread, one OpenMP pool."""
    engine = make_engine(tiny_llama, disable_overlap_schedule=False)
    seen: list[tuple[str, bool, int]] = []
    real, real_one_call = engine.runner.forward, engine.runner.forward_sample

    def recording(fb, *args, **kwargs):
        seen.append((threading.current_thread().name, fb.forward_mode.is_decode(), torch.get_num_threads()))
        return real(fb, *args, **kwargs)

    def recording_one_call(fb, *args, **kwargs):  # the decode step's forward and sampling in one call
        seen.append((threading.current_thread().name, fb.forward_mode.is_decode(), torch.get_num_threads()))
        return real_one_call(fb, *args, **kwargs)

    engine.runner.forward, engine.runner.forward_sample = recording, recording_one_call
    engine.generate(input_ids=PROMPTS[:2], sampling_params={"max_new_tokens": 6, "ignore_eos": True})
    assert {name for name, decode, _ in seen if decode} == {"rollout-forward"}
    assert {name for name, decode, _ in seen if not decode} == {"rollout-forward"}
    assert any(not decode for _, decode, _ in seen)
    assert {n for _, _, n in seen} == {1}


def test_kv_of_a_finished_request_is_freed_only_after_the_step_that_reads_it(tiny_llama, make_engine):
    """A request stopped by a stop token while the next step (built with its row) is in flight keeps its
    KV until that step is done: no release ever hits a request that the step in flight still reads."""
    engine = make_engine(tiny_llama, disable_overlap_schedule=False)
    ref = engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 16,
                                                              "ignore_eos": True})
    kv, overlap = engine.scheduler.kv, engine.scheduler.overlap
    real_release, real_defer = kv.release, overlap.defer_release
    seen = {"early": 0, "deferred": 0}

    def release(req):
        if overlap.ahead is not None and id(req) in overlap.ahead.members:
            seen["early"] += 1
        return real_release(req)

    def defer(req):
        deferred = real_defer(req)
        seen["deferred"] += deferred
        return deferred

    kv.release, overlap.defer_release = release, defer
    params = [{"temperature": 0, "max_new_tokens": 16, "stop_token_ids": [r["output_ids"][5]]} for r in ref]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert seen["deferred"] > 0 and seen["early"] == 0
    for out, r in zip(outs, ref):
        assert out["output_ids"] == r["output_ids"][: len(out["output_ids"])]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    _assert_clean(engine, overlapped=True)


def test_worker_hands_a_result_over_only_after_the_next_jobs_prologue():
    """A Phased job's prologue runs before the previous job's result is handed over and its body after; a
    job with nothing queued behind it is handed over at once; a failing prologue fails its own job only."""
    from rollout.overlap import ForwardWorker, Phased

    worker = ForwardWorker("cpu")
    try:
        log: list[str] = []
        gate = threading.Event()
        first = worker.submit(lambda: (gate.wait(5), log.append("first body"), "one")[-1])
        first.add_done_callback(lambda f: log.append("first handed over"))

        def bad_prologue():
            log.append("second prologue")
            raise ValueError("prologue failed")

        second = worker.submit(Phased(bad_prologue, lambda: log.append("second body")))
        third = worker.submit(Phased(lambda: log.append("third prologue"), lambda: "three"))
        gate.set()
        assert first.result(5) == "one" and third.result(5) == "three"
        with pytest.raises(ValueError, match="prologue failed"):
            second.result(5)
        assert log == ["first body", "second prologue", "first handed over", "third prologue"]
        alone = worker.submit(lambda: "alone")
        assert alone.result(5) == "alone"  # nothing behind it: handed over without waiting for another job
    finally:
        worker.close()
