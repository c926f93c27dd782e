"""The memory-saver interface and its backends that need no CUDA library.

`DisabledMemorySaver` tracks bytes per tag so `bytes_held` answers but refuses to release;
`PortableMemorySaver` frees the storage of every tracked tensor (`untyped_storage().resize_(0)`) and
reallocates it on resume, so addresses change (`address_epoch` counts the resumes that moved memory).
Both work on the CPU and on CUDA. The torch_memory_saver backend is runner/memory/tms_saver.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from runner.memory.host_backup import HostBackup, bytes_view, consolidate, release_host_memory

ALL_TAGS = ("weights", "kv_cache", "cuda_graph")
# Graph capture errors only on unsafe CUDA calls of the capturing thread: a recapture after a resume that moved
# memory runs on the overlap schedule's worker while the scheduler thread may allocate and copy for the next
# step (torch's default, "global", would fail the capture on those).
CAPTURE_ERROR_MODE = "thread_local"


def check_tag(tag: str) -> None:
    if tag not in ALL_TAGS:
        raise ValueError(f"unknown memory tag {tag!r}; valid tags: {list(ALL_TAGS)}")


@dataclass
class _Region:
    enable_cpu_backup: bool = False
    buffers: list[torch.Tensor] = field(default_factory=list)  # tensors whose storages we own
    nbytes: list[int] = field(default_factory=list)
    resident: bool = True
    host: HostBackup | None = None

    @property
    def backup(self) -> torch.Tensor | None:
        """The persistent host buffer (uint8, sum(nbytes)), once a release with backup made it."""
        return None if self.host is None else self.host.buffer


class DisabledMemorySaver:
    """Tracks bytes so `bytes_held` answers, but refuses to release anything."""

    name = "disabled"
    preserves_addresses = True  # nothing ever moves

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.regions = {tag: _Region() for tag in ALL_TAGS}
        self.address_epoch = 0  # bumped whenever a resume moved tracked memory to new addresses

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False):
        check_tag(tag)
        self.regions[tag].enable_cpu_backup = enable_cpu_backup
        yield

    def track(self, tag: str, tensors: list[torch.Tensor]) -> None:
        check_tag(tag)
        region = self.regions[tag]
        for t in self._own(tag, tensors):
            region.buffers.append(t)
            region.nbytes.append(t.untyped_storage().nbytes())

    def _own(self, tag: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)

    def bytes_held(self, tag: str) -> int:
        check_tag(tag)
        return sum(t.untyped_storage().nbytes() for t in self.regions[tag].buffers)

    def is_resident(self, tag: str) -> bool:
        return self.regions[tag].resident

    def has_cpu_backup(self, tag: str) -> bool:
        return self.regions[tag].enable_cpu_backup

    @contextmanager
    def graph_capture(self, graph, pool=None, stream=None):
        """`torch.cuda.graph(graph, pool, stream)`; backends that can page graph memory override it."""
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE):
            yield

    def pause(self, tag: str) -> None:
        raise RuntimeError("memory release is disabled: create the Engine with enable_memory_saver=True")

    def resume(self, tag: str) -> None:
        raise RuntimeError("memory release is disabled: create the Engine with enable_memory_saver=True")

    def close(self) -> None:
        pass

    def free(self) -> None:
        """Forget every tracked tensor and host backup (at shutdown, after close()): holds 0 bytes."""
        for region in self.regions.values():
            region.buffers.clear()
            region.nbytes.clear()
            region.host = None

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _region_to_release(self, tag: str) -> _Region | None:
        """The region of `tag` with its backup taken and the device idle; None when already released."""
        check_tag(tag)
        region = self.regions[tag]
        if not region.resident:
            return None
        self._save_backup(region)
        self._synchronize()  # the copies (and any kernel still reading) finish before memory goes
        return region

    def _save_backup(self, region: _Region) -> None:
        if region.enable_cpu_backup and region.buffers:
            region.host = region.host or HostBackup(self.device)
            region.host.save([bytes_view(b) for b in region.buffers])

    def _restore_backup(self, region: _Region) -> None:
        if region.enable_cpu_backup and region.backup is not None:
            region.host.restore([bytes_view(b) for b in region.buffers])


class PortableMemorySaver(DisabledMemorySaver):
    name = "portable"
    preserves_addresses = False

    def _own(self, tag: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # Weights are many small tensors: consolidate so a release frees a few big blocks. The KV
        # pool is already one buffer per K and V.
        return consolidate(list(tensors)) if tag == "weights" else list(tensors)

    def pause(self, tag: str) -> None:
        region = self._region_to_release(tag)
        if region is None:
            return
        for buf in region.buffers:
            buf.untyped_storage().resize_(0)
        region.resident = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_host_memory()

    def resume(self, tag: str) -> None:
        check_tag(tag)
        region = self.regions[tag]
        if region.resident:
            return
        for buf, n in zip(region.buffers, region.nbytes):
            buf.untyped_storage().resize_(n)
        if region.buffers:
            self.address_epoch += 1
        self._restore_backup(region)
        self._synchronize()
        region.resident = True
