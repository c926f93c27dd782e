"""A stand-in for torch's CUDA IPC calls (named as such), for CPU tests of the CUDA IPC transport.

`ShmStandInIpc` replaces exactly the three calls `weight_sync.cuda_ipc.TorchCudaIpc` makes into CUDA:
"sharing" a (CPU) tensor puts its storage's bytes in a POSIX shared-memory segment whose name is the
handle, "mapping" attaches that segment, and the visible device UUIDs come from a list (in the child,
from STANDIN_IPC_UUIDS, so the two processes can see the GPUs in different orders, as under
per-process CUDA_VISIBLE_DEVICES). Everything around those calls is the real code: the JSON schema
and its validation, the UUID -> ordinal mapping, the pipe or HTTP request, the engine's checked,
all-or-nothing update. Unlike CUDA IPC the stand-in copies the bytes once, into host shared memory;
the real zero-copy mapping is tested in tests/gpu/.
"""

from __future__ import annotations

import json
import os
from multiprocessing import shared_memory

import torch

from weight_sync import cuda_ipc
from weight_sync.shm import _Segment

UUID_A = "0a1b2c3d-0000-4000-8000-00000000000a"
UUID_B = "0a1b2c3d-1111-4111-8111-00000000000b"


class ShmStandInIpc:
    name = "stand-in"

    def __init__(self, uuids: list[str], log_path: str | None = None) -> None:
        self.uuids, self.log_path = list(uuids), log_path
        self.shared: list[shared_memory.SharedMemory] = []  # the sender keeps them until close()
        self.mapped: list[_Segment] = []

    def check(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError("the stand-in shares CPU tensors only")

    def device_uuids(self, what: str = "CUDA IPC") -> list[str]:
        return list(self.uuids)

    def share(self, tensor: torch.Tensor) -> tuple:
        storage = tensor.untyped_storage()
        shm = shared_memory.SharedMemory(create=True, size=max(storage.nbytes(), 1))
        self.shared.append(shm)
        torch.frombuffer(shm.buf, dtype=torch.uint8, count=storage.nbytes()).copy_(
            torch.empty(0, dtype=torch.uint8).set_(storage))
        return (torch.Tensor, tensor.shape, tensor.stride(), tensor.storage_offset(), torch.UntypedStorage,
                tensor.dtype, 0, shm.name.encode(), storage.nbytes(), 0, False, b"stand-in-ref", 0, b"", False)

    def open(self, f: dict, ordinal: int) -> torch.Tensor:
        seg = _Segment(f["handle"].decode())
        self.mapped.append(seg)
        if self.log_path:
            with open(self.log_path, "a") as fh:
                fh.write(json.dumps({"ordinal": ordinal, "device": f["device"]}) + "\n")
        raw = torch.frombuffer(seg.buf, dtype=torch.uint8, count=f["storage_size_bytes"]) if \
            f["storage_size_bytes"] else torch.empty(0, dtype=torch.uint8)
        flat = raw.view(f["dtype"])
        return flat.as_strided(f["shape"], f["stride"], f["offset"])

    def close(self) -> None:
        for shm in self.shared:
            shm.close()
            shm.unlink()
        self.shared.clear()


def standin_ipc_engine(**kwargs):
    """Child-side factory: install the stand-in (UUIDs in STANDIN_IPC_UUIDS order), then build the Engine."""
    from rollout import Engine

    cuda_ipc.set_ipc_backend(ShmStandInIpc(os.environ["STANDIN_IPC_UUIDS"].split(","),
                                           os.environ.get("STANDIN_IPC_LOG")))
    return Engine(**kwargs)
