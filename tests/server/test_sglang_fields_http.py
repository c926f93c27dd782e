"""SGLang's request/response fields that RL clients read: logprob_start_len=0 over HTTP, the weight
versions a request started and finished under, and OpenAI responses' `metadata.weight_version`.

Oracles: the Engine called directly on the same request, the prompt length, and versions set by the
test itself with update_weight_version (in the scheduler's thread between two decode steps, so the
change lands mid-request deterministically).
"""

from __future__ import annotations

import json
import warnings

import openai
from openai.types.chat import ChatCompletion

from tests.rl_surface.conftest import at_step
from tests.server.conftest import start_server

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def test_logprob_start_len_zero_scores_the_whole_prompt_over_http(server, client):
    """/generate with logprob_start_len=0 returns one input_token_logprobs entry per prompt token (the
    first None), equal to the Engine's, not just the last one."""
    body = dict(input_ids=PROMPT, sampling_params=dict(temperature=0, max_new_tokens=2), return_logprob=True,
                logprob_start_len=0)
    assert client.post("/flush_cache").status_code == 200
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    got = r.json()["meta_info"]["input_token_logprobs"]
    assert server.engine.flush_cache()
    want = server.engine.generate(**body)["meta_info"]["input_token_logprobs"]
    assert len(got) == len(PROMPT) and [e[1] for e in got] == PROMPT
    assert got[0][0] is None and [e[0] for e in got] == [e[0] for e in want]


def test_weight_version_start_and_end_bracket_an_update_mid_request(server):
    """A request submitted under version "a" that finishes after update_weight_version("b") reports
    weight_version_start "a", weight_version_end "b" (= weight_version); an untouched one reports "b" twice."""
    engine = server.engine
    engine.update_weight_version("a")
    state = at_step(engine, 3, lambda: engine.update_weight_version("b", abort_all_requests=False))
    out = engine.generate(input_ids=PROMPT, sampling_params=dict(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert state["done"].is_set() and "error" not in state
    meta = out["meta_info"]
    assert (meta["weight_version_start"], meta["weight_version_end"], meta["weight_version"]) == ("a", "b", "b")
    meta = engine.generate(input_ids=PROMPT, sampling_params=dict(max_new_tokens=2))["meta_info"]
    assert (meta["weight_version_start"], meta["weight_version_end"]) == ("b", "b")


def test_openai_responses_carry_metadata_weight_version(server):
    """/v1/completions and /v1/chat/completions responses carry metadata.weight_version, the served one."""
    server.engine.update_weight_version("step-7")
    # The tiny tokenizer has no chat template of its own: chat needs --chat-template.
    with start_server(server.path, engine=server.engine, chat_template="plain") as s, \
            openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=60, max_retries=0) as oai:
        comp = oai.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0)
        chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           temperature=0)
    spans = [{"start": 0, "end": 2, "version": "step-7"}]  # SGLang's weight_versions over the 2 tokens
    for metadata in (comp.model_extra["metadata"], chat.metadata):  # the latter a declared field of ChatCompletion
        assert metadata["weight_version"] == "step-7" and json.loads(metadata["weight_versions"]) == spans
    # OpenAI types metadata as {str: str}: the client's own model accepts the body as it is, without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ChatCompletion.model_validate(chat.model_dump()).metadata == chat.metadata


def test_get_model_info_reports_the_checkpoint_loaded_from_disk(server, client, tiny_llama, tmp_path):
    """After /update_weights_from_disk from another directory, /get_model_info's model_path is that
    directory (SGLang's behaviour); a failed update keeps it."""
    import shutil

    copy = shutil.copytree(tiny_llama, tmp_path / "ckpt-copy")  # same weights, another path
    assert client.get("/get_model_info").json()["model_path"] == str(tiny_llama)
    try:
        r = client.post("/update_weights_from_disk", json={"model_path": str(copy)})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert client.get("/get_model_info").json()["model_path"] == str(copy)
        r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
        assert not r.json()["success"]
        assert client.get("/get_model_info").json()["model_path"] == str(copy)
    finally:
        assert client.post("/update_weights_from_disk", json={"model_path": str(tiny_llama)}).json()["success"]


def test_streamed_generate_sends_the_first_token_at_once(server):
    """A streamed /generate of 24 tokens whose reader only gets to it after all 24 exist (the tiny model
    outruns the event loop) still sends the first token as its own first event, then the newest
    snapshot (all 24, extending the first) with [DONE] in the same write; over HTTP too the first event
    holds 1 token."""
    import asyncio
    import json
    import time

    from rollout.server.native import sse

    engine = server.engine
    sp = dict(temperature=0, max_new_tokens=24, ignore_eos=True)
    want = engine.generate(input_ids=PROMPT, sampling_params=sp)["output_ids"]

    async def read_late():
        stream = await engine.async_generate(input_ids=PROMPT, sampling_params=sp, stream=True)
        deadline = time.monotonic() + 30
        while engine.get_server_info()["num_in_flight"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # every delivery is queued before the first read
        return [part async for part in sse(stream)]

    parts = asyncio.run(read_late())
    events = [json.loads(e[6:]) for p in parts for e in p.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert parts[-1].endswith(b"\n\ndata: [DONE]\n\n") and len(parts) == 2  # first token alone, then the rest
    assert [e["output_ids"] for e in events] == [want[:1], want] and len(want) == 24
    lines = []
    with server.client() as c, c.stream("POST", "/generate", json=dict(input_ids=PROMPT, sampling_params=sp,
                                                                        stream=True)) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert lines[0]["output_ids"] == want[:1] and lines[-1]["output_ids"] == want


# Every field of SGLang's GenerateReqInput (python/sglang/srt/managers/io_struct.py) but the prompt, sampling and
# stream ones, at its default there, written down from its source.
SGLANG_REQ_INPUT_DEFAULTS = {
    "use_audio_in_video": False, "video_config": None, "return_sampling_mask": None, "return_text_in_logprobs": False,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False, "log_metrics": True,
    "routed_experts_start_len": 0, "return_indexer_topk": False, "modalities": None, "session_params": None,
    "lora_id": None, "positional_embed_overrides": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "bootstrap_pair_key": None, "decode_tp_size": None, "routed_dp_rank": None,
    "data_parallel_rank": None, "disagg_prefill_dp_rank": None, "kv_router_hint": None, "routing_key": None,
    "conversation_id": None, "http_worker_ipc": None, "background": False, "require_reasoning": False,
    "max_thinking_tokens": None, "priority": None, "extra_key": None, "no_logs": False, "custom_labels": None,
    "return_bytes": False, "return_entropy": False, "return_prompt_token_ids": False, "external_trace_header": None,
    "received_time": None, "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None, "multi_item_delimiter_indices": None, "cache_salt": None,
    "session_id": None, "mm_hashes": None, "mm_content_hashes": None, "input_embeds": None, "image_data": None,
    "video_data": None, "audio_data": None, "return_hidden_states": False, "return_routed_experts": False,
    "custom_logit_processor": None, "lora_path": None, "token_ids_logprob": None, "top_logprobs_num": None,
    "logprob_start_len": None, "return_logprob": None,
}


def test_sglang_generate_fields_at_neutral_values_are_served_others_refused(client):
    """/generate takes SGLang's other GenerateReqInput fields: at their neutral values (null, false,
    rank 0; all of them at once, at SGLang's defaults) the output equals the plain request's; a value asking for an unimplemented feature is a
    400 naming the field, and the server keeps serving."""
    plain = dict(input_ids=PROMPT, sampling_params=dict(temperature=0, max_new_tokens=4, ignore_eos=True))
    want = client.post("/generate", json=plain)
    assert want.status_code == 200, want.text
    neutral = dict(plain, image_data=None, audio_data=None, custom_logit_processor=None, return_hidden_states=False,
                   routed_dp_rank=0, data_parallel_rank=None, bootstrap_host=None, session_id=None, cache_salt=None,
                   require_reasoning=False, external_trace_header={"traceparent": "x"}, extra_key=None)
    got = client.post("/generate", json=neutral)
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == want.json()["output_ids"]
    every = client.post("/generate", json={**plain, **SGLANG_REQ_INPUT_DEFAULTS})
    assert every.status_code == 200, every.text
    assert every.json()["output_ids"] == want.json()["output_ids"]
    for field, value in [("image_data", "cat.png"), ("routed_dp_rank", 2), ("return_hidden_states", True),
                         ("extra_key", "tenant-a"), ("modalities", ["image"]), ("lora_id", "a1"),
                         ("max_thinking_tokens", 8), ("return_prompt_token_ids", True)]:
        r = client.post("/generate", json=dict(plain, **{field: value}))
        assert r.status_code == 400 and field in r.text, (field, r.status_code, r.text)
    assert client.post("/generate", json=plain).json()["output_ids"] == want.json()["output_ids"]


def test_weight_version_spans_cross_the_engine_process_pipe(tiny_llama):
    """With the engine in its own process, /generate's final meta_info carries the output spans and (with
    --enable-prefill-weight-versions) the prompt spans, equal to what the engine computed: one run each
    in the served version, covering completion_tokens and prompt_tokens."""
    with start_server(tiny_llama, engine_kw=dict(enable_prefill_weight_versions=True, weight_version="w0"),
                      in_child=True) as s, s.client() as c:
        body = dict(input_ids=PROMPT, sampling_params=dict(temperature=0, max_new_tokens=4, ignore_eos=True))
        meta = c.post("/generate", json=body).json()["meta_info"]
    assert meta["weight_versions"] == [{"start": 0, "end": 4, "version": "w0"}]
    assert meta["prefill_weight_versions"] == [{"start": 0, "end": len(PROMPT), "version": "w0"}]


def test_per_prompt_and_null_logprob_fields_and_custom_params_over_http(client):
    """SGLang's GenerateReqInput takes return_logprob / top_logprobs_num per prompt or null (its defaults), and
    sampling_params.custom_params (slime's, with top-p): served, with the Engine's outputs for the same call."""
    greedy = dict(temperature=0, max_new_tokens=3, ignore_eos=True)
    r = client.post("/generate", json=dict(input_ids=[PROMPT, PROMPT[:4]], sampling_params=greedy,
                                           return_logprob=[True, False], top_logprobs_num=[2, 0]))
    assert r.status_code == 200, r.text
    first, second = r.json()
    assert len(first["meta_info"]["output_top_logprobs"][0]) == 2 and "output_token_logprobs" not in second["meta_info"]
    r = client.post("/generate", json=dict(input_ids=PROMPT, sampling_params=greedy, return_logprob=None,
                                           top_logprobs_num=None))
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == first["output_ids"]
    r = client.post("/generate", json=dict(input_ids=PROMPT, sampling_params={
        **greedy, "top_p": 0.9, "custom_params": {"return_top_p_token_ids": True}}))
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == first["output_ids"]
    r = client.post("/generate", json=dict(input_ids=PROMPT, sampling_params=greedy, return_logprob="maybe"))
    assert r.status_code == 400 and "return_logprob" in r.text


def test_sglang_serving_tests_expectations(tiny_llama):
    """What SGLang's own serving tests read, each against an oracle computed here: stop_regex on the OpenAI
    routes (finish "stop", matched_stop the pattern, text cut where the regex matches the free text);
    errors with SGLang's top-level `type` beside OpenAI's nested `error`; /v1/score of no items is [];
    --enable-cache-report's usage.prompt_tokens_details.cached_tokens; a too-long prompt's message;
    custom_params taken on chat."""
    with start_server(tiny_llama, chat_template="chatml", enable_cache_report=True) as served, \
            served.client() as c:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
        free = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        letter = next(ch for ch in free[3:] if ch.isascii() and ch.isalpha())
        pattern = f"[{letter}]"
        r = c.post("/v1/completions", json={**body, "stop_regex": pattern}).json()["choices"][0]
        assert r["finish_reason"] == "stop" and r["matched_stop"] == pattern
        assert r["text"] == free[: free.find(letter)]
        bad = c.post("/v1/score", json={"model": "tiny", "query": "a", "items": ["b"], "label_token_ids": [999999]})
        assert bad.status_code == 400 and bad.json()["type"] == "BadRequestError"
        assert bad.json()["object"] == "error" and bad.json()["error"]["message"] == bad.json()["message"]
        empty = c.post("/v1/score", json={"model": "tiny", "query": "a", "items": [], "label_token_ids": [5]})
        assert empty.status_code == 200 and empty.json()["scores"] == []
        assert served.engine.score(query="a", items=[], label_token_ids=[5]) == []
        chat = {"model": "tiny", "max_tokens": 2, "temperature": 0, "custom_params": {"k": 1},
                "messages": [{"role": "user", "content": "a long enough question to be cached " * 3}]}
        first = c.post("/v1/chat/completions", json=chat)
        assert first.status_code == 200, first.text
        again = c.post("/v1/chat/completions", json=chat).json()["usage"]
        assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1
        # n choices of one prompt: its cached tokens counted once, as its prompt_tokens (were summed over choices)
        for stream in (False, True):
            many = {**chat, "n": 4, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
            r = c.post("/v1/chat/completions", json=many)
            usage = r.json()["usage"] if not stream else next(
                json.loads(line[6:])["usage"] for line in reversed(r.text.splitlines())
                if line.startswith("data: {") and json.loads(line[6:]).get("usage"))
            assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, (stream, usage)
        long = c.post("/generate", json={"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 1}})
        assert long.status_code == 400 and "longer than the model's maximum context length" in long.json()["message"]


def test_sglang_launch_flags_are_taken(tiny_llama):
    """SGLang launch flags its tests pass: no-ops here (--decode-log-interval, --log-requests,
    --sampling-backend) and --chunked-prefill-size -1 (no chunking: prompts up to --max-prefill-tokens a step)."""
    from rollout.server.args import parse_args

    _, kw = parse_args(["--model-path", str(tiny_llama), "--decode-log-interval", "10", "--log-requests",
                        "--sampling-backend", "pytorch", "--chunked-prefill-size", "-1", "--max-prefill-tokens", "4096"])
    from rollout.engine_args import EngineArgs

    assert EngineArgs.from_kwargs(**kw).scheduler_config().chunked_prefill_size == 4096


def test_skip_tokenizer_init_outputs_have_no_text_key(tiny_llama):
    """With skip_tokenizer_init, /generate's outputs (whole, each stream chunk) carry output_ids and meta_info and
    no "text" key, as SGLang's token-id outputs; the ids are the Engine's for the same request."""
    with start_server(tiny_llama, engine_kw={"skip_tokenizer_init": True}) as s, s.client() as c:
        body = dict(input_ids=PROMPT, sampling_params=dict(temperature=0, max_new_tokens=4, ignore_eos=True))
        whole = c.post("/generate", json=body).json()
        assert "text" not in whole and whole["output_ids"] == s.engine.generate(**body)["output_ids"]
        r = c.post("/generate", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert chunks and all("text" not in ch and "output_ids" in ch for ch in chunks)
        assert chunks[-1]["output_ids"] == whole["output_ids"]


def test_text_and_input_ids_together_take_the_ids(client):
    """/generate with both text and input_ids generates from the ids (SGLang's order), as the ids alone do."""
    body = dict(input_ids=PROMPT, sampling_params=dict(temperature=0, max_new_tokens=4, ignore_eos=True))
    want = client.post("/generate", json=body).json()
    got = client.post("/generate", json={**body, "text": "unrelated words"})
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == want["output_ids"] and got.json()["meta_info"]["prompt_tokens"] == len(PROMPT)
