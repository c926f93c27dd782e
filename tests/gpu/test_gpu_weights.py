"""Atomic weight updates on the GPU (CUDA only): the snapshots of an update stay on the device while it
has room and go to pinned host memory when it has none; either way a failure part-way restores every
written slice bit for bit, and an engine update from GPU tensors equals a fresh engine on them."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_engine import _engine, _run, _state_dict

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("room", ["device", "host"])
def test_failed_update_restores_from_either_snapshot_place(room):
    """Two slices written then a failure: both old values come back bitwise, from the device or the host."""
    from runner.weights.loader import LoadTarget, WeightUpdateError, WeightWriter
    from runner.weights.snapshot import SnapshotStore

    lin = torch.nn.Linear(64, 96, bias=False, device="cuda", dtype=torch.bfloat16)
    old = lin.weight.detach().clone()
    targets = [LoadTarget("a", "weight", None, lin.weight)]
    writer = WeightWriter()
    if room == "host":
        writer.snapshots = SnapshotStore(free_bytes=lambda device: 0)
    with pytest.raises(WeightUpdateError, match="restored"):
        with writer:
            writer.write(targets[0], torch.full((96, 64), 3.0, device="cuda", dtype=torch.bfloat16))
            flat = lin.weight.data.view(-1)
            writer.write_elements(targets[0], flat, torch.tensor([0, 5, 7], device="cuda"),
                                  torch.zeros(3, device="cuda", dtype=torch.bfloat16))
            store = writer.snapshots
            on_device, on_host = store.device_bytes, store.host_bytes
            raise RuntimeError("the trainer's next bucket never came")
    torch.cuda.synchronize()
    assert torch.equal(lin.weight.detach(), old)
    if room == "device":
        assert on_device > 0 and on_host == 0
    else:
        assert on_host > 0 and on_device == 0


def test_update_from_gpu_tensors_equals_fresh_engine(ckpt_factory):
    """An update from CUDA tensors (snapshots on the device) serves what a fresh engine on them serves."""
    a = ckpt_factory("qwen2", hidden_size=256, head_dim=64)
    b = ckpt_factory("qwen2", hidden_size=256, head_dim=64, seed=1)
    with _engine(b) as fresh:
        want = _run(fresh)
    with _engine(a) as engine:
        ok, msg = engine.update_weights_from_tensor([(n, t.cuda()) for n, t in _state_dict(b)])
        assert ok, msg
        assert _run(engine) == want
