"""EngineClient: the HTTP server's stand-in for an Engine that runs in a child process.

`EngineClient.spawn(engine_kwargs)` starts rollout/server/engine_process.py (multiprocessing "spawn")
and offers what the server's routes use of an Engine: `async_generate` (streamed or not, n > 1,
logprobs, LoRA, ...), every control and weights method (each a call into the child, answered with the
same value, or the same exception type and message, so HTTP status codes and bodies do not change),
`get_load`, finish observers (/metrics), and the attributes routes read: `args`, `tokenizer` (loaded
here, so tokenizing prompts, chat templates and detokenizing outputs never take the engine's GIL),
`runner.context_len`, `runner.lora_adapters()`, `weight_version`, `model_path`.

Messages on the private pipe (pickled; engine_process.py says why that is safe), parent -> child:
("generate", call_id, (ids per prompt, single), kwargs), ("abort", call_id), ("call", call_id, method or
function, args, kwargs), ("shutdown",). Child -> parent: ("submitted", call_id, ok, (requests, single) or
error), ("out", deltas, load) once per engine step, ("reply", call_id, ok, value or error, state),
("bye",). A request's small "generate" and "abort" go onto the pipe from the event loop when that cannot
block (`_send_direct`); everything else, and those whenever a message is queued ahead, is written by one
sender thread (an event loop never blocks on the pipe). A PipeReader (rollout/server/engine_pipe.py) reads and
dispatches, on its thread or, once `attach_loop` was called (the HTTP app does at start-up), on the server's event
loop; the generate calls ("submitted", "out": deltas applied to this side's copy of each request, at once on
the reading loop, one wake-up per other event loop) are handled by rollout/server/engine_generate.py, mixed in
here.

When the child dies, every request in flight ends as abort with the reason, every waiting call raises
RuntimeError, and `is_alive()` turns False (/health answers 503). Every wait is bounded.

What it does not do: run anything of the model, or restart a dead engine process.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import pickle
import queue
import select
import threading
import weakref

from rollout.server import engine_process
from rollout.server.engine_generate import RemoteGeneration, _Call
from rollout.server.engine_pipe import PipeReader, write_frame
from rollout.server.engine_process import EngineProcessError
from rollout.tokenizer import TokenizerWrapper

logger = logging.getLogger("rollout.server.engine_client")
DIRECT_OPS = ("generate", "abort")  # the messages a request's path sends; everything else takes the sender thread
# The pipe is a Unix socket pair (multiprocessing.Pipe(duplex=True)): one that polls writable has at least
# three quarters of its send buffer (~200 KB) free, and write_frame writes a frame this small (a 4-byte
# header, then the pickle) in one write that cannot block.
DIRECT_MAX_BYTES = 4096 - 4


class _RunnerView:
    """The two things routes read from Engine.runner, served from this side."""

    def __init__(self, client: EngineClient, context_len: int) -> None:
        self._client = client
        self.context_len = context_len

    def lora_adapters(self) -> dict[str, dict]:
        return self._client._state["lora_adapters"]


def _remote(name: str):
    def method(self, *args, **kwargs):
        return self._call(name, args, kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Engine.{name}, run in the engine process (same result, same exceptions)."
    return method


class EngineClient(RemoteGeneration):
    def __init__(self, conn, process, info: dict) -> None:
        self._conn = conn
        self._process = process
        self.args = info["args"]
        self.pid = info["pid"]
        self.engine_num_threads = info["num_threads"]
        self._state = info["state"]
        self.runner = _RunnerView(self, info["context_len"])
        self.tokenizer = TokenizerWrapper(self.args.tokenizer_path or self.args.model_path, self.args.skip_tokenizer_init)
        self._load = {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        self._finish_observers: list = []
        self._ids = itertools.count()
        self._calls: dict[int, _Call] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()  # guards _calls, _replies and _dead together
        self._dead: str | None = None  # why the engine process is gone
        self._closing = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        # The pipe has one writer at a time (`_write_lock`); `_queued` counts messages handed to the sender
        # thread and not yet written (under `_count_lock`), so a direct write never overtakes one.
        self._write_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._queued = 0
        self._bye = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="engine-client-sender", daemon=True)
        self._sender.start()
        self._reader = PipeReader(conn, self._dispatch, self._on_eof)
        # multiprocessing joins a non-daemonic child at exit, and the child waits for this pipe to close:
        # a client nobody shut down would hang the interpreter's exit, so shut it down first.
        ref = weakref.ref(self)
        atexit.register(lambda: (c := ref()) is not None and c.shutdown(timeout_s=10))

    # ---- start and stop ------------------------------------------------------------------------
    @classmethod
    def spawn(cls, engine_kwargs: dict, num_threads: int | None = None, start_timeout_s: float = 600.0
              ) -> EngineClient:
        """Start the engine process and wait (at most `start_timeout_s`) until its Engine is built.
        `num_threads`: its torch intra-op threads (default: this process's count, what an in-process
        Engine would use). Raises EngineProcessError with the child's reason if it fails to start."""
        import torch

        conn, proc, info = engine_process.start(engine_kwargs, num_threads or torch.get_num_threads(),
                                                start_timeout_s)
        return cls(conn, proc, info)

    def attach_loop(self, loop) -> None:
        """Read the engine's messages on `loop` (call it on that loop's thread): the HTTP app does for its
        lifetime, so outputs for the calls on its loop are applied there with no thread in between."""
        self._reader.attach(loop)

    def detach_loop(self) -> None:
        """Read on the reader's own thread again (the app's shutdown; any thread, bounded)."""
        self._reader.detach()

    def is_alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine (in-flight requests end as abort, delivered here first) and its process."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._reader.detach()  # "bye" and the last outputs must not wait for a loop (this may be its thread)
        if self._dead is None:
            self._enqueue(("shutdown",))
            self._bye.wait(timeout_s)
        self._outbox.put(None)
        self._process.join(timeout_s if self._dead is None else 5)
        engine_process.stop(self._process, 5)
        self._reader.wait_eof(5)
        self._reader.close()
        self._conn.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- the pipe --------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        if self._dead is not None:
            raise EngineProcessError(self._dead)
        if self._closing:
            raise RuntimeError("engine is shut down")
        if msg[0] in DIRECT_OPS and self._send_direct(msg):
            return
        self._enqueue(msg)

    def _enqueue(self, msg: tuple) -> None:
        """For the sender thread; counted until written, so no direct write overtakes it."""
        with self._count_lock:
            self._queued += 1
        self._outbox.put(msg)

    def _send_direct(self, msg: tuple) -> bool:
        """Write a small message from the calling thread (the event loop) when that cannot block: nothing
        queued before it, and the pipe has room for all of it (see DIRECT_MAX_BYTES). Handing a request to
        the sender thread cost its admission a GIL hand-over in this busy process, ~5 ms at the median and
        ~24 ms at p90 on the streaming benchmark, every request. False: the sender thread takes it (too
        big, a message queued ahead, the pipe full, or unpicklable)."""
        try:
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - the sender thread fails that call with the reason
            return False
        if len(data) > DIRECT_MAX_BYTES or not self._write_lock.acquire(blocking=False):
            return False
        try:
            with self._count_lock:
                if self._queued:
                    return False
            fd = self._conn.fileno()
            if not select.select([], [fd], [], 0)[1]:
                return False
            write_frame(fd, data)
            return True
        except (OSError, ValueError):  # the child is gone: the reader says why; the call fails as it would
            return False
        finally:
            self._write_lock.release()

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
                with self._write_lock:
                    write_frame(self._conn.fileno(), data)
            except (OSError, ValueError):  # the child is gone: the reader says why
                return
            except Exception as e:  # noqa: BLE001 - an argument that does not pickle: fail that call only
                self._fail_message(msg, e)
            finally:
                with self._count_lock:
                    self._queued -= 1

    def _fail_message(self, msg: tuple, e: Exception) -> None:
        err = TypeError(f"cannot send {msg[0]!r} to the engine process: {type(e).__name__}: {e}")
        if msg[0] == "call":
            fut = self._replies.pop(msg[1], None)
            if fut is not None:
                fut.set_exception(err)
        elif msg[0] == "generate":
            self._fail_call(msg[1], err)

    def _dispatch(self, msg: tuple) -> None:
        """One message from the engine process (on the reader's thread or its loop)."""
        op = msg[0]
        try:
            if op == "out":
                self._on_out(msg[1], msg[2])
            elif op == "submitted":
                self._on_submitted(*msg[1:])
            elif op == "reply":
                self._on_reply(*msg[1:])
            elif op == "bye":
                self._bye.set()
        except Exception:  # a bug here must not stop every other request's outputs
            logger.exception("handling the engine process's %r message failed", op)

    def _on_eof(self) -> None:
        """The pipe closed (on a thread): the child exited or is exiting."""
        self._process.join(2)
        code = self._process.exitcode
        self._on_child_gone("engine is shut down" if self._closing else
                            f"the engine process died (exit code {code}); restart the server")

    def _on_child_gone(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
            calls, self._calls = self._calls, {}
            replies, self._replies = self._replies, {}
        self._bye.set()
        for fut in replies.values():
            fut.set_exception(EngineProcessError(reason))
        self._end_calls(calls, reason)

    # ---- control: calls into the engine process ----------------------------------------------
    def _call(self, name, args: tuple = (), kwargs: dict | None = None):
        loop = self._reader.loop
        if loop is not None and asyncio._get_running_loop() is loop:  # its reply could never be read
            raise RuntimeError(f"EngineClient.{getattr(name, '__name__', name)} blocks until the engine answers, "
                               "and this event loop reads the answers: call it from a thread (run_in_executor)")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        with self._lock:
            if self._dead is not None:
                raise EngineProcessError(self._dead)
            self._replies[call_id] = fut
        self._send(("call", call_id, name, tuple(args), dict(kwargs or {})))
        # Bounded by the engine's own bounds: the wait ends when it answers or its process is gone.
        while True:
            try:
                return fut.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if not self._process.is_alive() and not fut.done():
                    self._reader.wait_eof(5)
                    if not fut.done():
                        raise EngineProcessError(self._dead or "the engine process is gone") from None

    def _on_reply(self, call_id: int, ok: bool, value, state: dict | None) -> None:
        if state is not None:
            self._state = state
        fut = self._replies.pop(call_id, None)
        if fut is None:
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run_on_engine(self, fn, *args, **kwargs):
        """fn(engine, *args, **kwargs) in the engine process; fn must be a module-level function (it
        crosses the pipe by name). The server's routes use it to decode HTTP payloads next to the engine."""
        return self._call(fn, args, kwargs)

    def get_load(self) -> dict:
        """Engine.get_load as of the engine's last step boundary (no round trip); EngineProcessError once the
        engine process is gone (its last numbers would mislead a router)."""
        if not self.is_alive():
            raise EngineProcessError(self._dead or "the engine process is gone")
        return dict(self._load)

    def load_snapshot(self) -> dict:
        from rollout.server.native import load_snapshot

        return self.run_on_engine(load_snapshot)

    @property
    def weight_version(self) -> str:
        return self._state["weight_version"]

    @property
    def model_path(self) -> str:
        return self._state["model_path"]

    @property
    def tokenizer_path(self) -> str:
        return self._state["tokenizer_path"]

    def add_finish_observer(self, fn) -> None:
        """fn(req) once per finished request, on the event loop of the call it belongs to (quick; no engine
        calls)."""
        self._finish_observers = [*self._finish_observers, fn]

    def remove_finish_observer(self, fn) -> None:
        self._finish_observers = [f for f in self._finish_observers if f is not fn]

    fatal_problem = _remote("fatal_problem")
    abort_request = _remote("abort_request")
    pause_generation = _remote("pause_generation")
    continue_generation = _remote("continue_generation")
    flush_cache = _remote("flush_cache")
    drain = _remote("drain")
    get_model_info = _remote("get_model_info")
    freeze_gc = _remote("freeze_gc")
    get_server_info = _remote("get_server_info")
    update_weight_version = _remote("update_weight_version")
    get_weights_checksum = _remote("get_weights_checksum")
    get_weights_by_name = _remote("get_weights_by_name")
    update_weights_from_tensor = _remote("update_weights_from_tensor")
    update_weights_from_disk = _remote("update_weights_from_disk")
    init_weights_update_group = _remote("init_weights_update_group")
    update_weights_from_distributed = _remote("update_weights_from_distributed")
    destroy_weights_update_group = _remote("destroy_weights_update_group")
    release_memory_occupation = _remote("release_memory_occupation")
    resume_memory_occupation = _remote("resume_memory_occupation")
    load_lora_adapter = _remote("load_lora_adapter")
    load_lora_adapter_from_tensors = _remote("load_lora_adapter_from_tensors")
    unload_lora_adapter = _remote("unload_lora_adapter")
    start_expert_distribution_record = _remote("start_expert_distribution_record")
    stop_expert_distribution_record = _remote("stop_expert_distribution_record")
    dump_expert_distribution_record = _remote("dump_expert_distribution_record")
    post_process_weights = _remote("post_process_weights")
    check_weights = _remote("check_weights")
    weights_checksums = _remote("weights_checksums")
    start_profile = _remote("start_profile")
    stop_profile = _remote("stop_profile")
