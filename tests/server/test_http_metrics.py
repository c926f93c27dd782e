"""SGLang's HTTP-layer metrics count what clients sent: requests and response statuses per endpoint, requests in
flight, and the routing keys (sglang-router's x-smg-routing-key header) of the requests in flight."""

from __future__ import annotations

import threading
import time

from tests.server.conftest import metric_samples as _samples
from tests.server.conftest import metric_value as _value
from tests.server.conftest import start_server


def test_requests_and_statuses_per_endpoint(server):
    """3 good /generate posts and 1 malformed, 2 GETs of a path the app lacks: counted per endpoint and status
    (the unknown path as "other"), and nothing left in flight afterwards but the scrape itself."""
    with start_server(server.path, engine=server.engine) as s, s.client() as c:
        for _ in range(3):
            assert c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
                          ).status_code == 200
        assert c.post("/generate", json={"input_ids": "x"}).status_code == 400
        for path in ("/no/such/path", "/another-one"):
            assert c.get(path).status_code == 404
        got = _samples(c.get("/metrics").text)
    assert _value(got, "sglang:http_requests_total", endpoint="/generate", method="POST") == 4
    assert _value(got, "sglang:http_responses_total", endpoint="/generate", status_code="200") == 3
    assert _value(got, "sglang:http_responses_total", endpoint="/generate", status_code="400") == 1
    assert _value(got, "sglang:http_requests_total", endpoint="other", method="GET") == 2
    assert _value(got, "sglang:http_responses_total", endpoint="other", status_code="404") == 2
    assert _value(got, "sglang:http_requests_active", endpoint="/generate") == 0
    assert _value(got, "sglang:http_requests_active", endpoint="/metrics") == 1  # the scrape, in flight
    assert _value(got, "sglang:routing_keys_active") == 0


def test_routing_keys_of_requests_in_flight(server):
    """Paused in place, three requests wait in flight: two under key "a", one under "b". Two keys are active,
    the histogram has one key at <= 1 request and both at <= 2, /generate shows 3 in flight; once generation
    continues and they finish, no key is active."""
    with start_server(server.path, engine=server.engine) as s, s.client() as c:
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        results = []

        def post(key):
            with s.client() as own:
                results.append(own.post("/generate", headers={"x-smg-routing-key": key}, json={
                    "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}).status_code)

        threads = [threading.Thread(target=post, args=(k,)) for k in ("a", "a", "b")]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while server.engine.get_server_info()["num_in_flight"] < 3:
                assert time.monotonic() < deadline, "the three requests never arrived"
                time.sleep(0.02)
            got = _samples(c.get("/metrics").text)
        finally:
            assert c.post("/continue_generation", json={}).status_code == 200
            for t in threads:
                t.join(60)
        assert results == [200, 200, 200]
        assert _value(got, "sglang:routing_keys_active") == 2
        assert _value(got, "sglang:num_unique_running_routing_keys") == 2
        assert _value(got, "sglang:http_requests_active", endpoint="/generate", method="POST") == 3
        for name in ("sglang:routing_key_all_req_count", "sglang:routing_key_running_req_count"):
            buckets = {float(dict(lab)["le"]): v for (n, lab), v in got.items() if n == f"{name}_bucket"}
            assert buckets[1.0] == 1 and buckets[2.0] == 2 and buckets[float("inf")] == 2  # "b" <= 1, "a" <= 2
            assert _value(got, f"{name}_gsum") == 3
        after = _samples(c.get("/metrics").text)
        assert _value(after, "sglang:routing_keys_active") == 0
        assert _value(after, "sglang:http_requests_active", endpoint="/generate") == 0
