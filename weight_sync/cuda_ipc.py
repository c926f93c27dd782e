"""CUDA IPC for weight sync: another process on the same machine maps the sender's GPU memory.

The sender turns a CUDA tensor (or a flattened bucket of them) into a descriptor of plain JSON types:
the CUDA IPC handles torch produces for the tensor's allocation (base64 strings), the storage's size
and offset inside that allocation, the tensor's dtype / shape / stride / offset, and the device as its
UUID, as SGLang sends it: ordinals differ between processes under per-process CUDA_VISIBLE_DEVICES (Ray
sets one per actor), the UUID does not. The receiver maps the UUID to its own ordinal (an int ordinal
is still accepted, for senders that know both processes see the same devices). The receiver
checks every field against a fixed schema before it touches CUDA, then maps the memory with torch's
own `rebuild_cuda_tensor` (`torch.UntypedStorage._new_shared_cuda`, with torch's per-process cache of
opened handles). Nothing is unpickled: a hostile or corrupt descriptor can fail an update, never run
code or read outside the storage it names. The received tensor aliases the sender's memory, so a
flattened bucket reaches `update_weights_from_tensor` without a host round trip.

Lifetime: the sender must keep the tensor alive until the receiver has loaded it (torch's IPC
reference counter stops the sender's allocator from reusing the block while a receiver holds it).

The two torch calls (share: `reduce_tensor`; map: `rebuild_cuda_tensor`) and the device UUIDs sit
behind `TorchCudaIpc`; a test on a machine without CUDA swaps in a named stand-in with
`use_ipc_backend` to run everything around them. `encode_request` / `decode_request` are the JSON
payload of `/update_weights_from_tensor` with `load_format="cuda_ipc"` (a list of bucket descriptors).

What this module does not do: open pipes or processes (`cross_process.RemoteEngine` moves the JSON),
or copy anything through host memory. On a machine without CUDA only the schema and its refusals
run; `encode_*` / `decode_*` raise a clear error when CUDA is missing.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch

from weight_sync.bucket import FlattenedTensorBucket, dtype_to_str, str_to_dtype

SCHEMA = "rollout.cuda_ipc.v1"
MAX_HANDLE_BYTES = 1024  # a cudaIpcMemHandle is 64 bytes; torch adds a little framing
MAX_DIMS = 8
MAX_BUCKETS = 4096  # per request: far more than a model's weights need at any sane bucket size
_UUID = re.compile(r"(gpu-)?[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
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


def _device_field(value: Any) -> int | str:
    """A device UUID string (what encode_tensor sends) or a non-negative ordinal."""
    if isinstance(value, str):
        if not _UUID.fullmatch(value.lower()):
            raise IpcDescriptorError(f"field 'device' {value[:60]!r} is neither a CUDA device UUID nor an ordinal")
        return value.lower().removeprefix("gpu-")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise IpcDescriptorError(f"field 'device' must be a device UUID string or an int >= 0, got {value!r}")
    return value


def resolve_device(device: int | str, visible_uuids: list[str]) -> int:
    """This process's ordinal of a descriptor's device (UUID or ordinal), given the UUIDs it sees in
    ordinal order; IpcDescriptorError when it does not see that device."""
    if isinstance(device, int):
        if device >= len(visible_uuids):
            raise IpcDescriptorError(f"descriptor names cuda:{device}; this process sees {len(visible_uuids)} devices")
        return device
    uuids = [u.lower().removeprefix("gpu-") for u in visible_uuids]
    if device not in uuids:
        raise IpcDescriptorError(f"descriptor names device UUID {device}, which this process does not see "
                                 f"(visible: {uuids}); CUDA IPC needs sender and receiver on the same GPU")
    return uuids.index(device)


class TorchCudaIpc:
    """torch's CUDA IPC: share a tensor's allocation, map one shared by another process."""

    name = "torch"

    def check(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cuda":
            raise ValueError(f"CUDA IPC shares CUDA tensors; this one is on {tensor.device} "
                             f"(use the shared-memory transport for host tensors)")
        _require_cuda("encode_tensor")

    def device_uuids(self, what: str = "CUDA IPC") -> list[str]:
        _require_cuda(what)
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]

    def share(self, tensor: torch.Tensor) -> tuple:
        """reduce_tensor's rebuild arguments (it registers the storage in torch's sender-side IPC cache)."""
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(tensor)[1]

    def open(self, f: dict, ordinal: int) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(f["shape"]), tuple(f["stride"]), f["offset"], torch.UntypedStorage, f["dtype"],
            ordinal, f["handle"], f["storage_size_bytes"], f["storage_offset_bytes"], False,
            f["ref_counter_handle"], f["ref_counter_offset"], f["event_handle"], f["event_sync_required"],
        )


_backend = TorchCudaIpc()


def set_ipc_backend(backend):
    """Use another share/open/device_uuids implementation (tests: a named stand-in); returns the old one."""
    global _backend
    old, _backend = _backend, backend
    return old


@contextmanager
def use_ipc_backend(backend):
    """`set_ipc_backend` for the duration of a with-block."""
    old = set_ipc_backend(backend)
    try:
        yield backend
    finally:
        set_ipc_backend(old)


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
        "device": _device_field(d["device"]),
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
    _backend.check(tensor)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size_bytes, storage_offset_bytes,
     _requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = \
        _backend.share(tensor.detach())
    return {
        "schema": SCHEMA, "device": _backend.device_uuids()[int(device)], "handle": _b64(handle),
        "storage_size_bytes": int(storage_size_bytes), "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle), "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle or b""), "event_sync_required": bool(event_sync_required),
        "dtype": dtype_to_str(dtype), "shape": list(size), "stride": list(stride), "offset": int(offset),
    }  # fmt: skip


def decode_tensor(descriptor: Any, device: int | None = None) -> torch.Tensor:
    """Validate `descriptor`, then map the sender's memory: a tensor aliasing it (no copy).

    The descriptor's device (a UUID, or an ordinal) is mapped to this process's ordinal; `device`
    (optional) is the ordinal the receiver expects, and a descriptor naming another GPU is refused.
    """
    f = validate_tensor_descriptor(descriptor)
    ordinal = resolve_device(f["device"], _backend.device_uuids("decode_tensor"))
    if device is not None and ordinal != device:
        raise IpcDescriptorError(f"descriptor names cuda:{ordinal} (here), this receiver expects cuda:{device}")
    return _backend.open(f, ordinal)


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


def validate_request(d: Any) -> list:
    """The `cuda_ipc` payload of /update_weights_from_tensor and RemoteEngine: a non-empty list of bucket
    descriptors, every one checked (no CUDA call) before any memory is mapped."""
    if not isinstance(d, list) or not d:
        raise IpcDescriptorError(f"a cuda_ipc payload is a non-empty list of bucket descriptors, got "
                                 f"{type(d).__name__ if not isinstance(d, list) else 'an empty list'}")
    if len(d) > MAX_BUCKETS:
        raise IpcDescriptorError(f"a cuda_ipc payload holds at most {MAX_BUCKETS} buckets, got {len(d)}")
    for i, b in enumerate(d):
        try:
            validate_bucket_descriptor(b)
        except IpcDescriptorError as e:
            raise IpcDescriptorError(f"bucket {i}: {e}") from None
    return d


def encode_request(buckets: list[FlattenedTensorBucket]) -> str:
    """JSON text of the buckets' descriptors (serialized_named_tensors[i] with load_format="cuda_ipc")."""
    return json.dumps([encode_bucket(b) for b in buckets])


def decode_request(payload: Any, device: int | None = None) -> list[FlattenedTensorBucket]:
    """JSON text (or the parsed list) -> mapped buckets. Every descriptor is validated first; a bad one
    maps nothing. The buckets alias the sender's memory: load them, then drop them."""
    if isinstance(payload, str | bytes):
        if len(payload) > MAX_BUCKETS * 8192:
            raise IpcDescriptorError(f"cuda_ipc payload of {len(payload)} characters is too large")
        try:
            payload = json.loads(payload)
        except (ValueError, RecursionError) as e:
            raise IpcDescriptorError(f"cuda_ipc payload is not JSON: {type(e).__name__}") from None
    buckets = validate_request(payload)
    uuids = _backend.device_uuids("decode_request")
    for i, b in enumerate(buckets):  # every device resolved before the first mapping
        try:
            resolve_device(validate_tensor_descriptor(b["flattened_tensor"])["device"], uuids)
        except IpcDescriptorError as e:
            raise IpcDescriptorError(f"bucket {i}: {e}") from None
    return [decode_bucket(b, device) for b in buckets]
