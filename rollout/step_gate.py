"""StepGate: the engine's step lock, with a fair handoff from the scheduler thread to control calls.

The scheduler thread holds the lock for a run of steps; a control call (pause, abort, a weight update,
memory release, get_server_info, ...) enters with `with gate:`. A plain lock is not enough: the
scheduler thread takes it again straight after releasing it, so a waiting control call would starve
until the batch finished. Here a control call first registers itself (`pending`), the scheduler thread
checks `pending` after every step, stops there (with its in-flight work rolled back, see
`on_acquire`), and does not take the lock again until every registered call has had it. So a control
call waits for at most the step in progress.

Submissions never take this lock (the engine queues them); the scheduler thread sleeps on `wait_for_wake`
when it has nothing to do, and anything that may give it work calls `notify_all`.

It does not decide what runs; rollout.scheduler_loop does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager


class StepGate:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._meta = threading.Condition(threading.Lock())
        self._pending = 0  # control calls registered and not yet holding the lock
        self._wake = threading.Event()
        # Called by every control call once it holds the lock, before its body: the engine rolls back a
        # step the scheduler launched ahead (the overlap schedule), so control always sees a step boundary.
        self.on_acquire: Callable[[], None] | None = None
        self.on_release: Callable[[], None] | None = None  # ... and after its body (the engine's load counters)

    # ---- control calls -------------------------------------------------------------------------
    def __enter__(self) -> StepGate:
        with self._meta:
            self._pending += 1
        try:
            self._lock.acquire()
        finally:
            with self._meta:
                self._pending -= 1
                if not self._pending:
                    self._meta.notify_all()
        try:
            if self.on_acquire is not None:
                self.on_acquire()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.on_release is not None:
                self.on_release()
        finally:
            self._lock.release()
        self._wake.set()  # what the call changed may let the scheduler run again

    @property
    def pending(self) -> bool:
        """A control call is waiting for the lock: the scheduler thread should stop at this step."""
        return self._pending > 0

    # ---- the scheduler thread -----------------------------------------------------------------------
    @contextmanager
    def scheduler_turn(self):
        """Hold the lock for a run of steps, once no control call is waiting for it."""
        with self._meta:
            while self._pending:
                self._meta.wait()
        with self._lock:
            yield

    def clear_wake(self) -> None:
        self._wake.clear()

    def wait_for_wake(self, timeout: float | None = None) -> None:
        self._wake.wait(timeout)

    def notify_all(self) -> None:
        """Something may have given the scheduler work (a submission, continue, resume, shutdown)."""
        self._wake.set()
