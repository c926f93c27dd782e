"""The CUDA IPC transport end to end on the CPU: a trainer process and an engine process (RemoteEngine) and
the HTTP server's /update_weights_from_tensor with load_format="cuda_ipc" exchange weights as JSON IPC
descriptors, with the same checks and all-or-nothing update as every other route.

The CUDA calls are replaced by `ShmStandInIpc` (tests/weight_sync/ipc_standin.py, a named stand-in:
share = put the storage in a shared-memory segment, map = attach it). The engine child sees the GPUs in
the other order than the trainer, so the device UUID must be mapped to the child's own ordinal. The real
thing (CUDA memory mapped across processes, no host copy) is tests/gpu/test_gpu_ipc.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from rollout import Engine
from tests.server.conftest import start_server
from tests.weight_sync.ipc_standin import UUID_A, UUID_B, ShmStandInIpc
from tests.weight_sync.test_transports import (  # noqa: F401
    ENGINE_KW,
    SMALL_BUCKET,
    assert_same,
    ckpt,  # noqa: F401 - the module fixtures
    differ,
    outputs,
    trainer,
)
from weight_sync import cuda_ipc, sync_weights
from weight_sync.bucket import FlattenedTensorBucket, iter_buckets
from weight_sync.cross_process import RemoteEngine


@pytest.fixture
def ipc():
    backend = ShmStandInIpc([UUID_A, UUID_B])  # the trainer's tensors live on its cuda:0 = UUID_A
    with cuda_ipc.use_ipc_backend(backend):
        yield backend
    backend.close()


@pytest.fixture(scope="module")
def remote(ckpt, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("ipc") / "opened.jsonl"
    env = {"STANDIN_IPC_UUIDS": f"{UUID_B},{UUID_A}", "STANDIN_IPC_LOG": str(log)}  # the child: A is cuda:1
    with RemoteEngine("tests.weight_sync.ipc_standin:standin_ipc_engine", weight_transport="cuda_ipc",
                      child_env=env, model_path=str(ckpt), **ENGINE_KW) as r:
        r.opened_log = log
        yield r


def test_engine_process_sync_by_ipc_equals_fresh_engine(remote, trainer, ipc):  # noqa: F811
    """sync_weights into an engine process over IPC descriptors gives a fresh engine's outputs, twice; every
    bucket was mapped on the child's ordinal of the sender's GPU (UUID_A is cuda:1 there)."""
    for seed in (11, 12):
        model, want = trainer(seed)
        ok, msg = sync_weights(model, remote, bucket_bytes=SMALL_BUCKET)
        assert ok, msg
        assert_same(outputs(remote), want)
    opened = [json.loads(line) for line in remote.opened_log.read_text().splitlines()]
    assert len(opened) > 2 and all(o == {"ordinal": 1, "device": UUID_A} for o in opened)


def _raw_update(remote, descriptors):
    return remote.call("update_weights_from_tensor", named_tensors=descriptors, load_format="cuda_ipc")


def test_bad_ipc_payloads_are_refused_and_weights_kept(remote, trainer, ipc):  # noqa: F811
    """Malformed descriptors, an unseen GPU and an update naming an unknown weight in its second bucket all
    come back (False, reason naming it) and the engine serves its previous weights."""
    model, want = trainer(13)
    assert sync_weights(model, remote, bucket_bytes=SMALL_BUCKET)[0]
    named = list(model.state_dict().items())
    good = cuda_ipc.encode_bucket(FlattenedTensorBucket(named[:2]))
    extra = {**good, "pickle": "x"}
    unseen = {**good, "flattened_tensor": {**good["flattened_tensor"], "device": "0a1b2c3d-2222-4222-8222-00000000000c"}}
    bad_name = cuda_ipc.encode_bucket(FlattenedTensorBucket([("model.layers.99.mlp.up_proj.weight", named[0][1])]))
    cases = [(extra, "bucket 0: a CUDA IPC bucket needs exactly keys"), ([], "non-empty list"),
             ([good, unseen], "bucket 1.*does not see"), ([good, bad_name], "model.layers.99")]
    for payload, why in cases:
        ok, msg = _raw_update(remote, payload if isinstance(payload, list) else [payload])
        assert not ok and __import__("re").search(why, msg), msg
        assert_same(outputs(remote), want)


def test_weight_transport_is_checked():
    """An unknown weight_transport is refused before any process starts."""
    with pytest.raises(ValueError, match="weight_transport='pipe'"):
        RemoteEngine("rollout:Engine", weight_transport="pipe", model_path="unused")


def test_server_update_weights_from_tensor_by_ipc(ckpt, trainer, ipc):  # noqa: F811
    """/update_weights_from_tensor with load_format="cuda_ipc" loads the buckets (outputs equal a fresh engine
    on the new weights); a malformed descriptor is a 400 naming the field and changes nothing."""
    model, want = trainer(14)
    with Engine(str(ckpt), **ENGINE_KW) as engine, start_server(ckpt, engine=engine) as s:
        before = outputs(engine)
        assert differ(before, want)
        buckets = list(iter_buckets(list(model.state_dict().items()), bucket_bytes=SMALL_BUCKET))
        body = cuda_ipc.encode_request(buckets[:1])
        bad = json.loads(body)
        bad[0]["flattened_tensor"]["stride"] = [2]
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [json.dumps(bad)],
                                                            "load_format": "cuda_ipc"})
            assert r.status_code == 400 and "past its storage" in r.text, r.text
            assert_same(outputs(engine), before)
            r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [
                cuda_ipc.encode_request(buckets)], "load_format": "cuda_ipc"})
            assert r.status_code == 200 and r.json()["success"], r.text
        assert_same(outputs(engine), want)
        assert torch.equal(torch.tensor(engine.get_weights_by_name("model.norm.weight")),
                           model.state_dict()["model.norm.weight"].float())
