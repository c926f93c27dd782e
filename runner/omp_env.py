"""How long an OpenMP thread of the engine's child processes spins before it sleeps, set where they start.

torch's CPU build runs its parallel ops on GNU OpenMP (libgomp). A thread that reaches a barrier first spins,
by default 300,000 iterations, before it sleeps. On a quiet machine that spin is what makes a small decode step
fast (each step opens hundreds of short parallel regions). On a shared one, where the team's other thread is
descheduled for a whole time slice, the spinner burns its core through every barrier: measured on 2 cores
with two busy processes beside it (Qwen2.5-0.5B shape, bf16, 4 x 32 -> 32, 2 threads, three calls), 33.5 s of
wall and 33.3 CPU-s by default, 8.9-9.1 s with GOMP_SPINCOUNT=3000-10000, 8.4 s with OMP_WAIT_POLICY=PASSIVE;
quiet, the 40M fp32 decode (16 x 32 -> 64) took 0.38-0.44 s at the default and at 10,000 alike, and 0.50-0.55 s
passive. So processes the engine starts itself (the server's engine process, tensor-parallel ranks, the
trainers' --engine-process through RemoteEngine's child_env) get
GOMP_SPINCOUNT=10000 unless the user's environment already chooses (GOMP_SPINCOUNT or OMP_WAIT_POLICY).

libgomp reads these variables once, when it loads: they apply to a process that has not imported torch yet,
which is why this sets them around the spawn of a child. The caller's own process gets the same default only
from `import rollout` before torch (rollout/__init__.py; importing this module imports torch first).
"""

from __future__ import annotations

import contextlib
import os
import threading

CHILD_SPINCOUNT = "10000"
USER_CHOICES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def child_defaults() -> dict[str, str]:
    """The variables a child should get that the environment does not set (nothing once the user chose)."""
    if any(k in os.environ for k in USER_CHOICES):
        return {}
    return {"GOMP_SPINCOUNT": CHILD_SPINCOUNT}


_lock = threading.Lock()  # guards _holders and _added: threads may start engines at the same time
_holders = 0
_added: dict[str, str] = {}


@contextlib.contextmanager
def for_children():
    """Inside: os.environ holds child_defaults(), so processes started here inherit them; restored when the
    last thread inside leaves (a second thread entering meanwhile sees ours, not a choice of the user's)."""
    global _holders, _added
    with _lock:
        if _holders == 0:
            _added = child_defaults()
            os.environ.update(_added)
        _holders += 1
        added = dict(_added)
    try:
        yield added
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                for k in _added:
                    os.environ.pop(k, None)
                _added = {}
