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

What is not here: the OpenAI routes (openai_api.py), /metrics (metrics.py), auth and error plumbing
(app.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from rollout.server import limits, security
from rollout.server.common import (
    JSONResponse,
    dumpb,
    engine_error,
    error_response,
    run_blocking,
    run_on_engine,
    truncate,
)
from rollout.server.tensor_codec import PayloadError, decode_and_update

logger = logging.getLogger(__name__)
router = APIRouter()
HEALTH_CHECK_TIMEOUT_S = 20.0
DISCONNECT_POLL_S = 0.5


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class GenerateReqInput(Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
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
    # sglang-router re-serialises every /generate body with these: accepted, no effect here.
    model: str | None = None
    background: bool | None = None
    no_logs: bool | None = None

    def passthrough(self) -> dict:
        names = ("logprob_start_len", "token_ids_logprob", "input_embeds", "image_data", "lora_path",
                 "custom_logit_processor", "return_hidden_states", "return_routed_experts", "session_params", "priority",
                 "return_bytes", "return_entropy")
        # `is not`, not `in (None, False)`: 0 == False, and logprob_start_len=0 (score the whole prompt)
        # must go through.
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None and getattr(self, n) is not False}


def num_sequences(prompts: int, sampling_params) -> int:
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * prompts
    return sum(sp.get("n", 1) if isinstance(sp.get("n", 1), int) else 1 for sp in sps)


def check_n(request: Request, total: int) -> JSONResponse | None:
    limit = request.app.state.server_args.max_n
    if total > limit:
        return error_response(f"request asks for {total} sequences (prompts x n); this server's limit is "
                              f"--max-n {limit}", 400, param="n")
    return None


def _strip_logprob_text(out: dict) -> dict:
    """SGLang puts token text in logprob entries only when return_text_in_logprobs is set."""
    meta = out["meta_info"]
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


def coalesce(chunks: list[dict]) -> list[dict]:
    """Chunks are cumulative snapshots: of each sequence ("index") keep only the newest (the last)."""
    newest = {c["index"]: i for i, c in enumerate(chunks)}
    return [c for i, c in enumerate(chunks) if newest[c["index"]] == i]


async def sse(chunks, post=lambda c: c):
    """Server-sent events: `data: <json>` per chunk, then `data: [DONE]`. Each sequence's first chunk (its
    first token: time to first token) goes out alone, the moment it is read. After that, whatever the
    engine delivered while the previous write was going out is sent as one write, keeping only each
    sequence's newest snapshot (a cumulative chunk supersedes the older ones; SGLang's stream_interval
    skips the same way): a client that keeps up sees every token, one that falls behind costs the server
    no extra encode. Closing this generator (the client went away mid-stream) closes `chunks`, which
    aborts the engine request and frees its KV."""
    started: set[int] = set()  # sequences whose first chunk was sent
    try:
        async for chunk in chunks:
            if chunk["index"] not in started:
                started.add(chunk["index"])
                yield b"data: " + dumpb(post(chunk)) + b"\n\n"
                continue
            ready = chunks.ready_nowait(keep_first_of=started)
            firsts = [c for c in ready if c["index"] not in started]
            started.update(c["index"] for c in firsts)
            batch = firsts + coalesce([chunk, *(c for c in ready if not any(c is f for f in firsts))])
            yield b"".join(b"data: " + dumpb(post(c)) + b"\n\n" for c in batch)
        yield b"data: [DONE]\n\n"
    finally:
        await chunks.aclose()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(obj: GenerateReqInput, request: Request):
    engine = request.app.state.engine
    if (obj.text is None) == (obj.input_ids is None):
        return error_response("pass exactly one of text or input_ids", 400, param="text")
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

    return StreamingResponse(sse(chunks, post), media_type="text/event-stream")


# ---- health and info --------------------------------------------------------------------------
def engine_alive(request: Request) -> bool:
    """False once the app shut down, or the engine process (EngineClient) is gone."""
    is_alive = getattr(request.app.state.engine, "is_alive", None)
    return not request.app.state.engine_shut_down and (is_alive is None or is_alive())


@router.get("/health")
async def health(request: Request):
    if not engine_alive(request):
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request):
    """200 once the engine produced a token (or is busy producing others'); 503 otherwise."""
    engine = request.app.state.engine
    if not engine_alive(request):
        return Response(status_code=503)
    load = await run_blocking(request, engine.get_server_info)
    if load["num_in_flight"] and not load.get("paused"):
        return Response(status_code=200)
    try:
        await asyncio.wait_for(engine.async_generate(input_ids=[0], sampling_params={
            "max_new_tokens": 1, "temperature": 0.0}), HEALTH_CHECK_TIMEOUT_S)
    except Exception as e:  # timeout, released memory, shut down: unhealthy, with the reason logged
        logger.warning("health_generate failed: %s: %s", type(e).__name__, e)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request):
    engine = request.app.state.engine
    return JSONResponse({"model_path": getattr(engine, "model_path", engine.args.model_path),
                         "tokenizer_path": getattr(engine, "tokenizer_path", engine.args.model_path),
                         "is_generation": True, "preferred_sampling_params": None,
                         "weight_version": engine.weight_version})


@router.get("/get_server_info")
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
    kv = engine.runner.token_to_kv_pool
    used = max(0, info["max_total_num_tokens"] - kv.available_size())
    return {"info": info, "num_running": info["num_in_flight"] - waiting, "num_waiting": waiting,
            "num_used_tokens": used}


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


# ---- cache and scheduling control -------------------------------------------------------------
@router.api_route("/flush_cache", methods=["GET", "POST"])  # GET kept: slime calls it so (security.py)
async def flush_cache(request: Request):
    ok = await run_blocking(request, request.app.state.engine.flush_cache)
    if ok is False:
        return Response("Cache not flushed: requests are running or waiting.\n", status_code=400)
    return Response("Cache flushed.\n", status_code=200)


class PauseGenerationReqInput(Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


async def _optional_body(request: Request, model: type[BaseModel]):
    """SGLang clients post these with `{}`, with no body, or GET them: all mean the defaults."""
    raw = await request.body()
    if not raw.strip():
        return model()
    return model.model_validate_json(raw)


@router.post("/pause_generation")
async def pause_generation(request: Request):
    obj = await _optional_body(request, PauseGenerationReqInput)
    try:
        await run_blocking(request, request.app.state.engine.pause_generation, mode=obj.mode)
    except Exception as e:
        return engine_error(e)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request):
    await run_blocking(request, request.app.state.engine.continue_generation)
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


class AbortReq(Body):
    rid: str = ""
    abort_all: bool = False


@router.post("/abort_request")
async def abort_request(obj: AbortReq, request: Request):
    try:
        await run_blocking(request, request.app.state.engine.abort_request, rid=obj.rid, abort_all=obj.abort_all)
    except Exception as e:
        return engine_error(e)
    return Response(status_code=200)


# ---- memory -----------------------------------------------------------------------------------
class MemoryOccupationReqInput(Body):
    tags: list[str] | None = None


@router.post("/release_memory_occupation")  # POST only: it changes state (security.py)
async def release_memory_occupation(request: Request):
    return await _memory(request, "release_memory_occupation")


@router.post("/resume_memory_occupation")  # POST only: it changes state (security.py)
async def resume_memory_occupation(request: Request):
    return await _memory(request, "resume_memory_occupation")


async def _memory(request: Request, method: str):
    obj = await _optional_body(request, MemoryOccupationReqInput)
    if not getattr(request.app.state.engine.args, "enable_memory_saver", False):
        # The engine's own message names its keyword argument; an HTTP client needs the server's flag.
        return error_response(f"{method}: this server was started without --enable-memory-saver, so it cannot "
                              f"release memory; restart it with --enable-memory-saver (add "
                              f"--enable-weights-cpu-backup to keep released weights on the host)", 400,
                              param="--enable-memory-saver")
    try:
        await run_blocking(request, getattr(request.app.state.engine, method), obj.tags)
    except Exception as e:
        return engine_error(e)
    return JSONResponse({"success": True, "message": f"{method}({obj.tags}) done"})


# ---- expert distribution (MoE; SGLang's paths) ------------------------------------------------
async def _expert_record(request: Request, method: str):
    fn = getattr(request.app.state.engine, method, None)
    if fn is None:
        return error_response(f"{method}: this engine has no expert distribution recorder", 400)
    try:
        return await run_blocking(request, fn)
    except Exception as e:
        return engine_error(e)


@router.post("/start_expert_distribution_record")  # POST only: it changes state (security.py)
async def start_expert_distribution_record(request: Request):
    out = await _expert_record(request, "start_expert_distribution_record")
    return out if isinstance(out, Response) else Response("Start recording the expert distribution.\n")


@router.post("/stop_expert_distribution_record")  # POST only: it changes state (security.py)
async def stop_expert_distribution_record(request: Request):
    out = await _expert_record(request, "stop_expert_distribution_record")
    return out if isinstance(out, Response) else Response("Stop recording the expert distribution.\n")


@router.post("/dump_expert_distribution_record")  # POST only: it changes state (security.py)
async def dump_expert_distribution_record(request: Request):
    """SGLang writes the record to a server-side file and answers with a line of text; over HTTP the
    record itself is more use, so this answers with it as JSON ({"logical_count": [layer][expert], ...})."""
    out = await _expert_record(request, "dump_expert_distribution_record")
    return out if isinstance(out, Response) else JSONResponse(out)


# ---- weights ----------------------------------------------------------------------------------
def _result(res) -> JSONResponse:
    """Engine (ok, msg) or (ok, msg, num_paused) -> SGLang's {"success", "message"[, ...]}, 200 or 400."""
    ok, msg = res[0], res[1]
    body = {"success": bool(ok), "message": truncate(str(msg))}
    if len(res) > 2:
        body["num_paused_requests"] = res[2]
    return JSONResponse(body, status_code=200 if ok else 400)


async def _abort_all_first(request: Request, abort_all_requests: bool) -> None:
    if abort_all_requests:
        await run_blocking(request, request.app.state.engine.abort_request, abort_all=True)


class UpdateWeightFromDiskReqInput(Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput, request: Request):
    engine = request.app.state.engine
    refused = security.disk_path_refusal(obj.model_path, request.app.state.server_args.allowed_disk_roots)
    if refused is not None:
        return JSONResponse({"success": False, "message": refused, "num_paused_requests": 0}, status_code=400)
    await _abort_all_first(request, obj.abort_all_requests)
    res = await run_blocking(request, engine.update_weights_from_disk, obj.model_path, load_format=obj.load_format,
                             weight_version=obj.weight_version, flush_cache=obj.flush_cache)
    # SGLang always reports how many requests were paused across the update.
    return _result(res if len(res) > 2 else (*res, 0))


class UpdateWeightsFromTensorReqInput(Body):
    serialized_named_tensors: list[str]
    load_format: Literal["flattened_bucket", "cuda_ipc", "delta"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput, request: Request):
    """Each entry of serialized_named_tensors is one TP rank's payload (tensor_codec.py documents it)."""
    engine = request.app.state.engine
    tp = engine.args.tp_size
    if len(obj.serialized_named_tensors) not in (1, tp):
        return error_response(f"serialized_named_tensors has {len(obj.serialized_named_tensors)} entries; "
                              f"expected 1 or tp_size={tp}", 400, param="serialized_named_tensors")
    try:  # decoded where the engine runs (its own process by default): the tensors never cross a pipe
        res = await run_on_engine(request, decode_and_update, obj.serialized_named_tensors[0], obj.load_format,
                                  obj.flush_cache, obj.weight_version, obj.abort_all_requests)
    except PayloadError as e:
        return error_response(str(e), 400, param="serialized_named_tensors")
    return _result(res)


class InitWeightsUpdateGroupReqInput(Body):
    master_address: str
    master_port: int | str  # SGLang's clients often send "29500"; the engine parses and names a bad one
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str | None = None  # SGLang defaults to nccl; None lets the engine pick for its device
    timeout_s: float | None = None  # ours: the join's deadline; default --weight-group-join-timeout-s


@router.post("/init_weights_update_group")
async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput, request: Request):
    """Joins wait on the network: they run in their own pool, at most --max-concurrent-weight-group-joins
    at once (more get 503), so a join to a dead address never holds up a control call."""
    state = request.app.state
    limit = state.server_args.max_concurrent_weight_group_joins
    if obj.timeout_s is not None and not 0 < obj.timeout_s <= 3600:
        return error_response(f"timeout_s must be in (0, 3600] seconds, got {obj.timeout_s}", 400, param="timeout_s")
    if state.num_joins >= limit:
        return error_response(f"{state.num_joins} weight update group joins are already in progress; this server "
                              f"runs at most --max-concurrent-weight-group-joins {limit} at once: retry later", 503)
    kwargs = obj.model_dump(exclude_none=True)
    kwargs["timeout_s"] = obj.timeout_s or state.server_args.weight_group_join_timeout_s
    state.num_joins += 1  # only the event loop touches it
    try:
        loop = asyncio.get_running_loop()
        res = await loop.run_in_executor(state.join_executor,
                                         functools.partial(state.engine.init_weights_update_group, **kwargs))
    finally:
        state.num_joins -= 1
    return _result(res)


class UpdateWeightsFromDistributedReqInput(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput, request: Request):
    """SGLang's transfer modes: load_format null = one broadcast per tensor in its own dtype;
    "flattened_bucket" = one broadcast of the bucket's bytes. The format goes to the Engine only when
    set, so an Engine without that mode refuses it by name (400)."""
    engine = request.app.state.engine
    kwargs = dict(group_name=obj.group_name, flush_cache=obj.flush_cache, weight_version=obj.weight_version)
    if obj.load_format is not None:
        kwargs["load_format"] = obj.load_format
    await _abort_all_first(request, obj.abort_all_requests)
    try:
        res = await run_blocking(request, engine.update_weights_from_distributed, obj.names, obj.dtypes, obj.shapes,
                                 **kwargs)
    except Exception as e:
        return engine_error(e)
    return _result(res)


class DestroyWeightsUpdateGroupReqInput(Body):
    group_name: str = "weight_update_group"


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput, request: Request):
    try:
        res = await run_blocking(request, request.app.state.engine.destroy_weights_update_group, obj.group_name)
    except Exception as e:
        return engine_error(e)
    return _result(res if isinstance(res, tuple) else (True, f"destroyed weight update group {obj.group_name!r}"))


@router.get("/get_weight_version")
async def get_weight_version(request: Request):
    return JSONResponse({"weight_version": request.app.state.engine.weight_version})


class UpdateWeightVersionReqInput(Body):
    new_version: str
    abort_all_requests: bool = False


@router.post("/update_weight_version")
async def update_weight_version(obj: UpdateWeightVersionReqInput, request: Request):
    engine = request.app.state.engine
    await run_blocking(request, engine.update_weight_version, obj.new_version, obj.abort_all_requests)
    return JSONResponse({"success": True, "message": f"Weight version updated to {obj.new_version}",
                         "new_version": obj.new_version})


class GetWeightsByNameReqInput(Body):
    name: str
    truncate_size: int = 100


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(obj: GetWeightsByNameReqInput, request: Request):
    try:
        out = await run_blocking(request, request.app.state.engine.get_weights_by_name, obj.name, obj.truncate_size)
    except Exception as e:
        return engine_error(e)
    if out is None:
        return error_response(f"Get parameter by name failed: no weight {obj.name!r}", 400, param="name")
    return JSONResponse(out.tolist() if hasattr(out, "tolist") else out)


@router.api_route("/get_weights_checksum", methods=["GET", "POST"])
async def get_weights_checksum(request: Request):
    t0 = time.perf_counter()
    out = await run_blocking(request, request.app.state.engine.get_weights_checksum)
    out.setdefault("seconds", round(time.perf_counter() - t0, 6))
    return JSONResponse(out)
