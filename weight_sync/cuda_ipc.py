"""CUDA IPC for weight sync: another process on the same machine maps the sender's GPU memory.

The sender turns a CUDA tensor (or a flattened bucket of them) into a descriptor of plain JSON types:
the CUDA IPC handles torch produces for the tensor's allocation (base64 strings), the storage's size
and offset inside that allocation, and the tensor's dtype / shape / stride / offset. The receiver
checks every field against a fixed schema before it touches CUDA, then maps the memory with torch's
own `rebuild_cuda_tensor` (`torch.UntypedStorage._new_shared_cuda`, with torch's per-process cache of
opened handles). Nothing is unpickled: a hostile or corrupt descriptor can fail an update, never run
code or read outside the storage it names. The received tensor aliases the sender's memory, so a
flattened bucket reaches `update_weights_from_tensor` without a host round trip.

Lifetime: the sender must keep the tensor alive until the receiver has loaded it (torch's IPC
reference counter stops the sender's allocator from reusing the block while a receiver holds it).

What this module does not do: open pipes or processes (`cross_process.RemoteEngine` moves the JSON),
or copy anything through host memory. On a machine without CUDA only the schema and its refusals
run; `encode_*` / `decode_*` raise a clear error when CUDA is missing.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from typing import Any

import torch

from weight_sync.bucket import FlattenedTensorBucket, dtype_to_str, str_to_dtype

SCHEMA = "rollout.cuda_ipc.v1"
MAX_HANDLE_BYTES = 1024  # a cudaIpcMemHandle is 64 bytes; torch adds a little framing
MAX_DIMS = 8
_TENSOR_KEYS = frozenset({
    "schema", "device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle",
    "ref_counter_offset", "event_handle", "event_sync_required", "dtype", "shape", "stride", "offset",
})
_BUCKET_KEYS = frozenset({"schema", "flattened_tensor", "metadata"})


class IpcDescriptorError(ValueError):
    """A received descriptor does not fit the schema; the message names the field."""


def _b64(data: bytes) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def _unb64(d: Mapping, key: str, allow_empty: bool) -> bytes:
    value = d[key]
    if not isinstance(value, str):
        raise IpcDescriptorError(f"field {key!r} must be a base64 string, got {type(value).__name__}")
    if len(value) > 2 * MAX_HANDLE_BYTES:
        raise IpcDescriptorError(f"field {key!r} is {len(value)} characters; a handle is at most "
                                 f"{MAX_HANDLE_BYTES} bytes")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise IpcDescriptorError(f"field {key!r} is not valid base64") from None
    if not raw and not allow_empty:
        raise IpcDescriptorError(f"field {key!r} is empty")
    return raw


def _int(d: Mapping, key: str, lo: int = 0) -> int:
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise IpcDescriptorError(f"field {key!r} must be an int >= {lo}, got {value!r}")
    return value


def _int_list(d: Mapping, key: str) -> list[int]:
    value = d[key]
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise IpcDescriptorError(f"field {key!r} must be a list of at most {MAX_DIMS} ints, got {value!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise IpcDescriptorError(f"field {key!r} must hold non-negative ints, got {value!r}")
    return value


def validate_tensor_descriptor(d: Any) -> dict:
    """Check a tensor descriptor field by field; returns the decoded fields (bytes, dtype, ints).

    Refuses unknown or missing keys, wrong types, an unknown schema or dtype, and a tensor whose
    elements would reach past the storage it names.
    """
    if not isinstance(d, Mapping):
        raise IpcDescriptorError(f"a CUDA IPC descriptor must be a dict, got {type(d).__name__}")
    keys = set(d)
    if keys != _TENSOR_KEYS:
        missing, extra = sorted(_TENSOR_KEYS - keys), sorted(keys - _TENSOR_KEYS)
        raise IpcDescriptorError(f"CUDA IPC descriptor keys: missing {missing}, unexpected {extra}")
    if d["schema"] != SCHEMA:
        raise IpcDescriptorError(f"schema {d['schema']!r} is not {SCHEMA!r}")
    try:
        dtype = str_to_dtype(d["dtype"])
    except ValueError as e:
        raise IpcDescriptorError(f"field 'dtype': {e}") from None
    if not isinstance(d["event_sync_required"], bool):
        raise IpcDescriptorError("field 'event_sync_required' must be a bool")
    out = {
        "device": _int(d, "device"),
        "handle": _unb64(d, "handle", allow_empty=False),
        "storage_size_bytes": _int(d, "storage_size_bytes"),
        "storage_offset_bytes": _int(d, "storage_offset_bytes"),
        "ref_counter_handle": _unb64(d, "ref_counter_handle", allow_empty=False),
        "ref_counter_offset": _int(d, "ref_counter_offset"),
        "event_handle": _unb64(d, "event_handle", allow_empty=True),
        "event_sync_required": d["event_sync_required"],
        "dtype": dtype,
        "shape": _int_list(d, "shape"),
        "stride": _int_list(d, "stride"),
        "offset": _int(d, "offset"),
    }
    if len(out["shape"]) != len(out["stride"]):
        raise IpcDescriptorError(f"shape {out['shape']} and stride {out['stride']} differ in rank")
    itemsize = dtype.itemsize
    if out["storage_size_bytes"] % itemsize:
        raise IpcDescriptorError(f"storage of {out['storage_size_bytes']} bytes is not a whole number of "
                                 f"{dtype} elements")
    if math.prod(out["shape"]):
        last = out["offset"] + sum((n - 1) * s for n, s in zip(out["shape"], out["stride"]))  # highest element
        if (last + 1) * itemsize > out["storage_size_bytes"]:
            raise IpcDescriptorError(
                f"tensor {out['shape']} (stride {out['stride']}, offset {out['offset']}) of {dtype} reaches "
                f"byte {(last + 1) * itemsize}, past its storage of {out['storage_size_bytes']} bytes")
    return out


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs CUDA, which is not available in this process")


def encode_tensor(tensor: torch.Tensor) -> dict:
    """Descriptor of a CUDA tensor's memory (JSON-able). Keep `tensor` alive until the receiver is done."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise ValueError(f"CUDA IPC shares CUDA tensors; this one is on {tensor.device} "
                         f"(use the shared-memory transport for host tensors)")
    _require_cuda("encode_tensor")
    from torch.multiprocessing.reductions import reduce_tensor

    # reduce_tensor registers the storage in torch's sender-side IPC cache and gives the handles.
    _, args = reduce_tensor(tensor.detach())
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size_bytes, storage_offset_bytes,
     _requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return {
        "schema": SCHEMA, "device": int(device), "handle": _b64(handle),
        "storage_size_bytes": int(storage_size_bytes), "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle), "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle or b""), "event_sync_required": bool(event_sync_required),
        "dtype": dtype_to_str(dtype), "shape": list(size), "stride": list(stride), "offset": int(offset),
    }  # fmt: skip


def decode_tensor(descriptor: Any, device: int | None = None) -> torch.Tensor:
    """Validate `descriptor`, then map the sender's memory: a CUDA tensor aliasing it (no copy).

    `device` (optional) is the CUDA ordinal the receiver expects; a descriptor naming another is refused.
    """
    f = validate_tensor_descriptor(descriptor)
    if device is not None and f["device"] != device:
        raise IpcDescriptorError(f"descriptor names cuda:{f['device']}, this receiver expects cuda:{device}")
    _require_cuda("decode_tensor")
    if f["device"] >= torch.cuda.device_count():
        raise IpcDescriptorError(f"descriptor names cuda:{f['device']}; this process sees "
                                 f"{torch.cuda.device_count()} devices")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(f["shape"]), tuple(f["stride"]), f["offset"], torch.UntypedStorage, f["dtype"],
        f["device"], f["handle"], f["storage_size_bytes"], f["storage_offset_bytes"], False,
        f["ref_counter_handle"], f["ref_counter_offset"], f["event_handle"], f["event_sync_required"],
    )


def encode_bucket(bucket: FlattenedTensorBucket) -> dict:
    """A flattened CUDA bucket as {"schema", "flattened_tensor": tensor descriptor, "metadata": [...]}."""
    d = bucket.to_dict()
    return {"schema": SCHEMA, "flattened_tensor": encode_tensor(bucket.flattened_tensor), "metadata": d["metadata"]}


def validate_bucket_descriptor(d: Any) -> None:
    """Schema checks of a bucket descriptor that need no CUDA (the flat tensor's fields included)."""
    if not isinstance(d, Mapping) or set(d) != _BUCKET_KEYS:
        got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
        raise IpcDescriptorError(f"a CUDA IPC bucket needs exactly keys {sorted(_BUCKET_KEYS)}, got {got}")
    if d["schema"] != SCHEMA:
        raise IpcDescriptorError(f"schema {d['schema']!r} is not {SCHEMA!r}")
    flat = validate_tensor_descriptor(d["flattened_tensor"])
    if len(flat["shape"]) != 1 or flat["stride"] != [1]:
        raise IpcDescriptorError(f"a bucket's flattened tensor must be 1-D and contiguous, got shape "
                                 f"{flat['shape']} stride {flat['stride']}")


def decode_bucket(d: Any, device: int | None = None) -> FlattenedTensorBucket:
    """Validate a bucket descriptor, map its flat tensor, and rebuild the bucket (entries checked too)."""
    validate_bucket_descriptor(d)
    flat = decode_tensor(d["flattened_tensor"], device)
    return FlattenedTensorBucket.from_dict({"flattened_tensor": flat, "metadata": d["metadata"]})
