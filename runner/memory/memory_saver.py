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

This module picks and builds a backend and re-exports the savers' names. The backends live in
runner/memory/portable_saver.py (disabled, portable) and runner/memory/tms_saver.py
(torch_memory_saver); the host backup and consolidation in runner/memory/host_backup.py.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from runner.memory.host_backup import HostBackup, consolidate, release_host_memory
from runner.memory.portable_saver import ALL_TAGS, DisabledMemorySaver, PortableMemorySaver
from runner.memory.tms_saver import TorchMemorySaver, load_torch_memory_saver

__all__ = ["ALL_TAGS", "DisabledMemorySaver", "HostBackup", "PortableMemorySaver", "TorchMemorySaver",
           "choose_memory_saver_backend", "consolidate", "create_memory_saver", "load_torch_memory_saver",
           "release_host_memory"]

logger = logging.getLogger(__name__)


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
