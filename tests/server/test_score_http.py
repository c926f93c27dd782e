"""/v1/score over HTTP (SGLang's scoring route): the scores equal Engine.score's, served in-process and from
the engine process; a bad argument is a 400 naming it and the server keeps serving."""

from __future__ import annotations

import pytest
import torch

from rollout import Engine
from tests.server.conftest import ENGINE_KW, start_server

BODY = {"query": [5, 9, 12], "items": [[30, 31], [44]], "label_token_ids": [3, 17, 40], "apply_softmax": True}


@pytest.mark.parametrize("in_child", [False, True], ids=["in-process", "engine-process"])
def test_score_route_equals_engine_score(tiny_llama, in_child):
    """The route's scores are Engine.score's on the same checkpoint, in the response shape SGLang gives."""
    with Engine(str(tiny_llama), **ENGINE_KW) as engine:
        want = engine.score(**BODY)
    with start_server(tiny_llama, in_child=in_child) as s, s.client() as c:
        r = c.post("/v1/score", json={**BODY, "model": "any"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "scoring" and len(body["scores"]) == 2
        torch.testing.assert_close(torch.tensor(body["scores"]), torch.tensor(want), atol=1e-5, rtol=1e-4)
        bad = c.post("/v1/score", json={**BODY, "label_token_ids": [10**6]})
        assert bad.status_code == 400 and "label_token_ids" in bad.text, bad.text
        wrong_type = c.post("/v1/score", json={**BODY, "apply_softmax": "yes"})
        assert wrong_type.status_code in (400, 422) and "apply_softmax" in wrong_type.text, wrong_type.text
        assert c.post("/v1/score", json=BODY).status_code == 200


def test_score_route_keeps_the_server_limits(tiny_llama):
    """More items than --max-n is a 400 naming the limit; text items are tokenized as Engine.score does."""
    with start_server(tiny_llama, max_n=2) as s, s.client() as c:
        r = c.post("/v1/score", json={**BODY, "items": [[1], [2], [3]]})
        assert r.status_code == 400 and "--max-n 2" in r.text, r.text
        r = c.post("/v1/score", json={"query": "hello", "items": [" world", "!"], "label_token_ids": [3, 4]})
        assert r.status_code == 200, r.text
        got = r.json()["scores"]
        assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["prompt_tokens"] > 0
    with Engine(str(tiny_llama), **ENGINE_KW) as engine:
        want = engine.score(query="hello", items=[" world", "!"], label_token_ids=[3, 4])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)
