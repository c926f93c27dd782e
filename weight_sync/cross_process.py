"""Cross-process weight sync: the engine in another process on the same machine.

`RemoteEngine` starts the engine in a child process (spawn) and proxies Engine methods over a pipe.
Messages are JSON, never pickles: the child only ever rebuilds tensors from a descriptor (shared
memory segment name, dtype, byte length, and bucket metadata) after validating every field, so a
malformed or hostile message can fail an update but cannot run code. Bucket bytes travel through
POSIX shared memory on the CPU; the trainer's segment is reused between buckets of similar size.

CUDA tensors (CUDA IPC handles) are not handled here yet: they belong with the GPU path and are
refused with a clear error rather than silently copied through host memory.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import threading
from multiprocessing import shared_memory
from typing import Any

import torch

from weight_sync.bucket import FlattenedTensorBucket, dtype_to_str, str_to_dtype

ALLOWED_METHODS = frozenset({
    "generate", "update_weights_from_tensor", "update_weights_from_disk", "release_memory_occupation",
    "resume_memory_occupation", "flush_cache", "get_server_info", "pause_generation", "continue_generation",
    "init_weights_update_group", "update_weights_from_distributed", "get_weights_by_name",
})


def bucket_to_shm(bucket: FlattenedTensorBucket, shm: shared_memory.SharedMemory | None):
    """Copy a CPU bucket into shared memory (reusing `shm` when big enough). Returns (descriptor, shm)."""
    flat = bucket.flattened_tensor
    if flat.device.type != "cpu":
        raise NotImplementedError(f"cross-process sync of {flat.device.type} tensors (CUDA IPC) is not "
                                  f"implemented yet; move the bucket to the CPU or sync in-process")
    nbytes = flat.numel() * flat.element_size()
    if shm is None or shm.size < nbytes:
        if shm is not None:
            shm.close()
            shm.unlink()
        shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    dst = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
    dst.copy_(flat.contiguous().view(torch.uint8))
    d = bucket.to_dict()
    descriptor = {"shm_name": shm.name, "nbytes": nbytes, "dtype": dtype_to_str(flat.dtype),
                  "metadata": d["metadata"]}
    return descriptor, shm


def bucket_from_shm(descriptor: Any) -> tuple[FlattenedTensorBucket, shared_memory.SharedMemory]:
    """Rebuild a bucket from a descriptor: validated field by field, tensors only, nothing executed."""
    if not isinstance(descriptor, dict) or set(descriptor) != {"shm_name", "nbytes", "dtype", "metadata"}:
        raise ValueError(f"malformed bucket descriptor: expected keys shm_name, nbytes, dtype, metadata; "
                         f"got {sorted(descriptor) if isinstance(descriptor, dict) else type(descriptor).__name__}")
    name, nbytes = descriptor["shm_name"], descriptor["nbytes"]
    if not isinstance(name, str) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError("malformed bucket descriptor: shm_name must be a string and nbytes an int >= 0")
    dtype = str_to_dtype(descriptor["dtype"])
    shm = shared_memory.SharedMemory(name=name)
    if shm.size < nbytes or nbytes % dtype.itemsize:
        shm.close()
        raise ValueError(f"bucket descriptor claims {nbytes} bytes of {dtype}; segment {name} has {shm.size}")
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes).view(dtype)
    try:
        bucket = FlattenedTensorBucket.from_dict({"flattened_tensor": flat, "metadata": descriptor["metadata"]})
    except Exception:
        del flat
        shm.close()
        raise
    return bucket, shm


def _jsonable(x):
    if isinstance(x, tuple | list):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


def _serve(conn, factory: str, kwargs: dict) -> None:
    """Child process: build the engine, answer JSON requests until shutdown."""
    module, _, attr = factory.partition(":")
    engine = getattr(importlib.import_module(module), attr)(**kwargs)
    conn.send_bytes(json.dumps({"ok": True, "result": "ready"}).encode())
    try:
        while True:
            try:
                raw = conn.recv_bytes()
            except EOFError:
                return
            try:
                msg = json.loads(raw)
            except (ValueError, RecursionError) as e:  # not JSON (a pickle, say): refuse it, keep serving
                reply = {"ok": False, "error": f"message is not JSON: {type(e).__name__}"}
                conn.send_bytes(json.dumps(reply).encode())
                continue
            if not isinstance(msg, dict):
                msg = {"method": None}
            method, args, pos = msg.get("method"), msg.get("kwargs", {}), msg.get("args", [])
            if method == "shutdown":
                conn.send_bytes(json.dumps({"ok": True, "result": None}).encode())
                return
            try:
                if method not in ALLOWED_METHODS or not isinstance(args, dict) or not isinstance(pos, list):
                    raise ValueError(f"method {method!r} is not allowed")
                if method == "update_weights_from_tensor" and args.get("load_format") == "shm_bucket":
                    result = _update_from_shm(engine, args)
                else:
                    result = getattr(engine, method)(*pos, **args)
                reply = {"ok": True, "result": _jsonable(result)}
            except Exception as e:  # the reason goes back to the caller; the engine keeps serving
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            conn.send_bytes(json.dumps(reply).encode())
    finally:
        engine.shutdown()


def _update_from_shm(engine, args: dict):
    args = dict(args)
    try:
        bucket, shm = bucket_from_shm(args.pop("named_tensors"))
    except (ValueError, FileNotFoundError, TypeError) as e:
        return [False, f"update_weights_from_tensor failed: bad bucket: {e}"]
    args["load_format"] = "flattened_bucket"
    try:
        return engine.update_weights_from_tensor(bucket, **args)
    finally:
        del bucket
        shm.close()


class RemoteEngine:
    """A handle on an engine living in a child process; Engine's methods, proxied as JSON calls."""

    def __init__(self, factory: str = "rollout:Engine", **engine_kwargs) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child_conn, factory, engine_kwargs), daemon=True)
        self._proc.start()
        self._lock = threading.Lock()
        self._shm: shared_memory.SharedMemory | None = None
        self._pending = False
        self._recv()  # "ready", or the child's construction error

    def _recv(self):
        if not self._conn.poll(600):
            raise TimeoutError("engine process did not answer within 600 s")
        try:
            reply = json.loads(self._conn.recv_bytes())
        except EOFError:
            raise RuntimeError(f"engine process exited (exit code {self._proc.exitcode})") from None
        if not reply["ok"]:
            raise RuntimeError(f"remote engine: {reply['error']}")
        return reply["result"]

    def call_async(self, method: str, *args, **kwargs) -> None:
        """Send a call without waiting; collect its result with `result()` (one call in flight)."""
        with self._lock:
            if self._pending:
                raise RuntimeError("a remote call is already in flight; call result() first")
            msg = {"method": method, "args": _jsonable(list(args)), "kwargs": _jsonable(kwargs)}
            self._conn.send_bytes(json.dumps(msg).encode())
            self._pending = True

    def result(self):
        with self._lock:
            self._pending = False
            return self._recv()

    def call(self, method: str, *args, **kwargs):
        self.call_async(method, *args, **kwargs)
        return self.result()

    def __getattr__(self, method: str):
        if method not in ALLOWED_METHODS:
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None) -> tuple[bool, str]:
        if load_format != "flattened_bucket":
            bucket = FlattenedTensorBucket(list(named_tensors.items()) if isinstance(named_tensors, dict)
                                           else list(named_tensors))
        elif isinstance(named_tensors, FlattenedTensorBucket):
            bucket = named_tensors
        else:
            bucket = FlattenedTensorBucket.from_dict(named_tensors)
        descriptor, self._shm = bucket_to_shm(bucket, self._shm)
        ok, msg = self.call("update_weights_from_tensor", named_tensors=descriptor, load_format="shm_bucket",
                            flush_cache=flush_cache, weight_version=weight_version)
        return bool(ok), msg

    def shutdown(self) -> None:
        if self._proc.is_alive():
            try:
                self.call("shutdown")
            except (RuntimeError, OSError, TimeoutError):
                pass
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def pid(self) -> int:
        return self._proc.pid or os.getpid()
