"""Shared-memory buckets for the cross-process transport: a bucket's bytes in a POSIX segment.

`bucket_to_shm` writes a FlattenedTensorBucket into a segment (reused between buckets of similar size)
and returns a JSON descriptor (segment name, dtype, byte length, bucket metadata); `bucket_from_shm`
validates every field of a descriptor and maps the bytes back. Segment names carry a prefix with a
random token (`new_segment_prefix`) and the reader attaches only to names with that prefix, without
registering them with its resource tracker (Python < 3.13 registers every attach, and the tracker then
unlinks the creator's segment when the attaching process exits). It opens no pipes or processes.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from multiprocessing import shared_memory
from typing import Any

import torch

from weight_sync.bucket import FlattenedTensorBucket, dtype_to_str, str_to_dtype


def new_segment_prefix() -> str:
    """`rlw_<12 hex>_`: the random, per-handle prefix of every segment a RemoteEngine creates."""
    return f"rlw_{secrets.token_hex(6)}_"


def _check_segment_name(name: Any, prefix: str) -> str:
    if not isinstance(name, str) or not re.fullmatch(re.escape(prefix) + r"[0-9a-f]{1,16}", name):
        raise ValueError(f"shared memory segment {name!r} was not created by this engine's sender (expected "
                         f"a name {prefix}<hex>); refused")
    return name


class _Segment:
    """A POSIX shared memory segment attached read-write, never registered with a resource tracker."""

    def __init__(self, name: str) -> None:
        try:
            import _posixshmem  # CPython's own binding, what SharedMemory uses on POSIX
        except ImportError:  # Windows: no resource tracker to avoid
            self._shm = shared_memory.SharedMemory(name=name)
            self.buf, self.size, self._mmap = self._shm.buf, self._shm.size, None
            return
        self._shm = None
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size) if self.size else None
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    def close(self) -> None:
        self.buf.release()
        if self._mmap is not None:
            self._mmap.close()
        if self._shm is not None:
            self._shm.close()


def bucket_to_shm(bucket: FlattenedTensorBucket, shm: shared_memory.SharedMemory | None,
                  name_prefix: str | None = None, counter: list[int] | None = None):
    """Copy a CPU bucket into shared memory (reusing `shm` when big enough). Returns (descriptor, shm).
    A new segment is named `name_prefix` + a hex counter (random name without a prefix)."""
    flat = bucket.flattened_tensor
    if flat.device.type != "cpu":
        raise NotImplementedError(f"cross-process sync of {flat.device.type} tensors through shared memory is not "
                                  f"supported; use weight_sync.cuda_ipc, move the bucket to the CPU, or sync in-process")
    nbytes = flat.numel() * flat.element_size()
    if shm is None or shm.size < nbytes:
        if shm is not None:
            shm.close()
            shm.unlink()
        name = None
        if name_prefix is not None:
            counter = counter if counter is not None else [0]
            counter[0] += 1
            name = f"{name_prefix}{counter[0]:x}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
    dst = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
    dst.copy_(flat.contiguous().view(torch.uint8))
    d = bucket.to_dict()
    descriptor = {"shm_name": shm.name, "nbytes": nbytes, "dtype": dtype_to_str(flat.dtype),
                  "metadata": d["metadata"]}
    return descriptor, shm


def bucket_from_shm(descriptor: Any, name_prefix: str) -> tuple[FlattenedTensorBucket, _Segment]:
    """Rebuild a bucket from a descriptor: validated field by field (the segment name must carry
    `name_prefix`), then the metadata as a whole, before any tensor is built; nothing executed."""
    if not isinstance(descriptor, dict) or set(descriptor) != {"shm_name", "nbytes", "dtype", "metadata"}:
        raise ValueError(f"malformed bucket descriptor: expected keys shm_name, nbytes, dtype, metadata; "
                         f"got {sorted(descriptor) if isinstance(descriptor, dict) else type(descriptor).__name__}")
    name, nbytes = descriptor["shm_name"], descriptor["nbytes"]
    if not isinstance(name, str) or not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError("malformed bucket descriptor: shm_name must be a string and nbytes an int >= 0")
    _check_segment_name(name, name_prefix)
    dtype = str_to_dtype(descriptor["dtype"])
    if nbytes % dtype.itemsize:
        raise ValueError(f"bucket descriptor claims {nbytes} bytes, not a whole number of {dtype} elements")
    seg = _Segment(name)
    if seg.size < nbytes:
        seg.close()
        raise ValueError(f"bucket descriptor claims {nbytes} bytes of {dtype}; segment {name} has {seg.size}")
    try:
        flat = torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes).view(dtype) if nbytes else \
            torch.empty(0, dtype=dtype)
        bucket = FlattenedTensorBucket.from_dict({"flattened_tensor": flat, "metadata": descriptor["metadata"]})
    except Exception:
        flat = None
        seg.close()
        raise
    return bucket, seg
