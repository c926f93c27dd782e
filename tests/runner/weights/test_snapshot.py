"""runner/weights/snapshot.py: a snapshot is a copy later writes do not change; on CUDA snapshots stay on
the device until the update's share of free memory (less the headroom) is spent, then go to the host."""

from __future__ import annotations

import torch

from runner.weights.snapshot import SnapshotStore


def test_cpu_snapshot_is_independent_of_the_source():
    """A CPU snapshot keeps the old values after the source is overwritten; an owned one is kept as is."""
    store = SnapshotStore()
    src = torch.arange(12.0).view(3, 4)
    view = src[:, 1:3]  # a strided slice, as a fused weight's shard is
    snap = store.take(view)
    src.fill_(-1.0)
    assert torch.equal(snap, torch.arange(12.0).view(3, 4)[:, 1:3])
    fresh = torch.ones(3)
    assert store.take(fresh, owned=True) is fresh


def test_device_budget_is_free_memory_less_headroom_and_is_spent_in_order():
    """With 10 MiB free and 4 MiB headroom, snapshots of 4 + 2 MiB fit and the next 1 MiB does not; free
    memory is read once per device per update, and close() starts the next update's reading afresh."""
    reads = []
    mib = 1 << 20

    def free(device):
        reads.append(device)
        return 10 * mib

    store = SnapshotStore(free_bytes=free, headroom_bytes=4 * mib)
    dev = torch.device("cuda", 0)  # never touched: the budget is bookkeeping only
    assert store.fits_on_device(dev, 4 * mib)
    store.spend(dev, 4 * mib)
    assert store.fits_on_device(dev, 2 * mib)
    store.spend(dev, 2 * mib)
    assert not store.fits_on_device(dev, 1 * mib)
    assert store.device_bytes == 6 * mib and reads == [dev]
    other = torch.device("cuda", 1)
    assert store.fits_on_device(other, 6 * mib) and not store.fits_on_device(other, 6 * mib + 1)
    assert reads == [dev, other]
    store.close()
    assert store.device_bytes == 0 and store.fits_on_device(dev, 6 * mib) and len(reads) == 3
