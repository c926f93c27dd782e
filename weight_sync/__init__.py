"""Moving weights from a trainer to a rollout engine.

A leaf package: both ends import it, it imports neither `runner`, `rollout` nor `trainers`.

- `bucket`: the flattened-bucket wire format (`FlattenedTensorBucket`, `iter_buckets`).
- `disk`: atomic Hugging Face checkpoints (`save_hf_checkpoint`) for `update_weights_from_disk`.
"""

from weight_sync.bucket import (
    FlattenedTensorBucket,
    TensorMeta,
    dtype_to_str,
    iter_buckets,
    iter_named_tensors,
    str_to_dtype,
)
from weight_sync.disk import save_hf_checkpoint

__all__ = [
    "FlattenedTensorBucket",
    "TensorMeta",
    "dtype_to_str",
    "iter_buckets",
    "iter_named_tensors",
    "save_hf_checkpoint",
    "str_to_dtype",
]
