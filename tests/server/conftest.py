"""Fixtures for the HTTP server tests: real servers on free ports, real clients.

`server` is one in-process uvicorn server (background thread) over an Engine on the tiny Llama
checkpoint, started once per session; tests that need their own weights or options start theirs with
`start_server`. Every engine is built with `disable_cuda_graph=True` (no compiled decode step: the
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
def start_server(path, engine: Engine | None = None, engine_kw: dict | None = None, **server_kw):
    """Serve `engine` (or a new Engine on `path`) on a free port; stops both (an engine it built) at exit."""
    own = engine is None
    engine = engine or Engine(str(path), **{**ENGINE_KW, **(engine_kw or {})})
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
