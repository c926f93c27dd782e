"""The official openai client against /v1/*, checked against Engine.generate on the same prompts."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import openai
import pytest

from rollout.server.openai_api import render_chat
from tests.server.conftest import start_server

IGN = {"ignore_eos": True}  # fixed lengths: random weights often sample EOS early


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0) as c:
        yield c


def _engine(server, prompt, **sp):
    server.engine.flush_cache()
    return server.engine.generate(prompt=prompt, sampling_params=sp, return_logprob=True, top_logprobs_num=2)


def test_models(server, oai):
    """/v1/models lists the served model name."""
    assert [m.id for m in oai.models.list().data] == ["tiny"]


def test_completion_equals_engine(server, oai):
    """/v1/completions: greedy text, logprobs, finish_reason and usage equal Engine.generate's."""
    server.engine.flush_cache()
    r = oai.completions.create(model="tiny", prompt="Hello, world", max_tokens=6, temperature=0, logprobs=2,
                               extra_body=IGN)
    want = _engine(server, "Hello, world", max_new_tokens=6, temperature=0, ignore_eos=True)
    c = r.choices[0]
    assert c.text == want["text"] and c.finish_reason == "length"
    assert c.logprobs.token_logprobs == [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
    assert [max(d.values()) for d in c.logprobs.top_logprobs] == \
           [step[0][0] for step in want["meta_info"]["output_top_logprobs"]]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want["meta_info"]["prompt_tokens"], 6)


def test_completion_stream_n_seed(server, oai):
    """Streaming deltas concatenate to the non-streamed text; n choices with a seed are reproducible; usage counts all."""
    kw = dict(model="tiny", prompt=["The sun", "Birds"], max_tokens=5, temperature=0, extra_body=IGN)
    plain = oai.completions.create(**kw)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.text for c in plain.choices]
    assert usage.completion_tokens == 10 and usage.prompt_tokens == plain.usage.prompt_tokens
    a = oai.completions.create(model="tiny", prompt="Once", max_tokens=6, n=3, seed=11, temperature=1.0,
                               extra_body=IGN)
    b = oai.completions.create(model="tiny", prompt="Once", max_tokens=6, n=3, seed=11, temperature=1.0,
                               extra_body=IGN)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3
    streamed = {k: "" for k in range(3)}  # the same seeded choices streamed: each choice seeded as unstreamed
    for chunk in oai.completions.create(model="tiny", prompt="Once", max_tokens=6, n=3, seed=11, temperature=1.0,
                                        extra_body=IGN, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert [streamed[k] for k in range(3)] == [c.text for c in a.choices]
    assert a.usage.completion_tokens == 18 and a.usage.prompt_tokens == _engine(server, "Once", max_new_tokens=1)[
        "meta_info"]["prompt_tokens"]


def test_completion_stop(server, oai):
    """A stop string cuts the text before it and finishes with finish_reason stop, streamed or not."""
    full = oai.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                  extra_body=IGN).choices[0].text
    stop = full[3:5]
    assert stop and stop not in full[:3]
    r = oai.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                               extra_body=IGN)
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=[stop], stream=True,
        extra_body=IGN) if c.choices)
    assert streamed == r.choices[0].text


def test_completion_logprob_offsets_are_the_same_streamed(server, oai):
    """text_offset counts each token's text from 0, and a stream with a stop string that never matches (so
    each chunk holds text back) reports the same tokens and offsets as the non-streamed answer."""
    kw = dict(model="tiny", prompt="Hello", max_tokens=10, temperature=0, logprobs=1, stop=["\x01never"],
              extra_body=IGN)
    plain = oai.completions.create(**kw).choices[0].logprobs
    offsets, at = [], 0
    for token in plain.tokens:  # the oracle: a running sum of the token texts
        offsets.append(at)
        at += len(token)
    assert plain.text_offset == offsets
    assert _streamed_tokens_and_offsets(oai, kw) == (plain.tokens, plain.text_offset)


def _streamed_tokens_and_offsets(oai, kw: dict) -> tuple[list[str], list[int]]:
    """The logprobs tokens and text offsets of a streamed completion, concatenated over its chunks."""
    tokens, offsets = [], []
    for chunk in oai.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                offsets += ch.logprobs.text_offset
    return tokens, offsets


def test_completion_logprob_tokens_join_into_the_text_across_multibyte_characters(server, oai):
    """A prompt whose characters span several byte tokens, echoed with logprobs, and outputs forced onto the
    bytes of 'é' (logit_bias): each token's text is its piece of the decoded text ('' for a byte that completes
    no character, the character at the byte that does), so the tokens join into the response text and every
    text_offset points at its token's text there (the bytes forced in any order leave replacement characters,
    which the tokens carry too); streamed, the same tokens and offsets."""
    tok = server.engine.tokenizer.tokenizer
    prompt = "a\u00e9\u20acb"
    ids = tok.encode(prompt)
    assert len(ids) > len(prompt), "the test tokenizer should split these characters into byte tokens"
    e_bytes = tok.encode("\u00e9", add_special_tokens=False)
    assert len(e_bytes) == 2
    for kw in (dict(prompt=prompt, max_tokens=2, echo=True),
               dict(prompt="Hi", max_tokens=4, logit_bias={str(t): 100 for t in e_bytes})):
        kw = dict(model="tiny", temperature=0, logprobs=1, extra_body=IGN, **kw)
        whole = oai.completions.create(**kw).choices[0]
        lp = whole.logprobs
        assert "".join(lp.tokens) == whole.text, (lp.tokens, whole.text)
        assert all(whole.text[o:].startswith(t) for t, o in zip(lp.tokens, lp.text_offset))
        if kw.get("echo"):  # the prompt's characters are whole: a byte that completes none has no text
            assert "\ufffd" not in whole.text and "" in lp.tokens and "\u20ac" in lp.tokens
        assert _streamed_tokens_and_offsets(oai, kw) == (lp.tokens, lp.text_offset)


def test_completion_logprob_pieces_follow_skip_special_tokens_and_greedy_tops_are_single(server, oai):
    """With skip_special_tokens=false and eos forced, the text keeps each "</s>" and the tokens and offsets do
    too (the tokens join into the text); with eos skipped it takes no characters. Greedy with logprobs=1, each
    position's top_logprobs is the one sampled token, under its text in `tokens`, also for a byte token
    completing no character (it was listed twice, under its piece and under U+FFFD)."""
    tok = server.engine.tokenizer.tokenizer
    eos = tok.eos_token_id
    for skip in (False, True):
        c = oai.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=1,
                                   logit_bias={str(eos): 100},
                                   extra_body={**IGN, "skip_special_tokens": skip}).choices[0]
        lp = c.logprobs
        assert c.text == ("" if skip else tok.eos_token * 3)
        assert "".join(t for t in lp.tokens if not skip) == c.text
        assert lp.text_offset == ([0, 0, 0] if skip else [0, len(tok.eos_token), 2 * len(tok.eos_token)])
    e_bytes = tok.encode("\u00e9", add_special_tokens=False)
    lp = oai.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, logprobs=1,
                                logit_bias={str(t): 100 for t in e_bytes}, extra_body=IGN).choices[0].logprobs
    assert all(list(top) == [token] for token, top in zip(lp.tokens, lp.top_logprobs)), lp.top_logprobs


@pytest.mark.parametrize("k", [0, 1])
def test_completion_top_logprobs_always_hold_the_sampled_token(server, oai, k):
    """OpenAI's "up to logprobs + 1" entries: each position's top_logprobs has the k likeliest tokens and the
    sampled one with its own logprob, also where sampling at temperature 1 took a token outside the top k
    (logprobs=0: just the sampled token), streamed or not."""
    kw = dict(model="tiny", prompt="Hello", max_tokens=24, temperature=1.0, seed=5, logprobs=k, extra_body=IGN)
    lp = oai.completions.create(**kw).choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 24
    outside = 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob, abs=1e-6) and k <= len(top) <= k + 1
        outside += len(top) == k + 1
    assert k == 0 or outside > 0, "seeded sampling never left the top token: the case is not exercised"
    streamed = [t for c in oai.completions.create(**kw, stream=True) for ch in c.choices if ch.logprobs
                for t in ch.logprobs.top_logprobs]
    assert [set(t) for t in streamed] == [set(t) for t in lp.top_logprobs]


def test_chat_equals_engine_on_plain_template(server):
    """/v1/chat/completions with --chat-template plain: the documented plain prompt, Engine's answer."""
    with start_server(server.path, engine=server.engine, chat_template="plain") as s, \
            openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=60, max_retries=0) as oai:
        _chat_on_plain_template(server, oai)


def _chat_on_plain_template(server, oai):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    server.engine.flush_cache()
    r = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=2, extra_body=IGN)
    want = _engine(server, "system: Be brief.\nuser: What is 2 + 3?\nassistant:", max_new_tokens=6, temperature=0,
                   ignore_eos=True)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want["text"]
    assert [t.logprob for t in c.logprobs.content] == [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in oai.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True, extra_body=IGN) if ch.choices)
    assert streamed == c.message.content


def test_chat_function_role_message(server):
    """A message with OpenAI's deprecated role "function" is served as SGLang and vLLM serve it: rendered by the
    template under that role (the hand-written plain prompt, generated as the Engine does on it)."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "function", "name": "f", "content": "42"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with start_server(server.path, engine=server.engine, chat_template="plain") as s, s.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    want = _engine(server, "user: Hi\nfunction: 42\nassistant:", max_new_tokens=5, temperature=0, ignore_eos=True)
    assert r.json()["choices"][0]["message"]["content"] == want["text"]
    assert r.json()["usage"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]


def test_chat_template_kwargs_and_continue_final_message(server):
    """SGLang's chat_template_kwargs reach the template and continue_final_message leaves the last message open (the
    hand-written prompt, generated as the Engine does on it); a kwarg naming one of the server's own is a 400."""
    template = ("{% if greeting %}[{{ greeting }}]{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                "</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, it is"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"greeting": "yo"}, "continue_final_message": True}
    with start_server(server.path, engine=server.engine, chat_template=template) as s, s.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        want = _engine(server, "[yo]<user>Hi</><assistant>Sure, it is", max_new_tokens=5, temperature=0, ignore_eos=True)
        assert r.json()["choices"][0]["message"]["content"] == want["text"]
        r = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and "chat_template_kwargs may not set ['tokenize']" in r.json()["error"]["message"]


def test_openai_bookkeeping_fields_change_nothing(server):
    """metadata, store, service_tier, parallel_tool_calls and SGLang's separate/stream_reasoning are served, with the
    same text as without them; a reasoning_effort (read by reasoning templates) is a 400 naming it."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    extras = {"metadata": {"run": "7"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True,
              "separate_reasoning": False, "stream_reasoning": False}
    with start_server(server.path, engine=server.engine, chat_template="plain") as s, s.client() as c:
        plain = c.post("/v1/chat/completions", json=body)
        r = c.post("/v1/chat/completions", json={**body, **extras})
        assert plain.status_code == r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
        r = c.post("/v1/chat/completions", json={**body, "reasoning_effort": "high"})
        assert r.status_code == 400 and "reasoning_effort" in r.text


def test_sglang_routing_fields_at_rank_0_change_nothing_and_others_are_named(server, client):
    """data_parallel_rank / routed_dp_rank 0 (sglang-router --dp-aware adds the first to every body) give the same
    completion as without them; rank 1 or a PD bootstrap host is a 400 naming the field; chat takes them too."""
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=body)
    for extra in ({"data_parallel_rank": 0}, {"routed_dp_rank": 0, "bootstrap_room": None}):
        r = client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"], r.text
    for field, value in (("data_parallel_rank", 1), ("routed_dp_rank", 3), ("bootstrap_host", "10.0.0.1")):
        r = client.post("/v1/completions", json={**body, field: value})
        assert r.status_code == 400 and field in r.text, r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "data_parallel_rank": 2}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "data_parallel_rank" in r.text, r.text


def test_chat_template_is_the_tokenizers(server):
    """With a chat template, the prompt is exactly the tokenizer's apply_chat_template output, tokenized."""
    tok = server.engine.tokenizer.tokenizer
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    msgs = [{"role": "user", "content": "Hi there"}]
    got = render_chat(server.engine, msgs, template)
    assert got == {"input_ids": tok.encode("<user>Hi there<assistant>", add_special_tokens=False)}


def test_content_parts_reach_the_template_as_sglang_gives_them(server):
    """A message's text parts: joined by a space for a template that renders content as a string (SGLang's
    "string" format), kept as a list for one that loops over content parts ("openai"); the oracle is the
    hand-written prompt of each template, tokenized."""
    tok = server.engine.tokenizer.tokenizer
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    got = render_chat(server.engine, msgs, "plain")
    assert got == {"input_ids": tok.encode("user: Hello world\nassistant:", add_special_tokens=False)}
    loops = ("{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}"
             "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    got = render_chat(server.engine, msgs, loops)
    assert got == {"input_ids": tok.encode("<user>[Hello][world]<assistant>", add_special_tokens=False)}


def test_null_openai_fields_take_their_defaults(server, oai):
    """Fields OpenAI types "or null" (temperature, top_p, n, stream, penalties, echo, chat logprobs) sent as null,
    as the openai client sends a None, give exactly what leaving them out gives (same seed, same text)."""
    base = dict(model="tiny", max_tokens=6, seed=3, extra_body=IGN)
    nulls = dict(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None, frequency_penalty=None)
    plain = oai.completions.create(prompt="Hello", **base)
    got = oai.completions.create(prompt="Hello", echo=None, **base, **nulls)
    assert got.choices[0].text == plain.choices[0].text and len(got.choices) == 1
    with start_server(server.path, engine=server.engine, chat_template="plain") as s:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=60, max_retries=0) as c:
            msgs = [{"role": "user", "content": "Hi"}]
            plain = c.chat.completions.create(messages=msgs, **base)
            got = c.chat.completions.create(messages=msgs, logprobs=None, **base, **nulls)
            assert got.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_null_vllm_and_sglang_extras_take_their_defaults(server, route):
    """The extras vLLM types "or null" (top_k, min_p, repetition_penalty) and SGLang's stream_options flags, sent as
    null (as vLLM clients send them), give exactly what leaving them out gives (same seed, same text)."""
    body = {"model": "tiny", "max_tokens": 6, "seed": 3, "ignore_eos": True, "stream": True}
    body |= {"prompt": "Hello"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}

    def text(c, extra):
        with c.stream("POST", route, json={**body, **extra}) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 6  # include_usage as asked, also beside a null flag
        return "".join(ch.get("text") or ch.get("delta", {}).get("content") or "" for e in events
                       for ch in e["choices"])

    with start_server(server.path, engine=server.engine, chat_template="plain") as s, s.client() as c:
        plain = text(c, {"stream_options": {"include_usage": True}})
        nulls = text(c, {"top_k": None, "min_p": None, "repetition_penalty": None,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": None}})
        assert nulls == plain and len(plain) > 0


def test_max_tokens_defaults_are_openais(server, oai):
    """A chat request with neither max_tokens nor max_completion_tokens runs to the context length (OpenAI's and
    vLLM's default, not the engine's 128); a completion's max_tokens sent as null is OpenAI's default, 16."""
    context = server.engine.runner.context_len
    assert context > 128 + 16
    with start_server(server.path, engine=server.engine, chat_template="plain") as s:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=120, max_retries=0) as c:
            r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          extra_body=IGN)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == context, (r.usage, context)
    for max_tokens in (None, 16):
        got = oai.completions.create(model="tiny", prompt="Hello", max_tokens=max_tokens, temperature=0,
                                     extra_body=IGN)
        assert got.usage.completion_tokens == 16 and got.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_rid_of_an_openai_request_aborts_it(server, stream):
    """A completion sent with SGLang's `rid` runs as that id (one choice), streamed or not, so /abort_request
    with it aborts the request (finish_reason "abort"), as with /generate."""
    rid = f"oai-rid-{stream}"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 50, "ignore_eos": True, "rid": rid, "stream": stream}
    with start_server(server.path, engine=server.engine) as s, s.client() as c:
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        got: dict = {}

        def send():
            with s.client() as c2:
                if not stream:
                    got["finish"] = c2.post("/v1/completions", json=body).json()["choices"][0]["finish_reason"]
                    return
                with c2.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            for ch in json.loads(line[6:])["choices"]:
                                got["finish"] = ch["finish_reason"] or got.get("finish")

        t = threading.Thread(target=send)
        try:
            t.start()
            deadline = time.monotonic() + 30
            while s.engine.get_server_info()["num_in_flight"] < 1:  # submitted (waiting: generation is paused)
                assert time.monotonic() < deadline, "the request never reached the engine"
                time.sleep(0.02)
            assert c.post("/abort_request", json={"rid": rid}).status_code == 200
        finally:
            assert c.post("/continue_generation", json={}).status_code == 200
        t.join(30)
        assert got["finish"] == "abort", got


def _finish_reasons(served, body: dict, got: dict) -> None:
    """POST body to /v1/completions (streamed or not, as it says); got[choice index] = its finish_reason."""
    with served.client() as c:
        if not body.get("stream"):
            for ch in c.post("/v1/completions", json=body).json()["choices"]:
                got[ch["index"]] = ch["finish_reason"]
            return
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        got[ch["index"]] = ch["finish_reason"] or got.get(ch["index"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_rid_list_names_each_prompts_choices(server, stream):
    """SGLang's `rid` as a list, one per prompt of a batch completion: each prompt's choices run as rid[i] (n = 1)
    or rid[i]_j, as on /generate, streamed or not, so /abort_request with one prompt's ids aborts only its
    choices; a list of the wrong length is a 400 naming rid."""
    body = {"model": "tiny", "prompt": ["hi", "yo"], "max_tokens": 20, "ignore_eos": True, "stream": stream}
    with start_server(server.path, engine=server.engine) as s, s.client() as c:
        r = c.post("/v1/completions", json={**body, "rid": ["only-one"]})
        assert r.status_code == 400 and "rid" in r.json()["error"]["message"], r.text
        for n, aborted in ((1, [f"rl-{stream}-b"]), (2, [f"rl-{stream}-b_0", f"rl-{stream}-b_1"])):
            rids = [f"rl-{stream}-a", f"rl-{stream}-b"]
            assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            got: dict = {}
            t = threading.Thread(target=_finish_reasons, args=(s, {**body, "n": n, "rid": rids}, got))
            try:
                t.start()
                deadline = time.monotonic() + 30
                while s.engine.get_server_info()["num_in_flight"] < 2 * n:
                    assert time.monotonic() < deadline, "the requests never reached the engine"
                    time.sleep(0.02)
                for rid in aborted:
                    assert c.post("/abort_request", json={"rid": rid}).status_code == 200
            finally:
                assert c.post("/continue_generation", json={}).status_code == 200
            t.join(30)
            assert got == {i: "length" if i < n else "abort" for i in range(2 * n)}, (n, got)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_usage_on_every_chunk(server, route):
    """stream_options.continuous_usage_stats: every content chunk carries its choice's usage so far (the prompt's
    tokens, completion tokens never decreasing, ending at max_tokens = the final usage chunk's); without it, only
    include_usage's last chunk has usage."""
    body = {"model": "tiny", "max_tokens": 6, "ignore_eos": True, "stream": True}
    body |= {"prompt": "Hello"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}

    def events(options):
        with start_server(server.path, engine=server.engine, chat_template="plain") as s, s.client() as c:
            with c.stream("POST", route, json={**body, "stream_options": options}) as r:
                assert r.status_code == 200
                return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    got = events({"include_usage": True, "continuous_usage_stats": True})
    final = got[-1]["usage"]
    content = [e for e in got if e["choices"] and ("text" in e["choices"][0] or e["choices"][0]["delta"].get("content")
                                                    or e["choices"][0]["finish_reason"])]
    assert content and all("usage" in e for e in content)
    counts = [e["usage"]["completion_tokens"] for e in content]
    assert counts == sorted(counts) and counts[-1] == final["completion_tokens"] == 6
    assert {e["usage"]["prompt_tokens"] for e in content} == {final["prompt_tokens"]}
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in content)
    plain = events({"include_usage": True})
    assert [("usage" in e) for e in plain] == [False] * (len(plain) - 1) + [True]


def test_completion_echo(server, oai):
    """echo=true: text is the prompt then the completion (a text prompt as sent, token ids decoded), streamed
    or not; with logprobs the prompt's tokens come first, the first without a logprob, each prompt logprob the
    Engine's input_token_logprobs; max_tokens=0 scores the prompt alone (lm-eval's loglikelihood request)."""
    prompt = "Hello, world"
    plain = oai.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, extra_body=IGN)
    echo = oai.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                  extra_body=IGN)
    assert echo.choices[0].text == prompt + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True, stream=True, extra_body=IGN)
        if c.choices)
    assert streamed == echo.choices[0].text
    ids = server.engine.tokenizer.encode(prompt)
    by_ids = oai.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, echo=True, extra_body=IGN)
    assert by_ids.choices[0].text == server.engine.tokenizer.tokenizer.decode(ids) + plain.choices[0].text
    server.engine.flush_cache()
    scored = oai.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    want = server.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                  logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.token_logprobs == [e[0] for e in want]
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    both = oai.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                  extra_body=IGN).choices[0].logprobs
    alone = oai.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                   extra_body=IGN).choices[0].logprobs
    assert len(both.tokens) == len(ids) + 3 and both.tokens[len(ids):] == alone.tokens
    # the same tokens; their logprobs within float rounding (scoring the prompt takes another kernel path)
    assert all(abs(a - b) < 1e-4 for a, b in zip(both.token_logprobs[len(ids):], alone.token_logprobs))


def test_completion_echo_with_logprobs_streamed_equals_unstreamed(server, oai):
    """echo + logprobs streamed: the chunks' texts, tokens, logprobs and text offsets, concatenated, are the
    unstreamed response's (the prompt's tokens first, the first without a logprob), for n=2 too."""
    prompt = "Hello, world"
    kw = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2, n=2, extra_body=IGN)
    whole = oai.completions.create(**kw)
    got = {i: {"text": "", "tokens": [], "token_logprobs": [], "text_offset": [], "top": []} for i in range(2)}
    for c in oai.completions.create(**kw, stream=True):
        for ch in c.choices:
            g = got[ch.index]
            g["text"] += ch.text
            if ch.logprobs is not None:
                g["tokens"] += ch.logprobs.tokens
                g["token_logprobs"] += ch.logprobs.token_logprobs
                g["text_offset"] += ch.logprobs.text_offset
                g["top"] += ch.logprobs.top_logprobs or [None] * len(ch.logprobs.tokens)
    for choice in whole.choices:
        g, lp = got[choice.index], choice.logprobs
        assert g["text"] == choice.text and choice.text.startswith(prompt)
        assert g["tokens"] == lp.tokens and g["text_offset"] == lp.text_offset
        assert g["token_logprobs"][0] is None and lp.token_logprobs[0] is None
        assert g["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
        assert [t and set(t) for t in g["top"]] == [t and set(t) for t in lp.top_logprobs]


@pytest.mark.parametrize("skip", [False, True])
def test_echoed_token_id_prompt_follows_skip_special_tokens(server, oai, skip):
    """echo of a token-id prompt holding special tokens decodes it as skip_special_tokens says, as the completion
    is: the text is the tokenizer's decode of prompt + output ids, and the logprobs' tokens join into it."""
    tok = server.engine.tokenizer.tokenizer
    ids = [tok.bos_token_id, *tok.encode("Hi", add_special_tokens=False), tok.eos_token_id,
           *tok.encode("there", add_special_tokens=False)]
    kw = dict(model="tiny", prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=0,
              extra_body={**IGN, "skip_special_tokens": skip})
    c = oai.completions.create(**kw).choices[0]
    out = server.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0, **IGN})
    want = tok.decode(ids, skip_special_tokens=skip) + tok.decode(out["output_ids"], skip_special_tokens=skip)
    assert c.text == want and (tok.eos_token in want) is not skip
    special = (tok.bos_token, tok.eos_token) if skip else ()  # skipped: shown, taking no characters
    assert "".join(t for t in c.logprobs.tokens if t not in special) == c.text
    assert all(c.text[o:].startswith(t) for t, o in zip(c.logprobs.tokens, c.logprobs.text_offset)
               if t not in special)
    assert _streamed_tokens_and_offsets(oai, kw) == (c.logprobs.tokens, c.logprobs.text_offset)


def test_text_delta_holds_back_a_tail_the_next_token_may_rewrite():
    """A tokenizer's clean-up rewrites the text's tail (" ," -> ","): with the tail held back the joined deltas
    equal the final text; a rewrite of what was already sent never stops the stream (later text still goes
    out, from the same length, as SGLang's incremental detokenizer does)."""
    from rollout.server.openai_engine import CLEAN_UP_TAIL, TextDelta

    texts = ["a", "a ", "a,", "a,a", "a,a b", "a,a b,", "a,a b, n", "a,a b,n't"]
    held = TextDelta(None, CLEAN_UP_TAIL)
    joined = "".join(held.step(t, False) for t in texts) + held.step(texts[-1] + "!", True)
    assert joined == texts[-1] + "!"
    bare = TextDelta(None)
    parts = [bare.step(t, False) for t in texts] + [bare.step(texts[-1] + "!", True)]
    assert parts[-1] and "".join(parts).endswith("!")  # it went on after the rewrite


def test_streamed_text_equals_the_final_text_with_a_clean_up_tokenizer(tmp_path):
    """On a tokenizer that cleans up tokenization spaces (transformers' flag), a stream of spaces and commas
    joins to exactly the non-streamed text on both OpenAI routes (it stopped at the first rewrite)."""
    import shutil

    model = tmp_path / "cleanup"
    shutil.copytree(Path(__file__).resolve().parents[2] / "assets" / "demo-model", model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update(clean_up_tokenization_spaces=True,  # transformers 5 applies it to BPE only with its opt-in
               clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with start_server(model, chat_template="plain") as s, s.client() as c:
        assert s.engine.tokenizer.cleans_up_spaces
        bias = {str(t): 30 for t in s.engine.tokenizer.tokenizer.convert_tokens_to_ids([" ", ",", "a"])}
        for route, extra in (("/v1/completions", {"prompt": "x"}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            for seed in range(4):
                body = {"model": "tiny", "max_tokens": 12, "logit_bias": bias, "seed": seed, **extra}
                choice = c.post(route, json=body).json()["choices"][0]
                final = choice["text"] if "text" in choice else choice["message"]["content"]
                streamed = ""
                with c.stream("POST", route, json={**body, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            for ch in json.loads(line[6:])["choices"]:
                                streamed += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                assert streamed == final, (route, seed, streamed, final)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_refused(server, route):
    """stream_options with stream false (or left out) is a 400 naming it, as SGLang's and vLLM's servers answer;
    null or {} stream_options without a stream, and stream_options with one, are served."""
    body = {"model": "tiny", "max_tokens": 2, "ignore_eos": True}
    body |= {"prompt": "Hello"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    with start_server(server.path, engine=server.engine, chat_template="plain") as s, s.client() as c:
        for extra in ({"stream_options": {"include_usage": True}},
                      {"stream": False, "stream_options": {"continuous_usage_stats": True}}):
            r = c.post(route, json={**body, **extra})
            assert r.status_code == 400 and r.json()["param"] == "stream_options", r.text
            assert "stream=true" in r.json()["message"]
        for extra in ({"stream_options": None}, {"stream_options": {}}):
            assert c.post(route, json={**body, **extra}).status_code == 200
        with c.stream("POST", route, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
        assert c.get("/health").status_code == 200
