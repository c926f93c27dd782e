"""The server under hostile and careless clients: cross-site requests, oversize bodies and prompts,
responses too big to build, API key from the environment. Each refusal names its flag or limit, the
engine's state is unchanged, and the next request is served."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest

from rollout.server import limits, security
from rollout.server.args import ServerArgs, parse_args
from tests.server.conftest import start_server

GOOD = dict(input_ids=[5, 6, 7], sampling_params=dict(temperature=0, max_new_tokens=2))


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


# ---- item 1: cross-site requests ----------------------------------------------------------------
def test_browser_style_simple_requests_cannot_change_state(server, client):
    """A text/plain POST to /pause_generation (415) and an image-style GET of /release_memory_occupation
    (405) are refused before they act: the engine stays unpaused and its memory resident."""
    engine = server.engine
    r = client.post("/pause_generation", content=b'{"mode": "abort"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert engine._paused is False
    r = client.get("/release_memory_occupation")
    assert r.status_code == 405 and "POST" in r.json()["error"]["message"]
    assert engine.runner.memory_saver.is_resident("weights") and engine.runner.memory_saver.is_resident("kv_cache")
    r = client.post("/generate", content=b"text=hi", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    # SGLang clients post control calls with no body at all: still served
    assert client.post("/continue_generation").status_code == 200
    assert client.post("/generate", json=GOOD).status_code == 200


def test_foreign_host_and_origin_are_refused(server, client):
    """DNS rebinding (a Host naming another site) and a foreign Origin get 403; the loopback aliases and
    the server's own origin are served."""
    port = _port(server)
    r = client.post("/generate", json=GOOD, headers={"host": f"attacker.example:{port}"})
    assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"]
    r = client.get("/get_model_info", headers={"host": "attacker.example"})
    assert r.status_code == 403
    r = client.post("/pause_generation", json={}, headers={"origin": "http://attacker.example"})
    assert r.status_code == 403 and "--allowed-origins" in r.json()["error"]["message"]
    assert server.engine._paused is False
    r = client.post("/generate", json=GOOD, headers={"origin": "null"})  # sandboxed frames, file:// pages
    assert r.status_code == 403
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert client.post("/generate", json=GOOD, headers={"host": host}).status_code == 200, host
    r = client.post("/generate", json=GOOD, headers={"origin": f"http://127.0.0.1:{port}"})
    assert r.status_code == 200


def test_allowed_hosts_and_origins_flags(server):
    """--allowed-hosts adds names to loopback's, --allowed-origins admits a listed page, '*' any origin."""
    with start_server(server.path, engine=server.engine, allowed_hosts=["rollout.internal"],
                      allowed_origins=["http://dashboard.example"]) as s, s.client() as c:
        port = _port(s)
        assert c.post("/generate", json=GOOD, headers={"host": f"rollout.internal:{port}"}).status_code == 200
        assert c.post("/generate", json=GOOD).status_code == 200  # loopback still served
        assert c.post("/generate", json=GOOD, headers={"host": "other.example"}).status_code == 403
        assert c.post("/generate", json=GOOD, headers={"origin": "http://dashboard.example"}).status_code == 200
        assert c.post("/generate", json=GOOD, headers={"origin": "http://other.example"}).status_code == 403
    with start_server(server.path, engine=server.engine, allowed_origins=["*"]) as s, s.client() as c:
        assert c.post("/generate", json=GOOD, headers={"origin": "http://other.example"}).status_code == 200


def test_host_defaults_follow_the_bound_address():
    """Bound to one address: loopback aliases plus it; bound to every interface: any name (it needs a key)."""
    assert set(security.allowed_hosts("10.1.2.3", None)) == {"127.0.0.1", "localhost", "::1", "10.1.2.3"}
    assert security.allowed_hosts("0.0.0.0", None) == ["*"]
    assert "*" not in security.allowed_hosts("0.0.0.0", ["gpu7.cluster"])


# ---- items 11 and 14: exposure warning, API key from the environment ---------------------------
def test_warning_when_exposed_without_key(caplog):
    """A server bound beyond loopback without --api-key logs a warning naming the flag; loopback or a key: none."""
    with caplog.at_level(logging.WARNING, logger="rollout.server"):
        assert security.warn_if_exposed("0.0.0.0", None)
        assert "--api-key" in caplog.text
        caplog.clear()
        assert not security.warn_if_exposed("127.0.0.1", None)
        assert not security.warn_if_exposed("::1", None)
        assert not security.warn_if_exposed("0.0.0.0", "k")
        assert caplog.text == ""


def test_api_key_from_environment(monkeypatch):
    """SGLANG_API_KEY sets the key when --api-key is absent (so it stays off the command line); the flag wins."""
    monkeypatch.setenv("SGLANG_API_KEY", "from-env")
    server_args, _ = parse_args(["--model-path", "x"])
    assert server_args.api_key == "from-env"
    server_args, _ = parse_args(["--model-path", "x", "--api-key", "flag"])
    assert server_args.api_key == "flag"
    monkeypatch.delenv("SGLANG_API_KEY")
    assert parse_args(["--model-path", "x"])[0].api_key is None


# ---- item 3 and the newcomer's 10 MB prompt: refused early, nothing tokenized on the loop ---------
def _health_latency(url: str, stop: threading.Event, worst: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            worst.append(time.perf_counter() - t0)
            time.sleep(0.02)


def test_oversize_body_refused_before_it_is_read(server):
    """A body over --max-request-bytes gets 413 naming the flag, from Content-Length or mid-stream when
    chunked, while /health keeps answering; the next request is served."""
    with start_server(server.path, engine=server.engine, max_request_bytes=1 << 20) as s, s.client() as c:
        stop, worst = threading.Event(), []
        probe = threading.Thread(target=_health_latency, args=(s.url, stop, worst))
        probe.start()
        while not worst:  # the probe is answering before the big bodies go out
            time.sleep(0.01)
        try:
            big = b'{"text": "' + b"a" * (8 << 20) + b'"}'
            r = c.post("/generate", content=big, headers={"content-type": "application/json"})
            assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

            def chunks():
                yield b'{"text": "'
                for _ in range(64):
                    yield b"a" * (64 << 10)
                yield b'"}'

            r = c.post("/generate", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        finally:
            stop.set()
            probe.join()
        assert worst and max(worst) < 2.0, max(worst)
        assert c.post("/generate", json=GOOD).status_code == 200


def test_prompt_longer_than_the_context_is_refused_without_tokenizing(server, client, monkeypatch):
    """A prompt with more characters than the context could hold is 400 naming the context length, and the
    tokenizer never sees it; a prompt that fits is tokenized in the tokenizer pool, not on the event loop."""
    tok = server.engine.tokenizer
    calls: list[str] = []
    real = tok.encode

    def spy(text):
        calls.append(threading.current_thread().name)
        return real(text)

    monkeypatch.setattr(tok, "encode", spy)
    ctx = server.engine.runner.context_len
    limit = 2 * ctx * limits.max_token_chars(tok.tokenizer)
    r = client.post("/generate", json={"text": "a" * (limit + 1), "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and f"{ctx} tokens" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "b" * (limit + 1), "max_tokens": 1})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert calls == []
    r = client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 200
    assert calls and all(name.startswith("rollout-tokenize") for name in calls), calls
    # the same output as the engine given the text itself (tokenizing in the server changes nothing)
    ref = server.engine.generate(prompt="hello", sampling_params={"max_new_tokens": 1, "temperature": 0})
    assert r.json()["output_ids"] == ref["output_ids"] and r.json()["text"] == ref["text"]


# ---- item 8: the work one request can ask for ---------------------------------------------------
def test_response_entries_are_bounded(server, client):
    """n x new tokens x (2 + top_logprobs_num) (+ the scored prompt position) over --max-response-entries
    is 400 naming the flag and the count; the same request under a larger limit is served."""
    vocab = server.engine.runner.model_config.vocab_size
    n, new = 64, 100
    body = dict(input_ids=[5, 6, 7], sampling_params=dict(n=n, max_new_tokens=new, temperature=0),
                return_logprob=True, top_logprobs_num=vocab)
    expected = n * new * (2 + vocab) + n * 1 * (1 + vocab)  # tokens + (logprob + top) per token, + prompt pos
    assert expected > ServerArgs().max_response_entries  # over the default limit
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "--max-response-entries" in msg and str(expected) in msg
    # n and max_new_tokens as integral floats (the engine reads them as ints) are counted the same
    as_floats = dict(body, sampling_params=dict(n=float(n), max_new_tokens=float(new), temperature=0))
    r = client.post("/generate", json=as_floats)
    assert r.status_code == 400 and str(expected) in r.json()["error"]["message"], r.text
    small = dict(body, sampling_params=dict(n=2, max_new_tokens=3, temperature=0), top_logprobs_num=5)
    r = client.post("/generate", json=small)
    assert r.status_code == 200 and len(r.json()) == 2
    completion = {"model": "tiny", "prompt": [5, 6, 7], "n": 4, "max_tokens": 100, "logprobs": 5}
    with start_server(server.path, engine=server.engine, max_response_entries=1000) as s, s.client() as c:
        r = c.post("/v1/completions", json=completion)
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and "--max-response-entries 1000" in msg and str(4 * 100 * 7 + 4 * 6) in msg
    assert client.post("/v1/completions", json=completion).status_code == 200


def test_get_weights_by_name_is_bounded_by_max_response_entries(server):
    """A slice of more values than --max-response-entries is 400 naming truncate_size, the count and the flag;
    a slice within the limit equals the in-process Engine's read, and the engine serves on."""
    name = "model.embed_tokens.weight"
    whole = server.engine.get_weights_by_name(name, 10**9)  # in-process, no bound: every row
    rows, cols = len(whole), len(whole[0])
    assert rows > 3
    with start_server(server.path, engine=server.engine, max_response_entries=3 * cols) as s, s.client() as c:
        r = c.post("/get_weights_by_name", json={"name": name, "truncate_size": 3})
        assert r.status_code == 200 and r.json() == whole[:3]
        for size in (4, 10**9):
            r = c.post("/get_weights_by_name", json={"name": name, "truncate_size": size})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "truncate_size", r.text
            count = min(size, rows) * cols
            assert f"hold {count} values" in err["message"] and f"--max-response-entries {3 * cols}" in err["message"]
        r = c.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 10**9})
        assert r.status_code == 200 and r.json() == server.engine.get_weights_by_name("model.norm.weight", 10**9)
        assert c.post("/generate", json=GOOD).status_code == 200


def test_n_as_a_float_counts_toward_max_n(server, client):
    """n=257.0 is 257 sequences to the --max-n limit (256 by default), not one: 400 naming the flag."""
    limit = ServerArgs().max_n
    body = dict(input_ids=[5, 6, 7], sampling_params=dict(n=float(limit + 1), max_new_tokens=1, temperature=0))
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and f"--max-n {limit}" in r.json()["error"]["message"], r.text
    r = client.post("/generate", json=dict(body, sampling_params=dict(n=2.0, max_new_tokens=1, temperature=0)))
    assert r.status_code == 200 and len(r.json()) == 2


# ---- items 7 and 10: errors that name the problem, bounded in size ------------------------------
@pytest.mark.parametrize("path,body,needle", [
    ("/generate", b"null", "JSON object, got null"),
    ("/abort_request", b"[1, 2]", "JSON object, got an array"),
    ("/generate", {"text": ["a", 5]}, "text: must be str | list[str]"),
    ("/v1/completions", {"model": "tiny", "prompt": [[1, "a"]]}, "prompt: must be str | list[str]"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"\u00b2": 1.0}}}, "ASCII digits"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"5": 1e308}}}, "logit_bias[5]"),
])
def test_errors_name_the_problem(client, path, body, needle):
    """Wrong body shapes, wrong prompt types, non-ASCII digits and overflowing biases: 400 naming what is wrong."""
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert client.post("/generate", json=GOOD).status_code == 200


def test_error_bodies_do_not_echo_huge_inputs(client):
    """A 1 MB weight name gives an error body of a few KB that still names the problem."""
    r = client.post("/get_weights_by_name", json={"name": "w" * (1 << 20)})
    assert r.status_code == 400
    assert len(r.content) < 5000 and "characters omitted" in r.json()["error"]["message"]


def test_chat_longer_than_the_context_is_refused_before_rendering(tiny_llama, monkeypatch):
    """A chat whose message contents alone have more characters than the context could hold is 400 naming
    `messages`, at once and without rendering the template; one that fits is rendered and tokenized in the
    tokenizer pool, never on the event loop (a long conversation there stalled every client)."""
    with start_server(tiny_llama, chat_template="chatml") as served, served.client() as c:
        hf = served.engine.tokenizer.tokenizer
        threads: list[str] = []
        real = hf.apply_chat_template

        def spy(*a, **kw):
            threads.append(threading.current_thread().name)
            return real(*a, **kw)

        monkeypatch.setattr(hf, "apply_chat_template", spy)
        ctx = served.engine.runner.context_len
        limit = 2 * ctx * limits.max_token_chars(hf)
        half = "a" * (limit // 2 + 1)  # two messages, each within the limit, together past it
        body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": half},
                                                                {"role": "user", "content": [{"type": "text", "text": half}]}]}
        t0 = time.perf_counter()
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert f"{ctx} tokens" in r.json()["error"]["message"] and time.perf_counter() - t0 < 2.0
        assert threads == []
        r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
        assert threads and all(name.startswith("rollout-tokenize") for name in threads), threads


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_stream_dropped_while_paused_is_aborted_before_generation_continues(server, route):
    """A streamed request whose client goes away while generation is paused (no first token yet) is aborted
    then, as an unstreamed one is: the engine holds nothing in flight, still paused, and /get_load reads 0."""
    body = {"stream": True, "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}, "input_ids": [5, 6, 7]}
    if route != "/generate":
        body = {"model": "tiny", "stream": True, "max_tokens": 50, "ignore_eos": True, "n": 2}
        body |= {"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    engine = server.engine
    with start_server(server.path, engine=engine, chat_template="plain") as s, s.client() as c:
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        try:
            with httpx.Client(base_url=s.url, timeout=httpx.Timeout(2.0, connect=5.0)) as gone:
                with pytest.raises(httpx.ReadTimeout):  # paused: no first token, so no status line yet either
                    with gone.stream("POST", route, json=body) as r:
                        r.read()
            deadline = time.monotonic() + 10
            while engine.get_server_info()["num_in_flight"]:
                assert time.monotonic() < deadline, "the dropped stream's requests are still queued"
                time.sleep(0.05)
            assert engine.get_server_info()["paused"] and c.get("/get_load").json()[0]["num_reqs"] == 0
        finally:
            assert c.post("/continue_generation", json={}).status_code == 200
        assert c.post("/generate", json=GOOD).status_code == 200


def test_health_fails_once_a_tensor_parallel_rank_died(tiny_llama):
    """A tp_size=2 server whose rank 1 was killed answers 503 on /health and /health_generate at once, while idle
    and without a request having failed first (it stayed 200: only the engine process was checked, and the
    first probe's abort counted as a token); before the kill both are 200."""
    with start_server(tiny_llama, engine_kw={"tp_size": 2}) as s, s.client() as c:
        assert c.get("/health").status_code == 200 and c.get("/health_generate").status_code == 200
        assert s.engine.fatal_problem() == ""
        proc = s.engine.runner.procs[0]
        proc.kill()
        proc.join(timeout=10)
        assert c.get("/health").status_code == 503
        assert c.get("/health_generate").status_code == 503
        assert "tensor-parallel rank 1 died" in s.engine.fatal_problem()


def test_health_generate_fails_when_its_probe_ends_as_abort(server, client, monkeypatch):
    """/health_generate's probe that comes back aborted (a step failed before anything reported why: the first
    probe after a tensor-parallel rank died) is a 503, not a token; a probe that finishes is a 200."""
    real = server.engine.async_generate

    async def aborted(**kw):
        out = await real(**kw)
        out["meta_info"]["finish_reason"] = {"type": "abort", "message": "a scheduler step failed"}
        return out

    assert client.get("/health_generate").status_code == 200
    monkeypatch.setattr(server.engine, "async_generate", aborted)
    assert client.get("/health_generate").status_code == 503
