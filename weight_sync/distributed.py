"""torch.distributed weight sync: the trainer (rank 0) broadcasts buckets to the engine's ranks.

Both ends build the same standalone process group with `create_weight_update_group` (a TCPStore and
a Gloo or NCCL group of their own, so neither side needs a default process group). Protocol per
bucket: the trainer asks the engine for `update_weights_from_distributed(names, dtypes, shapes,
group_name)`, then broadcasts the bucket's flat tensor; the engine receives the whole flat tensor
before it checks or writes anything, so a trainer that dies mid-broadcast makes the engine's receive
time out and it keeps serving its old weights.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weight_sync.bucket import iter_buckets, str_to_dtype

DEFAULT_TIMEOUT_S = 120.0


def create_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                               group_name: str, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S):
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: choose 'gloo' (CPU) or 'nccl' (GPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return WeightUpdateGroup(group, store, rank, world_size, group_name)


@dataclass
class WeightUpdateGroup:
    process_group: object
    store: object  # the group needs its store alive
    rank: int
    world_size: int
    name: str


def broadcast(group: WeightUpdateGroup, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.process_group.broadcast([tensor], opts).wait()


def receive_named_tensors(group, names: list[str], dtypes: list[str], shapes: list[list[int]],
                          device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
    """Engine side: receive one bucket (a single dtype) broadcast by rank 0, as named views."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must be "
                         f"non-empty lists of the same length")
    kinds = {str_to_dtype(d) for d in dtypes}
    if len(kinds) != 1:
        raise ValueError(f"one bucket carries one dtype; got {sorted(map(str, kinds))}")
    dtype = kinds.pop()
    sizes = [math.prod(s) for s in shapes]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    broadcast(group, flat, src=0)
    out, offset = [], 0
    for name, shape, n in zip(names, shapes, sizes):
        out.append((name, flat[offset : offset + n].view(tuple(shape))))
        offset += n
    return out


class DistributedTarget:
    """Trainer side: `sync_weights(model, DistributedTarget(engine_handle, group, group_name))`.

    `engine_handle` must accept `call_async("update_weights_from_distributed", ...)` and `result()`
    (a `cross_process.RemoteEngine`), because the engine's receive and our broadcast run together.
    """

    def __init__(self, engine_handle, group, group_name: str) -> None:
        self.engine = engine_handle
        self.group = group
        self.group_name = group_name

    def sync_from(self, source, bucket_bytes: int, name_map=None, weight_version: str | None = None):
        num_buckets = num_tensors = 0
        with torch.no_grad():
            for bucket in iter_buckets(source, bucket_bytes=bucket_bytes, name_map=name_map):
                metas = bucket.to_dict()["metadata"]
                self.engine.call_async(
                    "update_weights_from_distributed", names=[m["name"] for m in metas],
                    dtypes=[m["dtype"] for m in metas], shapes=[m["shape"] for m in metas],
                    group_name=self.group_name, weight_version=weight_version)
                try:
                    broadcast(self.group, bucket.flattened_tensor, src=0)
                except RuntimeError as e:  # e.g. the engine refused before receiving: collect its reason
                    ok, msg = self.engine.result()
                    return False, f"bucket {num_buckets}: broadcast failed ({e}); engine said: {msg}"
                ok, msg = self.engine.result()
                if not ok:
                    return False, f"bucket {num_buckets}: {msg}"
                num_buckets += 1
                num_tensors += len(bucket)
        return True, f"broadcast {num_tensors} tensors in {num_buckets} bucket(s)"
