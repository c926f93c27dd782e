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
last allowed one, and so do engines in other processes of this machine: a worker CPU is claimed with an
exclusive `flock` on a per-CPU file in the temp directory (released at shutdown, or by the OS when the
process dies), so two CPU engines on Ray take different worker CPUs; where every allowed CPU is claimed
already, nothing is pinned.

What not. It pins nothing where fewer than two CPUs are allowed, off Linux, or when the worker steps
on more than one intra-op thread (its OpenMP team would inherit the one-CPU mask); it never touches the
caller's threads (the main thread, a trainer's), only the engine's own two, which end at shutdown.
`cpu_pin_overlap_threads=False` (server: `--no-cpu-pin-overlap-threads`) turns it off.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

logger = logging.getLogger(__name__)


def allowed_cpus() -> list[int]:
    """The CPUs the calling thread may run on, sorted; [] where the OS does not say (not Linux)."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return []
    try:
        return sorted(getter(0))
    except OSError:
        return []


def plan_cpus(allowed: list[int], worker: int) -> tuple[set[int], set[int]]:
    """(the worker's CPUs, the scheduler thread's CPUs): `worker` alone, and every other allowed CPU."""
    return {worker}, {c for c in allowed if c != worker}


def claims_directory() -> str:
    """Where worker CPUs are claimed: one directory per user in the temp directory."""
    return os.path.join(tempfile.gettempdir(), f"rollout-engine-cpus-{os.getuid()}")


class CpuClaims:
    """Machine-wide claims on worker CPUs: an exclusive, non-blocking flock on `<dir>/cpu<N>.lock`. A lock
    belongs to the open file, so a second claim of the same CPU fails in this process as in any other."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or claims_directory()

    def claim(self, candidates: list[int]) -> tuple[int, int] | None:
        """(cpu, fd) of the first of `candidates` nobody holds, now held through fd; None if all are held
        (or claims cannot be made here: no fcntl, an unwritable directory)."""
        try:
            import fcntl

            os.makedirs(self.directory, exist_ok=True)
        except (ImportError, OSError):
            return None
        for cpu in candidates:
            try:
                fd = os.open(os.path.join(self.directory, f"cpu{cpu}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held by another engine
                os.close(fd)
                continue
            return cpu, fd
        return None


class OverlapPinning:
    """The CPUs of one overlap schedule's two threads; each thread calls its own pin method; `release()`
    (at shutdown) gives the worker's CPU claim back."""

    def __init__(self, enabled: bool, claims: CpuClaims | None = None) -> None:
        self.plan: tuple[set[int], set[int]] | None = None
        self._fd: int | None = None
        self.pinned: dict[str, set[int]] = {}  # role -> the CPUs it was pinned to (what tests and logs read)
        if not enabled or not hasattr(os, "sched_setaffinity"):
            return
        allowed = allowed_cpus()
        if len(allowed) < 2:
            return
        claimed = (claims or CpuClaims()).claim(allowed[::-1])  # from the last CPU down
        if claimed is None:
            logger.info("every allowed CPU already has an overlap worker pinned to it: this engine's threads "
                        "stay unpinned")
            return
        cpu, self._fd = claimed
        self.plan = plan_cpus(allowed, cpu)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops the flock

    def __del__(self) -> None:  # an engine that failed after its scheduler was built never reaches close()
        self.release()

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
