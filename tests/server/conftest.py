"""Fixtures for the HTTP server tests: real servers on free ports, real clients.

`server` is one in-process uvicorn server (background thread) over an Engine on the tiny Llama
checkpoint, started once per session; tests that need their own weights or options start theirs with
`start_server` (`in_child=True`: the engine in its own process, as launch_server runs it). Every engine is built with `disable_cuda_graph=True` (no compiled decode step: the
server, not the runner, is under test, and a compile would dominate the run time). Clients use short,
bounded timeouts so a hung server fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import httpx
import pytest

from rollout import Engine
from rollout.launch_server import ServerThread, free_port
from rollout.server import ServerArgs, create_app
from rollout.server.engine_client import EngineClient

ENGINE_KW = dict(device="cpu", max_total_tokens=4096, max_running_requests=64, show_progress=False,
                 disable_cuda_graph=True, enable_memory_saver=True)
TIMEOUT = httpx.Timeout(60.0, connect=5.0)


@dataclass
class Served:
    engine: Engine
    thread: ServerThread
    path: str

    @property
    def url(self) -> str:
        return self.thread.url

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=TIMEOUT, **kw)


@contextlib.contextmanager
def start_server(path, engine: Engine | None = None, engine_kw: dict | None = None, in_child: bool = False,
                 **server_kw):
    """Serve `engine` (or a new Engine on `path`; with `in_child`, in an engine process behind an
    EngineClient, launch_server's default layout) on a free port; stops both (an engine it built) at exit."""
    own = engine is None
    kw = {**ENGINE_KW, **(engine_kw or {})}
    if engine is None and in_child:
        engine = EngineClient.spawn({"model_path": str(path), **kw}, start_timeout_s=120)
    engine = engine or Engine(str(path), **kw)
    try:
        args = ServerArgs(port=free_port(), **{"served_model_name": "tiny", **server_kw})
        thread = ServerThread(create_app(engine, args), args).start()
        try:
            yield Served(engine, thread, str(path))
        finally:
            thread.stop()
    finally:
        if own:
            engine.shutdown()


@pytest.fixture(scope="session")
def server(tiny_llama):
    with start_server(tiny_llama) as s:
        yield s


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted label pairs): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric_value(samples, name: str, **labels) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == w
                                                                          for k, w in labels.items()))
