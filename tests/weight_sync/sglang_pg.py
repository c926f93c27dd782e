"""A trainer-side update group built the way SGLang's `init_custom_process_group` builds it.

slime, verl and OpenRLHF carry a copy of that helper; this one is written here from its documented
steps (not copied), so the engine's side can be tested against what those trainers run:

1. rendezvous over `tcp://address:port` (torch's own handler: rank 0 hosts a TCPStore for
   `world_size` ranks), with the store's timeout set;
2. wrap the store in `PrefixStore(group_name, store)`;
3. create a new process group on it with torch's process-group factory (which registers it in
   torch.distributed's group table, so `dist.broadcast(..., group=pg)` works without a default group).

Test-only: it reaches into torch.distributed's private factory exactly as that helper does.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.rendezvous import rendezvous


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = 60.0):
    """Step 1-3 above; returns the process group (use it with `dist.broadcast(t, src=0, group=pg)`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                           group_name=group_name, backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy(pg) -> None:
    dist.destroy_process_group(pg)
