"""SGLang's native control endpoints: cache, scheduling, memory and the MoE expert-distribution record.

/flush_cache, /freeze_gc, /pause_generation (abort, retract or in_place), /continue_generation, /drain, /abort_request,
/release_memory_occupation and /resume_memory_occupation (refused with the server flag to restart with
when the memory saver is off), SGLang's three expert-distribution paths (a dense engine answers 400), and
/start_profile and /stop_profile (torch.profiler traces of the engine's steps, rollout/profiler.py).
Each engine call blocks on the engine lock, so it runs in the server's thread pool; the engine's error
becomes the 400 body.

What it does not do: generate or report (native.py), or touch weights (native_weights.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, field_validator

from rollout.server import security
from rollout.server.common import JSONResponse, SGLangReqBody, engine_error, error_response, run_blocking
from rollout.server.gc_freeze import freeze_heap
from rollout.server.native import Body

router = APIRouter()
DRAIN_POLL_S = 0.05


# ---- cache and scheduling control -------------------------------------------------------------
@router.api_route("/flush_cache", methods=["GET", "POST"])  # GET kept: slime calls it so (security.py)
async def flush_cache(request: Request):
    ok = await run_blocking(request, request.app.state.engine.flush_cache)
    if not ok:  # a FlushCacheReqOutput (falsy when refused), or a bool
        return Response("Cache not flushed: requests are running or waiting.\n", status_code=400)
    return Response("Cache flushed.\n", status_code=200)


@router.api_route("/freeze_gc", methods=["GET", "POST"])
async def freeze_gc(request: Request):
    """SGLang's /freeze_gc: every object alive now, in this process and in the engine's, moves to the
    permanent generation, so later collections skip it (the server already did so once when it started)."""
    freeze_heap()
    await run_blocking(request, request.app.state.engine.freeze_gc)
    return Response("Garbage collection frozen.\n", status_code=200)


class PauseGenerationReqInput(SGLangReqBody):
    mode: Literal["abort", "retract", "in_place"] | None = None  # None: from the flags below, else "abort"
    # Older SGLang clients' spelling of the mode: retract_all -> "retract", abort_all -> "abort", only
    # false ones -> "in_place" (nothing aborted or retracted).
    abort_all: bool | None = None
    retract_all: bool | None = None

    def resolved_mode(self) -> str:
        """The mode asked for; ValueError when the fields contradict each other."""
        if self.abort_all and self.retract_all:
            raise ValueError("abort_all and retract_all are both true: pass one (or mode)")
        flags = None
        if self.abort_all or self.retract_all:
            flags = "abort" if self.abort_all else "retract"
        elif self.abort_all is False or self.retract_all is False:
            flags = "in_place"
        if self.mode is not None and flags is not None and flags != self.mode:
            raise ValueError(f"mode={self.mode!r} contradicts abort_all={self.abort_all}, "
                             f"retract_all={self.retract_all} (which mean {flags!r})")
        return self.mode or flags or "abort"


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
        mode = obj.resolved_mode()
    except ValueError as e:
        return error_response(str(e), 400, param="mode")
    try:
        await run_blocking(request, request.app.state.engine.pause_generation, mode=mode)
    except Exception as e:
        return engine_error(e)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request):
    await run_blocking(request, request.app.state.engine.continue_generation)
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


class DrainReqInput(Body):
    model_config = {**Body.model_config, "strict": False}  # timeout: JSON 5 and 5.0 alike
    timeout: float | None = None

    @field_validator("timeout")
    @classmethod
    def _a_number(cls, v):
        if v is not None and math.isnan(v):  # NaN compares false to every deadline: it would read as 0
            raise ValueError("must be a number of seconds or null, not NaN")
        return v


@router.post("/drain")  # POST only, as SGLang
async def drain(request: Request):
    """Wait until no request is in flight or `timeout` seconds pass: {"success", "remaining_requests"}.
    The wait is on the event loop, polling a non-blocking drain(0), so drains never hold the control pool's
    threads (eight clients draining with no timeout must not lock out /abort_request); it ends early if
    the client goes away."""
    obj = await _optional_body(request, DrainReqInput)
    engine = request.app.state.engine
    deadline = None if obj.timeout is None else time.monotonic() + max(0.0, obj.timeout)
    try:
        while True:
            out = await run_blocking(request, engine.drain, 0)
            if out["success"] or (deadline is not None and time.monotonic() >= deadline):
                return JSONResponse(out)
            if await request.is_disconnected():
                return Response(status_code=499)
            await asyncio.sleep(DRAIN_POLL_S)
    except Exception as e:
        return engine_error(e)


class AbortReq(Body):
    rid: str = ""
    abort_all: bool = False
    # SGLang's: abort_message becomes the aborted requests' finish_reason message; finished_reason (what
    # SGLang's tokenizer manager reports for a request aborted before it was scheduled) is accepted, and
    # the finish reason here is always {"type": "abort", "message"}.
    abort_message: str | None = None
    finished_reason: dict[str, Any] | None = None


@router.post("/abort_request")
async def abort_request(obj: AbortReq, request: Request):
    try:
        await run_blocking(request, request.app.state.engine.abort_request, rid=obj.rid, abort_all=obj.abort_all,
                           **({} if obj.abort_message is None else {"abort_message": obj.abort_message}))
    except Exception as e:
        return engine_error(e)
    return Response(status_code=200)


# ---- memory -----------------------------------------------------------------------------------
class MemoryOccupationReqInput(SGLangReqBody):
    tags: list[str] | None = None
    # verl posts it with every release (and SGLang's bodies ignore keys they do not know): there is no KV
    # connector here to reset, so it changes nothing.
    reset_connector: bool | None = None


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
    # None and [] both mean every tag, as in SGLang: say so rather than echo an empty list.
    return JSONResponse({"success": True, "message": f"{method}({obj.tags or 'every tag'}) done"})


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


# ---- torch profiler (SGLang's paths) ------------------------------------------------------------
class ProfileReqInput(SGLangReqBody):
    path_fields = ("output_dir",)
    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    profile_by_stage: bool = False
    with_stack: bool | None = None
    record_shapes: bool | None = None


@router.post("/start_profile")  # POST only: it changes state and writes files (security.py)
async def start_profile(request: Request):
    """Profile the engine's steps (rollout/profiler.py); 400 for bad arguments or a profile already running.
    With --allowed-disk-roots, output_dir must lie under one of them."""
    obj = await _optional_body(request, ProfileReqInput)
    roots = request.app.state.server_args.allowed_disk_roots
    if obj.output_dir is not None and security.disk_path_refusal(obj.output_dir, roots) is not None:
        return error_response(f"start_profile refused: output_dir is not under --allowed-disk-roots {list(roots)}",
                              400, param="output_dir")
    try:
        message = await run_blocking(request, request.app.state.engine.start_profile,
                                     **obj.model_dump(exclude={"rid"}))
    except Exception as e:
        return engine_error(e)
    return JSONResponse({"success": True, "message": message})


@router.post("/stop_profile")  # POST only: it changes state and writes files (security.py)
async def stop_profile(request: Request):
    """Stop the running profile and write its trace; 400 when none is running."""
    await _optional_body(request, Body)  # `{}` or nothing
    try:
        message = await run_blocking(request, request.app.state.engine.stop_profile)
    except Exception as e:
        return engine_error(e)
    return JSONResponse({"success": True, "message": message})
