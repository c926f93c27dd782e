"""SGLang's native HTTP endpoints over an Engine (in this process, or in its own behind an EngineClient):
same paths, methods, bodies and status codes.

Generation goes through `Engine.async_generate` (the event loop awaits its own sink); every other engine
call blocks on the engine lock, so it runs in the server's thread pool. Request bodies are pydantic
models with `extra="forbid"` and strict types: an unknown or mistyped field is a 400 naming it.
SGLang generate fields (`logprob_start_len`, `token_ids_logprob`, and ones the Engine does not implement,
e.g. `lora_path`) are accepted here and passed through, so the Engine's TypeError/ValueError becomes the
400 message. MoE: `return_routed_experts` (SGLang's base64 int32 in meta_info, built by the Engine) and
the three expert-distribution endpoints call the Engine's methods; a dense model answers 400.

Streaming costs one JSON encode and one socket write per token and sequence, so whatever the engine
delivered while the previous write went out is sent in one write, each sequence's stale cumulative
snapshots dropped (see `sse`). Non-streamed requests do no per-token work here at all.

This module holds /generate and the health, info and load endpoints, and what the other route modules
share (`Body`, `check_n`, `await_unless_disconnected`, `load_snapshot`). What is not here: the control
endpoints (cache, pause, abort, memory, expert record: native_control.py), the weight endpoints
(native_weights.py), the OpenAI routes (openai_api.py), /metrics (metrics.py), auth and error plumbing
(app.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.routing import Route

from rollout.sampling_params import as_int
from rollout.server import limits
from rollout.server.common import (
    Body,
    JSONResponse,
    dumpb,
    engine_error,
    error_response,
    read_json_body,
    run_blocking,
    run_on_engine,
)
from rollout.server.sse_response import SSEResponse
from rollout.sglang_generate_args import UNIMPLEMENTED

logger = logging.getLogger(__name__)
router = APIRouter()
HEALTH_CHECK_TIMEOUT_S = 20.0
DISCONNECT_POLL_S = 0.5


class GenerateReqInput(Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    # One value for every prompt or one per prompt; None is SGLang's default (False / 0).
    return_logprob: bool | list[bool | None] | None = False
    top_logprobs_num: int | list[int | None] | None = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    log_metrics: bool = True
    # SGLang fields the Engine may not implement: passed through when set, so it names what it refuses.
    logprob_start_len: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    input_embeds: list | None = None
    image_data: Any = None
    lora_path: str | list[str | None] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    return_hidden_states: bool | None = None
    return_routed_experts: bool = False  # MoE: meta_info["routed_experts"], base64 int32 (SGLang's format)
    session_params: dict | None = None
    priority: int | None = None
    return_bytes: bool | None = None
    return_entropy: bool | None = None
    # More of SGLang's GenerateReqInput: taken at their neutral value, refused by name otherwise
    # (rollout/sglang_generate_args.py); `Any` so the Engine, not pydantic, words the refusal.
    audio_data: Any = None
    video_data: Any = None
    require_reasoning: Any = None
    routed_experts_start_len: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    session_id: Any = None
    cache_salt: Any = None
    kv_router_hint: Any = None
    extra_key: Any = None
    external_trace_header: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    modalities: Any = None
    use_audio_in_video: Any = None
    video_config: Any = None
    images_config: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    positional_embed_overrides: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    lora_id: Any = None
    max_thinking_tokens: Any = None
    return_sampling_mask: Any = None
    return_flat_raw_top_logprobs: Any = None
    return_flat_raw_top_logprobs_b64: Any = None
    return_indexer_topk: Any = None
    return_prompt_token_ids: Any = None
    multi_item_delimiter_indices: Any = None
    routing_key: Any = None
    conversation_id: Any = None
    custom_labels: Any = None
    http_worker_ipc: Any = None
    received_time: Any = None
    # Beside sampling_params, as some SGLang clients post it (SGLang's RL tests): applied to every
    # prompt's sampling params that lack it; a different value there is refused.
    max_new_tokens: int | None = None
    # sglang-router re-serialises every /generate body with these: accepted, no effect here.
    model: str | None = None
    background: bool | None = None
    no_logs: bool | None = None

    def merged_sampling_params(self):
        """sampling_params with the top-level max_new_tokens folded in; ValueError on a contradiction."""
        if self.max_new_tokens is None:
            return self.sampling_params
        sps = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params or {}]
        out = []
        for sp in sps:
            if sp.get("max_new_tokens", self.max_new_tokens) != self.max_new_tokens:
                raise ValueError(f"max_new_tokens={self.max_new_tokens} beside sampling_params contradicts "
                                 f"sampling_params.max_new_tokens={sp['max_new_tokens']}: pass one")
            out.append({**sp, "max_new_tokens": self.max_new_tokens})
        return out if isinstance(self.sampling_params, list) else out[0]

    def passthrough(self) -> dict:
        # `is not`, not `in (None, False)`: 0 == False, and logprob_start_len=0 (score the whole prompt)
        # must go through.
        return {n: v for n in _PASSTHROUGH if (v := getattr(self, n)) is not None and v is not False}


# The Engine's own options, then every SGLang argument it takes only at a neutral value (it words refusals).
_PASSTHROUGH = ("logprob_start_len", "token_ids_logprob", "lora_path", "return_routed_experts",
                *(n for n in UNIMPLEMENTED if n in GenerateReqInput.model_fields))


def num_sequences(prompts: int, sampling_params) -> int:
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * prompts
    # n as the engine will read it (2.0 is 2); a value it refuses counts 1 and is refused there
    return sum(max(1, as_int(sp.get("n", 1)) or 1) if isinstance(sp, dict) else 1 for sp in sps)


def check_n(request: Request, total: int) -> JSONResponse | None:
    limit = request.app.state.server_args.max_n
    if total > limit:
        return error_response(f"request asks for {total} sequences (prompts x n); this server's limit is "
                              f"--max-n {limit}", 400, param="n")
    return None


def _strip_logprob_text(out: dict) -> dict:
    """SGLang puts token text in logprob entries only when return_text_in_logprobs is set. Only a final
    output's entries carry text (rollout.outputs.logprob_meta): a stream chunk passes as it is."""
    meta = out["meta_info"]
    if meta.get("finish_reason") is None:
        return out
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:
            meta[key] = [(lp, t, None) for lp, t, _ in meta[key]]
    for key in ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"):
        if key in meta:  # a position's list is None where SGLang pads (the first prompt position)
            meta[key] = [None if step is None else [(lp, t, None) for lp, t, _ in step] for step in meta[key]]
    return out


async def await_unless_disconnected(request: Request, coro):
    """Await `coro`; if the client goes away first, cancel it (the engine aborts its requests)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()


def coalesce(chunks: list[dict], segments: bool = False) -> list[dict]:
    """Chunks are cumulative snapshots: of each sequence ("index") keep only the newest (the last). With
    `segments` (--stream-output) their output_ids are disjoint pieces: the newest gets all of them, in order."""
    newest = {c["index"]: i for i, c in enumerate(chunks)}
    if segments:
        ids: dict[int, list] = {}
        for c in chunks:
            ids.setdefault(c["index"], []).extend(c["output_ids"])
        for i in newest.values():
            chunks[i]["output_ids"] = ids[chunks[i]["index"]]
    return [c for i, c in enumerate(chunks) if newest[c["index"]] == i]


async def sse(chunks, post=lambda c: c):
    """Server-sent events: `data: <json>` per chunk, then `data: [DONE]`. Each sequence's first chunk (its
    first token: time to first token) goes out alone, the moment it is read. After that, whatever the
    engine delivered while the previous write was going out is sent as one write, keeping only each
    sequence's newest snapshot (a cumulative chunk supersedes the older ones; SGLang's stream_interval
    skips the same way): a client that keeps up sees every token, one that falls behind costs the server
    no extra encode. The last outputs and `[DONE]` go out in one write. Closing this generator (the client
    went away mid-stream) closes `chunks`, which aborts the engine request and frees its KV."""
    started: set[int] = set()  # sequences whose first chunk was sent
    done = b"data: [DONE]\n\n"
    try:
        async for chunk in chunks:
            if chunk["index"] not in started:
                started.add(chunk["index"])
                yield b"data: " + dumpb(post(chunk)) + b"\n\n" + (done if chunks.done else b"")
                continue
            ready = chunks.ready_nowait(keep_first_of=started)
            firsts = [c for c in ready if c["index"] not in started]
            started.update(c["index"] for c in firsts)
            batch = firsts + coalesce([chunk, *(c for c in ready if not any(c is f for f in firsts))], chunks.segments)
            yield b"".join(b"data: " + dumpb(post(c)) + b"\n\n" for c in batch) + (done if chunks.done else b"")
        if not started:  # nothing was streamed (no request): the end still says so
            yield done
    finally:
        await chunks.aclose()


async def generate(request: Request):
    """POST/PUT /generate: a plain Starlette route (GENERATE_ROUTE, which app.py puts first in the routing
    table), the body read and validated here: the same model and 400s as a FastAPI body parameter, without
    ~60 us of FastAPI's dependency solving and routing per request, the hot path of every rollout."""
    obj = GenerateReqInput.model_validate(await read_json_body(request))  # a ValidationError: the app's 400
    engine = request.app.state.engine
    if obj.text is None and obj.input_ids is None and obj.input_embeds is not None:
        return error_response("input_embeds are not supported: pass text or input_ids", 400, param="input_embeds")
    if obj.text is None and obj.input_ids is None:
        return error_response("pass text or input_ids", 400, param="text")
    if obj.input_ids is not None:
        obj.text = None  # given both, input_ids are the prompt (SGLang's tokenizer manager takes them first)
    try:
        obj.sampling_params = obj.merged_sampling_params()
    except ValueError as e:
        return error_response(str(e), 400, param="max_new_tokens")
    prompts = obj.text if obj.text is not None else obj.input_ids
    num_prompts = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
    if isinstance(obj.text, list):
        num_prompts = len(obj.text)
    bad_n = check_n(request, num_sequences(num_prompts, obj.sampling_params))
    if bad_n is not None:
        return bad_n
    prepared = await limits.prepare_prompts(request, obj.text, obj.input_ids)
    if isinstance(prepared, Response):
        return prepared
    text, input_ids = prepared
    if input_ids is not None:
        ids_list = [input_ids] if input_ids and isinstance(input_ids[0], int) else input_ids
        too_much = limits.check_work(request, ids_list, obj.sampling_params, return_logprob=obj.return_logprob,
                                     top_logprobs_num=obj.top_logprobs_num, token_ids_logprob=obj.token_ids_logprob,
                                     logprob_start_len=obj.logprob_start_len)
        if too_much is not None:
            return too_much
    kwargs = dict(prompt=text, input_ids=input_ids, sampling_params=obj.sampling_params,
                  return_logprob=obj.return_logprob, top_logprobs_num=obj.top_logprobs_num, rid=obj.rid,
                  **obj.passthrough())
    post = (lambda o: o) if obj.return_text_in_logprobs else _strip_logprob_text
    try:
        if obj.stream:
            chunks = await engine.async_generate(stream=True, **kwargs)
        else:
            out = await await_unless_disconnected(request, engine.async_generate(**kwargs))
    except asyncio.CancelledError:
        return Response(status_code=499)  # nobody is listening; the engine has aborted the request
    except Exception as e:
        return engine_error(e)
    if not obj.stream:
        return await limits.json_response_off_loop(
            request, lambda: [post(o) for o in out] if isinstance(out, list) else post(out))

    return SSEResponse(sse(chunks, post), is_last=lambda: chunks.done)


GENERATE_ROUTE = Route("/generate", generate, methods=["POST", "PUT"])


# ---- health and info --------------------------------------------------------------------------
def engine_alive(request: Request) -> bool:
    """False once the app shut down, or the engine process (EngineClient) is gone."""
    is_alive = getattr(request.app.state.engine, "is_alive", None)
    return not request.app.state.engine_shut_down and (is_alive is None or is_alive())


async def engine_fatal(request: Request) -> str:
    """Why the engine can never generate again, "" if it can: its process gone, or the engine's own fatal_problem
    (a dead tensor-parallel rank), asked without the engine lock and bounded in time, in a thread of its own
    (not the control pool, which weight updates may fill: a busy server is not an unhealthy one)."""
    if not engine_alive(request):
        return "the engine is gone"
    check = getattr(request.app.state.engine, "fatal_problem", None)
    if check is None:
        return ""
    try:
        return await asyncio.wait_for(asyncio.to_thread(check), HEALTH_CHECK_TIMEOUT_S) or ""
    except Exception as e:  # noqa: BLE001 - an engine that cannot answer this is not healthy
        return f"{type(e).__name__}: {e}"


@router.get("/health")
async def health(request: Request):
    problem = await engine_fatal(request)
    if problem:
        logger.warning("health: %s", problem)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request):
    """200 once the engine produced a token (or is busy producing others'); 503 otherwise, and for a probe that
    ended as abort (a step failed: the engine answered, but could not generate)."""
    engine = request.app.state.engine
    problem = await engine_fatal(request)
    if problem:
        logger.warning("health_generate: %s", problem)
        return Response(status_code=503)
    load = await run_blocking(request, engine.get_server_info)
    if load["num_in_flight"] and not load.get("paused"):
        return Response(status_code=200)
    try:
        out = await asyncio.wait_for(engine.async_generate(input_ids=[0], sampling_params={
            "max_new_tokens": 1, "temperature": 0.0}), HEALTH_CHECK_TIMEOUT_S)
    except Exception as e:  # timeout, released memory, shut down: unhealthy, with the reason logged
        logger.warning("health_generate failed: %s: %s", type(e).__name__, e)
        return Response(status_code=503)
    reason = out["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "abort":
        logger.warning("health_generate: the probe ended as abort: %s", reason.get("message"))
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")  # SGLang's newer name; /get_model_info stays for the clients that use it
async def get_model_info(request: Request):
    engine = request.app.state.engine
    # Built here from what an EngineClient caches too (no engine call): the same keys as Engine.get_model_info.
    return JSONResponse({"model_path": getattr(engine, "model_path", engine.args.model_path),
                         "tokenizer_path": getattr(engine, "tokenizer_path", engine.args.model_path),
                         "is_generation": True, "preferred_sampling_params": None,
                         "weight_version": engine.weight_version,
                         "load_format": getattr(engine.args, "load_format", None), "reasoning_parser": None,
                         "tool_call_parser": None})


@router.get("/get_server_info")
@router.get("/server_info")  # SGLang's newer name, as /model_info
async def get_server_info(request: Request):
    engine = request.app.state.engine
    """SGLang's shape: one flat dict of every server arg (the engine's and this server's, api_key left
    out) beside the scheduler info and internal_states; Engine.get_server_info() already is that shape."""
    info = await run_blocking(request, engine.get_server_info)
    server = {k: v for k, v in dataclasses.asdict(request.app.state.server_args).items() if k != "api_key"}
    info = {**info, **server}
    info["enable_metrics"] = True  # this server always serves /metrics (the Engine option is a no-op)
    info.setdefault("version", request.app.version)
    return JSONResponse(info)


def load_snapshot(engine) -> dict:
    """Running/waiting requests and KV tokens in use (blocking: takes the engine lock)."""
    if hasattr(engine, "load_snapshot"):  # an EngineClient: taken in the engine process
        return engine.load_snapshot()
    info = engine.get_server_info()
    waiting = len(engine.scheduler.waiting)
    # Evictable prefix-cache slots count as free (SGLang's num_used_tokens): an idle engine reads 0.
    used = max(0, info["max_total_num_tokens"] - engine.scheduler.kv.available_tokens())
    return {"info": info, "num_running": info["num_in_flight"] - waiting, "num_waiting": waiting,
            "num_used_tokens": used}


def _load_limits(engine) -> dict:
    """The capacities a load report divides by (fixed for the engine's life). Runs where the engine is."""
    return {"max_total_num_tokens": engine.runner.max_total_num_tokens,
            "max_running_requests": engine.scheduler.max_running}


# SGLang's /v1/loads sections. Only "core" and "queues" have counterparts here; the others (memory pools,
# speculative decoding, LoRA slots, disaggregation queues) are accepted and left out of the report.
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


@router.get("/v1/loads")
async def v1_loads(request: Request, include: str = "core", dp_rank: int | None = None, format: str = "json"):
    """SGLang's load report: {"loads": [one dict per scheduler]}, read without the step lock as /get_load
    (slime polls it until a server is idle). One scheduler here: dp_rank 0."""
    sections = {part.strip() for part in include.split(",") if part.strip()} or {"core"}
    unknown = sorted(sections - set(LOAD_SECTIONS))
    if unknown:
        return error_response(f"include: unknown section(s) {unknown}; choose from {list(LOAD_SECTIONS)}", 400,
                              param="include")
    if format != "json":
        return error_response(f"format={format!r}: only 'json' is served here (Prometheus: GET /metrics)", 400,
                              param="format")
    if dp_rank is not None and dp_rank != 0:
        return JSONResponse({"loads": []})
    engine = request.app.state.engine
    limits_ = getattr(request.app.state, "load_limits", None)
    if limits_ is None:
        limits_ = request.app.state.load_limits = await run_on_engine(request, _load_limits)
    load = engine.get_load()
    waiting, used = load["num_waiting_reqs"], load["num_tokens"]
    total = limits_["max_total_num_tokens"]
    report = {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": load["num_reqs"] - waiting,
              "num_waiting_reqs": waiting, "num_used_tokens": used, "max_total_num_tokens": total,
              "token_usage": used / total if total else 0.0,
              "max_running_requests": limits_["max_running_requests"]}
    if sections & {"queues", "all"}:
        report["queues"] = {"waiting": waiting}
    return JSONResponse({"loads": [report]})


@router.get("/get_load")
async def get_load(request: Request):
    """SGLang's load report. The Engine publishes its counters at every step boundary, so this reads them
    without the step lock (and counts requests still queued for the scheduler)."""
    engine = request.app.state.engine
    if hasattr(engine, "get_load"):
        return JSONResponse([{"dp_rank": 0, **engine.get_load()}])
    snap = await run_blocking(request, load_snapshot, engine)
    return JSONResponse([{"dp_rank": 0, "num_reqs": snap["num_running"] + snap["num_waiting"],
                          "num_waiting_reqs": snap["num_waiting"], "num_tokens": snap["num_used_tokens"]}])
