"""A trainer process (rank 0) that broadcasts a checkpoint's tensors to an engine's update group.

`python -m tests.weight_sync.trainer_proc HELPER PORT GROUP CKPT FORMAT BUCKETS`: HELPER is `sglang`
(the group from tests/weight_sync/sglang_pg.py and `dist.broadcast`, as slime/verl do) or `ours`
(`weight_sync.distributed`); FORMAT is `per_tensor` (one broadcast per tensor, SGLang's default) or
`bucket` (one broadcast of the bucket's bytes, SGLang's "flattened_bucket"). The tensors go in
sorted-name order, split into BUCKETS consecutive chunks, one engine update per chunk. Prints
"joined" after the group is formed and "done" at the end.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file


def chunks(named, n):
    size = -(-len(named) // n)
    return [named[i : i + size] for i in range(0, len(named), size)]


def main(helper: str, port: int, group_name: str, ckpt: str, fmt: str, buckets: int) -> None:
    sd = {}
    for f in sorted(pathlib.Path(ckpt).glob("*.safetensors")):
        sd.update(load_file(f))
    named = sorted(sd.items())
    if helper == "sglang":
        from tests.weight_sync.sglang_pg import destroy, init_custom_process_group

        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group_name)

        def send(t):
            dist.broadcast(t, src=0, group=pg)
    else:
        from weight_sync.distributed import broadcast, create_weight_update_group, destroy_weight_update_group

        pg = create_weight_update_group("127.0.0.1", port, 0, 2, group_name, "gloo", 60)

        def send(t):
            broadcast(pg, t)
    print("joined", flush=True)
    for chunk in chunks(named, buckets):
        if fmt == "per_tensor":
            for _, t in chunk:
                send(t.contiguous())
        else:  # SGLang's flattened bucket: every tensor's bytes back to back, one uint8 broadcast
            send(torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in chunk]))
    (destroy if helper == "sglang" else destroy_weight_update_group)(pg)
    print("done", flush=True)


if __name__ == "__main__":
    h, port, name, ckpt, fmt, n = sys.argv[1:7]
    main(h, int(port), name, ckpt, fmt, int(n))
