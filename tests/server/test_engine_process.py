"""The default server layout: HTTP in this process, the Engine in a child process (EngineClient).

One child-process server per module (`split`, over the tiny Llama) answers for the imported tests of
the in-process server (their invariants must hold in both layouts) and for the tests here, whose oracle
is an in-process Engine on the same checkpoint (`oracle`) and HF's forward for greedy tokens. Faults
(a child that dies, SIGTERM, SIGKILL of the server, an engine that fails to build) get their own
processes. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from rollout import Engine
from rollout.launch_server import ServerThread, free_port
from rollout.server import ServerArgs, create_app
from rollout.server.engine_client import EngineClient
from tests.checkpoints import load_hf_model
from tests.server.conftest import ENGINE_KW, TIMEOUT, start_server

# The in-process server's tests, run again here against the child-process server (this module's
# `server`/`wserver` fixtures below replace conftest's for them).
from tests.server.test_bad_requests import test_bad_request_is_4xx_naming_the_field  # noqa: F401
from tests.server.test_native import (  # noqa: F401
    test_disconnect_mid_stream_aborts_and_frees_kv,
    test_generate_stream_sse,
    test_info_and_health,
    test_metrics,
    test_pause_continue_abort_flush,
    test_pause_modes_resume_to_same_tokens,
    test_release_resume_kv_cache,
    test_weight_version_and_get_weights_by_name,
)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 40, 41, 42] * 3]
GREEDY = dict(temperature=0, max_new_tokens=8, ignore_eos=True)
START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def split(tiny_llama):
    with start_server(tiny_llama, in_child=True, chat_template="plain") as served:
        yield served


@pytest.fixture(scope="module")
def server(split):
    return split


@pytest.fixture
def client(split):
    with split.client() as c:
        yield c


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    with Engine(str(tiny_llama), **ENGINE_KW) as engine:
        yield engine


def _lp(meta, key="output_token_logprobs"):
    return [(e[0], e[1]) for e in meta[key]]


def _wait(pred, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_generate_equals_in_process_engine_and_hf(split, client, oracle, tiny_llama):
    """Over the child process, /generate returns the in-process Engine's tokens, text and logprobs (output,
    top, prompt) exactly, for a batch, a text prompt, seeded sampling and n > 1; greedy tokens equal HF's."""
    sampled = dict(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=6, ignore_eos=True)
    cases = [
        dict(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2),
        dict(text="The quick brown fox", sampling_params=GREEDY, return_logprob=True),
        dict(input_ids=PROMPTS[0], sampling_params=sampled, return_logprob=True),
        dict(input_ids=PROMPTS[2], sampling_params={**sampled, "n": 3}, return_logprob=True, logprob_start_len=0,
             top_logprobs_num=3, token_ids_logprob=[5, 6]),
    ]
    for body in cases:
        assert client.post("/flush_cache").status_code == 200
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        oracle.flush_cache()
        want = oracle.generate(**{("prompt" if k == "text" else k): v for k, v in body.items()})
        got, want = (r.json(), want) if isinstance(want, list) else ([r.json()], [want])
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g["output_ids"] == w["output_ids"] and g["text"] == w["text"]
            gm, wm = g["meta_info"], w["meta_info"]
            assert gm["finish_reason"] == wm["finish_reason"] and gm["prompt_tokens"] == wm["prompt_tokens"]
            for key in ("output_token_logprobs", "input_token_logprobs"):
                assert _lp(gm, key) == _lp(wm, key), key
            for key in ("output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs",
                        "input_token_ids_logprobs"):
                assert key in gm or key not in wm, key
                if key in wm:
                    strip = [None if s is None else [(lp, t) for lp, t, _ in s] for s in wm[key]]
                    assert [None if s is None else [(lp, t) for lp, t, _ in s] for s in gm[key]] == strip, key
    if len(set(map(tuple, (o["output_ids"] for o in got)))) < 2:
        pytest.fail("n=3 seeded samples were identical: the seeds did not reach the child")
    hf = load_hf_model(tiny_llama)
    greedy = client.post("/generate", json=dict(input_ids=PROMPTS, sampling_params=GREEDY)).json()
    assert [o["output_ids"] for o in greedy] == [_hf_greedy(hf, p, GREEDY["max_new_tokens"]) for p in PROMPTS]


def test_stream_first_event_arrives_before_the_last(split):
    """A stream's first event reaches the client while the request still runs (TTFT < total time), the
    events are cumulative, and the last equals the non-streamed answer."""
    body = dict(input_ids=PROMPTS[1], sampling_params=dict(temperature=0, max_new_tokens=200, ignore_eos=True))
    with split.client() as c:
        want = c.post("/generate", json=body).json()
        t0 = time.perf_counter()
        times, chunks = [], []
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter() - t0)
                    chunks.append(json.loads(line[6:]))
    assert len(chunks) >= 2 and times[0] < times[-1]
    assert chunks[0]["meta_info"]["finish_reason"] is None and len(chunks[0]["output_ids"]) < 200
    assert all(a["output_ids"] == b["output_ids"][: len(a["output_ids"])] for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1]["output_ids"] == want["output_ids"] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_dropped_non_streamed_request_is_aborted_in_the_child(split):
    """A client that goes away before its non-streamed answer: the request is aborted in the engine process
    (the engine is paused, so only the abort can take it out of flight) and serving goes on."""
    import socket

    engine = split.engine
    host, port = split.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(dict(input_ids=PROMPTS[0], sampling_params=dict(max_new_tokens=100, ignore_eos=True))).encode()
    engine.pause_generation(mode="in_place")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
            _wait(lambda: engine.get_server_info()["num_in_flight"] == 1, what="the request to be queued")
        _wait(lambda: engine.get_server_info()["num_in_flight"] == 0, what="the dropped request to be aborted")
    finally:
        engine.continue_generation()
    assert engine.flush_cache()
    with split.client() as c:
        assert c.post("/generate", json=dict(input_ids=PROMPTS[1], sampling_params=GREEDY)).status_code == 200


def test_bad_input_gets_the_in_process_servers_400(split, oracle, tiny_llama):
    """A request the engine refuses gets the same status and body from both layouts, and the child server
    goes on serving."""
    bodies = [dict(input_ids=[5, 99999]), dict(input_ids=[[5, 6], []]),
              dict(input_ids=[5, 6], rid=["a", "b"], stream=True),
              dict(input_ids=[5, 6], return_logprob=True, top_logprobs_num=10**6),
              dict(input_ids=[5, 6], sampling_params=dict(stop_token_ids="x")),
              dict(input_ids=[5, 6], image_data="cat.png"), dict(input_ids=[5, 6], routed_dp_rank=1)]
    with start_server(tiny_llama, engine=oracle) as inproc, inproc.client() as want_c, split.client() as got_c:
        for body in bodies:
            want, got = want_c.post("/generate", json=body), got_c.post("/generate", json=body)
            assert want.status_code == 400, want.text
            assert (got.status_code, got.json()) == (want.status_code, want.json()), got.text
        assert got_c.post("/generate", json=dict(input_ids=PROMPTS[0], sampling_params=GREEDY)).status_code == 200


def test_openai_routes_equal_the_in_process_server(split, oracle, tiny_llama):
    """/v1/completions (streamed, n=2 seeded, logprobs) and /v1/chat/completions answer the same choices
    from both layouts (chat templates and detokenization now run in the HTTP process)."""
    completion = dict(model="tiny", prompt=["The sun", "Birds"], max_tokens=5, temperature=0, logprobs=2,
                      ignore_eos=True)
    sampled = dict(model="tiny", prompt="Once", max_tokens=6, n=2, seed=11, temperature=1.0, ignore_eos=True)
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=5, temperature=0,
                ignore_eos=True)

    def answers(c: httpx.Client) -> list:
        out = []
        for path, body in (("/v1/completions", completion), ("/v1/completions", sampled),
                           ("/v1/chat/completions", chat)):
            c.post("/flush_cache")
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            out.append([{k: v for k, v in ch.items()} for ch in r.json()["choices"]])
        c.post("/flush_cache")
        with c.stream("POST", "/v1/completions", json={**completion, "stream": True}) as r:
            deltas = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        text = {0: "", 1: ""}
        for d in deltas:
            for ch in d["choices"]:
                text[ch["index"]] += ch["text"]
        out.append(text)
        return out

    with start_server(tiny_llama, engine=oracle, chat_template="plain") as inproc, inproc.client() as want_c, \
            split.client() as got_c:
        want, got = answers(want_c), answers(got_c)
    assert got == want
    assert [want[3][0], want[3][1]] == [c["text"] for c in want[0]]  # the stream adds up to the plain answer


def test_weight_version_and_adapter_list_follow_the_child(client):
    """What the parent serves from its cache (weight version, model path, loaded adapters) and each output's
    versions (the one at submission too) are the child's after each call; the child's torch threads are the ones an in-process engine would get."""
    assert client.post("/update_weight_version", json={"new_version": "v7"}).status_code == 200
    assert client.get("/get_weight_version").json()["weight_version"] == "v7"
    assert client.get("/get_model_info").json()["weight_version"] == "v7"
    out = client.post("/generate", json=dict(input_ids=PROMPTS[0], sampling_params=GREEDY)).json()
    assert out["meta_info"]["weight_version"] == "v7"
    assert out["meta_info"]["weight_version_start"] == "v7"  # set in the child at submission
    assert out["meta_info"]["weight_versions"] == [{"start": 0, "end": 8, "version": "v7"}]
    assert client.get("/get_server_info").json()["weight_version"] == "v7"
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_drain_reaches_the_child(client):
    """/drain asks the engine process: idle, it succeeds at once; a request streaming in the child keeps
    it from succeeding until the request is done."""
    assert client.post("/drain", json={"timeout": 5}).json() == {"success": True, "remaining_requests": 0}
    body = dict(input_ids=PROMPTS[0], sampling_params=dict(GREEDY, max_new_tokens=200), stream=True)
    with client.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        next(lines)  # the first token: the request is in flight in the child
        assert client.post("/drain", json={"timeout": 0}).json()["remaining_requests"] == 1
        for _ in lines:
            pass
    assert client.post("/drain", json={}).json() == {"success": True, "remaining_requests": 0}


def test_engine_process_froze_its_heap_and_freeze_gc_reaches_both(split, client):
    """The engine process froze its start-up objects once its Engine was built (so the collector never
    walks torch's and the model's objects again); /freeze_gc freezes this process and the child."""
    import gc

    from rollout.server import gc_freeze

    before = split.engine.run_on_engine(gc_freeze.frozen_count)
    assert before > 1000  # torch, transformers and the Engine: hundreds of thousands here
    junk = [[i] for i in range(5000)]  # alive now: frozen by the call below
    assert client.post("/freeze_gc").status_code == 200
    assert client.get("/freeze_gc").status_code == 200  # SGLang answers both
    assert gc.get_freeze_count() >= len(junk)
    assert split.engine.run_on_engine(gc_freeze.frozen_count) >= before


def test_child_threads_match_in_process_engine(split):
    """The engine process runs as many torch threads as an Engine in the server's own process would."""
    assert split.engine.engine_num_threads == torch.get_num_threads()


def test_blocking_call_on_the_reading_loop_is_refused(split):
    """The app reads the engine's messages on its loop; a blocking call made on that loop raises at once,
    naming the method, instead of waiting for an answer the blocked loop could never read."""
    engine = split.engine
    loop = engine._reader.loop
    assert loop is not None  # attached by the app's lifespan

    async def call():
        return engine.get_server_info()

    with pytest.raises(RuntimeError, match="get_server_info blocks"):
        asyncio.run_coroutine_threadsafe(call(), loop).result(10)
    assert engine.get_server_info()["num_in_flight"] == 0  # from a thread it is answered


def test_finish_observer_counts_requests(client):
    """/metrics' per-request histograms (fed by the child's finish events) count each finished request once."""
    def count() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith("sglang:e2e_request_latency_seconds_count"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no e2e latency histogram in /metrics")

    before = count()
    assert client.post("/generate", json=dict(input_ids=PROMPTS, sampling_params=GREEDY)).status_code == 200
    assert count() == before + len(PROMPTS)


# ---- faults ----------------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids += [int(k) for k in pathlib.Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return kids + [d for k in kids for d in _descendants(k)]


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it runs nothing and holds no memory)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _launch(path, *flags) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rollout.launch_server", "--model-path", str(path), "--port",
                             str(port), "--max-total-tokens", "1024", "--disable-cuda-graph", "--no-access-log",
                             "--log-level", "warning", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, port


def _wait_ready(proc: subprocess.Popen, port: int) -> None:
    deadline, lines = time.monotonic() + START_TIMEOUT_S, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "".join(lines)
        lines.append(line)
        if f"ready at http://127.0.0.1:{port}" in line:
            return
    raise AssertionError("".join(lines))


def test_reading_moves_to_the_app_loop_and_back(tiny_llama, oracle):
    """While an app serves an EngineClient its loop reads the pipe; once the app stops, the reader thread
    does again and the client still answers (a generate from a loop of this thread equals the in-process
    Engine's greedy tokens), and a second app can take the pipe over."""
    client = EngineClient.spawn({"model_path": str(tiny_llama), **ENGINE_KW}, start_timeout_s=START_TIMEOUT_S)
    body = dict(input_ids=PROMPTS[2], sampling_params=GREEDY)
    greedy_ids = oracle.generate(**body)["output_ids"]
    try:
        for _ in range(2):
            args = ServerArgs(port=free_port())
            thread = ServerThread(create_app(client, args), args).start()
            try:
                assert client._reader.loop is not None
                with httpx.Client(base_url=thread.url, timeout=TIMEOUT) as c:
                    assert c.post("/generate", json=body).json()["output_ids"] == greedy_ids
            finally:
                thread.stop()
            assert client._reader.loop is None
            assert asyncio.run(client.async_generate(**body))["output_ids"] == greedy_ids
    finally:
        client.shutdown()


def test_dead_child_ends_requests_with_an_error(tiny_llama):
    """The engine process dying mid-stream ends the stream with finish_reason abort naming the cause (no
    hang), then /health is 503 and new requests get 503."""
    client = EngineClient.spawn({"model_path": str(tiny_llama), **ENGINE_KW}, start_timeout_s=START_TIMEOUT_S)
    args = ServerArgs(port=free_port())
    thread = ServerThread(create_app(client, args), args).start()
    try:
        with httpx.Client(base_url=thread.url, timeout=TIMEOUT) as c:
            body = dict(input_ids=PROMPTS[0], stream=True, sampling_params=dict(max_new_tokens=5000, ignore_eos=True))
            with c.stream("POST", "/generate", json=body) as r:
                events = (line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]")
                last = json.loads(next(events))
                os.kill(client.pid, signal.SIGKILL)
                for event in events:
                    last = json.loads(event)
            reason = last["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "engine process died" in reason["message"], last["meta_info"]
            assert 0 <= last["meta_info"]["e2e_latency"] < 300  # ended here: it was -(the clock's reading)
            _wait(lambda: c.get("/health").status_code == 503, what="/health to report the dead engine")
            r = c.post("/generate", json=dict(input_ids=PROMPTS[1], sampling_params=GREEDY))
            assert r.status_code == 503 and "engine process died" in r.json()["error"]["message"]
            # Every route that needs the engine says so with a 503 naming the cause (a 500 before), and the
            # load report does not repeat the dead engine's last numbers to a router.
            for method, path, json_body in (("POST", "/flush_cache", None), ("GET", "/get_server_info", None),
                                            ("GET", "/metrics", None), ("GET", "/get_load", None),
                                            ("GET", "/v1/loads", None), ("POST", "/continue_generation", {}),
                                            ("POST", "/freeze_gc", {}),
                                            ("POST", "/update_weights_from_disk", {"model_path": str(tiny_llama)})):
                r = c.request(method, path, json=json_body)
                assert r.status_code == 503 and "engine process died" in r.json()["error"]["message"], (path, r.text)
    finally:
        thread.stop()
        client.shutdown()
    assert not client._process.is_alive()


def test_sigterm_stops_server_and_engine_process(tiny_llama):
    """SIGTERM on `launch_server`: it exits 0 and leaves no process behind (engine process included)."""
    proc, port = _launch(tiny_llama)
    try:
        _wait_ready(proc, port)
        kids = _descendants(proc.pid)
        assert kids, "the server started no engine process"
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60, json=dict(input_ids=PROMPTS[0],
                                                                                   sampling_params=GREEDY))
        assert r.status_code == 200 and len(r.json()["output_ids"]) == GREEDY["max_new_tokens"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _wait(lambda: all(_gone(k) for k in kids), what="the engine process to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def test_killed_server_leaves_no_orphan(tiny_llama):
    """SIGKILL of the server process (no cleanup runs there): the engine process sees its pipe close and exits."""
    proc, port = _launch(tiny_llama)
    try:
        _wait_ready(proc, port)
        kids = _descendants(proc.pid)
        assert kids
        proc.kill()
        proc.wait(10)
        _wait(lambda: all(_gone(k) for k in kids), timeout_s=60, what="the orphaned engine process to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def test_engine_that_fails_to_build_stops_the_server(tiny_llama, tmp_path):
    """An engine that cannot be built (unknown architecture) makes launch_server exit 1 with the engine's
    reason, without serving."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    proc, _ = _launch(bad)
    try:
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1, out
    assert "the engine failed to start" in out and "NoSuchForCausalLM" in out and "ready at" not in out, out


# ---- weights (last: they leave the server on other weights) ---------------------------------------
@pytest.fixture(scope="module")
def wserver(split):
    return split


@pytest.fixture(scope="module")
def ckpts(tiny_llama, ckpt_factory):
    return tiny_llama, ckpt_factory("llama", seed=1)


from tests.server.test_weights import (  # noqa: E402, F401  (collected last, see above)
    expected,
    test_update_from_disk,
    test_update_from_tensor_plain_and_bucketed,
    wclient,
)


def test_get_weights_by_name_bound_crosses_the_pipe(split):
    """max_values reaches the engine process: over it, the ValueError naming truncate_size comes back as
    raised there (its class kept, so the HTTP route names its flag); within it, the same rows as without."""
    from runner.weights.routes import TooManyValues

    name = "model.embed_tokens.weight"
    rows = split.engine.get_weights_by_name(name, 4)
    cols = len(rows[0])
    assert split.engine.get_weights_by_name(name, 4, max_values=4 * cols) == rows
    with pytest.raises(TooManyValues, match=f"first 5 rows of '{name}' hold {5 * cols} values"):
        split.engine.get_weights_by_name(name, 5, max_values=4 * cols)
