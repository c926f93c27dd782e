"""`python -m rollout.launch_server --model-path DIR [--host 127.0.0.1] [--port 30000] [--api-key KEY] ...`

Builds the Engine from SGLang-named flags (every EngineArgs field is one; `--help` lists them), serves it
with uvicorn, logs the URL once the socket listens, and shuts down cleanly on SIGINT/SIGTERM: uvicorn
stops accepting, finishes open responses, then the engine is shut down (in-flight requests end with
finish_reason abort); the shutdown and the stop are printed. `--log-level` (default info) applies to
every logger of the process; uvicorn's access log is on unless `--no-access-log`.

Two processes by default (SGLang's layout): this one runs HTTP, tokenization and detokenization; the
Engine (scheduler and model) runs in a child (rollout/server/engine_process.py, reached through
rollout/server/engine_client.py), so the two halves hold two GILs. The child gets the torch thread count
an in-process engine would have; this process then keeps one torch thread (it runs no model). An engine
that fails to build makes the server exit 1 with its reason. `--engine-in-process` keeps everything in
this process.

`ServerThread` runs the same server in a background thread of this process (tests, benchmarks).
uvicorn picks uvloop and httptools when they are installed (`pip install uvicorn[standard]`): on the
tiny-model streaming benchmark they cut the server's CPU by roughly a fifth (one run each, loaded machine).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time

import uvicorn

from rollout.server.app import create_app
from rollout.server.args import ServerArgs, parse_args
from rollout.server.gc_freeze import freeze_heap

logger = logging.getLogger("rollout.server")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _uvicorn_config(app, server_args: ServerArgs, log_level: str, access_log: bool) -> uvicorn.Config:
    # uvicorn writes its access lines at INFO: on at --log-level info/debug unless --no-access-log.
    return uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=log_level,
                          access_log=access_log, timeout_keep_alive=30, lifespan="on")


def configure_logging(log_level: str) -> None:
    """--log-level for every logger of the process (rollout, runner, uvicorn, libraries), one format."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)


class ServerThread:
    """An app on uvicorn in a daemon thread; `start()` returns once it accepts connections. Quiet by
    default (tests, benchmarks): warnings only, no access log."""

    def __init__(self, app, server_args: ServerArgs, log_level: str = "warning", access_log: bool = False) -> None:
        self.server = uvicorn.Server(_uvicorn_config(app, server_args, log_level, access_log))
        self.server.install_signal_handlers = lambda: None  # only the main thread may own signals
        self.url = f"http://{server_args.host}:{server_args.port}"
        self.thread = threading.Thread(target=self.server.run, name="rollout-http-server", daemon=True)

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server at {self.url} did not start within {timeout_s}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def server_engine_kwargs(engine_kwargs: dict) -> dict:
    """The engine's options as the server builds it. On a CPU device, with disable_overlap_schedule left at
    None, the plain schedule: the overlap schedule's second thread pays only where a core is free for it
    (rollout/thread_pinning.py), and beside the HTTP process and its clients none is. On a 2-core AMD EPYC
    (Zen 5), `bench/serve_ab.py` (500 streams, 64 in flight, tiny model) measured the plain schedule
    1.27x the overlap's tok/s in the server (6 of 6 pairs), and the overlap unpinned 1.13x it pinned, while
    in-process the pinned overlap is 1.3x single plain steps. The Engine's own CPU default is the plain schedule
    now too (its decode blocks beat the overlap in-process as well); this keeps the server's choice explicit.
    An explicit value is kept as given."""
    kwargs = dict(engine_kwargs)
    if kwargs.get("disable_overlap_schedule") is None and str(kwargs.get("device") or "cpu").startswith("cpu"):
        kwargs["disable_overlap_schedule"] = True
    return kwargs


def build_engine(server_args: ServerArgs, engine_kwargs: dict):
    """The Engine in this process (--engine-in-process), else an EngineClient over the engine process;
    None (the reason printed) if the engine process failed to start."""
    engine_kwargs = server_engine_kwargs(engine_kwargs)
    if server_args.engine_in_process:
        from rollout import Engine

        return Engine(**engine_kwargs)
    import torch

    from rollout.server.engine_client import EngineClient, EngineProcessError

    try:
        engine = EngineClient.spawn(engine_kwargs, num_threads=torch.get_num_threads(),
                                    start_timeout_s=server_args.engine_start_timeout_s)
    except EngineProcessError as e:
        print(f"rollout server not started: {e}", file=sys.stderr, flush=True)
        return None
    # This process parses, tokenizes and streams; it runs no forward pass and decodes no tensors (the
    # engine process does): one intra-op thread, so torch's pool never competes with the engine's.
    torch.set_num_threads(1)
    logger.info("engine process %d ready (%d torch threads)", engine.pid, engine.engine_num_threads)
    return engine


def main(argv: list[str] | None = None) -> int:
    server_args, engine_kwargs = parse_args(argv)
    log_level = str(engine_kwargs.get("log_level", "info")).lower()
    configure_logging(log_level)
    engine = build_engine(server_args, engine_kwargs)
    if engine is None:
        return 1
    try:
        app = create_app(engine, server_args)
        server = uvicorn.Server(_uvicorn_config(app, server_args, log_level, server_args.access_log))

        def announce():  # uvicorn binds after lifespan startup: wait for the socket, then say where
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                logger.info("rollout server ready at http://%s:%d (model %s)", server_args.host, server_args.port,
                            app.state.model_name)
                print(f"rollout server ready at http://{server_args.host}:{server_args.port}", flush=True)

        threading.Thread(target=announce, daemon=True).start()
        freeze_heap()  # start-up's objects leave the collector's scans (rollout/server/gc_freeze.py)
        # uvicorn turns SIGINT/SIGTERM into a graceful exit, then re-raises the signal into the handler
        # that was installed before it: make that one a no-op, so the engine is shut down below and the
        # process exits 0 instead of dying by the signal.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda num, frame: None)
        server.run()
    finally:
        # Printed, like the ready line, whatever --log-level says: an operator sees why the server is gone.
        print("rollout server shutting down: in-flight requests end with finish_reason abort", flush=True)
        engine.shutdown()
    print("rollout server stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
