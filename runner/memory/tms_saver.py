"""The torch_memory_saver backend: device memory unmapped on pause, virtual addresses kept.

`TorchMemorySaver` puts the KV region, the tracked weights (consolidated into the library's region when
tracked) and, in preload hook mode, captured CUDA-graph memory into torch_memory_saver regions, so
captured graphs stay valid across a release (`preserves_addresses`). torch_memory_saver is imported only
when this backend is built (`load_torch_memory_saver`), never on the CPU path. Each pause is measured
with mem_get_info and a release that returns (nearly) nothing is reported once per tag.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
from contextlib import contextmanager

import torch

from runner.memory.host_backup import consolidate
from runner.memory.portable_saver import ALL_TAGS, CAPTURE_ERROR_MODE, DisabledMemorySaver, check_tag

logger = logging.getLogger(__name__)

MIN_CHECKED_BYTES = 64 << 20  # pauses smaller than this are not measured (noise of other allocations)
RETURNED_FRACTION = 0.5  # a pause that returns less than this share of what it holds is reported
_saver_ids = itertools.count()


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
        check_tag(tag)
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
        # thread_local (portable_saver.CAPTURE_ERROR_MODE says why)
        if not self.graphs_pauseable:
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE):
                yield
            return
        self._in_library.add("cuda_graph")
        with self.tms.cuda_graph(cuda_graph=graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE,
                                 tag=self._tag("cuda_graph")):
            yield

    def pause(self, tag: str) -> None:
        region = self._region_to_release(tag)
        if region is None:
            return
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
        check_tag(tag)
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
