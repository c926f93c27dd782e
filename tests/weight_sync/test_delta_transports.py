"""DeltaSync over every transport but Ray (tests/weight_sync/test_delta_ray.py) and TP (test_delta_tp.py).

Each transport: a full first sync, then Adam steps at lr 1e-6 and 1e-3, each followed by a delta; after
each the engine's `get_weights_checksum` (and at the end its greedy outputs) equal a reference engine
given a plain full update of the same bf16 cast (tests/weight_sync/delta_helpers.py). Then another writer updates the engine in between and
the next delta is refused (stale base) with nothing changed, and fallback=True syncs in full.
"""

from __future__ import annotations

import base64

import pytest

from rollout import Engine
from rollout.launch_server import free_port
from tests.server.conftest import start_server
from tests.weight_sync.delta_helpers import (
    ENGINE_KW,
    Trainer,
    checksum,
    greedy,
    run_steps,
    stale_then_fallback,
)
from weight_sync import DeltaSync, DiskTarget, sync_weights
from weight_sync import delta_codec as dc
from weight_sync.cross_process import RemoteEngine
from weight_sync.distributed import DistributedTarget, create_weight_update_group, destroy_weight_update_group
from weight_sync.http import HttpEngine

SMALL = 2 << 10  # bytes of payload per delta part: several parts per sync


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("llama")


@pytest.fixture(scope="module")
def reference(ckpt):
    with Engine(str(ckpt), **ENGINE_KW) as e:
        yield e


@pytest.fixture(scope="module")
def groups():
    kept = []
    yield kept
    for g in kept:
        destroy_weight_update_group(g)


@pytest.fixture(scope="module")
def remote(ckpt, groups):
    kw = {k: v for k, v in ENGINE_KW.items()}
    with RemoteEngine("rollout:Engine", model_path=str(ckpt), **kw) as r:
        yield r


def test_remote_engine_through_shared_memory(remote, ckpt, reference):
    """A RemoteEngine child takes deltas (several parts each) through shared memory, exactly."""
    ds = DeltaSync(remote, bucket_bytes=SMALL)
    trainer = Trainer(ckpt, 1e-6, seed=1)
    run_steps(ds, trainer, lambda: remote.get_weights_checksum()["checksum"], reference, serving=remote)
    assert ds.last["num_updates"] > 1
    stale_then_fallback(ds, trainer, Trainer(ckpt, 1e-2, seed=2), lambda o: sync_weights(o.model, remote),
                        lambda: remote.get_weights_checksum()["checksum"], reference)


def test_http_server_url(ckpt, reference):
    """DeltaSync (and sync_weights) take a server URL; a truncated or garbled delta body is a 400 and
    changes nothing."""
    with start_server(ckpt, engine_kw={"dtype": "bfloat16"}) as served:
        handle = HttpEngine(served.url)
        ds = DeltaSync(served.url)
        trainer = Trainer(ckpt, 1e-6, seed=3)
        run_steps(ds, trainer, lambda: handle.get_weights_checksum()["checksum"], reference, serving=served.engine)
        before = handle.get_weights_checksum()["checksum"]
        name = "model.norm.weight"
        w = served.engine.runner.name_map.resolve(name).view().detach().clone()
        new = w.clone()
        new[0] = 3.0
        blob = dc.DeltaUpdate.pack([dc.encode_tensor(name, w, new, dc.tensor_hash(w))]).to_bytes()
        with served.client() as c:
            for body in (blob[:-2], blob[: len(blob) // 2], b"not a delta"):
                r = c.post("/update_weights_from_tensor", json={
                    "serialized_named_tensors": [base64.b64encode(body).decode()], "load_format": "delta"})
                assert r.status_code == 400, r.text
        assert handle.get_weights_checksum()["checksum"] == before
        stale_then_fallback(ds, trainer, Trainer(ckpt, 1e-2, seed=4),
                            lambda o: sync_weights(o.model, served.url),
                            lambda: handle.get_weights_checksum()["checksum"], reference)
        assert greedy(served.engine)


@pytest.mark.parametrize("name", ["policy", "policy[1]"])
def test_disk_delta_files_beside_the_checkpoint(ckpt, reference, tmp_path, name):
    """DiskTarget writes the full checkpoint once, then one delta file per sync beside it; a new full
    sync starts a new chain. A name with glob characters ("[1]") chains the same (it had matched no file,
    so every delta was numbered 1), and another checkpoint's deltas beside it are never touched."""
    out_dir = tmp_path / "sync" / name
    out_dir.parent.mkdir(parents=True)
    other = out_dir.parent / "policy1.delta-000001.safetensors"  # what "policy[1]" would glob as a pattern
    other.write_bytes(b"another checkpoint's delta")
    with Engine(str(ckpt), **ENGINE_KW) as engine:
        target = DiskTarget(engine, out_dir, ckpt / "config.json")
        ds = DeltaSync(target)
        trainer = Trainer(ckpt, 1e-6, seed=5)
        run_steps(ds, trainer, lambda: checksum(engine), reference, serving=engine)
        names = sorted(p.name for p in out_dir.parent.iterdir() if p != other)
        assert names == sorted([name] + [f"{name}.delta-{i:06d}.safetensors" for i in (1, 2, 3)]), names
        stale_then_fallback(ds, trainer, Trainer(ckpt, 1e-2, seed=6),
                            lambda o: engine.update_weights_from_tensor(o.cast()), lambda: checksum(engine), reference)
        assert sorted(p.name for p in out_dir.parent.iterdir() if p != other) == [name]
        assert other.read_bytes() == b"another checkpoint's delta"
        ok, msg, _ = engine.update_weights_from_disk(str(tmp_path / "missing.safetensors"), load_format="delta")
        assert not ok and "missing.safetensors" in msg


def test_distributed_checked_buckets(remote, ckpt, reference, groups):
    """Deltas broadcast over a gloo group (as checked buckets of the blob) apply exactly."""
    name = "delta-broadcast"
    port = free_port()
    remote.call_async("init_weights_update_group", master_address="127.0.0.1", master_port=port, rank_offset=1,
                      world_size=2, group_name=name, backend="gloo", timeout_s=30)
    group = create_weight_update_group("127.0.0.1", port, rank=0, world_size=2, group_name=name, backend="gloo",
                                       timeout_s=30)
    assert remote.result()[0]
    groups.append(group)
    target = DistributedTarget(remote, group, name)
    ds = DeltaSync(target, bucket_bytes=SMALL)
    trainer = Trainer(ckpt, 1e-6, seed=7)
    run_steps(ds, trainer, lambda: remote.get_weights_checksum()["checksum"], reference, serving=remote)
    stale_then_fallback(ds, trainer, Trainer(ckpt, 1e-2, seed=8), lambda o: sync_weights(o.model, remote),
                        lambda: remote.get_weights_checksum()["checksum"], reference)


def test_list_of_engines(ckpt, reference):
    """A plain list: every part to every engine, both exact."""
    with Engine(str(ckpt), **ENGINE_KW) as a, Engine(str(ckpt), **ENGINE_KW) as b:
        ds = DeltaSync([a, b])
        trainer = Trainer(ckpt, 1e-6, seed=9)
        run_steps(ds, trainer, lambda: checksum(a), reference, lrs=(1e-6, 1e-3), serving=b)
        assert checksum(b) == checksum(a)


def test_url_handle_rejects_non_http():
    """A target string that is not an http(s) URL is refused by name."""
    with pytest.raises(ValueError, match="http://"):
        DeltaSync("localhost:30000", dtype="bfloat16")
