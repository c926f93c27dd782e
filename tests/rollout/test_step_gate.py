"""StepGate's handoff both ways, driven by hand on threads: a control call that leaves while the scheduler
thread waits owes it a step, and a call waiting for that owed step counts as pending (so the overlap schedule
launches nothing ahead that the call would roll back)."""

from __future__ import annotations

import threading
import time

from rollout.step_gate import StepGate


def _wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_call_waiting_for_the_owed_step_is_pending_and_runs_after_it():
    """Order of events: a control call holds the gate; the scheduler thread asks for its turn; the call leaves
    (the turn is owed); a second call arrives and waits, already pending; the scheduler takes its one step
    even so, then must stop; the second call runs after that step, never before."""
    gate, log = StepGate(), []
    entered, go, stepped = threading.Event(), threading.Event(), threading.Event()

    def scheduler():
        with gate.scheduler_turn():
            entered.set()
            go.wait(30)
            assert not gate.must_stop(stepped=False)  # an owed turn steps once, whatever is pending
            log.append("step")
            gate.step_done()
            stepped.set()
            assert _wait_until(lambda: gate.must_stop(stepped=True))

    def second_call():
        with gate:
            log.append("call")

    with gate:
        sched = threading.Thread(target=scheduler, daemon=True)
        sched.start()
        assert _wait_until(lambda: gate._scheduler_waiting)
    assert entered.wait(5)  # the scheduler holds its owed turn and has not stepped yet
    caller = threading.Thread(target=second_call, daemon=True)
    caller.start()
    assert _wait_until(lambda: gate.pending)  # waiting for the owed step, not yet registered for the lock
    go.set()
    assert stepped.wait(5)
    sched.join(5)
    caller.join(5)
    assert not sched.is_alive() and not caller.is_alive()
    assert log == ["step", "call"]
    assert not gate.pending
