"""Engine.drain and /drain (SGLang's drain): wait until nothing is in flight, or a timeout.

Oracles: requests the test itself holds in flight (generation paused in place, so they cannot finish
on their own) and the wall clock.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.conftest import start_server

SP = dict(temperature=0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama, module_engines):
    return module_engines(tiny_llama)


def _held(engine, n: int = 2):
    """n requests submitted while generation is paused in place: in flight until continue_generation()."""
    engine.pause_generation(mode="in_place")
    outs: list = []
    t = threading.Thread(target=lambda: outs.append(engine.generate(input_ids=[[5, 6, 7]] * n, sampling_params=SP)))
    t.start()
    deadline = time.monotonic() + 10
    while len(engine._in_flight()) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return t, outs


def test_idle_drain_returns_at_once(engine):
    """With nothing in flight drain succeeds immediately, whatever the timeout."""
    t0 = time.monotonic()
    assert engine.drain(timeout=5.0) == {"success": True, "remaining_requests": 0}
    assert engine.drain() == {"success": True, "remaining_requests": 0}
    assert time.monotonic() - t0 < 1.0


def test_drain_times_out_with_requests_in_flight_then_completes(engine):
    """Held requests make drain(0.2) report them after ~0.2 s; once generation continues, drain() waits
    for them and succeeds, and they finish normally."""
    t, outs = _held(engine)
    try:
        t0 = time.monotonic()
        assert engine.drain(timeout=0.2) == {"success": False, "remaining_requests": 2}
        assert 0.15 <= time.monotonic() - t0 < 5
        threading.Timer(0.3, engine.continue_generation).start()
        assert engine.drain() == {"success": True, "remaining_requests": 0}
    finally:
        engine.continue_generation()
        t.join(30)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs[0]] == ["length", "length"]


@pytest.mark.parametrize("timeout", [-1, "5", True, float("nan")])
def test_bad_timeout_is_refused_by_name(engine, timeout):
    """A timeout that is not None or a number >= 0 is a ValueError naming it."""
    with pytest.raises(ValueError, match="drain timeout"):
        engine.drain(timeout=timeout)


def test_http_drain_and_many_waiting_drains_do_not_block_control(engine, tiny_llama):
    """/drain answers SGLang's body; eight /drain calls with no timeout, waiting on held requests, leave
    /abort_request answering at once (they do not hold the control threads), and all succeed after."""
    with start_server(tiny_llama, engine=engine) as s, s.client() as c:
        assert c.post("/drain", json={"timeout": 5.0}).json() == {"success": True, "remaining_requests": 0}
        t, _ = _held(engine)
        try:
            r = c.post("/drain", json={"timeout": 0.2}).json()
            assert r == {"success": False, "remaining_requests": 2}
            with ThreadPoolExecutor(8) as pool:
                waits = [pool.submit(lambda: s.client().post("/drain", json={"timeout": None}).json())
                         for _ in range(8)]
                time.sleep(0.3)
                t0 = time.monotonic()
                assert c.post("/abort_request", json={"rid": "nobody"}).status_code == 200
                assert time.monotonic() - t0 < 2.0
                assert not any(w.done() for w in waits)
                engine.continue_generation()
                assert [w.result(30) for w in waits] == [{"success": True, "remaining_requests": 0}] * 8
        finally:
            engine.continue_generation()
            t.join(30)
        assert c.post("/drain", json={"timeout": "x"}).status_code == 400
