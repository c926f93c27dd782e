"""DeltaSync into an EngineGroup of two Ray actors: every engine takes each delta, or none does.

Oracle: a reference in-process engine given a plain full update of the same bf16 cast; the group's
`get_weights_checksum` (which checks both engines hold the same bits) must equal it after each step.
When one engine alone was written in between, the delta is refused and both engines keep what they held.
"""

from __future__ import annotations

import pytest
import ray

from rollout import Engine
from rollout.ray import launch_engines
from tests.weight_sync.delta_helpers import ENGINE_KW, Trainer, checksum, run_steps
from weight_sync import DeltaSync


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("llama")


@pytest.fixture(scope="module")
def group(ckpt):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    g = launch_engines(2, str(ckpt), num_cpus_per_engine=0.5, call_timeout_s=120, **ENGINE_KW)
    yield g
    g.shutdown()
    ray.shutdown()


def test_group_all_or_none(group, ckpt):
    """Exact deltas on both engines; a stale base on one engine makes both refuse, unchanged."""
    with Engine(str(ckpt), **ENGINE_KW) as reference:
        ds = DeltaSync(group, bucket_bytes=2 << 10)
        trainer = Trainer(ckpt, 1e-6, seed=1)
        run_steps(ds, trainer, lambda: group.get_weights_checksum()["checksum"], reference, lrs=(1e-6, 1e-3),
                  serving=group)
        held = group.get_weights_checksum()["checksum"]
        other = Trainer(ckpt, 1e-2, seed=2)
        other.step()
        version = ray.get(group.handles[0].weight_version.remote())  # same label, other bits on engine 1
        ok, msg = ray.get(group.handles[1].call.remote("update_weights_from_tensor", (other.cast(),),
                                                       {"weight_version": version}))
        assert ok, msg
        sums = [ray.get(h.call.remote("get_weights_checksum"))["checksum"] for h in group.handles]
        assert sums[0] == held != sums[1]
        trainer.step()
        ok, msg = ds.sync(trainer.model)
        assert not ok and "stale base" in msg, msg
        assert [ray.get(h.call.remote("get_weights_checksum"))["checksum"] for h in group.handles] == sums
        ok, msg = ds.sync(trainer.model, fallback=True)
        assert ok and ds.last["mode"] == "full", msg
        assert reference.update_weights_from_tensor(trainer.cast())[0]
        assert group.get_weights_checksum()["checksum"] == checksum(reference)
