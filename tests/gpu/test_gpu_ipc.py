"""CUDA IPC as a transport on the GPU (CUDA only): a trainer process and an engine process on the same GPU
exchange weights through IPC handles (no host copy): RemoteEngine with weight_transport='cuda_ipc', and the
HTTP server's /update_weights_from_tensor with load_format='cuda_ipc' fed by a sender process. Outputs
after the update equal a fresh engine's on the new weights; a descriptor naming an unseen GPU is refused
and the weights stay."""

from __future__ import annotations

import json
import multiprocessing as mp

import httpx
import pytest
import torch

from tests.gpu.test_gpu_engine import ENGINE_KW, _engine, _run, _state_dict

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpts(ckpt_factory):
    a = ckpt_factory("qwen2", hidden_size=256, head_dim=64)
    b = ckpt_factory("qwen2", hidden_size=256, head_dim=64, seed=1)
    with _engine(b) as fresh:
        want = _run(fresh)
    return a, b, want


def test_remote_engine_takes_cuda_weights_by_ipc(ckpts):
    """CUDA tensors in this process reach an engine process by IPC; it then equals a fresh engine on them."""
    from weight_sync.cross_process import RemoteEngine

    a, b, want = ckpts
    named = [(n, t.cuda()) for n, t in _state_dict(b)]
    with RemoteEngine("rollout:Engine", weight_transport="cuda_ipc", model_path=str(a), **ENGINE_KW) as r:
        before = _run(r)
        ok, msg = r.update_weights_from_tensor(named)
        assert ok, msg
        assert _run(r) == want and before != want


def _sender(conn, path):
    import torch

    from tests.gpu.test_gpu_engine import _state_dict
    from weight_sync.bucket import iter_buckets
    from weight_sync.cuda_ipc import encode_request

    named = [(n, t.cuda()) for n, t in _state_dict(path)]
    buckets = list(iter_buckets(named, bucket_bytes=1 << 20))
    torch.cuda.synchronize()
    conn.send(encode_request(buckets))
    conn.recv()  # keep the memory until the server has loaded it
    conn.close()


def test_server_update_weights_from_tensor_by_cuda_ipc(ckpts):
    """A sender process's CUDA buckets posted as load_format='cuda_ipc' load into the served engine; a
    descriptor naming a GPU the server does not see is a 400 and changes nothing."""
    from tests.server.conftest import start_server

    a, b, want = ckpts
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, str(b)))
    proc.start()
    try:
        assert parent.poll(180), "sender sent nothing"
        body = parent.recv()
        with _engine(a) as engine, start_server(a, engine=engine) as s, httpx.Client(base_url=s.url, timeout=120) as c:
            before = _run(engine)
            bad = json.loads(body)
            bad[0]["flattened_tensor"]["device"] = "00000000-0000-4000-8000-000000000000"
            r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [json.dumps(bad)],
                                                            "load_format": "cuda_ipc"})
            assert r.status_code == 400 and "does not see" in r.text, r.text
            assert _run(engine) == before
            r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [body],
                                                            "load_format": "cuda_ipc"})
            assert r.status_code == 200 and r.json()["success"], r.text
            assert _run(engine) == want
            torch.cuda.synchronize()
        parent.send("done")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
