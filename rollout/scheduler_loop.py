"""The scheduler thread's body: wait for work, run steps under the engine lock, deliver their results.

The lock is held across a run of steps and left at a step boundary as soon as a control call waits
for it (rollout.step_gate), after rolling back a decode step launched ahead (rollout.overlap).

Nothing a caller does can end this thread. Results leave through `Engine._deliver`, which never raises
(a sink whose consumer is gone drops its requests). A step attributes its own failures to the requests
that caused them (see rollout.scheduler). Anything else that raises in an iteration (a bug) is caught
here: every request in flight is finished as abort with the reason, the KV bookkeeping starts from
clean pools, and the loop goes on serving. The thread ends only at `Engine.shutdown()`.

It holds no state of its own; the engine owns the lock, the flags and the requests. The engine's
StepProfiler (rollout.profiler) is driven from here, since a torch profile covers one thread.
"""

from __future__ import annotations

import logging
import time

from runner.openmp_pool import release_thread_pool

logger = logging.getLogger(__name__)


def run_scheduler_loop(engine) -> None:
    while True:
        try:
            if not _one_iteration(engine):
                return
        except Exception as e:  # never let the thread die: fail what is in flight, keep serving
            logger.exception("scheduler loop iteration failed; aborting every request in flight")
            try:
                with engine._cv:
                    engine._fail_all(f"internal error in the scheduler loop: {type(e).__name__}: {e}")
            except Exception:  # even recovery failed: do not spin on it
                logger.exception("recovery after a scheduler loop failure failed")
                time.sleep(0.1)


def _one_iteration(engine) -> bool:
    """Take submissions and run steps until a control call waits, there is nothing to do, or the engine
    shuts down; then leave the step lock at a step boundary. False once the engine is shut down."""
    gate = engine._cv
    stepped = False
    with gate.scheduler_turn():
        gate.clear_wake()  # before looking for work: a submission after this wakes the wait below
        engine._take_submissions()
        profiler = engine._profiler  # torch.profiler records this thread's ops only (rollout.profiler)
        profiler.service()
        try:
            while not engine._shutdown and not gate.must_stop(stepped) and engine._can_step():
                profiler.service()
                # Looked up each time, not bound once: tests wrap scheduler.step to act between steps.
                with profiler.step_scope():
                    _deliver_all(engine, engine.scheduler.step())
                profiler.after_step(max(1, engine.scheduler.last_block_steps))  # a decode block: its steps
                stepped = True
                gate.step_done()
                engine._take_submissions()
                engine._publish_load()
        finally:
            engine.scheduler.cancel_ahead()  # the lock is only ever left at a step boundary
            engine._publish_load()
        if engine._shutdown:
            profiler.close()
            return False
    if not stepped:
        # Idle: give back this thread's OpenMP pool, so a trainer's ops in the same process are not
        # slowed by it (runner/openmp_pool.py); the next step builds a new one.
        release_thread_pool()
        gate.wait_for_wake()
    return True


def _deliver_all(engine, updated) -> None:
    # Its own frame: nothing of a step stays referenced while the thread sleeps (a request pins its sink,
    # and a sink whose consumer is gone should be collectable).
    for req in updated:
        engine._deliver(req)
