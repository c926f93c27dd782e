"""Cross-process weight sync: the engine in another process on the same machine.

`RemoteEngine(factory=DEFAULT_FACTORY, **kwargs)` starts the engine in a child process (spawn) with the
factory the caller names ("module:callable", or an importable callable; by default this package's
`rollout:Engine`, so `RemoteEngine(model_path=...)` works) and proxies Engine methods over a pipe. The
default is a string resolved in the child only: this leaf package never imports rollout itself.

- Messages are JSON, never pickles: the child only ever rebuilds tensors from a descriptor (shared
  memory segment name, dtype, byte length, and bucket metadata) after validating every field, so a
  malformed or hostile message can fail an update but cannot run code. A result that JSON cannot
  carry (a stream, say) comes back as an error; the child keeps serving.
- Start-up: a factory that raises sends its reason back, and a child that dies without one is
  noticed by its exit (the parent holds no copy of the child's pipe end), both within seconds.
- Threads: one call is in flight at a time; calls from several threads queue on a lock.
- Shared memory: bucket bytes travel through POSIX shared memory, one segment reused between buckets
  of similar size. Segment names carry a prefix with a random token made at start and handed to the
  child, which attaches only to segments with that prefix (those this handle created), and attaches
  without registering them with its resource tracker (Python < 3.13 registers every attach, and the
  tracker then unlinks the creator's segment when the attaching process exits).

- CUDA IPC: buckets of CUDA tensors (a trainer and the engine on the same GPU) go as CUDA IPC handles
  (`cuda_ipc`: a fixed JSON schema of the fields of torch's `reduce_tensor`, the device as its UUID),
  never through host memory. The child validates every descriptor before it maps any, loads all the
  buckets as one update (the engine's checks and all-or-nothing write), synchronizes so nothing still
  reads the sender's memory, drops its mappings, then replies; the parent keeps the buckets alive
  until that reply. `weight_transport`: "auto" (CUDA tensors by IPC, host tensors by shared memory),
  "shm" (CUDA tensors refused, never copied silently) or "cuda_ipc".
- `child_env`: environment variables set for the child only (e.g. torch_memory_saver's preload
  library in LD_PRELOAD, which must be there from the child's start).

`generate(stream=True)` is refused in the parent with a clear error: a stream cannot cross the pipe.

This module is the parent's side. The child's loop is weight_sync/remote_child.py, the shared-memory
bucket descriptors weight_sync/shm.py.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing as mp
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from multiprocessing import shared_memory

import torch

from weight_sync.bucket import FlattenedTensorBucket, as_one_bucket
from weight_sync.remote_child import ALLOWED_METHODS, DELTA_BLOB, jsonable, resolve_factory, serve
from weight_sync.shm import bucket_from_shm, bucket_to_shm, new_segment_prefix

__all__ = ["DEFAULT_FACTORY", "RemoteEngine", "bucket_from_shm", "bucket_to_shm", "new_segment_prefix"]

DEFAULT_START_TIMEOUT_S = 600.0
WEIGHT_TRANSPORTS = ("auto", "shm", "cuda_ipc")
_POLL_S = 0.2  # how often a waiting parent checks that the child still lives


def _factory_name(factory: str | Callable) -> str:
    """A callable becomes 'module:qualname', checked to import back to the same object."""
    if isinstance(factory, str):
        module, sep, attr = factory.partition(":")
        if not (sep and module and attr):
            raise ValueError(f"factory {factory!r} is not 'module:callable' (e.g. 'rollout:Engine')")
        return factory  # imported in the child only: this leaf package never imports the engine itself
    if not callable(factory):
        raise TypeError(f"factory must be a 'module:callable' string or a callable, got {type(factory).__name__}")
    name = f"{getattr(factory, '__module__', '')}:{getattr(factory, '__qualname__', '')}"
    try:
        same = resolve_factory(name) is factory
    except (ImportError, AttributeError, ValueError, TypeError):
        same = False
    if not same:
        raise ValueError(f"factory {factory!r} cannot be re-imported as {name!r} in the child process; pass a "
                         f"module-level callable or a 'module:callable' string")
    return name


# A string, not `rollout.Engine` itself: weight_sync is a leaf package (rollout imports it), so importing
# rollout here would be a cycle, and the parent never needs the engine's code; only the child imports it.
DEFAULT_FACTORY = "rollout:Engine"


class RemoteEngine:
    """A handle on an engine living in a child process; Engine's methods, proxied as JSON calls.

    `factory` builds the engine in the child: "module:callable" or an importable module-level callable;
    the default is this package's Engine (`RemoteEngine(model_path=..., device="cpu")`). `engine_kwargs`
    go to it. Raises RuntimeError carrying the child's reason
    if construction fails, TimeoutError after `start_timeout_s` if it neither succeeds nor fails.
    """

    def __init__(self, factory: str | Callable = DEFAULT_FACTORY, start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 weight_transport: str = "auto", child_env: Mapping[str, str] | None = None,
                 **engine_kwargs) -> None:
        factory = _factory_name(factory)
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport={weight_transport!r}: choose one of {list(WEIGHT_TRANSPORTS)}")
        self.weight_transport = weight_transport
        self.segment_prefix = new_segment_prefix()
        self._segment_counter = [0]
        self._shm: shared_memory.SharedMemory | None = None
        self._call_lock = threading.Lock()  # held from a call's send to its reply: one call in flight
        self._owner: int | None = None  # thread holding _call_lock between call_async and result
        self._closed = False
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        # Not a daemon: a daemonic process may not start children, and an engine with tp_size > 1 starts
        # its rank workers. multiprocessing joins a non-daemonic child at exit, and the child waits on this
        # pipe, so a RemoteEngine nobody shut down is shut down at exit (before that join: atexit is LIFO).
        self._proc = ctx.Process(target=serve, args=(child_conn, factory, engine_kwargs, self.segment_prefix),
                                 daemon=False)
        saved = {k: os.environ.get(k) for k in (child_env or {})}
        os.environ.update(child_env or {})  # spawn copies the environment at start: the child's only
        try:
            self._proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child_conn.close()  # ours closed, the child's exit is an EOF here: a dead child is seen at once
        ref = weakref.ref(self)
        atexit.register(lambda: (r := ref()) is not None and r.shutdown())
        try:
            self._recv(start_timeout_s, what="engine start-up")
        except BaseException:
            self._closed = True
            self._stop_process()
            raise

    def _recv(self, timeout_s: float | None = None, what: str = "call"):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(_POLL_S):
            if not self._proc.is_alive() and not self._conn.poll(0):
                raise RuntimeError(f"remote engine: {what}: engine process exited (exit code {self._proc.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                self._closed = True
                self._stop_process()
                raise TimeoutError(f"remote engine: {what}: no answer within {timeout_s} s; the process was stopped")
        try:
            reply = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._proc.join(timeout=5)
            raise RuntimeError(f"remote engine: {what}: engine process exited (exit code {self._proc.exitcode})"
                               ) from None
        if not reply["ok"]:
            raise RuntimeError(f"remote engine: {reply['error']}")
        return reply["result"]

    def _acquire(self) -> None:
        """Take the call lock (waiting for other threads' calls), refusing a thread that holds it."""
        if self._owner == threading.get_ident():
            raise RuntimeError("a remote call from this thread is already in flight; call result() first")
        self._call_lock.acquire()
        self._owner = threading.get_ident()

    def _release(self) -> None:
        self._owner = None
        self._call_lock.release()

    def _send(self, method: str, args: tuple, kwargs: dict) -> None:
        """Send one call; the caller holds the call lock."""
        if self._closed:
            raise RuntimeError("remote engine is shut down")
        if not self._proc.is_alive():
            raise RuntimeError(f"remote engine: engine process exited (exit code {self._proc.exitcode})")
        msg = {"method": method, "args": jsonable(list(args)), "kwargs": jsonable(kwargs)}
        try:
            self._conn.send_bytes(json.dumps(msg).encode())
        except OSError as e:
            raise RuntimeError(f"remote engine: cannot send ({e}); exit code {self._proc.exitcode}") from None

    def call_async(self, method: str, *args, **kwargs) -> None:
        """Send a call without waiting; collect its result with `result()` from the same thread. Other
        threads' calls wait until then."""
        self._acquire()
        try:
            self._send(method, args, kwargs)
        except BaseException:
            self._release()
            raise

    def result(self):
        """The reply to this thread's `call_async` (the engine's result, or RuntimeError with its reason)."""
        if self._owner != threading.get_ident():
            raise RuntimeError("no remote call from this thread is in flight")
        try:
            return self._recv()
        finally:
            self._release()

    def call(self, method: str, *args, **kwargs):
        self.call_async(method, *args, **kwargs)
        return self.result()

    def __getattr__(self, method: str):
        if method not in ALLOWED_METHODS:
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    @property
    def weight_version(self) -> str:
        """The child Engine's `weight_version` (read through get_model_info: one round trip)."""
        return self.call("get_model_info")["weight_version"]

    def generate(self, *args, stream: bool = False, **kwargs):
        if stream:
            raise ValueError("RemoteEngine.generate(stream=True) is not supported: a stream cannot cross the "
                             "process boundary; call with stream=False")
        return self.call("generate", *args, **kwargs)

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None, online: bool = False,
                                   abort_all_requests: bool = False) -> tuple[bool, str]:
        """Engine's signature: (name, tensor) pairs or a dict, or with load_format="flattened_bucket" a
        bucket (ours, its dict, SGLang's) or a list of them; shipped as one bucket, one atomic update (a name
        given twice takes its last value, as in Engine). load_format="delta": a weight_sync.delta_codec delta
        (or its blob), shipped as its blob. `online`, `abort_all_requests`: Engine's, applied in the child."""
        if load_format not in (None, "auto", "flattened_bucket", "delta"):
            return False, f"update_weights_from_tensor failed: load_format={load_format!r} is not supported"
        for flag, value in (("online", online), ("abort_all_requests", abort_all_requests)):
            if not isinstance(value, bool):
                return False, f"update_weights_from_tensor failed: {flag} must be a bool, got {value!r}"
        extra = dict(online=online, abort_all_requests=abort_all_requests)
        wire = "shm_bucket"
        try:
            if load_format == "delta":
                from weight_sync.delta_codec import DeltaUpdate

                blob = named_tensors if isinstance(named_tensors, torch.Tensor) else \
                    DeltaUpdate.from_blob(named_tensors).to_tensor()
                bucket, wire = FlattenedTensorBucket([(DELTA_BLOB, blob)]), "shm_delta"
            else:
                bucket = as_one_bucket(named_tensors, load_format)
        except (ValueError, TypeError) as e:
            return False, f"update_weights_from_tensor failed: {e}"
        ipc = self.weight_transport == "cuda_ipc" or (self.weight_transport == "auto"
                                                      and bucket.device.type == "cuda")
        if ipc:
            return self._update_by_ipc(bucket, flush_cache, weight_version, extra)
        if bucket.device.type != "cpu":
            return False, (f"update_weights_from_tensor failed: weight_transport='shm' carries host tensors; these "
                           f"are on {bucket.device} (use weight_transport='cuda_ipc' or 'auto')")
        self._acquire()  # the one segment is rewritten per call: hold the lock from the copy to the reply
        try:
            descriptor, self._shm = bucket_to_shm(bucket, self._shm, self.segment_prefix, self._segment_counter)
            self._send("update_weights_from_tensor", (), dict(named_tensors=descriptor, load_format=wire,
                                                              flush_cache=flush_cache, weight_version=weight_version,
                                                              **extra))
            ok, msg = self._recv()
        finally:
            self._release()
        return bool(ok), msg

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors, config_dict: dict,
                                       load_format: str | None = None, pinned: bool = False):
        """Engine's signature (weight_sync/lora.py calls it): the adapter's tensors (PEFT names; a dict, pairs,
        or with load_format="flattened_bucket" a bucket or its dict) in the shared-memory segment, the
        config as JSON. -> the engine's LoRAUpdateOutput as a dict."""
        try:
            if load_format not in (None, "flattened_bucket"):
                raise ValueError(f"load_format={load_format!r} is not supported (None or 'flattened_bucket')")
            bucket = as_one_bucket(tensors, load_format, last_wins=False)
            if bucket.device.type != "cpu":
                raise ValueError(f"the adapter's tensors are on {bucket.device}; send host tensors")
        except (ValueError, TypeError) as e:
            return {"success": False, "error_message": str(e), "loaded_adapters": None}
        self._acquire()
        try:
            descriptor, self._shm = bucket_to_shm(bucket, self._shm, self.segment_prefix, self._segment_counter)
            self._send("load_lora_adapter_from_tensors", (), dict(
                lora_name=lora_name, tensors=descriptor, config_dict=config_dict, load_format="shm_bucket",
                pinned=pinned))
            return self._recv()
        finally:
            self._release()

    def _update_by_ipc(self, bucket: FlattenedTensorBucket, flush_cache: bool,
                       weight_version: str | None, extra: dict) -> tuple[bool, str]:
        from weight_sync import cuda_ipc

        try:
            descriptors = [cuda_ipc.encode_bucket(bucket)]
        except (ValueError, RuntimeError) as e:
            return False, f"update_weights_from_tensor failed: {e}"
        self._acquire()
        try:
            self._send("update_weights_from_tensor", (), dict(named_tensors=descriptors, load_format="cuda_ipc",
                                                              flush_cache=flush_cache, weight_version=weight_version,
                                                              **extra))
            ok, msg = self._recv()  # the child has loaded and synchronized: `bucket` may go now
        finally:
            self._release()
        return bool(ok), msg

    def _stop_process(self) -> None:
        self._proc.join(timeout=0.5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._conn.close()

    def shutdown(self) -> None:
        """Stop the child (politely, then by force) and free the shared memory segment. Idempotent."""
        if self._closed:
            return
        mine = self._owner == threading.get_ident()  # our own call_async never collected: we hold the lock
        got = mine or self._call_lock.acquire(timeout=30)  # let a call in flight on another thread finish
        if mine:  # drop that call's reply, if it comes soon, so it is not read as shutdown's
            try:
                if self._conn.poll(5):
                    self._conn.recv_bytes()
            except (EOFError, OSError):
                pass
        try:
            self._closed = True
            if got and self._proc.is_alive():
                try:
                    self._conn.send_bytes(json.dumps({"method": "shutdown"}).encode())
                    self._recv(30, what="shutdown")
                except (RuntimeError, OSError, TimeoutError):
                    pass
                self._proc.join(timeout=30)
            self._stop_process()
            if self._shm is not None:
                self._shm.close()
                self._shm.unlink()
                self._shm = None
        finally:
            if got:
                self._owner = None
                self._call_lock.release()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def pid(self) -> int:
        return self._proc.pid or os.getpid()
