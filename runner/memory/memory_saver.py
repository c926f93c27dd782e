"""Memory saver: release the device memory of tagged regions between rollouts and take it back.

One adapter, `region(tag, enable_cpu_backup)`, `track(tag, tensors)`, `pause(tag)`, `resume(tag)`,
`bytes_held(tag)`, `is_resident(tag)`, `has_cpu_backup(tag)`, `graph_capture(...)`, `close()`, `free()`, over
tags `weights`, `kv_cache`, `cuda_graph`. Backends:

- `PortableMemorySaver` (CPU, or CUDA without torch_memory_saver): frees the storage of every
  tracked tensor (`untyped_storage().resize_(0)`) and reallocates it on resume. Addresses change, so
  anything that captured them (CUDA graphs) must be rebuilt: `address_epoch` counts resumes that
  moved memory, and a graph runner recaptures when it changed. Weights tracked here are first
  consolidated into one flat buffer per dtype, so a release frees a few large blocks the allocator
  really returns to the OS, and a backup is one large copy.
- `TorchMemorySaver` (CUDA with torch_memory_saver installed): the KV region and (in preload hook
  mode) captured graph memory are torch_memory_saver regions; tracked weights are consolidated into
  a torch_memory_saver region when tracked (so init-once buffers such as rotary tables stay out of it
  and are never zeroed by a resume). Pause unmaps the physical memory but keeps the virtual
  addresses, so captured CUDA graphs stay valid (`preserves_addresses`).
- `DisabledMemorySaver`: regions and tracking only count bytes; pause/resume are clear errors.

The weight CPU backup is ours on every backend (`HostBackup`): one persistent host buffer per tag
(pinned on CUDA), allocated on the first release and reused, filled with chunked non-blocking copies
on a side stream. torch_memory_saver's own backup ran at 1.9 / 5.9 GB/s on the H200; pinned copies
reach ~55 GB/s. torch_memory_saver is imported only when that backend is built.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import itertools
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

ALL_TAGS = ("weights", "kv_cache", "cuda_graph")
BACKUP_CHUNK_BYTES = 256 << 20  # one copy per chunk: large enough for full PCIe/NVLink-C2C rate
MIN_CHECKED_BYTES = 64 << 20  # pauses smaller than this are not measured (noise of other allocations)
RETURNED_FRACTION = 0.5  # a pause that returns less than this share of what it holds is reported
_saver_ids = itertools.count()


def _check_tag(tag: str) -> None:
    if tag not in ALL_TAGS:
        raise ValueError(f"unknown memory tag {tag!r}; valid tags: {list(ALL_TAGS)}")


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


def _bytes_view(buf: torch.Tensor) -> torch.Tensor:
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

    @contextmanager
    def graph_capture(self, graph, pool=None, stream=None):
        """`torch.cuda.graph(graph, pool, stream)`; backends that can page graph memory override it."""
        with torch.cuda.graph(graph, pool=pool, stream=stream):
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

    def _save_backup(self, region: _Region) -> None:
        if region.enable_cpu_backup and region.buffers:
            region.host = region.host or HostBackup(self.device)
            region.host.save([_bytes_view(b) for b in region.buffers])

    def _restore_backup(self, region: _Region) -> None:
        if region.enable_cpu_backup and region.backup is not None:
            region.host.restore([_bytes_view(b) for b in region.buffers])


class PortableMemorySaver(DisabledMemorySaver):
    name = "portable"
    preserves_addresses = False

    def _own(self, tag: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # Weights are many small tensors: consolidate so a release frees a few big blocks. The KV
        # pool is already one buffer per K and V.
        return consolidate(list(tensors)) if tag == "weights" else list(tensors)

    def pause(self, tag: str) -> None:
        _check_tag(tag)
        region = self.regions[tag]
        if not region.resident:
            return
        self._save_backup(region)
        self._synchronize()  # the copies (and any kernel still reading) finish before we free
        for buf in region.buffers:
            buf.untyped_storage().resize_(0)
        region.resident = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_host_memory()

    def resume(self, tag: str) -> None:
        _check_tag(tag)
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


def _preload_hook_active() -> bool:
    """torch_memory_saver's preload mode needs its hook library in LD_PRELOAD from process start."""
    return any("torch_memory_saver" in p for p in os.environ.get("LD_PRELOAD", "").split(":") if p)


def load_torch_memory_saver():
    """The torch_memory_saver singleton, hook mode set once per process. Returns (saver, hook_mode).

    Preload mode (hook library in LD_PRELOAD) also makes CUDA-graph memory pauseable; otherwise the
    torch hook mode (a pluggable allocator) pages the KV cache and the weights only.
    """
    tms = importlib.import_module("torch_memory_saver")
    saver = tms.torch_memory_saver
    mode = "preload" if _preload_hook_active() else "torch"
    global _TMS_HOOK_MODE
    if _TMS_HOOK_MODE is None:
        try:
            saver.hook_mode = mode  # only before the singleton's first use
        except (AssertionError, AttributeError):
            logger.warning("torch_memory_saver was initialised elsewhere; assuming hook mode %r", mode)
        _TMS_HOOK_MODE = mode
    return saver, _TMS_HOOK_MODE


_TMS_HOOK_MODE: str | None = None


class TorchMemorySaver(DisabledMemorySaver):
    """torch_memory_saver regions by tag: the memory is unmapped on pause, the addresses stay.

    Tags are namespaced per instance (`kv_cache#3`), because the library's tags are process-wide and
    several engines may share a process. Each tag's state is tracked here: the library kills the
    process on a double pause or resume, so neither ever reaches it.
    """

    name = "torch_memory_saver"
    preserves_addresses = True

    def __init__(self, device: torch.device, saver=None, hook_mode: str | None = None) -> None:
        super().__init__(device)
        if saver is None:
            saver, hook_mode = load_torch_memory_saver()
        self.tms, self.hook_mode = saver, hook_mode or "torch"
        self._uid = next(_saver_ids)
        self._in_library: set[str] = set()  # tags with memory the library manages
        self.last_freed: dict[str, int] = {}  # tag -> device bytes its last measured pause gave back
        self._warned: set[str] = set()

    def _tag(self, tag: str) -> str:
        return f"{tag}#{self._uid}"

    @property
    def graphs_pauseable(self) -> bool:
        return self.hook_mode == "preload"

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False):
        _check_tag(tag)
        self.regions[tag].enable_cpu_backup = enable_cpu_backup
        if tag == "weights":
            # Model construction allocates more than weights (rotary tables, ...): those stay in
            # ordinary memory. `track` moves the tracked weights into the library's region.
            yield
            return
        if not self.regions[tag].resident:
            raise RuntimeError(f"cannot allocate in memory region {tag!r} while it is released")
        self._in_library.add(tag)
        with self.tms.region(tag=self._tag(tag)):
            yield

    def _own(self, tag: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if tag != "weights":
            return list(tensors)
        self._in_library.add(tag)
        with self.tms.region(tag=self._tag(tag)):
            flats = consolidate(list(tensors))
        torch.cuda.empty_cache()  # the per-parameter storages just freed go back to the device
        return flats

    def bytes_held(self, tag: str) -> int:
        # Storages keep their (virtual) size while paused; what the device holds is what counts.
        return super().bytes_held(tag) if self.regions[tag].resident else 0

    @contextmanager
    def graph_capture(self, graph, pool=None, stream=None):
        if not self.regions["cuda_graph"].resident:
            raise RuntimeError("cannot capture a CUDA graph while the cuda_graph memory tag is released; "
                               "call resume_memory_occupation(['cuda_graph']) first")
        if not self.graphs_pauseable:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                yield
            return
        self._in_library.add("cuda_graph")
        with self.tms.cuda_graph(cuda_graph=graph, pool=pool, stream=stream, tag=self._tag("cuda_graph")):
            yield

    def pause(self, tag: str) -> None:
        _check_tag(tag)
        region = self.regions[tag]
        if not region.resident:
            return
        self._save_backup(region)
        self._synchronize()  # nothing may still read the memory we unmap
        held = self.bytes_held(tag)
        free0 = self._free_device_bytes()
        if tag in self._in_library:
            self.tms.pause(self._tag(tag))
        region.resident = False
        torch.cuda.empty_cache()
        self._check_returned(tag, held, free0)

    def _free_device_bytes(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.mem_get_info(self.device)[0]

    def _check_returned(self, tag: str, held: int, free0: int | None) -> None:
        """Measure what a pause gave back (mem_get_info): the hook may be absent or inactive (the
        preload library loaded too late, another allocator in front) and then pause frees nothing.
        Say so once per tag instead of letting a caller believe the device is free."""
        if free0 is None or held < MIN_CHECKED_BYTES:
            return
        freed = self._free_device_bytes() - free0
        self.last_freed[tag] = freed
        if freed < RETURNED_FRACTION * held and tag not in self._warned:
            self._warned.add(tag)
            logger.warning("memory saver: releasing %r returned %.1f MiB of the %.1f MiB it holds "
                           "(torch_memory_saver hook mode %r): the release is (nearly) a no-op; start the "
                           "process with torch_memory_saver's preload library in LD_PRELOAD", tag,
                           freed / 2**20, held / 2**20, self.hook_mode)

    def resume(self, tag: str) -> None:
        _check_tag(tag)
        region = self.regions[tag]
        if region.resident:
            return
        if tag in self._in_library:
            self.tms.resume(self._tag(tag))
        self._restore_backup(region)
        self._synchronize()
        region.resident = True

    def close(self) -> None:
        # Freeing a tensor whose memory is paused is a known library hazard: map everything back first.
        for tag in ALL_TAGS:
            if not self.regions[tag].resident and tag in self._in_library:
                self.tms.resume(self._tag(tag))
                self.regions[tag].resident = True

    def free(self) -> None:
        """Forget the tracked tensors, then drop the library's memory pools of this saver's tags.

        torch_memory_saver keeps one torch MemPool per (tag, flags, device) for the life of the process,
        and a MemPool keeps the blocks freed into it cached (torch.cuda.empty_cache does not reach
        them). Our tags are per saver, so without this every Engine built in a process would leave its
        KV cache and weights' worth of device memory behind. Dropping the pool object (after every
        tensor in it was freed) lets torch release its blocks. The pools live in the library's private
        `_impl._mem_pools` (0.0.10); when that is missing the leak is logged, not hidden.
        """
        super().free()
        pools = getattr(getattr(self.tms, "_impl", None), "_mem_pools", None)
        if pools is None:
            if self._in_library:
                logger.warning("torch_memory_saver has no _impl._mem_pools (version change?): the memory "
                               "pools of tags %s stay allocated until the process exits",
                               sorted(self._tag(t) for t in self._in_library))
            return
        ours = {self._tag(t) for t in ALL_TAGS}
        for key in [k for k in list(pools) if (k[0] if isinstance(k, tuple) else k) in ours]:
            del pools[key]
        self._in_library.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def choose_memory_saver_backend(device: torch.device, backend: str | None = None) -> str:
    """`backend` when given (checked); else torch_memory_saver on CUDA when it imports, else portable."""
    device = torch.device(device)
    if backend is None:
        if device.type != "cuda" or importlib.util.find_spec("torch_memory_saver") is None:
            return "portable"
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            logger.warning("torch_memory_saver refuses expandable_segments; using the portable memory saver")
            return "portable"
        return "torch_memory_saver"
    if backend not in ("portable", "torch_memory_saver"):
        raise ValueError(f"unknown memory saver backend {backend!r}; choose 'portable' or 'torch_memory_saver'")
    if backend == "torch_memory_saver" and device.type != "cuda":
        raise ValueError(f"the torch_memory_saver backend needs a CUDA device, got {device.type!r}")
    return backend


def create_memory_saver(enable: bool, device: torch.device, backend: str | None = None) -> DisabledMemorySaver:
    if not enable:
        return DisabledMemorySaver(device)
    if choose_memory_saver_backend(device, backend) == "torch_memory_saver":
        return TorchMemorySaver(torch.device(device))
    return PortableMemorySaver(torch.device(device))
