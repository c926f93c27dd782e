"""The tensor-parallel process group one rank's model computes with, and how a model finds it.

`TPGroup` wraps a standalone gloo (CPU) or NCCL (CUDA) process group built from its own TCPStore, so
it never touches torch.distributed's default group (a trainer in the same process may own that) and
two TP engines in one process do not share state. Every collective carries the group's timeout: a
rank that stops answering fails the step within `timeout_s` instead of hanging it.

Layers read the group once, at construction, from `building(tp)` / `current_tp()`; nothing global is
consulted on the hot path. This module does not spawn processes or move commands (runner/tp/runner.py,
worker.py do).
"""

from __future__ import annotations

import datetime
import threading
from contextlib import contextmanager

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from weight_sync.distributed import shutdown_process_group


class TPGroup:
    def __init__(self, rank: int, size: int, port: int, backend: str, timeout_s: float,
                 host: str = "127.0.0.1") -> None:
        self.rank, self.size, self.backend, self.timeout_s = rank, size, backend, timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=self.timeout)
        prefixed = dist.PrefixStore("rollout-tp", self.store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, self.timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over the ranks (in place on a contiguous tensor; returned)."""
        t = t.contiguous()
        opts = c10d.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = self.timeout
        self.pg.allreduce([t], opts).wait()
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank order."""
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        opts = c10d.AllgatherOptions()
        opts.timeout = self.timeout
        self.pg.allgather([outs], [t], opts).wait()
        return torch.cat(outs, dim=-1)

    def close(self) -> None:
        pg, self.pg, self.store = self.pg, None, None
        shutdown_process_group(pg)  # a dead peer's broken group is dropped too


_building = threading.local()


@contextmanager
def building(tp: TPGroup | None):
    """Models constructed inside this block are built for `tp`'s rank (None: unsharded)."""
    prev = getattr(_building, "tp", None)
    _building.tp = tp
    try:
        yield tp
    finally:
        _building.tp = prev


def current_tp() -> TPGroup | None:
    return getattr(_building, "tp", None)
