"""Weight endpoints against careless and hostile callers: files that block, paths outside the allowed
roots, joins to dead or unresolvable addresses, requests sent while weights are released without a backup.
In each case the server keeps answering its other clients and the weights stay as they were."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest

from rollout.launch_server import free_port
from tests.server.conftest import start_server

GOOD = dict(input_ids=[5, 6, 7], sampling_params=dict(temperature=0, max_new_tokens=4, ignore_eos=True))


def _checksum(c: httpx.Client) -> str:
    return c.get("/get_weights_checksum").json()["checksum"]


def _answers_quickly(c: httpx.Client, bound_s: float = 2.0) -> None:
    for method, path in (("GET", "/health"), ("GET", "/get_load")):
        t0 = time.perf_counter()
        assert c.request(method, path).status_code == 200
        assert time.perf_counter() - t0 < bound_s, path
    t0 = time.perf_counter()
    assert c.post("/abort_request", json={"rid": "nobody"}).status_code == 200
    assert time.perf_counter() - t0 < bound_s


@pytest.mark.parametrize("fifo_name", ["model.safetensors", "config.json"])
def test_checkpoint_file_that_would_block_is_refused(server, client, tmp_path, fifo_name):
    """A FIFO in place of a checkpoint file is refused by name at once (it is never opened for blocking
    reads), /health answers meanwhile, and the weights are unchanged."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(server.path, ckpt)
    (ckpt / fifo_name).unlink()
    os.mkfifo(ckpt / fifo_name)
    before = _checksum(client)
    t0 = time.perf_counter()
    r = client.post("/update_weights_from_disk", json={"model_path": str(ckpt)}, timeout=20)
    assert time.perf_counter() - t0 < 10
    assert r.status_code == 400 and "not a regular file" in r.json()["message"] and fifo_name in r.json()["message"]
    _answers_quickly(client)
    assert _checksum(client) == before


def test_checkpoint_is_opened_without_the_engine_lock(server, client, monkeypatch):
    """update_weights_from_disk opens (headers, config, mappings) the checkpoint before taking the engine
    lock, so a slow disk stalls only that call; the load then succeeds and the weights are unchanged."""
    runner, cv = server.engine.runner, server.engine._cv
    held: list[bool] = []
    real = type(runner).open_checkpoint

    def spy(self, path):
        held.append(cv._lock._is_owned())  # the engine's step lock (rollout.step_gate), by this thread
        return real(self, path)

    monkeypatch.setattr(type(runner), "open_checkpoint", spy)
    before = _checksum(client)
    r = client.post("/update_weights_from_disk", json={"model_path": server.path})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert held == [False]
    assert _checksum(client) == before


def test_allowed_disk_roots(server, tmp_path):
    """With --allowed-disk-roots, a path outside every root (missing, a file, a directory, a symlink out of
    a root) gets one message that says nothing about what is there; a checkpoint inside a root loads."""
    root = tmp_path / "root"
    root.mkdir()
    inside = root / "ckpt"
    shutil.copytree(server.path, inside)
    (root / "escape").symlink_to(server.path)
    (tmp_path / "a_file").write_text("x")
    with start_server(server.path, engine=server.engine, allowed_disk_roots=[str(root)]) as s, s.client() as c:
        messages = set()
        for path in (tmp_path / "missing", tmp_path / "a_file", tmp_path, root / "escape", root / ".." / "a_file"):
            r = c.post("/update_weights_from_disk", json={"model_path": str(path)})
            assert r.status_code == 400 and not r.json()["success"]
            messages.add(r.json()["message"])
        assert len(messages) == 1 and "--allowed-disk-roots" in messages.pop()
        r = c.post("/update_weights_from_disk", json={"model_path": str(inside)})
        assert r.status_code == 200 and r.json()["success"], r.text


def test_join_to_a_dead_address_honours_its_timeout(client):
    """init_weights_update_group to a port nobody listens on fails by its timeout_s (not 2x, not 120 s), an
    unresolvable name fails at once naming it, and both messages say why."""
    port = free_port()
    t0 = time.perf_counter()
    r = client.post("/init_weights_update_group", json=dict(master_address="127.0.0.1", master_port=port,
                                                            rank_offset=1, world_size=2, group_name="dead",
                                                            timeout_s=2.0))
    elapsed = time.perf_counter() - t0
    assert r.status_code == 400 and not r.json()["success"] and f"127.0.0.1:{port}" in r.json()["message"]
    assert 1.5 < elapsed < 6, elapsed
    t0 = time.perf_counter()
    r = client.post("/init_weights_update_group", json=dict(master_address="no-such-host.invalid", master_port=port,
                                                            rank_offset=1, world_size=2, group_name="dead",
                                                            timeout_s=30.0))
    assert r.status_code == 400 and "no-such-host.invalid" in r.json()["message"]
    assert time.perf_counter() - t0 < 15
    r = client.post("/init_weights_update_group", json=dict(master_address="127.0.0.1", master_port=port,
                                                            rank_offset=1, world_size=2, timeout_s=-1))
    assert r.status_code == 400 and "timeout_s" in r.json()["error"]["message"]


def test_slow_joins_do_not_starve_control_calls(server):
    """While --max-concurrent-weight-group-joins joins wait on dead addresses, one more is refused with 503
    naming the flag, and /health, /get_load, /abort_request and /generate still answer at once."""
    with start_server(server.path, engine=server.engine, max_concurrent_weight_group_joins=2) as s, s.client() as c:
        results: list[int] = []

        def join(i):
            with s.client() as cj:
                r = cj.post("/init_weights_update_group", json=dict(
                    master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
                    group_name=f"slow{i}", timeout_s=4.0))
                results.append(r.status_code)

        threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # both joins are waiting now
        r = c.post("/init_weights_update_group", json=dict(master_address="127.0.0.1", master_port=free_port(),
                                                           rank_offset=1, world_size=2, group_name="third"))
        assert r.status_code == 503 and "--max-concurrent-weight-group-joins 2" in r.json()["error"]["message"]
        _answers_quickly(c)
        assert c.post("/generate", json=GOOD).status_code == 200
        for t in threads:
            t.join(30)
        assert results == [400, 400]


def test_requests_sent_while_paused_wait_for_weights_released_without_backup(tiny_llama):
    """Paused, weights released without a CPU backup: a /generate sent then waits (no 503) and
    /get_weights_checksum is refused by name (the freed weights are never read); after resume, a disk update
    and continue it returns the same greedy tokens and checksum as before the release."""
    with start_server(tiny_llama, engine_kw=dict(enable_weights_cpu_backup=False)) as s, s.client() as c:
        reference = c.post("/generate", json=GOOD).json()["output_ids"]
        checksum = _checksum(c)
        assert c.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        assert c.post("/release_memory_occupation", json={}).status_code == 200
        r = c.get("/get_weights_checksum")
        assert r.status_code == 400 and "weights are released" in r.json()["error"]["message"], r.text
        got: dict = {}

        def send():
            with s.client() as c2:
                r = c2.post("/generate", json=GOOD)
                got.update(status=r.status_code, body=r.json())

        t = threading.Thread(target=send)
        t.start()
        time.sleep(1.0)
        assert t.is_alive() and not got  # waiting, not refused
        assert c.post("/resume_memory_occupation", json={}).status_code == 200
        r = c.post("/update_weights_from_disk", json={"model_path": str(tiny_llama)})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert c.post("/continue_generation", json={}).status_code == 200
        t.join(30)
        assert got["status"] == 200, got
        assert got["body"]["output_ids"] == reference
        assert _checksum(c) == checksum


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_pickled_tensor_payload_is_refused_by_name_and_never_unpickled(client, load_format, tmp_path):
    """What SGLang's MultiprocessingSerializer sends (base64 of a pickle) gets a 400 naming the pickle;
    the pickle is never loaded (its payload would have written a file) and the weights stay as they were."""
    import base64
    import pickle

    marker = tmp_path / "unpickled"

    class Payload:  # unpickling calls open(marker, "w"): proof that the server ran it
        def __reduce__(self):
            return (open, (str(marker), "w"))

    blob = base64.b64encode(pickle.dumps([("model.norm.weight", Payload())], protocol=4)).decode()
    before = _checksum(client)
    body = {"serialized_named_tensors": [blob], **({"load_format": load_format} if load_format else {})}
    r = client.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 400 and "pickle" in r.json()["message"], r.text
    assert "serialized_named_tensors[0]" in r.json()["message"]
    assert not marker.exists()
    assert _checksum(client) == before
    assert client.post("/generate", json=GOOD).status_code == 200
