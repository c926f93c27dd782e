"""Host-side helpers of the memory savers: the weights' CPU backup and returning host memory.

`HostBackup` keeps one persistent host buffer (pinned on CUDA) per region and fills or drains it with
chunked copies on a side stream; `consolidate` moves many tensors into one flat buffer per dtype, so a
release frees a few large blocks; `release_host_memory` asks glibc to return freed heap pages. It does
not decide what is released or when (runner/memory/memory_saver.py and its backends do).
"""

from __future__ import annotations

import ctypes
import itertools
from contextlib import contextmanager

import torch

BACKUP_CHUNK_BYTES = 256 << 20  # one copy per chunk: large enough for full PCIe/NVLink-C2C rate


def release_host_memory() -> None:
    """Ask glibc to hand freed heap pages back to the OS (large blocks are mmapped and go anyway)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def consolidate(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Move `tensors` (same device) into one flat buffer per dtype; they become views of it.

    Returns the flat buffers. Parameter objects stay the same Python objects, so every reference
    to them (optimisers aside) stays valid. The flat buffers are allocated in the caller's context,
    so a torch_memory_saver region around the call places them in pauseable memory.
    """
    unique, seen = [], set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            unique.append(t)
    flats = []
    for dtype in sorted({t.dtype for t in unique}, key=str):
        group = [t for t in unique if t.dtype == dtype]
        flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=group[0].device)
        offset = 0
        with torch.no_grad():
            for t in group:
                n = t.numel()
                view = flat[offset : offset + n].view(t.shape)
                view.copy_(t)
                t.data = view
                offset += n
        flats.append(flat)
    return flats


def bytes_view(buf: torch.Tensor) -> torch.Tensor:
    """The whole storage of `buf` as a flat uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=buf.device).set_(buf.untyped_storage())


class HostBackup:
    """One persistent host buffer holding the bytes of a list of device storages.

    `save` copies device -> host and `restore` host -> device, in chunks of `chunk_bytes`, as
    non-blocking copies on a side stream (CUDA) that waits for the work already queued on the current
    stream; both return after the copies finished. The buffer is allocated (pinned on CUDA) on the
    first save and reused, so repeated release/resume cycles allocate nothing new.
    """

    def __init__(self, device: torch.device, chunk_bytes: int = BACKUP_CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.buffer: torch.Tensor | None = None
        self.num_copies = 0  # copies issued by the last save/restore (for tests and benchmarks)

    def _copy(self, pairs) -> None:
        """`pairs`: (dst, src) flat uint8 tensors of equal size; copied chunk by chunk."""
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        self.num_copies = 0
        with torch.cuda.stream(stream) if cuda else _nullcontext():
            for dst, src in pairs:
                for start in range(0, src.numel(), self.chunk_bytes):
                    end = min(start + self.chunk_bytes, src.numel())
                    dst[start:end].copy_(src[start:end], non_blocking=cuda)
                    self.num_copies += 1
        if cuda:
            stream.synchronize()

    def _slices(self, sizes: list[int]) -> list[torch.Tensor]:
        offsets = list(itertools.accumulate(sizes, initial=0))
        return [self.buffer[a:b] for a, b in zip(offsets, offsets[1:])]

    def save(self, storages: list[torch.Tensor]) -> None:
        sizes = [s.numel() for s in storages]
        if self.buffer is None or self.buffer.numel() != sum(sizes):
            self.buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._copy(zip(self._slices(sizes), storages))

    def restore(self, storages: list[torch.Tensor]) -> None:
        sizes = [s.numel() for s in storages]
        if self.buffer is None or self.buffer.numel() != sum(sizes):
            raise RuntimeError(f"no host backup of {sum(sizes)} bytes to restore from")
        self._copy(zip(storages, self._slices(sizes)))


@contextmanager
def _nullcontext():
    yield
