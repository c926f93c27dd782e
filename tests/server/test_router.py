"""sglang-router (PyPI sglang-router) in front of two of our servers: health checks pass and it routes
/generate and /v1/completions to both."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def router(workers: list[str], tmp_path, *extra: str):
    """sglang-router over `workers`, ready (its /health and /v1/models answer); stopped at exit."""
    port = free_port()
    log_path = tmp_path / f"router-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *workers, "--log-level", "warn", "--worker-startup-timeout-secs", "60",
         "--health-check-interval-secs", "1", *extra],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            while True:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                try:
                    if c.get("/health").status_code == 200 and c.get("/v1/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "router not ready in 60s: " + log_path.read_text()[-3000:]
                time.sleep(0.25)
            yield c
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


@pytest.mark.slow
def test_router_routes_to_both(server, tmp_path):
    """Round-robin over two servers: the router becomes ready, and both engines receive native and OpenAI requests."""
    with start_server(server.path) as second, router([server.url, second.url], tmp_path, "--policy",
                                                     "round_robin") as c:
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


@pytest.mark.slow
def test_dp_aware_router_and_merged_metrics_with_a_fresh_worker(server, tmp_path):
    """The router's /engine_metrics merges a worker that has finished requests with a fresh one (every counter
    has its samples, with SGLang's labels, from the start; a finish-reason counter with no sample yet made it
    answer 500); and --dp-aware, which adds data_parallel_rank 0 to every body, gets 200 from /v1/completions
    and /generate."""
    with start_server(server.path) as first:
        with first.client() as direct:  # one worker with finished requests, the other fresh
            assert direct.post("/generate", json=dict(input_ids=[5, 6], sampling_params=dict(max_new_tokens=1))
                               ).status_code == 200
        with start_server(server.path) as fresh:
            with router([first.url, fresh.url], tmp_path) as c:
                merged = c.get("/engine_metrics")
                assert merged.status_code == 200, merged.text
                assert "sglang_num_requests_total" in merged.text  # the router writes names with underscores
            with router([first.url, fresh.url], tmp_path, "--dp-aware") as c:
                for _ in range(2):
                    r = c.post("/v1/completions", json=dict(model="tiny", prompt="Hello there", max_tokens=2))
                    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
                    r = c.post("/generate", json=dict(text="Hello", sampling_params=dict(max_new_tokens=2)))
                    assert r.status_code == 200, r.text
