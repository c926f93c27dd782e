"""The SGLang routes slime calls around a weight sync and for profiling: /weights_checker,
/post_process_weights, /start_profile, /stop_profile, in both server layouts (Engine in this process;
Engine in its own process behind an EngineClient, launch_server's default).

Oracles: the server's own greedy output before anything was touched (the original weights), the trace
file read back with gzip + json, and the status codes and messages SGLang's clients act on.
"""

from __future__ import annotations

import gzip
import json
import re

import pytest

from tests.server.conftest import start_server

PROMPT = [5, 6, 7, 8, 9]
GREEDY = dict(temperature=0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "engine_process"])
def served(request, tiny_llama):
    with start_server(tiny_llama, in_child=request.param) as s:
        yield s


def _greedy(c) -> list[int]:
    r = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_weights_checker_catches_a_reset_and_passes_after_a_full_sync(served):
    """compare without a snapshot is 400; after snapshot + reset_tensors compare is 400 naming how many
    parameters differ and outputs change; after update_weights_from_disk of the checkpoint compare is
    200 and greedy output equals the original weights' again."""
    with served.client() as c:
        c.post("/flush_cache")
        original = _greedy(c)
        r = c.post("/weights_checker", json={"action": "compare"})
        assert r.status_code == 400 and not r.json()["success"] and "no snapshot" in r.json()["message"]
        for action in ("snapshot", "reset_tensors"):
            r = c.post("/weights_checker", json={"action": action})
            assert r.status_code == 200 and r.json()["success"], r.text
        r = c.post("/weights_checker", json={"action": "compare"})
        assert r.status_code == 400 and not r.json()["success"]
        m = re.search(r"(\d+) of (\d+) parameters differ", r.json()["message"])
        assert m and m.group(1) == m.group(2), r.json()["message"]
        assert _greedy(c) != original
        r = c.post("/update_weights_from_disk", json={"model_path": served.path})
        assert r.status_code == 200 and r.json()["success"], r.text
        r = c.post("/weights_checker", json={"action": "compare"})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert _greedy(c) == original


def test_weights_checker_refuses_bad_bodies(served):
    """An unknown action is 400 naming it and the valid ones; a missing action or extra field is 400;
    GET is 405; the server still serves."""
    with served.client() as c:
        before = _greedy(c)
        r = c.post("/weights_checker", json={"action": "wipe"})
        assert r.status_code == 400 and "'wipe'" in r.json()["message"] and "Unsupported" in r.json()["message"]
        assert all(a in r.json()["message"] for a in ("snapshot", "reset_tensors", "compare", "checksum"))
        assert c.post("/weights_checker", json={}).status_code == 400
        assert c.post("/weights_checker", json={"action": "compare", "x": 1}).status_code == 400
        assert c.get("/weights_checker").status_code == 405
        assert _greedy(c) == before


def test_post_process_weights_succeeds_and_changes_nothing(served):
    """Both flags answer 200 {"success": true} saying why nothing was needed; greedy output is unchanged;
    a non-bool flag is 400."""
    with served.client() as c:
        before = _greedy(c)
        r = c.post("/post_process_weights", json={"restore_weights_before_load": True,
                                                  "post_process_quantization": True})
        assert r.status_code == 200 and r.json()["success"] and "nothing to do" in r.json()["message"]
        r = c.post("/post_process_weights", json={"restore_weights_before_load": "yes"})
        assert r.status_code == 400
        assert _greedy(c) == before


def _trace_events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_profile_routes_write_a_trace_of_the_forward(served, tmp_path):
    """start_profile, generate, stop_profile: 200s, and the named file is a Chrome trace holding aten
    ops; a second stop is 400; num_steps=2 ends by itself (its trace appears, then stop is 400)."""
    with served.client() as c:
        r = c.post("/start_profile", json={"output_dir": str(tmp_path), "activities": ["CPU"]})
        assert r.status_code == 200 and str(tmp_path) in r.json()["message"], r.text
        _greedy(c)
        r = c.post("/stop_profile", json={})
        assert r.status_code == 200, r.text
        path = re.search(r"(\S+\.trace\.json\.gz)", r.json()["message"]).group(1)
        names = {str(e.get("name", "")) for e in _trace_events(path)}
        assert names & {"aten::linear", "aten::mm", "aten::addmm"}
        r = c.post("/stop_profile")
        assert r.status_code == 400 and "no profile is running" in r.json()["error"]["message"]
        auto = tmp_path / "auto"
        r = c.post("/start_profile", json={"output_dir": str(auto), "num_steps": 2})
        assert r.status_code == 200, r.text
        _greedy(c)
        assert len(list(auto.glob("*.trace.json.gz"))) == 1
        assert c.post("/stop_profile", json={}).status_code == 400


def test_profile_routes_refuse_bad_requests(served, tmp_path):
    """GPU on a CPU engine, profile_by_stage, an unknown field and a second start are each 400 naming
    the problem; the server still serves the same greedy output."""
    with served.client() as c:
        before = _greedy(c)
        r = c.post("/start_profile", json={"activities": ["GPU"]})
        assert r.status_code == 400 and "'GPU'" in r.json()["error"]["message"]
        r = c.post("/start_profile", json={"profile_by_stage": True})
        assert r.status_code == 400 and "profile_by_stage" in r.json()["error"]["message"]
        assert c.post("/start_profile", json={"merge": True}).status_code == 400
        assert c.post("/start_profile", json={"output_dir": str(tmp_path)}).status_code == 200
        r = c.post("/start_profile", json={"output_dir": str(tmp_path)})
        assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
        assert c.post("/stop_profile").status_code == 200
        assert _greedy(c) == before


def _push(c, named) -> None:
    from rollout.server.tensor_codec import encode_named_tensors

    r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [encode_named_tensors(named)],
                                                     "flush_cache": True})
    assert r.status_code == 200 and r.json()["success"], r.text


def test_compare_names_the_fused_parameter_an_hf_name_wrote_with_its_max_abs_err(served):
    """SGLang's e2e flow: snapshot, push layer 0's up_proj full of 1.5 under its HF name: compare is 400
    naming the fused gate_up_proj it landed in, with max_abs_err = max |1.5 - the checkpoint's up_proj|
    (read from the safetensors file); pushing identical bytes twice around a snapshot keeps compare 200."""
    import torch

    from tests.rl_surface.conftest import read_state_dict

    name = "model.layers.0.mlp.up_proj.weight"
    up = read_state_dict(served.path)[name]
    with served.client() as c:
        assert c.post("/weights_checker", json={"action": "snapshot"}).status_code == 200
        _push(c, [(name, torch.full_like(up, 1.5))])
        r = c.post("/weights_checker", json={"action": "compare"})
        body = r.json()
        assert r.status_code == 400 and not body["success"]
        m = re.search(r"model\.layers\.0\.mlp\.gate_up_proj\.weight \(max_abs_err=([0-9.e+-]+)\)", body["message"])
        assert m, body["message"]
        assert float(m.group(1)) == pytest.approx((1.5 - up.double()).abs().max().item(), rel=1e-5)
        assert "1 of" in body["message"]  # only the tensor written
        _push(c, [(name, torch.full_like(up, 0.25))])
        assert c.post("/weights_checker", json={"action": "snapshot"}).status_code == 200
        _push(c, [(name, torch.full_like(up, 0.25))])
        r = c.post("/weights_checker", json={"action": "compare"})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert c.post("/update_weights_from_disk", json={"model_path": served.path}).json()["success"]


def test_checksum_action_hashes_every_parameter_stably(served):
    """action "checksum": one rank with SGLang's parallelism_info keys and a 16-hex hash per parameter
    (no rotary buffers); the same across calls; after an update only the written tensor's hash changes,
    and model.norm.weight's hash is BLAKE2b-64 of the checkpoint's own bytes."""
    import hashlib

    import torch

    from tests.rl_surface.conftest import read_state_dict

    sd = read_state_dict(served.path)
    with served.client() as c:
        first = c.post("/weights_checker", json={"action": "checksum"}).json()
        assert first["success"] and len(first["ranks"]) == 1
        rank = first["ranks"][0]
        assert set(rank["parallelism_info"]) == {"tp_rank", "tp_size", "dp_rank", "dp_size", "pp_rank", "pp_size",
                                                 "rank", "size"}
        sums = rank["checksums"]
        assert all(re.fullmatch(r"[0-9a-f]{16}", h) for h in sums.values())
        assert not any(k in n for n in sums for k in ("cos", "sin", "inv_freq", "rotary"))
        assert c.post("/weights_checker", json={"action": "checksum"}).json()["ranks"] == first["ranks"]
        norm = sd["model.norm.weight"]
        h = hashlib.blake2b(f"{norm.dtype}|{tuple(norm.shape)}|".encode(), digest_size=8)
        h.update(norm.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        assert sums["model.norm.weight"] == h.hexdigest()
        _push(c, [("model.layers.1.mlp.up_proj.weight", torch.full_like(sd["model.layers.1.mlp.up_proj.weight"], 0.5))])
        after = c.post("/weights_checker", json={"action": "checksum"}).json()["ranks"][0]["checksums"]
        assert [n for n in sums if sums[n] != after[n]] == ["model.layers.1.mlp.gate_up_proj.weight"]
        assert c.post("/update_weights_from_disk", json={"model_path": served.path}).json()["success"]
        assert c.post("/weights_checker", json={"action": "checksum"}).json()["ranks"][0]["checksums"] == sums
