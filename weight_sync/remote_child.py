"""The child side of `RemoteEngine`: build the engine, answer JSON calls over the pipe until shutdown.

`serve` runs in the spawned child: it resolves the factory ("module:callable"), reports "ready" or why
construction failed, then answers one JSON request at a time with a JSON reply. Only the methods in
`ALLOWED_METHODS` are called; a message that is not JSON, names another method, or asks for a stream is
refused with an error reply and the child keeps serving. Bucket payloads are rebuilt from shared-memory
or CUDA IPC descriptors only after validation (weight_sync/shm.py, weight_sync/cuda_ipc.py).
It never unpickles anything. The parent's side is weight_sync/cross_process.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable

import torch

from weight_sync.shm import bucket_from_shm

ALLOWED_METHODS = frozenset({
    "generate", "update_weights_from_tensor", "update_weights_from_disk", "release_memory_occupation",
    "resume_memory_occupation", "flush_cache", "get_server_info", "pause_generation", "continue_generation",
    "init_weights_update_group", "update_weights_from_distributed", "destroy_weights_update_group",
    "get_weights_by_name", "get_weights_checksum", "update_weight_version", "get_model_info",
    # adapter-only sync (weight_sync/lora.py): the tensors travel as a shared-memory bucket
    "load_lora_adapter_from_tensors", "load_lora_adapter", "unload_lora_adapter",
})
DELTA_BLOB = "delta_blob"  # the one tensor of a shared-memory bucket that carries a delta


def jsonable(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # LoRAUpdateOutput and the like: their fields
        return jsonable(dataclasses.asdict(x))
    if isinstance(x, tuple | list):
        return [jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "item") and type(x).__module__ == "numpy":  # a numpy scalar (logit_bias values, ids): JSON's
        return x.item()
    return x


def _encode(reply: dict) -> bytes:
    """JSON bytes of a reply; a result JSON cannot carry becomes an error reply (the child lives on)."""
    try:
        return json.dumps(reply).encode()
    except (TypeError, ValueError, RecursionError) as e:
        result = reply.get("result")
        if hasattr(result, "close"):  # a generator: stop it (and the requests behind it)
            try:
                result.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the error reply still goes back
                pass
        return json.dumps({"ok": False, "error": f"result of type {type(result).__name__} cannot be sent back "
                                                 f"as JSON ({type(e).__name__}); a stream cannot cross the "
                                                 f"process boundary: call without stream=True"}).encode()


def resolve_factory(factory: str) -> Callable:
    module, sep, attr = factory.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"factory {factory!r} is not 'module:callable'")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"factory {factory!r} is not callable")
    return obj


def serve(conn, factory: str, kwargs: dict, segment_prefix: str) -> None:
    """Child process: build the engine (or report why not), answer JSON requests until shutdown."""
    try:
        engine = resolve_factory(factory)(**kwargs)
    except BaseException as e:  # the reason goes to the parent, which is waiting for "ready"
        conn.send_bytes(json.dumps({"ok": False, "error": f"engine construction failed: {type(e).__name__}: "
                                                          f"{e}"}).encode())
        conn.close()
        return
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
                conn.send_bytes(_encode({"ok": False, "error": f"message is not JSON: {type(e).__name__}"}))
                continue
            if not isinstance(msg, dict):
                msg = {"method": None}
            method, args, pos = msg.get("method"), msg.get("kwargs", {}), msg.get("args", [])
            if method == "shutdown":
                conn.send_bytes(_encode({"ok": True, "result": None}))
                return
            try:
                if method not in ALLOWED_METHODS or not isinstance(args, dict) or not isinstance(pos, list):
                    raise ValueError(f"method {method!r} is not allowed")
                if method == "generate" and args.get("stream"):
                    raise ValueError("generate(stream=True) is not supported across processes; use stream=False")
                if method == "update_weights_from_tensor" and args.get("load_format") in ("shm_bucket", "shm_delta"):
                    result = _update_from_shm(engine, args, segment_prefix)
                elif method == "update_weights_from_tensor" and args.get("load_format") == "cuda_ipc":
                    result = _update_from_ipc(engine, args)
                elif method == "load_lora_adapter_from_tensors" and args.get("load_format") == "shm_bucket":
                    result = _adapter_from_shm(engine, args, segment_prefix)
                else:
                    result = getattr(engine, method)(*pos, **args)
                reply = {"ok": True, "result": jsonable(result)}
            except Exception as e:  # the reason goes back to the caller; the engine keeps serving
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            conn.send_bytes(_encode(reply))
    finally:
        engine.shutdown()


def _update_from_shm(engine, args: dict, segment_prefix: str):
    args = dict(args)
    try:
        bucket, seg = bucket_from_shm(args.pop("named_tensors"), segment_prefix)
    except (ValueError, FileNotFoundError, PermissionError, TypeError) as e:
        return [False, f"update_weights_from_tensor failed: bad bucket: {e}"]
    delta = args["load_format"] == "shm_delta"
    args["load_format"] = "delta" if delta else "flattened_bucket"
    try:
        if delta:  # one uint8 tensor: the delta blob (weight_sync/delta_codec.py); a copy, off the segment
            named = bucket.named_tensors()
            if len(named) != 1 or named[0][0] != DELTA_BLOB:
                return [False, f"update_weights_from_tensor failed: a delta bucket holds one tensor {DELTA_BLOB!r}"]
            return engine.update_weights_from_tensor(named[0][1].clone(), **args)
        return engine.update_weights_from_tensor(bucket, **args)
    finally:
        del bucket
        try:
            seg.close()
        except BufferError:  # a view is still referenced somewhere; the mapping goes with it
            pass


def _adapter_from_shm(engine, args: dict, segment_prefix: str):
    """load_lora_adapter_from_tensors with the adapter's tensors in a shared-memory bucket (validated first)."""
    args = dict(args)
    try:
        bucket, seg = bucket_from_shm(args.pop("tensors"), segment_prefix)
    except (ValueError, FileNotFoundError, PermissionError, TypeError, KeyError) as e:
        return {"success": False, "error_message": f"bad adapter bucket: {e}", "loaded_adapters": None}
    try:  # copies: the segment is rewritten by the next call
        tensors = {n: t.clone() for n, t in bucket.named_tensors()}
        args["load_format"] = None
        return engine.load_lora_adapter_from_tensors(tensors=tensors, **args)
    finally:
        del bucket
        try:
            seg.close()
        except BufferError:
            pass


def _update_from_ipc(engine, args: dict):
    """Map the CUDA IPC buckets (all validated first), load them as one update, release the mappings."""
    from weight_sync import cuda_ipc

    args = dict(args)
    try:
        buckets = cuda_ipc.decode_request(args.pop("named_tensors"))
    except (ValueError, RuntimeError, TypeError) as e:
        return [False, f"update_weights_from_tensor failed: bad CUDA IPC payload: {e}"]
    args["load_format"] = "flattened_bucket"
    try:
        return engine.update_weights_from_tensor([b.to_dict() for b in buckets], **args)
    finally:
        if any(b.device.type == "cuda" for b in buckets):
            torch.cuda.synchronize()  # the sender may reuse its memory once we reply
        del buckets
