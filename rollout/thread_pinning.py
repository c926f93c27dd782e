"""Pin the overlap schedule's two CPU threads (the scheduler thread, the forward worker) to distinct CPUs.

Why. With the overlap schedule on the CPU the two threads hand each other work every decode step (the
scheduler submits step N+1, the worker hands back step N's result), and each hand-over wakes the
other thread. Linux places a woken thread near its waker (wake-affine), so a run settles either with
the two threads on two cores, or both on one core, taking turns. On a 2-core AMD EPYC (Zen 5, AVX-512)
`bench/overlap.py --preset tiny --batch 16 --repeat 10` measured the pairs as two clusters: on ~79k
tok/s (1.30-1.38x the plain schedule, process CPU 1.4 cores) or ~50-59k (0.83-1.02x, CPU 1.0 core, both
threads on one core), a coin toss per run. With the worker on one CPU and the scheduler thread on the
others, all 10 pairs measured 1.24-1.32x.

What. `OverlapPinning` picks the CPUs once, at the scheduler's construction, from the process's
affinity mask: the worker gets one CPU, the scheduler thread every other allowed CPU. Each thread pins
itself (`pin_worker`, `pin_scheduler`: `os.sched_setaffinity(0, ...)` on Linux sets the calling thread's
mask only). Several overlap engines in one process take different worker CPUs, counting down from the
last allowed one.

What not. It pins nothing where fewer than two CPUs are allowed, off Linux, or when the worker steps
on more than one intra-op thread (its OpenMP team would inherit the one-CPU mask); it never touches the
caller's threads (the main thread, a trainer's), only the engine's own two, which end at shutdown.
`cpu_pin_overlap_threads=False` (server: `--no-cpu-pin-overlap-threads`) turns it off.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

logger = logging.getLogger(__name__)

_counter = itertools.count()  # the n-th plan in this process takes the n-th CPU from the end
_lock = threading.Lock()


def allowed_cpus() -> list[int]:
    """The CPUs the calling thread may run on, sorted; [] where the OS does not say (not Linux)."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return []
    try:
        return sorted(getter(0))
    except OSError:
        return []


def plan_cpus(allowed: list[int], index: int) -> tuple[set[int], set[int]] | None:
    """(the worker's CPUs, the scheduler thread's CPUs) for the index-th plan over `allowed`, or None when
    there are fewer than two: one CPU for the worker, counting down from the last, the rest for the
    scheduler thread."""
    if len(allowed) < 2:
        return None
    worker = allowed[-1 - index % len(allowed)]
    return {worker}, {c for c in allowed if c != worker}


class OverlapPinning:
    """The CPUs of one overlap schedule's two threads; each thread calls its own pin method."""

    def __init__(self, enabled: bool) -> None:
        self.plan = None
        if enabled and hasattr(os, "sched_setaffinity"):
            with _lock:
                index = next(_counter)
            self.plan = plan_cpus(allowed_cpus(), index)
        self.pinned: dict[str, set[int]] = {}  # role -> the CPUs it was pinned to (what tests and logs read)

    def pin_worker(self, num_intra_op_threads: int) -> bool:
        """On the worker thread: pin it, if it steps on one intra-op thread. True if pinned."""
        if num_intra_op_threads != 1:
            return False
        return self._pin("worker", 0)

    def pin_scheduler(self) -> bool:
        """On the scheduler thread (never the main thread): pin it to the CPUs the worker does not have."""
        if threading.current_thread() is threading.main_thread():
            return False
        return self._pin("scheduler", 1)

    def _pin(self, role: str, which: int) -> bool:
        if self.plan is None:
            return False
        cpus = self.plan[which]
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:  # a container that forbids it: run unpinned
            logger.info("could not pin the overlap schedule's %s thread to CPUs %s: %s", role, sorted(cpus), e)
            return False
        self.pinned[role] = set(cpus)
        return True
