"""The engine process: an Engine in a child of the HTTP server, driven over a private pipe.

`python -m rollout.launch_server` spawns this (multiprocessing "spawn"; `run` is the target) so that the
model's steps and the HTTP side (request parsing, tokenization, detokenization, SSE writes) hold two
different GILs: SGLang's layout, where the HTTP process never runs the model. The parent's half is
rollout/server/engine_client.py, which documents the messages.

What runs here:
- the reader (this process's main thread) takes the parent's messages in order. A submission is made and
  queued at once (`Engine._make_reqs` / `_submit` never wait for a step); an abort is posted (the
  scheduler runs it at its next step boundary); every other call runs in a thread pool, so a control
  call that waits (on the step lock, on a trainer's broadcast) never holds up submissions or the others.
- the scheduler thread delivers outputs into `_CallSink`s, which record each request's new tokens since
  its last message (a delta, read while the step lock is held), and at every step boundary
  (`Engine.on_step_boundary`) the batch of all deltas of that step becomes ONE message.
- every message is pickled and written by the thread that has it (the step's message by the scheduler
  thread, at the step boundary), under one write lock: handing it to a sender thread cost more (a GIL
  hand-off per step, ~10% of this process's GIL time in py-spy) than the write itself. A parent that
  stops reading blocks the step at the write: back-pressure, not a growing queue.

Pickle over this pipe is safe: it is an anonymous pipe (multiprocessing.Pipe) created by the server for
the child it spawned, inherited by nobody else, so no outside party can write to it; bytes from HTTP
clients cross it only as values (strings, ints, safetensors-encoded tensor strings, which the child's
existing decoders in rollout/server/tensor_codec.py rebuild), never as pickles.

`start` spawns it and waits for its Engine (the server's side, EngineClient.spawn, calls it).

What it does not do: HTTP, tokenizing prompts or building output dicts (the parent does), or outlive
the parent: when the pipe closes (the server exited, even by SIGKILL) the engine is shut down and this
process exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from rollout.server import engine_deltas as deltas
from runner import omp_env

logger = logging.getLogger("rollout.server.engine_process")


def _state(engine) -> dict:
    """What the parent serves without asking (cached there, refreshed with every call's reply)."""
    return {"weight_version": engine.weight_version, "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path, "lora_adapters": engine.runner.lora_adapters()}


def portable_error(e: BaseException) -> BaseException:
    """e itself if it survives a pickle round trip (so the parent raises the same type and message),
    else a RuntimeError naming its type."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception class with a custom __init__ or unpicklable args
        return RuntimeError(f"{type(e).__name__}: {e}")


class _Pipe:
    """The child's end of the pipe: whole messages, one writer at a time."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.is_broken = False

    def send(self, msg: tuple) -> None:
        """Never raises: a message that does not pickle is logged (a reply becomes that error instead), and
        a closed pipe (the parent is gone) is noted; the reader sees EOF and shuts the engine down."""
        try:
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - a value that does not pickle: say so to the caller
            if msg[0] != "reply":
                logger.exception("message %r does not pickle", msg[0])
                return
            data = pickle.dumps(("reply", msg[1], False, RuntimeError(f"the reply does not pickle: {e}"), msg[4]))
        with self.lock:
            if self.is_broken:
                return
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):
                self.is_broken = True


class _Batcher:
    """The deltas of one step, sent as one message at the step boundary. `lock` also orders a call's
    "submitted" reply before its first delta."""

    def __init__(self, engine, pipe: _Pipe) -> None:
        self.engine = engine
        self.pipe = pipe
        self.lock = threading.Lock()
        self.deltas: list[tuple] = []
        self.last_load: dict | None = None

    def add(self, delta: tuple) -> None:
        with self.lock:
            self.deltas.append(delta)

    def flush(self) -> None:
        """Engine.on_step_boundary (step lock held): never raises."""
        load = self.engine.get_load()
        with self.lock:
            if not self.deltas and load == self.last_load:
                return
            deltas, self.deltas = self.deltas, []
            self.last_load = load
            self.pipe.send(("out", deltas, load))


class _CallSink:
    """One generate call's sink. `put` runs on the scheduler thread under the step lock (Engine._deliver):
    it reads the live request (no snapshot: `reads_at_put`) and records what the parent has not seen."""

    reads_at_put = True
    closed = False  # never closes: the parent cancels by message, and the engine aborts the requests

    def __init__(self, call_id: int, batcher: _Batcher, calls: dict, num_reqs: int) -> None:
        self.call_id = call_id
        self.batcher = batcher
        self.calls = calls
        self.num_open = num_reqs
        self.sent: dict[int, tuple] = {}  # index -> what its deltas carried so far (engine_deltas.encode)
        self.failed: set[int] = set()  # indices whose output could not be sent (ended as abort)
        self.reqs: list = []

    def put(self, item) -> None:
        kind, req = item
        if req.index in self.failed:
            return
        version = self.batcher.engine.weight_version
        final = kind == "final"
        try:
            delta, self.sent[req.index] = deltas.encode(self.call_id, req, final,
                                                        self.sent.get(req.index, deltas.NOTHING_SENT), version)
        except Exception as e:  # noqa: BLE001 - a bug here must not leave the parent waiting forever
            logger.exception("request %s: its output could not be sent", req.rid)
            self.failed.add(req.index)
            delta = deltas.abort_delta(self.call_id, req, f"internal error sending this request's output: "
                                                          f"{type(e).__name__}: {e}", version)
            final = True
            if not req.finished:
                self.batcher.engine._abort_quietly([req])  # stop spending compute on it
        self.batcher.add(delta)
        if final:
            self.num_open -= 1
            if not self.num_open:
                self.calls.pop(self.call_id, None)


class EngineProcess:
    def __init__(self, conn, engine) -> None:
        self.conn = conn
        self.engine = engine
        self.pipe = _Pipe(conn)
        self.batcher = _Batcher(engine, self.pipe)
        self.calls: dict[int, _CallSink] = {}  # call id -> its sink, until every request delivered final
        # Control calls: as many as the HTTP server's control pool can have waiting, plus joins.
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-call")
        engine.on_step_boundary = self.batcher.flush

    def serve(self) -> None:
        try:
            while True:
                try:
                    msg = pickle.loads(self.conn.recv_bytes())
                except (EOFError, OSError):
                    logger.warning("the server closed the pipe; shutting the engine down")
                    return
                op = msg[0]
                if op == "generate":
                    self._generate(*msg[1:])
                elif op == "abort":
                    sink = self.calls.get(msg[1])
                    if sink is not None:
                        self.engine._abort_quietly(sink.reqs)
                elif op == "call":
                    self.pool.submit(self._call, *msg[1:])
                elif op == "shutdown":
                    return
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.engine.shutdown()  # in-flight requests end as abort; their finals go out before "bye"
            self.pipe.send(("bye",))

    def _generate(self, call_id: int, encoded, kwargs: dict) -> None:
        engine = self.engine
        try:
            reqs, single = engine._make_reqs(None, None, encoded=encoded, **kwargs)
            sink = _CallSink(call_id, self.batcher, self.calls, len(reqs))
            sink.reqs = reqs
            skeletons = [_skeleton(r) for r in reqs]
            self.calls[call_id] = sink
            with self.batcher.lock:  # the reply goes out before any delta of this call
                try:
                    engine._submit(reqs, sink)
                except BaseException:
                    self.calls.pop(call_id, None)
                    raise
                self.pipe.send(("submitted", call_id, True, (skeletons, single)))
        except Exception as e:  # noqa: BLE001 - the caller's error, raised in the parent as it is
            self.pipe.send(("submitted", call_id, False, portable_error(e)))

    def _call(self, call_id: int, name: str, args: tuple, kwargs: dict) -> None:
        """An Engine method by name, or a module-level function fn(engine, ...) (rollout.server's helpers
        that decode HTTP payloads here: EngineClient.run_on_engine)."""
        try:
            fn = getattr(self.engine, name) if isinstance(name, str) else (lambda *a, **k: name(self.engine, *a, **k))
            ok, value = True, fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            ok, value = False, portable_error(e)
        try:
            state = _state(self.engine)
        except Exception:  # noqa: BLE001 - the engine is shut down or broken: the parent keeps its cache
            state = None
        self.pipe.send(("reply", call_id, ok, value, state))


def _skeleton(req):
    """A fresh copy of a just-made request for the parent (its outputs arrive as deltas)."""
    import copy

    s = copy.copy(req)
    s.sink = None
    s.last_node = None
    s.output_ids, s.output_logprobs, s.output_top_logprobs, s.output_token_ids_logprobs = [], [], [], []
    s.input_logprobs = {}
    return s


class EngineProcessError(RuntimeError):
    """The engine process failed to start, or is gone."""


def start(engine_kwargs: dict, num_threads: int, start_timeout_s: float):
    """Spawn the engine process and wait (at most `start_timeout_s`) until its Engine is built.
    -> (the server's end of the pipe, the process, its "ready" info). EngineProcessError with the
    child's reason if it fails to start (the process is then stopped)."""
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    # Not daemonic: the engine may start processes of its own (tensor parallelism). It exits by itself
    # when the server's end of the pipe closes, however the server ends.
    proc = ctx.Process(target=run, args=(child_conn, dict(engine_kwargs), num_threads), name="rollout-engine",
                       daemon=False)
    with omp_env.for_children():  # libgomp's spin before it sleeps (runner/omp_env.py), read as the child loads torch
        proc.start()
    child_conn.close()  # only the child holds its end: EOF on ours when it dies
    gone = "the engine process exited with code {} before it was ready (see its log above)"
    deadline = time.monotonic() + start_timeout_s
    try:
        while not parent_conn.poll(0.2):
            if not proc.is_alive():
                raise EngineProcessError(gone.format(proc.exitcode))
            if time.monotonic() > deadline:
                raise EngineProcessError(f"the engine process was not ready within {start_timeout_s:.0f} s")
        try:
            msg = pickle.loads(parent_conn.recv_bytes())
        except (EOFError, OSError):
            proc.join(10)
            raise EngineProcessError(gone.format(proc.exitcode)) from None
        if msg[0] == "failed":
            raise EngineProcessError(f"the engine failed to start: {msg[1]}")
    except BaseException:
        parent_conn.close()
        stop(proc, 10)
        raise
    return parent_conn, proc, msg[1]


def stop(proc, timeout_s: float) -> None:
    """Bounded: terminate, then kill, an engine process that did not exit by itself."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout_s)


def run(conn, engine_kwargs: dict, num_threads: int) -> None:
    """The child's entry point: build the Engine, say "ready" (or why not), serve until told or orphaned."""
    # Ctrl-C reaches the whole process group: the server decides when the engine stops, not the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_level = str(engine_kwargs.get("log_level", "info")).upper()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s",
                        force=True)
    import torch

    torch.set_num_threads(num_threads)  # what the engine would get in the server's own process
    try:
        from rollout.engine import Engine

        engine = Engine(**engine_kwargs)
    except BaseException as e:  # noqa: BLE001 - the reason goes to the server, which exits with it
        reason = f"{type(e).__name__}: {e}"
        try:
            conn.send_bytes(pickle.dumps(("failed", reason, traceback.format_exc())))
        finally:
            conn.close()
        sys.exit(1)
    engine.freeze_gc()  # the Engine's and the imports' objects leave the collector's scans (gc_freeze.py says why)
    info = {"args": engine.args, "context_len": engine.runner.context_len, "state": _state(engine),
            "pid": os.getpid(), "num_threads": torch.get_num_threads()}
    conn.send_bytes(pickle.dumps(("ready", info)))
    EngineProcess(conn, engine).serve()
    conn.close()
