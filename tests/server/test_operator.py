"""What an operator of the server sees: chat-template choice, flags named in refusals, /metrics latency
histograms and finish-reason counts, and OpenAI field names in OpenAI errors."""

from __future__ import annotations

import logging

import jinja2
import pytest

from rollout.server import ServerArgs, create_app
from rollout.server.chat_template import BUILTIN
from tests.server.conftest import metric_samples as _samples
from tests.server.conftest import metric_value as _metric
from tests.server.conftest import start_server

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]


# ---- chat template ------------------------------------------------------------------------------
def test_chat_without_any_template_is_refused_naming_the_flag(client):
    """A tokenizer without a chat template and no --chat-template: 400 naming --chat-template (no silent
    plain prompt); the server keeps serving."""
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "--chat-template" in r.json()["error"]["message"]
    assert client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


@pytest.mark.parametrize("kind", ["file", "name"])
def test_chat_template_flag_file_or_name(server, tmp_path, kind):
    """--chat-template as a Jinja file or a built-in name: the prompt is that template rendered by jinja2
    itself, tokenized; the answer equals Engine.generate on those ids."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    value = str(tmp_path / "t.jinja") if kind == "file" else "chatml"
    if kind == "file":
        (tmp_path / "t.jinja").write_text(template)
    else:
        template = BUILTIN["chatml"]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # HF's rendering options
    text = env.from_string(template).render(messages=MSGS, add_generation_prompt=True)
    ids = server.engine.tokenizer.tokenizer.encode(text, add_special_tokens=False)
    sp = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    server.engine.flush_cache()
    want = server.engine.generate(input_ids=ids, sampling_params=sp)
    with start_server(server.path, engine=server.engine, chat_template=value) as s, s.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 4,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == want["text"]
        assert body["usage"]["prompt_tokens"] == len(ids)


def test_chat_template_choice_is_logged_and_bad_values_refused(server, caplog):
    """create_app logs which template it uses; a value that is no file, name or template is refused
    naming the flag at start-up."""
    with caplog.at_level(logging.INFO, logger="rollout.server"):
        apps = [create_app(server.engine, ServerArgs(chat_template="plain")), create_app(server.engine, ServerArgs())]
    for app in apps:  # never served: detach their metrics from the shared engine
        server.engine.remove_finish_observer(app.state.request_metrics)
    logged = [r.getMessage() for r in caplog.records if r.name == "rollout.server"]
    assert any("chat template: built-in 'plain'" in m for m in logged), logged
    assert any("chat template: none" in m and "refused" in m for m in logged), logged
    with pytest.raises(ValueError, match="--chat-template 'no/such/file.jinja'"):
        create_app(server.engine, ServerArgs(chat_template="no/such/file.jinja"))


# ---- flags named in refusals --------------------------------------------------------------------
def test_release_without_memory_saver_names_the_flag(server):
    """/release_memory_occupation and /resume_memory_occupation on a server started without
    --enable-memory-saver: 400 naming the flag; nothing is released and the server keeps serving."""
    with start_server(server.path, engine_kw={"enable_memory_saver": False}) as s, s.client() as c:
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            r = c.post(path, json={})
            assert r.status_code == 400, r.text
            assert "--enable-memory-saver" in r.json()["error"]["message"]
        assert s.engine.runner.memory_saver.is_resident("weights")
        r = c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


@pytest.mark.parametrize("route,body,field", [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "min_tokens": -2}, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "min_tokens": 5, "stream": True},
     "min_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "max_completion_tokens": 1, "min_tokens": 3},
     "min_tokens"),
    # Sampling fields the engine refuses: param is the top-level OpenAI field, not "sampling_params.<name>".
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "top_k": 0}, "top_k"),
])
def test_openai_errors_name_openai_fields(server, route, body, field):
    """An OpenAI route refusing a value names the OpenAI field (and sets param), not the engine's key."""
    with start_server(server.path, engine=server.engine, chat_template="plain") as s, s.client() as c:
        r = c.post(route, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert field in err["message"] and "max_new_tokens" not in err["message"]
        assert "min_new_tokens" not in err["message"]
        assert err["param"] == field


# ---- /metrics -----------------------------------------------------------------------------------
def test_metrics_latency_histograms_and_finish_reasons(server):
    """After a set of requests, /metrics counts them by finish reason as the clients saw them, its e2e
    histogram sums the e2e_latency each output reported, TTFT and inter-token counts match the tokens
    generated, and /get_server_info says enable_metrics: true."""
    with start_server(server.path, engine=server.engine) as s, s.client() as c:
        reasons, e2e, tokens, e2es = {}, 0.0, [], []
        bodies = [{"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
                  {"input_ids": [9, 4], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}},
                  {"input_ids": [8, 8, 8, 3], "sampling_params": {"max_new_tokens": 0}},
                  {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "stop_token_ids": list(range(
                      s.engine.runner.model_config.vocab_size))}}]  # every token stops: finish_reason stop
        for body in bodies:
            out = c.post("/generate", json=body).json()
            meta = out["meta_info"]
            reasons[meta["finish_reason"]["type"]] = reasons.get(meta["finish_reason"]["type"], 0) + 1
            e2e += meta["e2e_latency"]
            e2es.append(meta["e2e_latency"])
            tokens.append(len(out["output_ids"]))
        assert set(reasons) >= {"length", "stop"}, reasons
        samples = _samples(c.get("/metrics").text)
        for reason in ("stop", "length", "abort"):
            assert _metric(samples, "rollout:finished_requests_total", finish_reason=reason) == reasons.get(reason, 0)
        assert _metric(samples, "sglang:num_requests_total") == len(bodies)
        assert _metric(samples, "sglang:num_aborted_requests_total") == reasons.get("abort", 0)
        assert {tuple(k for k, _ in lab) for (n, lab), _ in samples.items() if n == "sglang:num_requests_total"} \
            == {("model_name",)}  # SGLang's labels: sglang-router merges workers' metrics by them
        assert _metric(samples, "sglang:e2e_request_latency_seconds_count") == len(bodies)
        assert _metric(samples, "sglang:e2e_request_latency_seconds_sum") == pytest.approx(e2e, rel=1e-9)
        buckets = {float(dict(lab)["le"]): v for (n, lab), v in samples.items()
                   if n == "sglang:e2e_request_latency_seconds_bucket"}
        assert len(buckets) > 5 and buckets[float("inf")] == len(bodies)
        for bound, count in buckets.items():  # cumulative "<= bound", against each reported latency
            assert count == sum(1 for x in e2es if x <= bound), bound
        assert _metric(samples, "sglang:time_to_first_token_seconds_count") == sum(1 for n in tokens if n)
        assert 0 < _metric(samples, "sglang:time_to_first_token_seconds_sum") <= e2e
        assert _metric(samples, "sglang:inter_token_latency_seconds_count") == sum(max(0, n - 1) for n in tokens)
        assert c.get("/get_server_info").json()["enable_metrics"] is True
