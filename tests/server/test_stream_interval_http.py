"""--stream-interval over HTTP (the engine in its own process, launch_server's layout): /generate streams
only the due chunks (tokens 1, N+1, 2N+1, ... and the final), a request's sampling param overrides the
flag, and the last event equals the non-streamed answer.

Oracles: the non-streamed answer of the same server (greedy) and SGLang's rule written out by hand.
"""

from __future__ import annotations

import json

import pytest

from rollout.server.args import parse_args
from tests.server.conftest import start_server

PROMPT = [5, 6, 7, 8]
GREEDY = dict(temperature=0, max_new_tokens=25, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tiny_llama):
    # Single decode steps: every token is a step boundary, so SGLang's due tokens show exactly (with decode
    # blocks a due chunk goes at the first block boundary after it: tests/rollout/test_stream_interval.py).
    with start_server(tiny_llama, engine_kw={"stream_interval": 10, "num_continuous_decode_steps": 1},
                      in_child=True) as s:
        yield s


def _stream_lengths(client, body) -> tuple[list[int], dict]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return [len(c["output_ids"]) for c in chunks], chunks[-1]


def test_flag_streams_only_due_chunks(served):
    """--stream-interval 10 over 25 tokens: events only at 1, 11, 21 and 25 (the first and last always);
    the last equals the non-streamed answer, logprobs included (each delta then carries up to 10 tokens)."""
    with served.client() as c:
        body = dict(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2)
        c.post("/flush_cache")  # a prefix-cache hit may move a logprob by an ulp
        want = c.post("/generate", json=body).json()
        c.post("/flush_cache")
        lengths, last = _stream_lengths(c, body)
    assert lengths[0] == 1 and lengths[-1] == 25 and set(lengths) <= {1, 11, 21, 25}
    assert last["output_ids"] == want["output_ids"]
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs"):  # deltas of 10 tokens
        assert last["meta_info"][key] == want["meta_info"][key]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 25}


def test_request_param_overrides_the_flag(served):
    """sampling_params.stream_interval=1 on the same server streams every token again (a reader that keeps up
    sees lengths beyond the flag's due set); a bad value is a 400 naming it and the server goes on serving."""
    body = dict(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 200, "stream_interval": 1})
    with served.client() as c:
        lengths, last = _stream_lengths(c, body)
        assert lengths == sorted(lengths) and lengths[-1] == 200
        assert set(lengths) - {1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 101, 111, 121, 131, 141, 151, 161, 171, 181,
                               191, 200}
        r = c.post("/generate", json=dict(input_ids=PROMPT, sampling_params={**GREEDY, "stream_interval": 0}))
        assert r.status_code == 400 and "stream_interval" in r.text
        assert c.post("/generate", json=dict(input_ids=PROMPT, sampling_params=GREEDY)).status_code == 200


def test_launch_server_flag_reaches_the_engine():
    """`--stream-interval 3` is an Engine option the server passes on (SGLang's flag name)."""
    _, kw = parse_args(["--model-path", "m", "--stream-interval", "3"])
    assert kw["stream_interval"] == 3


@pytest.mark.parametrize("in_child", [True, False], ids=["engine-process", "engine-in-process"])
def test_stream_output_flag_streams_disjoint_output_ids(tiny_llama, in_child):
    """--stream-output (SGLang's): /generate chunks carry only their new output_ids, which join (n=2 included) to
    the non-streamed answer's, however the server coalesced them; text stays cumulative; the OpenAI routes'
    deltas are unchanged by it (their streamed text equals the non-streamed text)."""
    _, kw = parse_args(["--model-path", str(tiny_llama), "--stream-output"])
    assert kw["stream_output"] is True
    with start_server(tiny_llama, engine_kw={"stream_output": True}, in_child=in_child) as s, s.client() as c:
        body = dict(input_ids=PROMPT, sampling_params={**GREEDY, "n": 2, "temperature": 1.0, "seed": 5})
        want = c.post("/generate", json=body).json()
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        joined: dict[int, list[int]] = {}
        for ch in chunks:
            joined.setdefault(ch["index"], []).extend(ch["output_ids"])
        assert joined == {i: w["output_ids"] for i, w in enumerate(want)}
        assert {ch["index"]: ch for ch in chunks}[1]["text"] == want[1]["text"]
        comp = dict(model="tiny", prompt=PROMPT, max_tokens=25, temperature=0, ignore_eos=True)
        whole = c.post("/v1/completions", json=comp).json()["choices"][0]["text"]
        with c.stream("POST", "/v1/completions", json={**comp, "stream": True}) as r:
            pieces = [json.loads(line[6:])["choices"] for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(ch[0]["text"] for ch in pieces if ch) == whole


def test_coalesce_joins_segments_into_the_newest_chunk():
    """coalesce keeps each sequence's newest chunk; with segments (--stream-output) that chunk carries every
    dropped chunk's output_ids before its own, in order, so no id is lost when a stream falls behind."""
    from rollout.server.native import coalesce

    def chunks():
        return [{"index": 0, "output_ids": [1]}, {"index": 1, "output_ids": [7]}, {"index": 0, "output_ids": [2, 3]}]

    assert coalesce(chunks()) == [{"index": 1, "output_ids": [7]}, {"index": 0, "output_ids": [2, 3]}]
    assert coalesce(chunks(), segments=True) == [{"index": 1, "output_ids": [7]}, {"index": 0, "output_ids": [1, 2, 3]}]
