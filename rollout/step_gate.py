"""StepGate: the engine's step lock, with a fair handoff from the scheduler thread to control calls.

The scheduler thread holds the lock for a run of steps; a control call (pause, abort, a weight update,
memory release, get_server_info, ...) enters with `with gate:`. A plain lock is not enough: the
scheduler thread takes it again straight after releasing it, so a waiting control call would starve
until the batch finished. Here a control call first registers itself (`pending`), the scheduler thread
checks `pending` after every step, stops there (with its in-flight work rolled back, see
`on_acquire`), and does not take the lock again until every registered call has had it. So a control
call waits for at most the step in progress.

The handoff is fair the other way too: a control call that leaves the lock while the scheduler thread waits
for it owes the scheduler a turn (`owed`), and a new control call waits until the scheduler has taken one
step of it (`step_done`) or found nothing to do. Without that, one thread calling a cheap control method in
a tight loop (a trainer polling get_weights_by_name, a health check) kept the lock, and no request made
progress. A control call nested in one that holds the lock (or made from the scheduler thread during its
turn) never waits: the lock is its thread's already.

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
        self._owed_waiters = 0  # control calls waiting for the scheduler's owed step before they register
        self._owner: int | None = None  # the thread holding the lock, and how many times (nested calls)
        self._depth = 0
        self._scheduler_waiting = False  # the scheduler thread waits for its turn
        self._owed = False  # a control call left while it waited: it takes a step before the next call
        self._turn_owed = False  # the current scheduler turn is an owed one
        self._wake = threading.Event()
        # Called by every control call once it holds the lock, before its body: the engine rolls back a
        # step the scheduler launched ahead (the overlap schedule), so control always sees a step boundary.
        self.on_acquire: Callable[[], None] | None = None
        self.on_release: Callable[[], None] | None = None  # ... and after its body (the engine's load counters)
        # Called (any thread) as a control call registers to wait: the engine stops a decode block in progress
        # at its next step (rollout/scheduler.py interrupt_block), so the call waits for one step at most.
        self.on_pending: Callable[[], None] | None = None

    # ---- control calls -------------------------------------------------------------------------
    def __enter__(self) -> StepGate:
        nested = self._owner == threading.get_ident()
        if not nested:
            with self._meta:
                while self._owed:  # the scheduler thread's turn first
                    self._owed_waiters += 1
                    self._notify_pending()  # that turn's step may be a decode block
                    try:
                        self._meta.wait()
                    finally:
                        self._owed_waiters -= 1
                self._pending += 1
                self._notify_pending()
        try:
            self._lock.acquire()
        finally:
            if not nested:
                with self._meta:
                    self._pending -= 1
                    if not self._pending:
                        self._meta.notify_all()
        self._hold()
        try:
            if self.on_acquire is not None:
                self.on_acquire()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.on_release is not None:
                self.on_release()
        finally:
            self._leave()
        self._wake.set()  # what the call changed may let the scheduler run again

    def _notify_pending(self) -> None:
        """After registering (so `pending` reads True first: the engine checks it after clearing the flag)."""
        if self.on_pending is not None:
            self.on_pending()

    def _hold(self) -> None:
        self._owner = threading.get_ident()
        self._depth += 1

    def _leave(self) -> None:
        """Release one level of the lock; the outermost release of a control call owes a waiting scheduler
        thread its turn."""
        self._depth -= 1
        outermost = not self._depth
        if outermost:
            self._owner = None
        self._lock.release()
        if outermost:
            with self._meta:
                if self._scheduler_waiting:
                    self._owed = True
                    self._meta.notify_all()

    @property
    def pending(self) -> bool:
        """A control call is waiting for the lock, or for the owed step before it: the scheduler thread should
        stop at this step (and the overlap schedule launch nothing ahead, which would be rolled back)."""
        return self._pending > 0 or self._owed_waiters > 0

    # ---- the scheduler thread -----------------------------------------------------------------------
    @contextmanager
    def scheduler_turn(self):
        """Hold the lock for a run of steps, once no control call is waiting for it (or the turn is owed)."""
        with self._meta:
            self._scheduler_waiting = True
            while self._pending and not self._owed:
                self._meta.wait()
        self._lock.acquire()
        with self._meta:
            self._scheduler_waiting = False
            self._turn_owed = self._owed
        self._owner, self._depth = threading.get_ident(), 1
        try:
            yield
        finally:
            self._owner, self._depth = None, 0
            self._lock.release()
            with self._meta:
                self._owed = self._turn_owed = False
                self._meta.notify_all()

    def must_stop(self, stepped: bool) -> bool:
        """Whether the scheduler thread should leave the lock before its next step: a control call waits,
        unless this turn is owed and has not stepped yet (it takes one step first)."""
        return self._pending > 0 and (stepped or not self._turn_owed)

    def step_done(self) -> None:
        """The scheduler thread took a step: an owed turn is served, control calls may register again."""
        if self._owed:
            with self._meta:
                self._owed = False
                self._meta.notify_all()

    def clear_wake(self) -> None:
        self._wake.clear()

    def wait_for_wake(self, timeout: float | None = None) -> None:
        self._wake.wait(timeout)

    def notify_all(self) -> None:
        """Something may have given the scheduler work (a submission, continue, resume, shutdown)."""
        self._wake.set()
