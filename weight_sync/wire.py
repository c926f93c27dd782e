"""The pickle-free HTTP wire form of named tensors and flattened buckets (encoding side).

Each string is the base64 of a safetensors blob (an 8-byte header length, a JSON header of names,
dtypes, shapes and byte offsets, then raw little-endian bytes): plain pairs under their names, or a
bucket as one 1-D tensor `flattened_tensor` with the JSON list of `{"name", "shape", "dtype", "start",
"end"}` entries in `__metadata__["bucket_metadata"]`. Here so that a trainer (weight_sync/http.py) can
encode without importing `rollout`; the server's decoder (rollout/server/tensor_codec.py) re-exports
these and owns decoding and validation. Deltas have their own blob (weight_sync/delta_codec.py).
"""

from __future__ import annotations

import base64
import json

from safetensors.torch import save as st_save

from weight_sync.bucket import FlattenedTensorBucket

FLAT_KEY = "flattened_tensor"
META_KEY = "bucket_metadata"


def encode_named_tensors(named_tensors) -> str:
    """[(name, tensor), ...] or {name: tensor} -> base64 safetensors string. Every name is encoded,
    also names whose tensors share storage (a tied model's embedding and lm_head in its state_dict):
    safetensors refuses shared storage, so each name after the first on one storage gets its own copy."""
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    tensors, storages = {}, set()
    for name, t in items:
        t = t.detach().to("cpu").contiguous()
        key = t.untyped_storage().data_ptr()
        if key in storages or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # shared with another name, or a view of a larger storage
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    return base64.b64encode(st_save(tensors)).decode("ascii")


def encode_bucket(bucket: FlattenedTensorBucket) -> str:
    d = bucket.to_dict()
    blob = st_save({FLAT_KEY: d["flattened_tensor"].detach().to("cpu").contiguous()},
                   metadata={META_KEY: json.dumps(d["metadata"])})
    return base64.b64encode(blob).decode("ascii")
