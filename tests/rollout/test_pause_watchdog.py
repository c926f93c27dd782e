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
