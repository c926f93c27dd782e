"""Bad requests get a 4xx whose message names the field, and the next request is served; API-key auth."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server.conftest import start_server

GOOD = dict(input_ids=[5, 6, 7], sampling_params=dict(temperature=0, max_new_tokens=2, ignore_eos=True))

CASES = [
    ("/generate", b'{"text": "hi", ', "malformed JSON"),
    ("/generate", b'[1, 2]', "JSON object"),
    ("/generate", {"input_embeds": [[0.1, 0.2]]}, "input_embeds are not supported"),  # alone, it is named
    # bodies json.loads refuses otherwise than as malformed JSON: each named (FastAPI says only "an error")
    ("/generate", b'{"text": "\xff", "sampling_params": {"max_new_tokens": 2}}', "not valid UTF-8 (byte 0xff"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + b'[' * 100000 + b']' * 100000 + b'}', "nested too deeply"),
    ("/abort_request", b'{"rid": 1' + b'0' * 5000 + b'}', "digits"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": "hi", "return_logprob": "yes"}, "return_logprob"),
    ("/generate", {"text": "hi", "temperature": 0}, "temperature"),  # unknown top-level field
    ("/generate", {"text": "hi", "sampling_params": {"temprature": 0}}, "temprature"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 100000}}, "n"),
    ("/generate", {"input_ids": [5, 99999]}, "99999"),
    ("/generate", {"text": "hi", "lora_path": "adapter"}, "lora_path"),  # SGLang field the Engine lacks
    ("/generate", {}, "text or input_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 100000}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"model": "tiny", "prompt": [[]]}, "prompt 0 is empty"),  # was "empty batch"
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "frequency_penalty": 5.0}, "frequency_penalty"),
    ("/generate", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     "top_logprobs needs logprobs=true"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, "tool_choice='required' needs tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, "base64"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "assets/demo-model\u0000"}, "model_path: a path cannot hold a NUL"),
    ("/start_profile", {"output_dir": "/tmp/x\u0000y"}, "output_dir: a path cannot hold a NUL"),
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp/\u0000"}, "lora_path: a path cannot hold a NUL"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1"}, "master_port"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/drain", b'{"timeout": NaN}', "timeout: Value error, must be a number of seconds"),  # read as 0 before
    # JSON's lone-surrogate escape decodes to a str no tokenizer, path or /metrics label can encode
    ("/generate", b'{"text": "a\\ud800b"}', "text: a string holds a lone UTF-16 surrogate"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    ("/update_weights_from_disk", b'{"model_path": "/tmp/\\ud800"}', "model_path"),
    ("/update_weight_version", b'{"new_version": "v\\ud800"}', "new_version"),
    ("/generate", b'{"input_ids": [5], "sampling_params": {"stop": ["\\ud800"]}}', "sampling_params.stop[0]"),
]


@pytest.mark.parametrize("path,body,needle", CASES, ids=[f"{p}:{n}" for p, _, n in CASES])
def test_bad_request_is_4xx_naming_the_field(client, path, body, needle):
    """Each malformed / mistyped / unknown / oversized request: 400 naming the field; the next request is served."""
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["code"] == 400
    assert client.post("/generate", json=GOOD).status_code == 200


def test_surrogate_refusal_changes_nothing(server, client):
    """A refused lone-surrogate version relabels nothing, and /metrics (whose labels carry the version) still renders."""
    version = server.engine.weight_version
    r = client.post("/update_weight_version", content=b'{"new_version": "\\ud800"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and server.engine.weight_version == version
    assert client.get("/metrics").status_code == 200


def test_union_error_names_the_bad_element_not_a_null(client):
    """A list with one mistyped element: the error points at the element and claims no value that was not sent."""
    r = client.post("/generate", json={"input_ids": [5, 1.5]})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "input_ids[1]" in msg and "null" not in msg, msg


def test_chat_content_part_errors_name_the_part(server):
    """A chat content part that is not text, or whose text is not a string, is a 400 naming messages[i].content[j]."""
    with start_server(server.path, engine=server.engine, chat_template="plain") as s, s.client() as c:
        for part, needle in (({"type": "text", "text": 5}, "messages[1].content[0].text must be a string"),
                             ({"type": "image_url"}, "messages[1].content[0]: message content part of type")):
            messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [part]}]
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]})
        assert r.status_code == 200


def test_wrong_method_and_path(client):
    """An unknown path is 404 and a wrong method 405, in the same error shape."""
    assert client.get("/no_such_endpoint").json()["error"]["code"] == 404
    r = client.get("/generate")
    assert r.status_code == 405 and "/generate" in r.json()["error"]["message"]


def _app_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, path parameters filled in; read from the app itself,
    so a route added later is covered without editing the test."""
    out = []
    for route in app.routes:
        # FastAPI >= 0.16x keeps an included router as one entry whose routes are its "effective contexts"
        entries = route.effective_route_contexts() if hasattr(route, "effective_route_contexts") else [route]
        for entry in entries:
            path = getattr(entry, "path", None)
            for method in sorted(getattr(entry, "methods", None) or ()):
                if path is not None and method not in ("HEAD", "OPTIONS"):
                    out.append((method, re.sub(r"\{[^}]*\}", "x", path)))
    return out


def test_api_key(server):
    """With --api-key every route the app has but SGLang's open ones (/health, /health_generate, /metrics: what a
    router's prober or a Prometheus scraper calls without a key) needs 'Authorization: Bearer <key>': 401
    without it or with a wrong one, before the handler runs (the engine is untouched), then served with it."""
    with start_server(server.path, engine=server.engine, api_key="s3cret") as s:
        routes = _app_routes(s.thread.server.config.app)
        assert len({p for _, p in routes}) >= 25, routes  # the enumeration found the app's routes
        version = server.engine.weight_version
        with httpx.Client(base_url=s.url, timeout=30) as c:
            open_paths = ("/health", "/health_generate", "/metrics")
            for path in open_paths:
                assert c.get(path).status_code == 200, path
            for method, path in routes:
                if path in open_paths:
                    continue
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                    r = c.request(method, path, json={}, headers=headers)
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert "Authorization" in r.json()["error"]["message"] or "invalid API key" in r.text
            assert server.engine.weight_version == version and not server.engine._paused
            r = c.post("/generate", json=GOOD, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
            r = c.post("/generate", json=GOOD, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_json_encoding_round_trips_and_is_strict():
    """dumpb: floats come back bit-identical, NaN/inf become null, int keys become strings, and what orjson
    cannot encode (a >64-bit int) falls back to the stdlib encoder: the same document either way."""
    import json
    import math

    from rollout.server.common import dumpb

    floats = [0.1, -1e-5, 1 / 3, 5e-324, 1.7976931348623157e308, -0.0, -12.345678901234567]
    back = json.loads(dumpb({"lp": floats}))["lp"]
    assert all(a == b and math.copysign(1, a) == math.copysign(1, b) for a, b in zip(back, floats))
    assert json.loads(dumpb([float("nan"), float("-inf"), (1, None)])) == [None, None, [1, None]]
    assert json.loads(dumpb({1: "a", "b": {2: [3]}})) == {"1": "a", "b": {"2": [3]}}
    assert json.loads(dumpb({"big": 2**70, "é": "ü"})) == {"big": 2**70, "é": "ü"}


def test_bad_tensor_payload_answers_in_sglangs_shape_too(client):
    """An undecodable /update_weights_from_tensor payload: 400 with SGLang's {"success": false, "message"} (what
    its clients read) beside this server's error naming the field."""
    r = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["AAAA"]})
    body = r.json()
    assert r.status_code == 400 and body["success"] is False and body["message"] == body["error"]["message"]
    assert body["error"]["param"] == "serialized_named_tensors"
    assert client.post("/generate", json=GOOD).status_code == 200


def test_sampling_param_error_names_the_param_field(client):
    """An Engine refusal of a sampling param carries `param` = sampling_params.<name>, not null."""
    r = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"temperature": -1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.temperature", r.text


@pytest.mark.parametrize("body", [b'{"rid": ', b"[1, 2]", b'{"rid": "\xff"}', b"[" * 100_000 + b"]" * 100_000, b"nul",
                                  b'{"rid": "a\\ud800"}'], ids=["cut", "array", "utf8", "deep", "nul", "surrogate"])
def test_generate_reads_its_body_as_the_fastapi_routes_do(client, body):
    """/generate parses its own body (a plain route): every broken body gets the status and message a FastAPI
    body route (/abort_request) gives the same bytes, its path aside."""
    headers = {"content-type": "application/json"}
    ours, theirs = client.post("/generate", content=body, headers=headers), client.post("/abort_request", content=body,
                                                                                        headers=headers)
    assert ours.status_code == theirs.status_code and ours.status_code in (400, 413), (ours.text, theirs.text)
    if ours.status_code == 400:
        assert ours.json()["error"]["message"] == theirs.json()["error"]["message"].replace("/abort_request", "/generate")
    assert client.post("/generate", json=GOOD).status_code == 200


def test_generate_with_no_body_says_the_object_is_missing(client):
    """An empty /generate body is a 400 saying the body must be a JSON object (what FastAPI's missing body read as)."""
    r = client.post("/generate", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body must be a JSON object, got null"
