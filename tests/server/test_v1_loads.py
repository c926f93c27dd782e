"""GET /v1/loads (SGLang's load report, which slime polls after abort_all until a server is idle): counts
in flight while a stream runs and zero after it is aborted, in both server layouts; the sections and
filters SGLang takes.

Oracles: requests the test itself started and aborted, and the engine's own get_server_info.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.server.conftest import start_server

LONG = dict(input_ids=[5, 6, 7, 8], sampling_params=dict(max_new_tokens=3000, ignore_eos=True), stream=True)


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.parametrize("in_child", [False, True], ids=["engine-in-process", "engine-process"])
def test_loads_count_a_running_stream_then_zero_after_abort_all(tiny_llama, in_child):
    """One running stream shows as num_running_reqs 1 with its KV tokens (at least the prompt's) in num_used_tokens; after
    /abort_request {"abort_all": true} the report falls back to zero running and waiting."""
    with start_server(tiny_llama, in_child=in_child) as served, served.client() as c:
        def loads(query="include=core"):
            r = c.get(f"/v1/loads?{query}")
            assert r.status_code == 200, r.text
            (load,) = r.json()["loads"]
            return load

        idle = loads()
        assert (idle["dp_rank"], idle["num_running_reqs"], idle["num_waiting_reqs"]) == (0, 0, 0)
        info = c.get("/get_server_info").json()
        assert idle["max_total_num_tokens"] == info["max_total_num_tokens"] and idle["max_running_requests"] >= 1
        started = threading.Event()

        def stream():
            with served.client() as s, s.stream("POST", "/generate", json=LONG) as r:
                for _ in r.iter_lines():
                    started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        _wait(lambda: loads()["num_running_reqs"] == 1, "the stream to show as running")
        busy = loads("include=core,queues")
        assert busy["num_used_tokens"] >= 4 and 0 < busy["token_usage"] <= 1 and busy["queues"] == {"waiting": 0}
        assert c.post("/abort_request", json={"abort_all": True}).status_code == 200
        _wait(lambda: loads()["num_running_reqs"] + loads()["num_waiting_reqs"] == 0, "the abort to land")
        t.join(30)
        assert not t.is_alive()
        # Idle with a warm prefix cache (the aborted stream's KV and a finished request's are cached): SGLang counts
        # evictable cache slots as free, so every load report reads zero tokens in use without a flush.
        warm = dict(input_ids=[5, 6, 7, 8, 9, 10, 11, 12], sampling_params=dict(max_new_tokens=4))
        assert c.post("/generate", json=warm).status_code == 200
        assert c.post("/generate", json=warm).json()["meta_info"]["cached_tokens"] > 0  # the cache is warm
        _wait(lambda: loads()["num_used_tokens"] == 0, "an idle server to read zero tokens in use")
        assert loads()["token_usage"] == 0.0 and c.get("/get_load").json()[0]["num_tokens"] == 0
        metrics = c.get("/metrics").text
        assert any(line.startswith("sglang:num_used_tokens") and line.split()[-1] in ("0", "0.0")
                   for line in metrics.splitlines()), metrics[:2000]


def test_loads_sections_and_filters(client):
    """include=all adds the queues; another dp_rank is an empty list (one scheduler here); an unknown section
    or format is a 400 naming the parameter."""
    assert "queues" in client.get("/v1/loads?include=all").json()["loads"][0]
    assert client.get("/v1/loads").json()["loads"][0]["dp_rank"] == 0
    assert client.get("/v1/loads?dp_rank=1").json() == {"loads": []}
    r = client.get("/v1/loads?include=core,gpu")
    assert r.status_code == 400 and "include" in r.text and "gpu" in r.text
    r = client.get("/v1/loads?format=prometheus")
    assert r.status_code == 400 and "format" in r.text
