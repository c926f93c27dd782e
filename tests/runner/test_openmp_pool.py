"""runner.openmp_pool: the calling thread's idle OpenMP pool is freed, and nothing else changes."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from runner import openmp_pool


def _num_os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


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

    def body():
        torch.set_num_threads(2)  # a team of 2 even on a 1-core machine: one worker thread
        x = torch.randn(64, 65536)
        before = _num_os_threads()
        y = x.mul(2.0)  # past torch's grain size: a parallel region, so the pool is built
        with_pool = _num_os_threads()
        assert openmp_pool.release_thread_pool() is True
        after = _num_os_threads()
        # The result is unchanged by what happens to the pool, and a new pool works.
        torch.testing.assert_close(x.mul(2.0), y, rtol=0, atol=0)
        openmp_pool.release_thread_pool()
        return before, with_pool, after

    before, with_pool, after = _in_thread(body)
    assert with_pool == before + 1
    assert after == before


@needs_libgomp
def test_release_without_a_pool_is_a_no_op():
    """A thread that never ran a parallel op has nothing to free: the call succeeds and changes nothing."""

    def body():
        before = _num_os_threads()
        ok = openmp_pool.release_thread_pool()
        return ok, before, _num_os_threads()

    ok, before, after = _in_thread(body)
    assert ok is True and after == before


def test_no_libgomp_means_nothing_is_called(monkeypatch):
    """Where the process has no libgomp (LLVM/Intel OpenMP, or another OS) the call does nothing."""
    monkeypatch.setattr(openmp_pool, "_pause", None)
    monkeypatch.setattr(openmp_pool, "_find_libgomp", lambda: None)
    assert openmp_pool.release_thread_pool() is False
