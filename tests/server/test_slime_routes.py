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
        assert r.status_code == 400 and "'wipe'" in r.json()["message"]
        assert all(a in r.json()["message"] for a in ("snapshot", "reset_tensors", "compare"))
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
