"""Where an all-or-nothing weight update keeps the old value of each slice it overwrites.

`SnapshotStore.take(t)` returns a copy of `t` that `runner/weights/loader.py`'s WeightWriter puts back
if the update fails. On the CPU that is a clone. On CUDA the copy stays on the weight's own device
while the update's snapshots fit in that device's free memory (less a headroom, so a snapshot never
starves the KV pool's neighbours), and goes to pinned host memory once they no longer do:
- a device-to-device copy runs at ~4 TB/s on an H200, a pinned device-to-host copy at ~50 GB/s;
- the old pageable host copy (`.to("cpu")`) made a 7B update run at 1.5 GB/s on the H200, the whole
  update bound by the snapshot.
A device snapshot that fails with an out-of-memory error falls back to the host for the rest of the
update. `close()` hands a large device snapshot's cached blocks back to the driver, so a trainer
sharing the GPU sees that memory again.

It does not decide what to snapshot (WeightWriter does) and does not restore (loader.restore does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Device memory a snapshot must leave free: the allocator's fragmentation and the next step's activations.
HEADROOM_BYTES = 1 << 30
# close() returns cached device blocks only after a snapshot this large (empty_cache is not free).
EMPTY_CACHE_BYTES = 256 << 20


def device_free_bytes(device: torch.device) -> int:
    """Bytes a new allocation on `device` can take: the driver's free memory plus torch's cached,
    unused blocks."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class SnapshotStore:
    """The snapshots of one update; `free_bytes(device)` is injectable for tests."""

    def __init__(self, free_bytes: Callable[[torch.device], int] = device_free_bytes,
                 headroom_bytes: int = HEADROOM_BYTES) -> None:
        self.free_bytes, self.headroom_bytes = free_bytes, headroom_bytes
        self._budget: dict[torch.device, int] = {}  # device -> bytes its snapshots may still take
        self.device_bytes = 0
        self.host_bytes = 0

    @torch.no_grad()
    def take(self, t: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """A copy of `t` that later writes to `t` do not change. `owned=True`: `t` is already a fresh
        tensor (a gather), kept as it is where it may stay on its device."""
        if t.device.type != "cuda":
            return t if owned else t.to("cpu", copy=True)
        nbytes = t.numel() * t.element_size()
        if self.fits_on_device(t.device, nbytes):
            try:
                copy = t if owned else t.clone()
            except torch.OutOfMemoryError:
                self._budget[t.device] = 0  # the estimate was wrong: the host takes the rest
            else:
                self.spend(t.device, nbytes)
                return copy
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch caches pinned blocks
        host.copy_(t, non_blocking=True)  # ordered before the write that follows on this stream
        self.host_bytes += nbytes
        return host

    def fits_on_device(self, device: torch.device, nbytes: int) -> bool:
        """Whether a snapshot of `nbytes` stays on `device` (free memory is read at the update's first)."""
        if device not in self._budget:
            self._budget[device] = self.free_bytes(device) - self.headroom_bytes
        return nbytes <= self._budget[device]

    def spend(self, device: torch.device, nbytes: int) -> None:
        self._budget[device] -= nbytes
        self.device_bytes += nbytes

    def close(self) -> None:
        """Called once the snapshots are dropped."""
        if self.device_bytes >= EMPTY_CACHE_BYTES:
            torch.cuda.empty_cache()
        self.device_bytes = self.host_bytes = 0
        self._budget.clear()
