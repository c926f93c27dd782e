"""Moving weights from a trainer to a rollout engine.

A leaf package: both ends import it, it imports neither `runner`, `rollout` nor `trainers`.

- `bucket`: the flattened-bucket wire format (`FlattenedTensorBucket`, `iter_buckets`); also reads
  SGLang's buckets (its getters, metadata objects, uint8 mixed-dtype layout).
- `disk`: atomic Hugging Face checkpoints (`save_hf_checkpoint`) for `update_weights_from_disk`.
- `sync`: `sync_weights(source, target)`, one call for every transport (a server URL too, via `http`).
- `delta`, `delta_codec`: `DeltaSync(target)`, exact sparse deltas after a first full sync; the format.
- `http`: `HttpEngine(url)`, the weight-update calls of a running server.
- `cross_process`: `RemoteEngine(factory, ...)`, an engine in a child process fed through shared memory.
- `distributed`: a standalone broadcast group, trainer rank 0 -> engine ranks, in SGLang's two wire
  formats (per tensor, flattened bucket) and a checked one of ours; `destroy_weight_update_group`.
"""

from weight_sync.bucket import (
    FlattenedTensorBucket,
    TensorMeta,
    as_dtype,
    dtype_to_str,
    iter_buckets,
    iter_named_tensors,
    str_to_dtype,
)
from weight_sync.delta import DeltaSync
from weight_sync.delta_codec import DeltaUpdate
from weight_sync.disk import DiskTarget, save_hf_checkpoint
from weight_sync.sync import DEFAULT_BUCKET_BYTES, sync_weights

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DeltaSync",
    "DeltaUpdate",
    "DiskTarget",
    "sync_weights",
    "FlattenedTensorBucket",
    "TensorMeta",
    "as_dtype",
    "dtype_to_str",
    "iter_buckets",
    "iter_named_tensors",
    "save_hf_checkpoint",
    "str_to_dtype",
]
