"""Memory saver: release the device memory of tagged regions between rollouts and take it back.

One adapter, `region(tag, enable_cpu_backup)`, `track(tag, tensors)`, `pause(tag)`, `resume(tag)`,
`bytes_held(tag)`, over tags `weights`, `kv_cache`, `cuda_graph`. Backends:

- `PortableMemorySaver` (CPU, or CUDA without torch_memory_saver): frees the storage of every
  tracked tensor (`untyped_storage().resize_(0)`) and reallocates it on resume. Addresses change, so
  anything that captured them (CUDA graphs) must be rebuilt. Weights tracked here are first
  consolidated into one flat buffer per dtype, so a release frees a few large blocks the allocator
  really returns to the OS, and a backup is one large copy.
- `DisabledMemorySaver`: regions and tracking only count bytes; pause/resume are clear errors.

The weight CPU backup is ours: one persistent host buffer (pinned on CUDA) per tag, allocated on the
first release and reused, filled with large copies. The torch_memory_saver backend (virtual
addresses that survive release, so CUDA graphs stay valid) belongs to the GPU issue and is not here.
"""

from __future__ import annotations

import ctypes
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

ALL_TAGS = ("weights", "kv_cache", "cuda_graph")


def _check_tag(tag: str) -> None:
    if tag not in ALL_TAGS:
        raise ValueError(f"unknown memory tag {tag!r}; valid tags: {list(ALL_TAGS)}")


def _release_host_memory() -> None:
    """Ask glibc to hand freed heap pages back to the OS (large blocks are mmapped and go anyway)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def consolidate(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Move `tensors` (same device) into one flat buffer per dtype; they become views of it.

    Returns the flat buffers. Parameter objects stay the same Python objects, so every reference
    to them (optimisers aside) stays valid.
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


@dataclass
class _Region:
    enable_cpu_backup: bool = False
    buffers: list[torch.Tensor] = field(default_factory=list)  # tensors whose storages we own
    nbytes: list[int] = field(default_factory=list)
    resident: bool = True
    backup: torch.Tensor | None = None  # persistent host buffer, uint8, sum(nbytes)


class DisabledMemorySaver:
    """Tracks bytes so `bytes_held` answers, but refuses to release anything."""

    name = "disabled"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.regions = {tag: _Region() for tag in ALL_TAGS}

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False):
        _check_tag(tag)
        self.regions[tag].enable_cpu_backup = enable_cpu_backup
        yield

    def track(self, tag: str, tensors: list[torch.Tensor]) -> None:
        _check_tag(tag)
        region = self.regions[tag]
        for t in self._own(tag, tensors):
            region.buffers.append(t)
            region.nbytes.append(t.untyped_storage().nbytes())

    def _own(self, tag: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)

    def bytes_held(self, tag: str) -> int:
        _check_tag(tag)
        return sum(t.untyped_storage().nbytes() for t in self.regions[tag].buffers)

    def is_resident(self, tag: str) -> bool:
        return self.regions[tag].resident

    def has_cpu_backup(self, tag: str) -> bool:
        return self.regions[tag].enable_cpu_backup

    def pause(self, tag: str) -> None:
        raise RuntimeError("memory release is disabled: create the Engine with enable_memory_saver=True")

    def resume(self, tag: str) -> None:
        raise RuntimeError("memory release is disabled: create the Engine with enable_memory_saver=True")

    def close(self) -> None:
        pass


class PortableMemorySaver(DisabledMemorySaver):
    name = "portable"

    def _own(self, tag: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # Weights are many small tensors: consolidate so a release frees a few big blocks. The KV
        # pool is already one buffer per K and V.
        return consolidate(list(tensors)) if tag == "weights" else list(tensors)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def pause(self, tag: str) -> None:
        _check_tag(tag)
        region = self.regions[tag]
        if not region.resident:
            return
        if region.enable_cpu_backup and region.buffers:
            if region.backup is None:
                region.backup = torch.empty(sum(region.nbytes), dtype=torch.uint8,
                                            pin_memory=self.device.type == "cuda")
            offset = 0
            for buf, n in zip(region.buffers, region.nbytes):
                src = torch.empty(0, dtype=torch.uint8, device=buf.device).set_(buf.untyped_storage())
                region.backup[offset : offset + n].copy_(src, non_blocking=True)
                offset += n
        self._synchronize()  # the copies (and any kernel still reading) finish before we free
        for buf in region.buffers:
            buf.untyped_storage().resize_(0)
        region.resident = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _release_host_memory()

    def resume(self, tag: str) -> None:
        _check_tag(tag)
        region = self.regions[tag]
        if region.resident:
            return
        offset = 0
        for buf, n in zip(region.buffers, region.nbytes):
            buf.untyped_storage().resize_(n)
            if region.enable_cpu_backup and region.backup is not None:
                dst = torch.empty(0, dtype=torch.uint8, device=buf.device).set_(buf.untyped_storage())
                dst.copy_(region.backup[offset : offset + n], non_blocking=True)
            offset += n
        self._synchronize()
        region.resident = True


def create_memory_saver(enable: bool, device: torch.device) -> DisabledMemorySaver:
    if not enable:
        return DisabledMemorySaver(device)
    return PortableMemorySaver(device)
