"""The overlap schedule's two CPU threads are pinned to disjoint CPUs that cover the process's mask (the
worker on one), only where the worker steps on one intra-op thread and only those two threads; the
caller's thread keeps its mask, and `cpu_pin_overlap_threads=False` pins nothing."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from rollout.thread_pinning import OverlapPinning, allowed_cpus, plan_cpus
from tests.rollout.oracle import random_prompts

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="thread pinning needs Linux and at least two allowed CPUs")

PARAMS = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_plan_gives_the_worker_one_cpu_counting_down_and_the_scheduler_the_rest():
    """plan_cpus: one CPU for the worker, from the end of the mask, and every other one for the scheduler."""
    assert plan_cpus([], 0) is None
    assert plan_cpus([3], 0) is None
    assert plan_cpus([0, 1], 0) == ({1}, {0})
    assert plan_cpus([0, 1], 1) == ({0}, {1})
    assert plan_cpus([0, 1], 2) == ({1}, {0})
    assert plan_cpus([2, 5, 7, 9], 1) == ({7}, {2, 5, 9})


def test_disabled_pinning_pins_nothing():
    """OverlapPinning(False) has no plan and its pin calls leave the calling thread's mask alone."""
    pinning = OverlapPinning(False)
    before = allowed_cpus()
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.extend([pinning.pin_worker(1), pinning.pin_scheduler()]))
    t.start()
    t.join(10)
    assert result == [False, False] and pinning.pinned == {} and allowed_cpus() == before


@needs_two_cpus
def test_worker_with_several_intra_op_threads_is_not_pinned():
    """A worker stepping on more than one intra-op thread keeps its mask (its OpenMP team inherits it)."""
    pinning = OverlapPinning(True)
    result: list = []

    def run():
        result.append(pinning.pin_worker(2))
        result.append(allowed_cpus())

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert result == [False, allowed_cpus()] and "worker" not in pinning.pinned


def _masks(engine) -> tuple[set[int], set[int]]:
    worker = engine.scheduler.overlap.worker._thread
    return os.sched_getaffinity(worker.native_id), os.sched_getaffinity(engine._thread.native_id)


@needs_two_cpus
def test_engine_pins_worker_and_scheduler_to_disjoint_cpus(tiny_llama, make_engine):
    """With the overlap on the CPU (tiny model: one intra-op thread), after a generate the worker runs on
    one CPU and the scheduler thread on the others; the caller's mask is unchanged; outputs equal an
    unpinned engine's."""
    before = os.sched_getaffinity(0)
    pinned = make_engine(tiny_llama, disable_overlap_schedule=False)
    free = make_engine(tiny_llama, disable_overlap_schedule=False, cpu_pin_overlap_threads=False)
    prompts = random_prompts([5, 9, 14], seed=3)
    outs = pinned.generate(input_ids=prompts, sampling_params=PARAMS)
    ref = free.generate(input_ids=prompts, sampling_params=PARAMS)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    worker, sched = _masks(pinned)
    assert len(worker) == 1 and worker.isdisjoint(sched) and worker | sched == before
    assert pinned.scheduler.overlap.pinning.pinned == {"worker": worker, "scheduler": sched}
    assert os.sched_getaffinity(0) == before  # the caller's thread is never pinned
    assert _masks(free) == (before, before) and free.scheduler.overlap.pinning.pinned == {}


@needs_two_cpus
def test_forced_overlap_on_a_multithreaded_model_is_not_pinned(tiny_llama, make_engine, monkeypatch):
    """A model above the one-thread limit, overlap forced on: neither thread is pinned."""
    import rollout.scheduler as scheduler_mod

    if torch.get_num_threads() < 2:
        pytest.skip("needs torch to step on at least two intra-op threads")
    monkeypatch.setattr(scheduler_mod, "SINGLE_THREAD_MAX_WEIGHTS", 0)
    engine = make_engine(tiny_llama, disable_overlap_schedule=False)
    engine.generate(input_ids=random_prompts([6], seed=1), sampling_params=PARAMS)
    before = os.sched_getaffinity(0)
    assert _masks(engine) == (before, before) and engine.scheduler.overlap.pinning.pinned == {}


def test_config_refuses_a_non_bool():
    """cpu_pin_overlap_threads must be a bool: the error names it."""
    from rollout.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="cpu_pin_overlap_threads"):
        SchedulerConfig(cpu_pin_overlap_threads="yes")
