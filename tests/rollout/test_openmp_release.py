"""The Engine frees idle OpenMP pools where they would slow its steps (runner/openmp_pool.py): on the
caller's thread after building the model, on every submission and after every control call, and on the
scheduler thread whenever it goes idle."""

from __future__ import annotations

import threading
import time

import rollout.engine as engine_mod
import rollout.scheduler_loop as loop_mod
from runner import openmp_pool


def spy_on_releases(monkeypatch, *modules) -> list[str]:
    """Record the thread name of every release_thread_pool call made through `modules` (the real call
    still happens); -> the list, appended to as calls come."""
    calls: list[str] = []
    lock = threading.Lock()

    def spy() -> bool:
        with lock:
            calls.append(threading.current_thread().name)
        return openmp_pool.release_thread_pool()

    for module in modules:
        monkeypatch.setattr(module, "release_thread_pool", spy)
    return calls


def test_pools_are_released_on_the_threads_that_built_them(tiny_llama, make_engine, monkeypatch):
    """Each release happens on the right thread, and generation is unchanged by it."""
    calls = spy_on_releases(monkeypatch, engine_mod, loop_mod)
    me = threading.current_thread().name

    engine = make_engine(tiny_llama, max_total_tokens=512)
    assert me in calls  # after building the model, on the caller's thread

    def settle() -> None:  # the scheduler thread releases once it finds nothing to do
        deadline = time.monotonic() + 10
        while "rollout-scheduler" not in calls and time.monotonic() < deadline:
            time.sleep(0.01)

    settle()
    calls.clear()
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert len(out["output_ids"]) == 4
    settle()
    assert calls.count(me) >= 1  # the submission
    assert "rollout-scheduler" in calls  # idle after the request

    calls.clear()
    assert engine.flush_cache().success is True
    assert me in calls  # after the control call, on the caller's thread


def test_the_overlap_worker_releases_its_pool_when_idle(tiny_llama, make_engine, monkeypatch):
    """With the overlap schedule, the forward worker (which runs every CPU forward) frees its pool once
    idle, and prefill forwards run there too (one thread steps the model, so one pool)."""
    import rollout.overlap as overlap_mod

    calls = spy_on_releases(monkeypatch, overlap_mod)
    engine = make_engine(tiny_llama, max_total_tokens=512, disable_overlap_schedule=False)
    out = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert [len(o["output_ids"]) for o in out] == [6, 6]
    deadline = time.monotonic() + 10
    while "rollout-forward" not in calls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "rollout-forward" in calls
