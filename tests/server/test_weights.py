"""Weight updates over HTTP (disk, tensor plain/bucketed, distributed per-tensor/bucketed) land exactly the
new weights: generation and the weights checksum equal a fresh server started on the new checkpoint."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from rollout.launch_server import free_port
from rollout.server.tensor_codec import encode_bucket, encode_named_tensors
from tests.rl_surface.conftest import read_state_dict
from tests.server.conftest import start_server
from weight_sync.bucket import FlattenedTensorBucket
from weight_sync.distributed import (
    broadcast_named_tensors,
    create_weight_update_group,
    destroy_weight_update_group,
)

BODY = dict(input_ids=[[5, 6, 7, 8, 9], [13, 40, 41, 42] * 3], return_logprob=True,
            sampling_params=dict(temperature=0, max_new_tokens=8, ignore_eos=True))


def _observe(c: httpx.Client) -> tuple:
    c.post("/flush_cache")
    outs = c.post("/generate", json=BODY).json()
    tokens = [(o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs]
    return tokens, c.get("/get_weights_checksum").json()["checksum"]


@pytest.fixture(scope="module")
def ckpts(ckpt_factory):
    return ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)


@pytest.fixture(scope="module")
def expected(ckpts):
    """What fresh servers on A and on B answer (the oracle)."""
    out = []
    for path in ckpts:
        with start_server(path) as s, s.client() as c:
            out.append(_observe(c))
    assert out[0] != out[1]
    return out


@pytest.fixture(scope="module")
def wserver(ckpts):
    with start_server(ckpts[0]) as s:
        yield s


@pytest.fixture
def wclient(wserver, ckpts, expected):
    """A client of a server reset to checkpoint A (over HTTP, from disk) before each test."""
    with wserver.client() as c:
        r = c.post("/update_weights_from_disk", json={"model_path": str(ckpts[0])})
        assert r.status_code == 200, r.text
        assert _observe(c) == expected[0]
        yield c


def test_update_from_disk(wclient, ckpts, expected):
    """/update_weights_from_disk with weight_version: B's outputs and checksum; success, message, num_paused_requests."""
    r = wclient.post("/update_weights_from_disk", json={"model_path": str(ckpts[1]), "weight_version": "b1"})
    assert r.status_code == 200 and set(r.json()) == {"success", "message", "num_paused_requests"}
    assert _observe(wclient) == expected[1]
    assert wclient.get("/get_weight_version").json()["weight_version"] == "b1"
    r = wclient.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert _observe(wclient) == expected[1]  # a failed update changes nothing


def test_update_from_disk_passes_flush_cache(wclient, ckpts):
    """flush_cache from the /update_weights_from_disk body reaches the engine: false keeps the prefix cache
    (a repeated prompt hits it), the default true empties it (no hit)."""
    body = dict(input_ids=[13, 40, 41, 42] * 3, sampling_params=dict(temperature=0, max_new_tokens=2))
    cached = []
    for flush in (False, True):
        wclient.post("/generate", json=body)  # the prompt is in the prefix cache now
        r = wclient.post("/update_weights_from_disk", json={"model_path": str(ckpts[0]), "flush_cache": flush})
        assert r.status_code == 200, r.text
        cached.append(wclient.post("/generate", json=body).json()["meta_info"]["cached_tokens"])
    assert cached[0] > 0 and cached[1] == 0, cached


def test_update_from_tensor_plain_and_bucketed(wclient, ckpts, expected):
    """/update_weights_from_tensor with named tensors, then with flattened buckets: B's outputs each time."""
    sd = read_state_dict(ckpts[1])
    r = wclient.post("/update_weights_from_tensor", json={"serialized_named_tensors": [encode_named_tensors(sd)]})
    assert r.status_code == 200, r.text
    assert _observe(wclient) == expected[1]
    wclient.post("/update_weights_from_disk", json={"model_path": str(ckpts[0])})
    items = sorted(sd.items())
    buckets = [FlattenedTensorBucket(items[: len(items) // 2]), FlattenedTensorBucket(items[len(items) // 2:])]
    r = wclient.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [json.dumps([encode_bucket(b) for b in buckets])],
        "load_format": "flattened_bucket", "weight_version": "bucketed"})
    assert r.status_code == 200, r.text
    assert _observe(wclient) == expected[1]
    bad = dict(sd, **{"model.norm.weight": sd["model.norm.weight"][:3]})
    r = wclient.post("/update_weights_from_tensor", json={"serialized_named_tensors": [encode_named_tensors(bad)]})
    assert r.status_code == 400 and "model.norm.weight" in r.json()["message"]
    assert _observe(wclient) == expected[1]


def _update_mid_stream(wserver, wclient, update) -> tuple[dict, httpx.Response]:
    """Stream a long greedy request and post `update(client)` once its first token arrived (it runs);
    -> (its last chunk, the update's response). Under load it may finish first: then try again (bounded)."""
    body = dict(input_ids=[5, 6, 7], stream=True, sampling_params=dict(temperature=0, max_new_tokens=300,
                                                                      ignore_eos=True))
    for _ in range(3):
        with wserver.client() as c, c.stream("POST", "/generate", json=body) as r:
            events = (line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]")
            last = json.loads(next(events))
            res = update(wclient)
            for event in events:
                last = json.loads(event)
        if len(last["meta_info"]["weight_versions"]) == 2:
            return last, res
        assert res.status_code in (200, 400), res.text  # it landed after the request ended
    pytest.fail("the request finished before the update landed, 3 times")


@pytest.mark.parametrize("route", ["disk-online", "tensor-force", "http-engine-online"])
def test_online_update_mid_request(wserver, wclient, ckpts, expected, route):
    """/update_weights_from_disk {"online": true} and /update_weights_from_tensor {"force": true} (SGLang's RL
    tests' fields), and weight_sync's HttpEngine.update_weights_from_tensor(online=True), land while a request
    runs unpaused: it is retracted and finishes (not aborted) with two weight-version spans, and the server
    then serves exactly B."""
    if route == "disk-online":
        def update(c):
            return c.post("/update_weights_from_disk", json={"model_path": str(ckpts[1]), "online": True})
    elif route == "http-engine-online":
        from types import SimpleNamespace

        from weight_sync.http import HttpEngine

        tensors = list(read_state_dict(ckpts[1]).items())

        def update(c):
            handle = HttpEngine(wserver.url)
            try:
                ok, msg = handle.update_weights_from_tensor(tensors, online=True)
            finally:
                handle.close()
            return SimpleNamespace(status_code=200 if ok else 400, text=msg, json=lambda: {"success": ok})
    else:
        blob = encode_named_tensors(read_state_dict(ckpts[1]))

        def update(c):
            return c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [blob], "force": True})
    last, res = _update_mid_stream(wserver, wclient, update)
    assert res.status_code == 200 and res.json()["success"], res.text
    assert last["meta_info"]["finish_reason"]["type"] == "length" and last["meta_info"]["num_retractions"] == 1
    assert _observe(wclient) == expected[1]


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_from_distributed(wserver, wclient, ckpts, expected, load_format):
    """init group over HTTP (master_port an int, or a numeric string as SGLang's clients send), trainer
    broadcasts B (per tensor, or one bucket), engine loads it: B's outputs."""
    sd = sorted(read_state_dict(ckpts[1]).items())
    port, name = free_port(), f"wug-{load_format}"
    joined: dict = {}

    def engine_joins():
        joined["r"] = wserver.client().post("/init_weights_update_group", json=dict(
            master_address="127.0.0.1", master_port=str(port) if load_format else port, rank_offset=1, world_size=2, group_name=name,
            backend="gloo"))

    t = threading.Thread(target=engine_joins)
    t.start()
    group = create_weight_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=30)
    t.join(30)
    assert joined["r"].status_code == 200, joined["r"].text
    try:
        body = {"names": [n for n, _ in sd], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in sd],
                "shapes": [list(t.shape) for _, t in sd], "group_name": name, "load_format": load_format}
        result: dict = {}
        t = threading.Thread(target=lambda: result.setdefault("r", wserver.client().post(
            "/update_weights_from_distributed", json=body)))
        t.start()
        broadcast_named_tensors(group, sd, load_format=load_format, timeout_s=30)
        t.join(30)
        assert result["r"].status_code == 200, result["r"].text
        assert _observe(wclient) == expected[1]
    finally:
        assert wclient.post("/destroy_weights_update_group", json={"group_name": name}).status_code == 200
        destroy_weight_update_group(group)
    r = wclient.post("/destroy_weights_update_group", json={"group_name": name})
    assert r.status_code == 400 and name in r.json()["message"]



def test_tp_payloads_per_rank_must_be_the_same(ckpts, expected):
    """On a tp_size=2 server, one entry per rank is accepted when both are the same full payload (B's weights:
    B's outputs); entries that differ are refused naming the one that differs, and the weights stay B's."""
    sd = read_state_dict(ckpts[1])
    with start_server(ckpts[0], engine_kw={"tp_size": 2}) as s, s.client() as c:
        full = encode_named_tensors(sd)
        r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [full, full]})
        assert r.status_code == 200, r.text
        tokens, checksum = _observe(c)
        assert [ids for ids, _ in tokens] == [ids for ids, _ in expected[1][0]]
        zeros = encode_named_tensors({"lm_head.weight": sd["lm_head.weight"] * 0})
        for second in (zeros, "not base64 at all"):
            r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [full, second]})
            assert r.status_code == 400 and "serialized_named_tensors[1] differs" in r.json()["message"], r.text
        assert _observe(c) == (tokens, checksum)


@pytest.mark.parametrize("route", ["disk", "tensor"])
def test_abort_all_requests_aborts_only_when_the_update_succeeds(wserver, wclient, ckpts, expected, route):
    """abort_all_requests=True with a refused update (bad path / wrong shape) aborts nothing: the request
    paused in place finishes by length after continue; with a good update it ends as abort, and the
    server then answers with B's weights."""
    sd = read_state_dict(ckpts[1])
    good = ({"model_path": str(ckpts[1])} if route == "disk" else
            {"serialized_named_tensors": [encode_named_tensors(sd)]})
    bad = ({"model_path": str(ckpts[1]) + "-missing"} if route == "disk" else
           {"serialized_named_tensors": [encode_named_tensors({"model.norm.weight": sd["model.norm.weight"][:-1]})]})
    path = f"/update_weights_from_{route}"
    for body, ok in ((bad, False), (good, True)):
        finals: list[dict] = []

        def stream(out: list):
            req = dict(input_ids=[5, 6, 7], stream=True, sampling_params=dict(max_new_tokens=40, ignore_eos=True))
            with wserver.client() as c, c.stream("POST", "/generate", json=req) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
            out.append(json.loads(events[-1]))

        assert wclient.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        t = threading.Thread(target=stream, args=(finals,))
        t.start()
        deadline = time.monotonic() + 30
        while wclient.get("/get_server_info").json()["num_in_flight"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = wclient.post(path, json={**body, "abort_all_requests": True})
        assert (r.status_code == 200) is ok, r.text
        wclient.post("/continue_generation", json={})
        t.join(60)
        reason = finals[0]["meta_info"]["finish_reason"]["type"]
        assert reason == ("abort" if ok else "length"), finals[0]["meta_info"]
    assert _observe(wclient) == expected[1]


def test_sglang_request_fields_are_accepted(wclient, wserver, ckpts, expected):
    """The fields of SGLang's own request classes are accepted on the weight routes (they were 400 "unknown
    field"): the update lands as without them; a `manifest` is refused by name and changes nothing; a field
    SGLang does not define is still refused."""
    sglang_disk = dict(rid="r1", is_async=True, torch_empty_cache=True, keep_pause=False, recapture_cuda_graph=True,
                       token_step=3, abort_all_requests=False, flush_cache=True, load_format=None)
    r = wclient.post("/update_weights_from_disk", json={"model_path": str(ckpts[1]), **sglang_disk})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert _observe(wclient) == expected[1]
    r = wclient.post("/update_weights_from_disk", json={"model_path": str(ckpts[0]), "manifest": {"a": 1}})
    assert r.status_code == 400 and "manifest" in r.json()["message"]
    assert _observe(wclient) == expected[1]
    sd = read_state_dict(ckpts[0])
    r = wclient.post("/update_weights_from_tensor", json={"serialized_named_tensors": [encode_named_tensors(sd)],
                                                          "rid": "r2", "torch_empty_cache": True,
                                                          "disable_draft_model": True})
    assert r.status_code == 200, r.text
    assert _observe(wclient) == expected[0]
    # load_format "direct" (runner parameter names) over HTTP as in-process: B's norm into A's weights
    norm = read_state_dict(ckpts[1])["model.norm.weight"]
    r = wclient.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [encode_named_tensors({"model.norm.weight": norm})], "load_format": "direct"})
    assert r.status_code == 200, r.text
    assert wclient.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 10**6,
                                                      "rid": "r3"}).json() == norm.float().tolist()
    r = wclient.post("/update_weights_from_disk", json={"model_path": str(ckpts[0]), "flush_cahce": False})
    assert r.status_code == 400 and "flush_cahce" in r.text
    r = wclient.post("/update_weight_version", json={"new_version": "v-rid", "rid": "r4"})
    assert r.status_code == 200 and wclient.get("/get_weight_version").json()["weight_version"] == "v-rid"
    # routes that pass their whole body on as keyword arguments leave rid out (it reached the engine as one)
    r = wclient.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                         "rank_offset": 1, "world_size": 2, "rid": "r5",
                                                         "timeout_s": 0.5})
    assert "rid" not in r.text, r.text
    r = wclient.post("/start_profile", json={"rid": "r6", "num_steps": 1})
    assert r.status_code == 200 and "rid" not in r.text, r.text
    wclient.post("/generate", json=BODY)  # the profiled step ends the trace
