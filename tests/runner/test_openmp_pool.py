"""runner.openmp_pool: the calling thread's idle OpenMP pool is freed, and nothing else changes."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest
import torch

from runner import openmp_pool


def _threads_named(name: str) -> int:
    """OS threads of this process whose kernel name is `name` (threads a thread creates inherit its name)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == name
        except OSError:  # the thread exited while we looked
            pass
    return n


def _name_this_thread(name: str) -> None:
    libc = ctypes.CDLL(None)
    PR_SET_NAME = 15
    assert libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0) == 0


def _wait_for(pred, timeout_s: float = 5.0) -> bool:
    """libgomp's freed workers leave a barrier and then exit: their OS threads go a moment later."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _in_thread(fn):
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


needs_libgomp = pytest.mark.skipif(openmp_pool._find_libgomp() is None,
                                   reason="torch here does not run on libgomp")


@needs_libgomp
def test_release_ends_the_pools_worker_threads():
    """A thread's parallel op leaves an OpenMP worker thread behind; release_thread_pool ends it."""

    name = "omp-pool-test"  # only this test's thread and the workers it spawns carry it: other threads
    # of the process (a server's, Ray's, an earlier test's engine) can come and go meanwhile

    x = torch.randn(64, 65536)  # made here: filling it may open a parallel region (and a pool) itself

    def body():
        _name_this_thread(name)
        torch.set_num_threads(2)  # a team of 2 even on a 1-core machine: at least one worker thread
        # Counted after set_num_threads: in a fresh process its first call may itself start a thread.
        before = _threads_named(name)
        y = x.mul(2.0)  # past torch's grain size: a parallel region, so the pool is built
        with_pool = _threads_named(name)
        assert openmp_pool.release_thread_pool() is True
        gone = _wait_for(lambda: _threads_named(name) <= before)
        # The result is unchanged by what happens to the pool, and a new pool works.
        torch.testing.assert_close(x.mul(2.0), y, rtol=0, atol=0)
        openmp_pool.release_thread_pool()
        return before, with_pool, gone

    before, with_pool, gone = _in_thread(body)
    assert with_pool > before, "the parallel op started no worker thread"
    assert gone, "the pool's worker threads were still alive 5 s after release_thread_pool()"


@needs_libgomp
def test_release_without_a_pool_is_a_no_op():
    """A thread that never ran a parallel op has nothing to free: the call succeeds and changes nothing."""

    name = "omp-nopool-test"

    def body():
        _name_this_thread(name)
        before = _threads_named(name)
        ok = openmp_pool.release_thread_pool()
        return ok, before, _threads_named(name)

    ok, before, after = _in_thread(body)
    assert ok is True and before == 1 and after == before


def test_no_libgomp_means_nothing_is_called(monkeypatch):
    """Where the process has no libgomp (LLVM/Intel OpenMP, or another OS) the call does nothing."""
    monkeypatch.setattr(openmp_pool, "_pause", None)
    monkeypatch.setattr(openmp_pool, "_find_libgomp", lambda: None)
    assert openmp_pool.release_thread_pool() is False
