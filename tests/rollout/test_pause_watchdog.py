"""SGLANG_ENGINE_PAUSE_TIMEOUT: a paused engine continues by itself after that many seconds.

Oracles: wall-clock bounds around the timeout, and the request queued while paused finishing with
its full length (not aborted) after the watchdog fired; a continue_generation before the timeout
disarms it (a later pause is not cut short by the earlier timer).
"""

from __future__ import annotations

import threading
import time

import pytest

from rollout import Engine

KW = dict(device="cpu", max_total_tokens=512, show_progress=False)
SP = dict(temperature=0, max_new_tokens=4, ignore_eos=True)


def test_paused_engine_continues_after_the_timeout(tiny_llama, monkeypatch):
    """Paused with the watchdog at 1 s, a queued request waits, then finishes normally within a few seconds."""
    monkeypatch.setenv("SGLANG_ENGINE_PAUSE_TIMEOUT", "1")
    with Engine(str(tiny_llama), **KW) as engine:
        engine.pause_generation(mode="in_place")
        t0 = time.monotonic()
        done: dict = {}
        worker = threading.Thread(target=lambda: done.setdefault("out", engine.generate(input_ids=[5, 6],
                                                                                        sampling_params=SP)))
        worker.start()
        time.sleep(0.5)
        assert "out" not in done  # still paused
        worker.join(10)
        elapsed = time.monotonic() - t0
        assert "out" in done and 0.9 <= elapsed < 8
        assert done["out"]["meta_info"]["finish_reason"]["type"] == "length"


def test_continue_disarms_and_a_new_pause_gets_its_own_timer(tiny_llama, monkeypatch):
    """continue_generation before the timeout disarms the timer: a second pause started 0.7 s into the
    first one's 1.2 s still holds when that first timer would have fired."""
    monkeypatch.setenv("SGLANG_ENGINE_PAUSE_TIMEOUT", "1.2")
    with Engine(str(tiny_llama), **KW) as engine:
        engine.pause_generation(mode="in_place")
        time.sleep(0.7)
        engine.continue_generation()
        engine.pause_generation(mode="in_place")
        t0 = time.monotonic()
        time.sleep(0.8)  # past the first timer's 1.2 s, inside the second's
        assert engine._paused
        out = engine.generate(input_ids=[5, 6], sampling_params=SP)  # returns once the second timer fires
        assert out["meta_info"]["finish_reason"]["type"] == "length" and time.monotonic() - t0 >= 1.1


def test_bad_timeout_is_refused_naming_the_variable(tiny_llama, monkeypatch):
    """A non-numeric or negative SGLANG_ENGINE_PAUSE_TIMEOUT is refused at Engine construction."""
    for bad in ("soon", "-3"):
        monkeypatch.setenv("SGLANG_ENGINE_PAUSE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="SGLANG_ENGINE_PAUSE_TIMEOUT"):
            Engine(str(tiny_llama), **KW)


def test_a_timer_firing_as_a_new_pause_begins_does_not_end_it():
    """A timer whose callback is past its own check when a new pause arms (the engine's lock free in between)
    claims nothing: the new pause holds until its own timer fires. The callback follows Engine's protocol:
    claim under the lock that pauses arm under."""
    from rollout.pause_watchdog import PauseWatchdog

    lock, state = threading.RLock(), {"paused": False}
    entered, go = threading.Event(), threading.Event()
    calls = []

    def resume(timer):
        calls.append(timer)
        if len(calls) == 1:  # the first timer: stop between its check and the claim
            entered.set()
            go.wait(5)
        with lock:
            if watchdog.claim(timer):
                state["paused"] = False

    watchdog = PauseWatchdog(0.5, resume)
    with lock:
        state["paused"] = True
        watchdog.arm()
    assert entered.wait(5)
    with lock:  # a new pause arms while the first timer's callback is on its way
        state["paused"] = True
        watchdog.arm()
    go.set()
    time.sleep(0.1)
    assert state["paused"]  # the first timer did not end the second pause (whose own fires 0.5 s after it began)
    deadline = time.monotonic() + 5
    while state["paused"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not state["paused"] and len(calls) == 2  # the second pause's own timer ended it
