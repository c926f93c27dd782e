"""Free the calling thread's idle OpenMP worker pool, so the thread that steps the model runs at full speed.

Why. torch's CPU build runs its parallel ops (oneDNN linears, SDPA, big elementwise ops) on GNU OpenMP
(libgomp). libgomp keeps one worker pool per thread that ever opened a parallel region, and while it
manages more threads than there are CPUs, its workers stop spinning between regions (100 spins
instead of ~3 ms) and sleep on a futex instead. A decode step opens hundreds of short regions, so every
one then pays a wake-up. The engine steps the model on its scheduler thread while the caller's thread
built the model (weights loaded, prepacked): two pools of 2 threads on a 2-core machine, and the step
ran 1.4x slower than the same loop on the main thread (40M Qwen2 shape, fp32, batch 16: 24 ms against
17 ms per decode step; a [16, 32768] multiply 29 us against 91-110 us).

What. `release_thread_pool()` hands the calling thread's pool back (OpenMP 5.0 `omp_pause_resource_all`,
which libgomp implements as "free this thread's pool, if it is not inside a parallel region"). The next
parallel op on that thread builds a new pool (tens of microseconds): it changes no result, only where
threads wait. The engine calls it on the caller's thread when the Engine is built, after each control
call and when generate() is called, and on its stepping thread when it goes idle (so a trainer sharing
the process is not slowed by the engine's idle pool either).

What not. Only libgomp, found among the libraries this process has loaded; with LLVM's or Intel's OpenMP
(where a hard pause shuts the runtime down for every thread) or none, it does nothing. It never touches
another thread's pool, and it does not set thread counts (rollout.scheduler does that).
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch  # noqa: F401  (loads the OpenMP runtime this module looks for)

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t; libgomp frees the calling thread's pool for either kind
_pause = None  # the bound omp_pause_resource_all, False once looked for and not usable


def _find_libgomp() -> str | None:
    """Path of the libgomp this process has loaded (torch's bundled copy, normally), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if "/libgomp" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


def _bind():
    global _pause
    if _pause is None:
        _pause = False
        path = _find_libgomp()
        if path is not None:
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all  # already loaded: the same instance
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                _pause = fn
            except (OSError, AttributeError) as e:  # a libgomp older than OpenMP 5.0 (GCC 9)
                logger.debug("libgomp at %s has no omp_pause_resource_all: %s", path, e)
    return _pause


def release_thread_pool() -> bool:
    """Free the calling thread's idle libgomp worker pool. True if libgomp took the call (also when the
    thread had no pool); False where it does not apply (no libgomp, or inside a parallel region)."""
    fn = _bind()
    if not fn:
        return False
    return fn(_OMP_PAUSE_SOFT) == 0
