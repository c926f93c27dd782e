"""Control calls act between steps whatever the size of the batch (issue 20, items 2 and 12): with one
request of n=64 x 120 tokens running, abort_request(abort_all), pause_generation in each mode,
get_load, update_weights_from_disk and release/resume answer within two scheduler steps of being
called, and abort/pause act on the running batch. Submission and get_load never wait for the step
lock. Measured in scheduler steps (a counter around Scheduler.step), never in wall time."""

from __future__ import annotations

import threading
import time

import pytest

from tests.rollout.oracle import random_prompts
from tests.step_counter import count_steps

N, NEW = 64, 120
PROMPT = random_prompts([8], seed=5)[0]
SP = {"n": N, "temperature": 1.0, "max_new_tokens": NEW, "ignore_eos": True, "seed": 3}
MAX_STEPS = 2  # the step in progress, and one more for the step launched ahead of it
TIMEOUT = 60.0


@pytest.fixture(params=[False, True], ids=["overlap", "no-overlap"])
def engine(request, tiny_llama, make_engine):
    eng = make_engine(tiny_llama, max_total_tokens=N * (len(PROMPT) + NEW) + 256, max_running_requests=N,
                      enable_memory_saver=True, enable_weights_cpu_backup=True,
                      disable_overlap_schedule=request.param)
    eng.steps = count_steps(eng)
    return eng


def _start(engine) -> tuple[threading.Thread, list]:
    """The big request in a thread; returns once it has run a few decode steps."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(engine.generate(input_ids=PROMPT, sampling_params=SP)),
                         daemon=True)
    t.start()
    deadline = time.monotonic() + TIMEOUT
    while engine.steps() < 5:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.001)
    return t, out


def _within_steps(engine, call):
    """call()'s result, asserting it returned within MAX_STEPS scheduler steps of being made."""
    before = engine.steps()
    result = call()
    taken = engine.steps() - before
    assert taken <= MAX_STEPS, f"the call waited {taken} scheduler steps"
    return result


def _join(t, out) -> list[dict]:
    t.join(TIMEOUT)
    assert not t.is_alive(), "generate never returned"
    return out[0]


def _assert_partial_aborts(outs: list[dict]) -> None:
    assert len(outs) == N
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(o["output_ids"]) < NEW  # the batch was running, and was stopped mid-way


def test_abort_all_acts_on_the_running_batch_within_two_steps(engine):
    """abort_request(abort_all=True) returns within two steps having aborted all 64 running sequences."""
    t, out = _start(engine)
    assert _within_steps(engine, lambda: engine.abort_request(abort_all=True)) == N
    _assert_partial_aborts(_join(t, out))


def test_pause_abort_acts_within_two_steps(engine):
    """pause_generation("abort") returns within two steps; every sequence ends as abort with partial output."""
    t, out = _start(engine)
    _within_steps(engine, lambda: engine.pause_generation(mode="abort"))
    _assert_partial_aborts(_join(t, out))
    engine.continue_generation()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keeps_the_batch_and_get_load_sees_it(engine, mode):
    """pause_generation(retract | in_place) returns within two steps; no step runs while paused; get_load
    reports all 64 sequences (waiting after retract, running in place); after continue every sequence
    completes its full length."""
    t, out = _start(engine)
    _within_steps(engine, lambda: engine.pause_generation(mode=mode))
    frozen = engine.steps()
    load = _within_steps(engine, engine.get_load)
    assert load["num_reqs"] == N
    assert load["num_waiting_reqs"] == (N if mode == "retract" else 0)
    if mode == "retract":  # their KV went back: nothing holds a request row
        with engine._cv:
            assert engine.scheduler.kv.is_idle()
    time.sleep(0.05)
    assert engine.steps() == frozen, "a step ran while paused"
    engine.continue_generation()
    outs = _join(t, out)
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": NEW} for o in outs)


def test_get_load_and_submission_answer_within_two_steps(engine):
    """get_load reports the 64 running sequences within two steps, and a second generate is accepted
    (its stream returned) within two steps while the batch runs."""
    t, out = _start(engine)
    load = _within_steps(engine, engine.get_load)
    assert load["num_reqs"] == N and load["num_waiting_reqs"] == 0
    stream = _within_steps(engine, lambda: engine.generate(input_ids=[5, 6, 7], stream=True,
                                                          sampling_params={"max_new_tokens": 2}))
    assert engine.abort_request(abort_all=True) == N + 1
    _assert_partial_aborts(_join(t, out))
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_weight_update_and_release_answer_within_two_steps(engine, tiny_llama, monkeypatch):
    """update_weights_from_disk answers within two steps while the batch runs (refused: requests in
    flight, before the checkpoint is even opened); after pause(in_place) the update and release/resume run,
    and the batch completes after continue."""
    opened = []
    real = type(engine.runner).open_checkpoint
    monkeypatch.setattr(type(engine.runner), "open_checkpoint", lambda self, p: opened.append(p) or real(self, p))
    t, out = _start(engine)
    ok, msg, _ = _within_steps(engine, lambda: engine.update_weights_from_disk(str(tiny_llama)))
    assert not ok and "pause_generation" in msg and opened == []
    _within_steps(engine, lambda: engine.pause_generation(mode="in_place"))
    ok, msg, _ = engine.update_weights_from_disk(str(tiny_llama))
    assert ok, msg
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    engine.continue_generation()
    outs = _join(t, out)
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": NEW} for o in outs)


def test_submission_and_get_load_never_wait_for_the_step_lock(engine):
    """While another thread holds the step lock (as a long step or a slow control call would), generate
    accepts a request and get_load answers; the request runs once the lock is free."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with engine._cv:
            held.set()
            release.wait(TIMEOUT)

    h = threading.Thread(target=hold, daemon=True)
    h.start()
    assert held.wait(TIMEOUT)
    result: list = []
    sub = threading.Thread(target=lambda: result.append(engine.generate(
        input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "temperature": 0}, stream=True)), daemon=True)
    sub.start()
    sub.join(10)
    try:
        assert not sub.is_alive(), "generate waited for the step lock"
        assert engine.get_load()["num_waiting_reqs"] == 1
    finally:
        release.set()
    h.join(TIMEOUT)
    chunks = list(result[0])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
