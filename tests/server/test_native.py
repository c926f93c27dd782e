"""SGLang's native endpoints over HTTP (httpx), checked against the Engine called directly."""

from __future__ import annotations

import json
import time

import pytest

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 40, 41, 42] * 3]
GREEDY = dict(temperature=0, max_new_tokens=8, ignore_eos=True)


def _lp(meta, key="output_token_logprobs"):
    return [(e[0], e[1]) for e in meta[key]]


def _wait(pred, timeout_s=15.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def test_generate_equals_engine(server, client):
    """/generate (input_ids batch, text single, sampled+seeded) returns the Engine's tokens and logprobs exactly."""
    engine = server.engine
    sampled = dict(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=6, ignore_eos=True)
    cases = [
        dict(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2),
        dict(text="The quick brown fox", sampling_params=GREEDY, return_logprob=True),
        dict(input_ids=PROMPTS[0], sampling_params=sampled, return_logprob=True),
    ]
    for body in cases:
        assert client.post("/flush_cache").status_code == 200
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        engine.flush_cache()
        kw = {("prompt" if k == "text" else k): v for k, v in body.items()}
        want = engine.generate(**kw)
        got, want = (got, want) if isinstance(want, list) else ([got], [want])
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g["output_ids"] == w["output_ids"]
            assert g["text"] == w["text"]
            assert _lp(g["meta_info"]) == [(lp, t) for lp, t, _ in w["meta_info"]["output_token_logprobs"]]
            assert all(e[2] is None for e in g["meta_info"]["output_token_logprobs"])  # no return_text_in_logprobs
            if body.get("top_logprobs_num"):
                assert [[(lp, t) for lp, t, _ in step] for step in g["meta_info"]["output_top_logprobs"]] == \
                       [[(lp, t) for lp, t, _ in step] for step in w["meta_info"]["output_top_logprobs"]]
            assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]


def test_generate_stream_sse(server, client):
    """stream=true sends SSE chunks with growing output, ending in data: [DONE]; the last equals the non-stream answer.
    64 tokens: a server that is behind sends what waits as one snapshot, so 8 tokens could arrive in one event."""
    body = dict(input_ids=PROMPTS[1], sampling_params=dict(GREEDY, max_new_tokens=64), return_logprob=True)
    client.post("/flush_cache")  # a prefix-cache hit may move a logprob by an ulp
    want = client.post("/generate", json=body).json()
    client.post("/flush_cache")
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2 and [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    assert chunks[-1]["output_ids"] == want["output_ids"]
    assert _lp(chunks[-1]["meta_info"]) == _lp(want["meta_info"])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_disconnect_mid_stream_aborts_and_frees_kv(server, client):
    """A client that drops a stream aborts its request: nothing stays in flight, all KV is free, serving goes on."""
    engine = server.engine
    body = dict(input_ids=PROMPTS[0], stream=True, sampling_params=dict(max_new_tokens=400, ignore_eos=True))
    with client.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk received, then the connection is closed
    _wait(lambda: engine.get_server_info()["num_in_flight"] == 0, what="the dropped stream to be aborted")
    assert engine.flush_cache()
    info = client.get("/get_load").json()[0]
    assert info["num_reqs"] == 0 and info["num_tokens"] == 0
    assert client.post("/generate", json=dict(input_ids=PROMPTS[1], sampling_params=GREEDY)).status_code == 200


def test_info_and_health(server, client):
    """health, health_generate, model/server info (under both SGLang names), load and weight version report the
    engine's state."""
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["model_path"] == server.path and info["is_generation"] is True
    sinfo = client.get("/get_server_info").json()
    assert sinfo["max_total_tokens"] == 4096 and sinfo["port"] == int(server.url.rsplit(":", 1)[1])
    assert "api_key" not in sinfo and sinfo["internal_states"][0]["max_total_num_tokens"] == 4096
    # SGLang's flat shape: the engine's info merged with the server's args, not nested inside them
    assert set(server.engine.get_server_info()) <= set(sinfo)
    assert sinfo["max_total_num_tokens"] == 4096 and sinfo["max_n"] == 256 and sinfo["paused"] is False
    # SGLang's newer names answer the same (volatile fields aside)
    assert client.get("/model_info").json() == info
    new = client.get("/server_info").json()
    assert set(new) == set(sinfo) and new["port"] == sinfo["port"] and new["max_n"] == sinfo["max_n"]
    load = client.get("/get_load").json()
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert client.get("/get_weight_version").json() == {"weight_version": server.engine.weight_version}


def test_weight_version_and_get_weights_by_name(server, client):
    """update_weight_version changes what outputs and /get_weight_version report; get_weights_by_name = the Engine's."""
    old = server.engine.weight_version
    try:
        r = client.post("/update_weight_version", json={"new_version": "v-http"})
        assert r.status_code == 200 and r.json()["new_version"] == "v-http"
        assert client.get("/get_weight_version").json()["weight_version"] == "v-http"
        out = client.post("/generate", json=dict(input_ids=PROMPTS[1], sampling_params=GREEDY)).json()
        assert out["meta_info"]["weight_version"] == "v-http"
    finally:
        client.post("/update_weight_version", json={"new_version": old})
    name = "model.layers.0.mlp.down_proj.weight"
    r = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 3})
    assert r.status_code == 200
    assert r.json() == json.loads(json.dumps(server.engine.get_weights_by_name(name, 3)))
    r = client.post("/get_weights_by_name", json={"name": "no.such.weight"})
    assert r.status_code == 400 and "no.such.weight" in r.text


def _long_stream(server, action) -> dict:
    """Stream a long request; call `action()` once its first token arrived (it is running, by a token
    received rather than a polled counter, which can miss a short run under load); -> its last chunk."""
    body = dict(input_ids=PROMPTS[0], stream=True, sampling_params=dict(max_new_tokens=2000, ignore_eos=True))
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        events = (line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]")
        last = json.loads(next(events))
        action()
        for event in events:
            last = json.loads(event)
    return last


def _abort_while_running(server, client, action, attempts: int = 3) -> None:
    """`action` (pause or abort) lands while a request runs and ends it as abort. Under heavy load the
    request may finish first: that attempt proves nothing, so try again (bounded)."""
    for _ in range(attempts):
        last = _long_stream(server, action)
        if last["meta_info"]["finish_reason"]["type"] == "abort":
            return
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert client.post("/continue_generation").status_code == 200
    pytest.fail(f"the request finished before the abort landed, {attempts} times")


def test_pause_continue_abort_flush(server, client):
    """slime's calls: pause {} aborts running work, GET /flush_cache then 200, continue serves again; abort_all aborts."""
    def pause():
        assert client.post("/pause_generation", json={}).json()["status"] == "ok"

    _abort_while_running(server, client, pause)
    _wait(lambda: client.get("/flush_cache").status_code == 200, what="flush_cache to succeed")
    assert client.post("/continue_generation", json={}).status_code == 200

    def abort_all():
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200

    _abort_while_running(server, client, abort_all)
    assert client.post("/abort_request", json={"rid": "never-seen"}).status_code == 200  # a no-op, as SGLang
    assert client.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
    for contradiction in ({"abort_all": True, "retract_all": True}, {"mode": "abort", "retract_all": True}):
        r = client.post("/pause_generation", json=contradiction)
        assert r.status_code == 400 and "retract_all" in r.json()["error"]["message"], r.text
    assert client.post("/generate", json=dict(input_ids=PROMPTS[1], sampling_params=GREEDY)).status_code == 200


def test_abort_request_takes_sglang_abort_message(server, client):
    """/abort_request with SGLang's abort_message (and finished_reason, accepted) ends the running request
    as abort with that message; without one the message is ours."""
    body = {"abort_all": True, "abort_message": "rollout step over", "finished_reason": {"type": "abort"}}
    last = _long_stream(server, lambda: client.post("/abort_request", json=body).raise_for_status())
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "rollout step over"}
    last = _long_stream(server, lambda: client.post("/abort_request", json={"abort_all": True}).raise_for_status())
    assert last["meta_info"]["finish_reason"]["message"] == "aborted by abort_request (abort_all)"
    assert client.post("/abort_request", json={"abort_all": True, "abort_message": 5}).status_code == 400


def test_update_weight_version_aborts_in_flight_unless_told_not_to(server, client):
    """/update_weight_version aborts the requests in flight by default (SGLang's abort_all_requests=True);
    with abort_all_requests false a running request finishes, its last chunk under the new version."""
    old = server.engine.weight_version
    try:
        def relabel():
            assert client.post("/update_weight_version", json={"new_version": "v-abort"}).status_code == 200

        _abort_while_running(server, client, relabel)
        keep = {"new_version": "v-keep", "abort_all_requests": False}
        last = _long_stream(server, lambda: client.post("/update_weight_version", json=keep).raise_for_status())
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert last["meta_info"]["weight_version"] == "v-keep"
    finally:
        client.post("/update_weight_version", json={"new_version": old, "abort_all_requests": False})


@pytest.mark.parametrize("mode,pause_body", [
    ("retract", {"mode": "retract"}), ("in_place", {"mode": "in_place"}),
    # older SGLang clients' flags (SGLang's test_update_weights_from_tensor posts the first)
    ("retract", {"abort_all": False, "retract_all": True}), ("in_place", {"abort_all": False, "retract_all": False}),
], ids=["retract", "in_place", "retract_all-flag", "no-flags-in_place"])
def test_pause_modes_resume_to_same_tokens(server, client, mode, pause_body):
    """pause (retract | in_place, by mode or by the legacy flags) mid-request then continue: it finishes with
    exactly the unpaused greedy tokens, retracted iff the mode is retract; /flush_cache meanwhile is refused
    iff the paused request holds KV (in place)."""
    body = dict(input_ids=PROMPTS[2], sampling_params=dict(temperature=0, max_new_tokens=300, ignore_eos=True))
    want = client.post("/generate", json=body).json()["output_ids"]
    engine = server.engine
    # Streamed, so that "it runs" is a token received rather than a polled counter (a poll can miss a
    # short request under load). Under heavy load it may still finish before the pause lands: that
    # attempt proves nothing, so try again (bounded).
    for _ in range(3):
        with server.client() as c, c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            events = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
            last = json.loads(next(events))  # a token came out: the request is running
            assert client.post("/pause_generation", json=pause_body).status_code == 200
            try:
                info = engine.get_server_info()
                caught = info["num_in_flight"] == 1
                if caught:  # paused means no progress: the counter stands still while we wait
                    time.sleep(0.1)
                    assert engine.get_server_info()["num_generated_tokens"] == info["num_generated_tokens"]
                    # /flush_cache: refused (400, SGLang's words) while a request paused in place holds KV; a
                    # retracted one holds none, so the flush goes through and the request re-prefills.
                    r = client.post("/flush_cache")
                    assert r.status_code == (400 if mode == "in_place" else 200), r.text
                    assert ("not flushed" in r.text) == (mode == "in_place"), r.text
            finally:
                assert client.post("/continue_generation").status_code == 200
            rest = list(events)
        assert rest[-1] == "[DONE]"
        last = json.loads(rest[-2]) if len(rest) > 1 else last
        assert last["output_ids"] == want and last["meta_info"]["finish_reason"]["type"] == "length"
        if caught:
            assert (last["meta_info"]["num_retractions"] >= 1) == (mode == "retract")
            return
    pytest.fail(f"the request finished before pause_generation(mode={mode!r}) landed, 3 times")


def test_generate_top_level_max_new_tokens(server, client):
    """max_new_tokens beside sampling_params (as SGLang's RL tests post it) caps every prompt's output exactly
    as the same value inside sampling_params does; a contradicting value is a 400 naming it."""
    inside = client.post("/generate", json=dict(input_ids=PROMPTS[:2], sampling_params=dict(
        temperature=0, max_new_tokens=5, ignore_eos=True))).json()
    beside = client.post("/generate", json=dict(input_ids=PROMPTS[:2], max_new_tokens=5, sampling_params=dict(
        temperature=0, ignore_eos=True))).json()
    assert [o["output_ids"] for o in beside] == [o["output_ids"] for o in inside]
    assert [o["meta_info"]["completion_tokens"] for o in beside] == [5, 5]
    r = client.post("/generate", json=dict(input_ids=PROMPTS[0], max_new_tokens=5,
                                           sampling_params=dict(max_new_tokens=3)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens", r.text


def test_stream_coalesces_for_a_reader_that_falls_behind(server):
    """A stream read only after its request finished is sent as its first-token event, then one write of
    the newest cumulative snapshot and [DONE]; that event equals Engine.generate's output."""
    import asyncio

    from rollout.server.native import sse

    engine = server.engine
    body = dict(input_ids=PROMPTS[0], sampling_params=GREEDY)

    async def read_late():
        stream = await engine.async_generate(stream=True, **body)
        deadline = time.monotonic() + 30
        while engine.get_server_info()["num_in_flight"]:
            assert time.monotonic() < deadline, "the request did not finish in 30 s"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # let the loop run the deliveries queued by the scheduler thread
        return [part async for part in sse(stream)]

    engine.flush_cache()
    parts = asyncio.run(read_late())
    engine.flush_cache()
    want = engine.generate(**body)
    assert len(parts) == 2
    assert json.loads(parts[0][6:])["output_ids"] == want["output_ids"][:1]  # the first token, alone
    events = parts[1].split(b"\n\n")
    assert len(events) == 3 and events[1:] == [b"data: [DONE]", b""] and events[0].startswith(b"data: ")
    got = json.loads(events[0][6:])
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def test_release_resume_kv_cache(server, client):
    """release/resume_memory_occupation of the KV cache over HTTP: generation afterwards is unchanged."""
    body = dict(input_ids=PROMPTS[0], sampling_params=GREEDY, return_logprob=True)
    client.post("/flush_cache")
    before = client.post("/generate", json=body).json()
    # verl's body: reset_connector beside the tags (no KV connector here: it changes nothing)
    assert client.post("/release_memory_occupation", json={"tags": ["kv_cache"], "reset_connector": True}
                       ).status_code == 200
    assert client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    after = client.post("/generate", json=body).json()
    assert after["output_ids"] == before["output_ids"]
    assert _lp(after["meta_info"]) == _lp(before["meta_info"])
    r = client.post("/release_memory_occupation", json={"tags": ["no_such_tag"]})
    assert r.status_code == 400 and "no_such_tag" in r.text


def test_metrics(server, client):
    """/metrics (Prometheus text) reports the engine's generated-token counter, KV usage and weight version."""
    client.post("/generate", json=dict(input_ids=PROMPTS[1], sampling_params=GREEDY))
    text = client.get("/metrics").text
    values = {line.split("{")[0]: line for line in text.splitlines() if line and not line.startswith("#")}
    info = server.engine.get_server_info()
    assert float(values["sglang:generation_tokens_total"].rsplit(" ", 1)[1]) == info["num_generated_tokens"]
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate"):
        assert name in values
    assert f'weight_version="{info["weight_version"]}"' in values["sglang:weight_version_info"]
    assert values["sglang:num_grammar_queue_reqs"].endswith(" 0.0")


def test_gen_throughput_is_tokens_since_the_previous_scrape(server, client):
    """sglang:gen_throughput = tokens generated between two scrapes / the seconds between them: positive after
    a request ran in between, within the bounds the scrapes' own timestamps give; 0 with nothing generated."""
    def scrape() -> float:
        text = client.get("/metrics").text
        line = next(ln for ln in text.splitlines() if ln.startswith("sglang:gen_throughput{"))
        return float(line.rsplit(" ", 1)[1])

    before = server.engine.get_server_info()["num_generated_tokens"]
    t0 = time.monotonic()
    scrape()  # the window opens inside this call...
    client.post("/generate", json=dict(input_ids=PROMPTS[1], sampling_params=GREEDY))
    rate = scrape()  # ...and closes inside this one: it is shorter than t0 -> now
    elapsed = time.monotonic() - t0
    tokens = server.engine.get_server_info()["num_generated_tokens"] - before
    assert tokens > 0 and rate >= tokens / elapsed
    assert scrape() < rate  # nothing generated since: the next window is idle
