"""The pickle-free wire form of named tensors for `/update_weights_from_tensor`.

SGLang's body carries `serialized_named_tensors`: one string per tensor-parallel rank. SGLang fills each
with a base64 pickle; we never unpickle request bytes. Each string here is the base64 of a safetensors
blob (https://github.com/huggingface/safetensors: an 8-byte header length, a JSON header of names,
dtypes, shapes and byte offsets, then raw little-endian bytes), which decoding can only turn into
tensors:

- plain (`load_format` null): the blob holds the named tensors under their HF names;
- `load_format="flattened_bucket"`: the blob holds one 1-D tensor named `flattened_tensor`, and the
  header's `__metadata__["bucket_metadata"]` holds the JSON list of `{"name", "shape", "dtype", "start",
  "end"}` entries of `weight_sync.bucket.FlattenedTensorBucket.to_dict()`. A list of buckets is a JSON
  list of such strings (one string per bucket, all for the same rank).

- `load_format="cuda_ipc"`: the string is the JSON list of CUDA IPC bucket descriptors of
  `weight_sync.cuda_ipc.encode_request` (a sender on the same GPU; no bytes cross, the engine's process
  maps the sender's memory), loaded as flattened buckets; the reply waits until nothing reads that memory.

`decode_and_update` is the route's whole job, run where the engine lives (rollout/server/common.py
`run_on_engine`): the strings cross the server's pipe to an engine process as strings, never as tensors.

- `load_format="delta"`: the string is the base64 of a sparse delta blob (itself a safetensors file,
  format owned by weight_sync/delta_codec.py, which both the sender and this decoder use).

Decoding validates structure (base64, safetensors header, bucket metadata) and raises ValueError
naming what is wrong; shape and dtype checks against the model are the engine's.
"""

from __future__ import annotations

import base64
import binascii
import json

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from weight_sync.bucket import FlattenedTensorBucket

# The encoders live in weight_sync (a trainer encodes without importing rollout); re-exported here.
from weight_sync.wire import FLAT_KEY, META_KEY, encode_bucket, encode_named_tensors  # noqa: F401


def _blob(s, what: str) -> bytes:
    if not isinstance(s, str):
        raise ValueError(f"{what} must be a base64 string, got {type(s).__name__}")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{what} is not valid base64: {e}") from None


def _load(blob: bytes, what: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(blob)
    except (SafetensorError, ValueError, RuntimeError) as e:
        # Only a blob safetensors refused is looked at as a pickle: a header length can start with the same
        # two bytes as a pickle's PROTO opcode (0x80, 2-5).
        if len(blob) > 1 and blob[0] == 0x80 and 2 <= blob[1] <= 5:
            # What SGLang's MultiprocessingSerializer sends (slime's and verl's colocated sync): refused by name.
            raise ValueError(f"{what} is a pickle (SGLang's MultiprocessingSerializer), which this engine never "
                             "unpickles: send base64 safetensors blobs (weight_sync.wire.encode_named_tensors / "
                             "encode_bucket), or update in process or through a torch.distributed group") from None
        raise ValueError(f"{what} is not a valid safetensors blob: {e}") from None


def decode_named_tensors(s: str, what: str = "serialized_named_tensors[0]") -> list[tuple[str, torch.Tensor]]:
    tensors = _load(_blob(s, what), what)
    if not tensors:
        raise ValueError(f"{what} holds no tensors")
    return list(tensors.items())


def decode_delta(s: str, what: str = "serialized_named_tensors[0]"):
    """-> a structurally validated weight_sync.delta_codec.DeltaUpdate (ValueError naming the problem)."""
    from weight_sync.delta_codec import DeltaFormatError, DeltaUpdate

    try:
        return DeltaUpdate.from_blob(_blob(s, what))
    except DeltaFormatError as e:
        raise ValueError(f"{what}: {e}") from None


def decode_buckets(s: str, what: str = "serialized_named_tensors[0]") -> list[dict]:
    """-> bucket dicts {"flattened_tensor", "metadata"} (validated by FlattenedTensorBucket.from_dict)."""
    strings = [s]
    if isinstance(s, str) and s.lstrip().startswith("["):
        try:
            strings = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what}: a list of buckets must be a JSON list of strings: {e}") from None
    out = []
    for i, b in enumerate(strings):
        where = f"{what} bucket {i}"
        blob = _blob(b, where)
        tensors = _load(blob, where)
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + header_len])
        meta = (header.get("__metadata__") or {}).get(META_KEY)
        if set(tensors) != {FLAT_KEY} or meta is None:
            raise ValueError(f"{where}: a bucket blob holds exactly one tensor {FLAT_KEY!r} and "
                             f"__metadata__[{META_KEY!r}]; got tensors {sorted(tensors)}")
        try:
            metadata = json.loads(meta)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: {META_KEY} is not JSON: {e}") from None
        FlattenedTensorBucket.from_dict({"flattened_tensor": tensors[FLAT_KEY], "metadata": metadata})
        out.append({"flattened_tensor": tensors[FLAT_KEY], "metadata": metadata})
    return out


def decode_ipc_buckets(s: str) -> list[dict]:
    """`load_format="cuda_ipc"`: JSON bucket descriptors (weight_sync.cuda_ipc), every one validated
    before any is mapped; the buckets alias the sender's GPU memory (no host copy)."""
    from weight_sync.cuda_ipc import decode_request

    return [b.to_dict() for b in decode_request(s)]


class PayloadError(ValueError):
    """serialized_named_tensors itself is malformed (nothing was aborted or loaded)."""


def decode_payload(serialized: str, load_format: str | None) -> tuple[object, str | None]:
    """One rank's string -> (what Engine.update_weights_from_tensor takes, its load_format)."""
    if load_format == "flattened_bucket":
        return decode_buckets(serialized), load_format
    if load_format == "cuda_ipc":  # a sender on the same GPU: buckets as CUDA IPC handles (cuda_ipc.py)
        return decode_ipc_buckets(serialized), "flattened_bucket"
    if load_format == "delta":
        return decode_delta(serialized), load_format
    return decode_named_tensors(serialized), load_format


def only_if_set(**flags: bool) -> dict:
    """The flags that are True: an engine whose method lacks one is only ever passed it when asked for it."""
    return {k: True for k, v in flags.items() if v}


def decode_and_update(engine, serialized: str, load_format: str | None, flush_cache: bool,
                      weight_version: str | None, abort_all_requests: bool, online: bool = False):
    """/update_weights_from_tensor next to the engine: decode (PayloadError if malformed: then nothing
    else happens), update (`online`: retracting requests in flight; `abort_all_requests`: aborting every
    request once the update succeeded)."""
    try:
        payload, load_format = decode_payload(serialized, load_format)
    except (ValueError, RuntimeError) as e:
        raise PayloadError(str(e)) from None
    return update_and_release(engine, payload, load_format, flush_cache, weight_version, online, abort_all_requests)


def update_and_release(engine, payload, load_format, flush_cache, weight_version, online: bool = False,
                       abort_all_requests: bool = False):
    """The update, then (CUDA IPC) a synchronize, so nothing still reads a sender's memory once we reply."""
    try:
        return engine.update_weights_from_tensor(payload, load_format=load_format, flush_cache=flush_cache,
                                                 weight_version=weight_version,
                                                 **only_if_set(online=online, abort_all_requests=abort_all_requests))
    finally:
        flats = [b["flattened_tensor"] for b in payload if isinstance(b, dict)] if isinstance(payload, list) else []
        if any(t.is_cuda for t in flats if isinstance(t, torch.Tensor)):
            torch.cuda.synchronize()
