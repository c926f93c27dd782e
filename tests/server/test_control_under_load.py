"""Over HTTP, control answers while a large batch runs (issue 20, item 2): with one /generate of
n=64 x 160 tokens running and a second /generate arriving, /health, /get_load (reporting the 65
sequences) and /abort_request answer before the batch would have finished, and the abort ends every
sequence with its partial output."""

from __future__ import annotations

import threading
import time

import httpx

from tests.server.conftest import start_server
from tests.step_counter import count_steps

N, NEW = 64, 160


def test_health_get_load_and_abort_answer_while_a_large_batch_runs(tiny_llama):
    """/health, /get_load and /abort_request(abort_all) answer mid-batch; every sequence ends as abort."""
    engine_kw = {"max_total_tokens": N * (NEW + 16) + 256, "max_running_requests": N}
    with start_server(tiny_llama, engine_kw=engine_kw) as s:
        num_steps = count_steps(s.engine)
        body = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"n": N, "temperature": 1.0, "max_new_tokens": NEW,
                                                                  "ignore_eos": True}}
        result: list = []
        t = threading.Thread(target=lambda: result.append(httpx.post(f"{s.url}/generate", json=body, timeout=120)),
                             daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while num_steps() < 5:
            assert time.monotonic() < deadline, "the batch never started"
            time.sleep(0.002)
        # A second /generate lands on the event loop mid-batch: submitting it must not block the loop.
        small: list = []
        t2 = threading.Thread(target=lambda: small.append(httpx.post(f"{s.url}/generate", timeout=120, json={
            "input_ids": [5, 6], "sampling_params": {"max_new_tokens": NEW, "ignore_eos": True}})), daemon=True)
        t2.start()
        with s.client() as c:
            assert c.get("/health").status_code == 200
            seen = time.monotonic() + 30  # the second request reaches the engine once its POST is handled
            while (load := c.get("/get_load").json()[0])["num_reqs"] != N + 1:
                assert time.monotonic() < seen, f"/get_load never counted the second request: {load}"
                time.sleep(0.01)
            assert c.post("/abort_request", json={"abort_all": True}).status_code == 200
        answered_at = num_steps()
        t.join(60)
        t2.join(60)
        assert not t.is_alive() and not t2.is_alive()
        assert small[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert answered_at < NEW, "control was answered only after the batch had run to its end"
        outs = result[0].json()
        assert len(outs) == N
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < len(o["output_ids"]) < NEW
