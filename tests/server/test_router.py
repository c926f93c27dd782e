"""sglang-router (PyPI sglang-router) in front of two of our servers: health checks pass and it routes
/generate and /v1/completions to both."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from rollout.launch_server import free_port
from tests.server.conftest import start_server

pytest.importorskip("sglang_router")


def _prompt_tokens(served) -> int:
    return served.engine.get_server_info()["num_prompt_tokens"]


@pytest.mark.slow
def test_router_routes_to_both(server, tmp_path):
    """Round-robin over two servers: the router becomes ready, and both engines receive native and OpenAI requests."""
    with start_server(server.path) as second:
        port = free_port()
        log = open(tmp_path / "router.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", server.url, second.url, "--policy", "round_robin", "--log-level", "warn",
             "--worker-startup-timeout-secs", "60", "--health-check-interval-secs", "1"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            with httpx.Client(base_url=url, timeout=30) as c:
                while True:
                    assert proc.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
                    try:
                        if c.get("/health").status_code == 200 and c.get("/v1/models").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline, "router not ready in 60s: " + \
                        (tmp_path / "router.log").read_text()[-3000:]
                    time.sleep(0.25)
                for route in ("generate", "completions"):
                    before = [_prompt_tokens(server), _prompt_tokens(second)]
                    for _ in range(4):
                        if route == "generate":
                            r = c.post("/generate", json=dict(text="Hello there", sampling_params=dict(
                                max_new_tokens=2, temperature=0)))
                            assert r.status_code == 200 and "output_ids" in r.json(), r.text
                        else:
                            r = c.post("/v1/completions", json=dict(model="tiny", prompt="Hello there",
                                                                      max_tokens=2, temperature=0))
                            assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
                    after = [_prompt_tokens(server), _prompt_tokens(second)]
                    assert all(a > b for a, b in zip(after, before)), (route, before, after)
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            log.close()
