"""The overlap schedule's two CPU threads are pinned to disjoint CPUs that cover the process's mask (the
worker on one), only where the worker steps on one intra-op thread and only those two threads; the
caller's thread keeps its mask, and `cpu_pin_overlap_threads=False` pins nothing."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from rollout.thread_pinning import CpuClaims, OverlapPinning, allowed_cpus, plan_cpus
from tests.rollout.oracle import random_prompts

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="thread pinning needs Linux and at least two allowed CPUs")

PARAMS = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_plan_gives_the_worker_its_cpu_and_the_scheduler_the_rest():
    """plan_cpus: the worker's CPU alone, and every other allowed CPU for the scheduler thread."""
    assert plan_cpus([0, 1], 1) == ({1}, {0})
    assert plan_cpus([0, 1], 0) == ({0}, {1})
    assert plan_cpus([2, 5, 7, 9], 7) == ({7}, {2, 5, 9})


def test_claims_take_free_cpus_from_the_end_and_give_them_back(tmp_path):
    """CpuClaims: each claim takes the first candidate nobody holds; with all held it is None; a released
    claim can be taken again."""
    claims = CpuClaims(str(tmp_path))
    first = claims.claim([3, 2])
    second = claims.claim([3, 2])
    assert first[0] == 3 and second[0] == 2 and claims.claim([3, 2]) is None
    os.close(first[1])
    again = claims.claim([3, 2])
    assert again[0] == 3
    os.close(again[1])
    os.close(second[1])


def test_a_claim_held_by_another_process_is_skipped(tmp_path):
    """A CPU claimed by another process (another engine on the machine) is not claimed here until that
    process lets go of it."""
    import subprocess
    import sys

    code = ("import sys, time; from rollout.thread_pinning import CpuClaims; "
            f"c = CpuClaims({str(tmp_path)!r}).claim([1]); print(c[0], flush=True); sys.stdin.readline()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        claims = CpuClaims(str(tmp_path))
        got = claims.claim([1, 0])
        assert got[0] == 0
        os.close(got[1])
    finally:
        holder.communicate("\n", timeout=30)
    got = CpuClaims(str(tmp_path)).claim([1, 0])
    assert got[0] == 1
    os.close(got[1])


@needs_two_cpus
def test_pinning_claims_a_cpu_until_released(tmp_path):
    """Two OverlapPinnings on one claims directory get different worker CPUs; with every CPU claimed a
    third gets no plan; release() frees its CPU for the next."""
    cpus = allowed_cpus()
    claims = CpuClaims(str(tmp_path))
    pins = [OverlapPinning(True, claims) for _ in cpus]
    workers = [next(iter(p.plan[0])) for p in pins]
    assert workers == cpus[::-1]
    extra = OverlapPinning(True, claims)
    assert extra.plan is None
    pins[0].release()
    again = OverlapPinning(True, claims)
    assert again.plan == ({cpus[-1]}, set(cpus[:-1]))
    for p in [*pins, again]:
        p.release()


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
def test_engine_pins_worker_and_scheduler_to_disjoint_cpus(tiny_llama, make_engine, monkeypatch, tmp_path):
    """With the overlap on the CPU (tiny model: one intra-op thread), after a generate the worker runs on
    one CPU and the scheduler thread on the others; the caller's mask is unchanged; outputs equal an
    unpinned engine's; shutdown gives the worker's CPU claim back."""
    import rollout.thread_pinning as pinning_mod

    monkeypatch.setattr(pinning_mod, "claims_directory", lambda: str(tmp_path))  # no other engine's claims
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
    pinned.shutdown()  # gives its worker CPU's claim back
    claim = CpuClaims(str(tmp_path)).claim(sorted(worker))
    assert claim is not None
    os.close(claim[1])


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


@needs_two_cpus
def test_a_dropped_pinning_gives_its_claim_back(tmp_path):
    """An OverlapPinning that is garbage-collected without release() (an engine that failed to build)
    gives its CPU claim back."""
    import gc

    claims = CpuClaims(str(tmp_path))
    cpu = next(iter(OverlapPinning(True, claims).plan[0]))  # the pinning itself is dropped at once
    gc.collect()
    again = claims.claim([cpu])
    assert again is not None and again[0] == cpu
    os.close(again[1])
