"""SGLang's native weight endpoints: updates (disk, tensors, distributed groups), version, reads, and the
weight checker and post-processing calls slime makes around a sync (/weights_checker, /post_process_weights).

Same paths, bodies and answers as SGLang (`{"success", "message"[, "num_paused_requests"]}`, 200 or 400).
Disk paths are checked against --allowed-disk-roots (security.py); tensor payloads are decoded where the
engine runs (tensor_codec.py), so the tensors never cross the engine pipe; group joins run in their own
bounded pool, so a join to a dead address never holds up a control call.

What it does not do: generate, report or control scheduling (native.py, native_control.py), or decode
payloads itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Literal

import torch
from fastapi import APIRouter, Request

from rollout.server import security
from rollout.server.common import (
    JSONResponse,
    SGLangReqBody,
    engine_error,
    error_body,
    error_response,
    run_blocking,
    run_on_engine,
    truncate,
)
from rollout.server.limits import json_response_off_loop
from rollout.server.tensor_codec import PayloadError, decode_and_update, only_if_set
from runner.weights.routes import TooManyValues

router = APIRouter()
logger = logging.getLogger(__name__)


# ---- weights ----------------------------------------------------------------------------------
def _result(res) -> JSONResponse:
    """Engine (ok, msg) or (ok, msg, num_paused) -> SGLang's {"success", "message"[, ...]}, 200 or 400."""
    ok, msg = res[0], res[1]
    body = {"success": bool(ok), "message": truncate(str(msg))}
    if len(res) > 2:
        body["num_paused_requests"] = res[2]
    return JSONResponse(body, status_code=200 if ok else 400)


class UpdateWeightFromDiskReqInput(SGLangReqBody):
    path_fields = ("model_path",)
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    # True: requests in flight are retracted and go on under the new weights (no pause needed);
    # False: an update with requests running and generation not paused is refused (400).
    online: bool = False
    # SGLang's other fields, accepted (README "SGLang's request fields"): the load is done when the reply
    # comes, async or not; an update never changes the pause state; captured decode steps read the weights in
    # place, so there is nothing to recapture; token_step is not reported. torch_empty_cache is honoured.
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict[str, Any] | None = None  # refused when given: what it would select is not implemented


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput, request: Request):
    engine = request.app.state.engine
    refused = security.disk_path_refusal(obj.model_path, request.app.state.server_args.allowed_disk_roots)
    if refused is None and obj.manifest is not None:
        refused = "manifest: loading by a tensor manifest is not supported here; load the checkpoint without one"
    if refused is not None:
        return JSONResponse({"success": False, "message": refused, "num_paused_requests": 0}, status_code=400)
    res = await run_blocking(request, engine.update_weights_from_disk, obj.model_path, load_format=obj.load_format,
                             weight_version=obj.weight_version, flush_cache=obj.flush_cache,
                             **only_if_set(online=obj.online, abort_all_requests=obj.abort_all_requests))
    if obj.torch_empty_cache:
        await _empty_cache_after(request)
    # SGLang always reports how many requests were paused across the update.
    return _result(res if len(res) > 2 else (*res, 0))


class UpdateWeightsFromTensorReqInput(SGLangReqBody):
    serialized_named_tensors: list[str]
    # "direct": the tensors are named as the runner's parameters (fused qkv_proj ...), as in-process
    load_format: Literal["flattened_bucket", "cuda_ipc", "delta", "direct"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    force: bool = False  # as /update_weights_from_disk's `online`: update now, retracting requests in flight
    torch_empty_cache: bool = False  # SGLang's: honoured
    disable_draft_model: bool = False  # SGLang's: there is no draft model to leave out


def empty_device_cache(engine) -> None:
    """SGLang's torch_empty_cache after an update: the CUDA caching allocator's free blocks go back to the
    driver (run where the engine lives; nothing on the CPU)."""
    if getattr(getattr(engine.runner, "device", None), "type", "cpu") == "cuda":
        torch.cuda.empty_cache()


async def _empty_cache_after(request: Request) -> None:
    """torch_empty_cache after an update: its failure (the engine gone meanwhile) changes nothing the update did."""
    try:
        await run_on_engine(request, empty_device_cache)
    except Exception:  # noqa: BLE001 - the update's own answer stands; the next call meets the engine's state
        logger.exception("torch_empty_cache after a weight update failed")


def _refused(message: str, param: str) -> JSONResponse:
    """A 400 that SGLang's clients read (`{"success": false, "message"}`, as every weight route's answer)
    and that also names the parameter (`error`, this server's shape for bad requests)."""
    return JSONResponse({"success": False, "message": truncate(message), **error_body(message, 400, param)},
                        status_code=400)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput, request: Request):
    """Each entry of serialized_named_tensors is one TP rank's payload (tensor_codec.py documents it)."""
    engine = request.app.state.engine
    tp = engine.args.tp_size
    if len(obj.serialized_named_tensors) not in (1, tp):
        return _refused(f"serialized_named_tensors has {len(obj.serialized_named_tensors)} entries; "
                        f"expected 1 or tp_size={tp}", "serialized_named_tensors")
    # SGLang's clients send one entry per TP rank; the engine slices the full tensors for its ranks itself, so
    # every entry must be the same payload: one that differs would otherwise be dropped unread.
    # (CUDA IPC descriptors are exempt: a sender may name each rank's own device in its entry)
    differs = None if obj.load_format == "cuda_ipc" else next(
        (i for i, x in enumerate(obj.serialized_named_tensors) if x != obj.serialized_named_tensors[0]), None)
    if differs is not None:
        return _refused(f"serialized_named_tensors[{differs}] differs from serialized_named_tensors[0]: give one "
                        f"entry, or one per TP rank, each the same full payload (the engine slices it for its "
                        f"ranks)", "serialized_named_tensors")
    try:  # decoded where the engine runs (its own process by default): the tensors never cross a pipe
        res = await run_on_engine(request, decode_and_update, obj.serialized_named_tensors[0], obj.load_format,
                                  obj.flush_cache, obj.weight_version, obj.abort_all_requests, obj.force)
    except PayloadError as e:
        return _refused(str(e), "serialized_named_tensors")
    if obj.torch_empty_cache:
        await _empty_cache_after(request)
    return _result(res)


class InitWeightsUpdateGroupReqInput(SGLangReqBody):
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
    kwargs = obj.model_dump(exclude_none=True, exclude={"rid"})
    kwargs["timeout_s"] = obj.timeout_s or state.server_args.weight_group_join_timeout_s
    state.num_joins += 1  # only the event loop touches it
    try:
        loop = asyncio.get_running_loop()
        res = await loop.run_in_executor(state.join_executor,
                                         functools.partial(state.engine.init_weights_update_group, **kwargs))
    finally:
        state.num_joins -= 1
    return _result(res)


class UpdateWeightsFromDistributedReqInput(SGLangReqBody):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False  # SGLang's: honoured


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput, request: Request):
    """SGLang's transfer modes: load_format null = one broadcast per tensor in its own dtype;
    "flattened_bucket" = one broadcast of the bucket's bytes. The format goes to the Engine only when
    set, so an Engine without that mode refuses it by name (400)."""
    engine = request.app.state.engine
    kwargs = dict(group_name=obj.group_name, flush_cache=obj.flush_cache, weight_version=obj.weight_version)
    if obj.load_format is not None:
        kwargs["load_format"] = obj.load_format
    try:
        res = await run_blocking(request, engine.update_weights_from_distributed, obj.names, obj.dtypes, obj.shapes,
                                 **kwargs, **only_if_set(abort_all_requests=obj.abort_all_requests))
    except Exception as e:
        return engine_error(e)
    if obj.torch_empty_cache:
        await _empty_cache_after(request)
    return _result(res)


class DestroyWeightsUpdateGroupReqInput(SGLangReqBody):
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


class UpdateWeightVersionReqInput(SGLangReqBody):
    new_version: str
    abort_all_requests: bool = True  # SGLang's default


@router.post("/update_weight_version")
async def update_weight_version(obj: UpdateWeightVersionReqInput, request: Request):
    engine = request.app.state.engine
    await run_blocking(request, engine.update_weight_version, obj.new_version, obj.abort_all_requests)
    return JSONResponse({"success": True, "message": f"Weight version updated to {obj.new_version}",
                         "new_version": obj.new_version})


class GetWeightsByNameReqInput(SGLangReqBody):
    name: str
    truncate_size: int = 100


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(obj: GetWeightsByNameReqInput, request: Request):
    try:
        # As a generate response, bounded by --max-response-entries: a whole embedding as JSON is gigabytes.
        limit = request.app.state.server_args.max_response_entries
        out = await run_blocking(request, request.app.state.engine.get_weights_by_name, obj.name, obj.truncate_size,
                                 max_values=limit)
    except TooManyValues as e:
        return error_response(f"{e} (this server's limit is --max-response-entries {limit})", 400,
                              param="truncate_size")
    except Exception as e:
        return engine_error(e)
    if out is None:
        return error_response(f"Get parameter by name failed: no weight {obj.name!r}", 400, param="name")
    return await json_response_off_loop(request, lambda: out)  # up to --max-response-entries floats: off the loop


@router.api_route("/get_weights_checksum", methods=["GET", "POST"])
async def get_weights_checksum(request: Request):
    t0 = time.perf_counter()
    try:
        out = await run_blocking(request, request.app.state.engine.get_weights_checksum)
    except Exception as e:  # released weights, a shut-down engine: said by name, as get_weights_by_name does
        return engine_error(e)
    out.setdefault("seconds", round(time.perf_counter() - t0, 6))
    return JSONResponse(out)


# ---- weight checker and post-processing (slime's check-weight-update mode) ----------------------
class PostProcessWeightsReqInput(SGLangReqBody):
    restore_weights_before_load: bool = False
    post_process_quantization: bool = False


@router.post("/post_process_weights")
async def post_process_weights(obj: PostProcessWeightsReqInput, request: Request):
    """SGLang's post-processing after a sync (quantized re-packing): nothing to do here, said so (200)."""
    res = await run_blocking(request, request.app.state.engine.post_process_weights,
                             restore_weights_before_load=obj.restore_weights_before_load,
                             post_process_quantization=obj.post_process_quantization)
    return _result(res)


class WeightsCheckerReqInput(SGLangReqBody):
    action: str  # "snapshot" | "reset_tensors" | "compare" | "checksum"; the engine names the valid ones otherwise


@router.post("/weights_checker")
async def weights_checker(obj: WeightsCheckerReqInput, request: Request):
    """SGLang's WeightChecker: {"success", "message"}, 400 for an unknown action, a compare without a
    snapshot, a compare that finds differences (naming them), or a reset refused under running requests."""
    engine = request.app.state.engine
    if obj.action == "checksum" and getattr(engine.args, "tp_size", 1) == 1:
        # SGLang's answer carries the hashes: {"success", "message", "ranks": [{"checksums", "parallelism_info"}]}
        try:
            ranks = await run_blocking(request, engine.weights_checksums)
        except Exception as e:
            return engine_error(e)
        return JSONResponse({"success": True, "message": f"{len(ranks[0]['checksums'])} parameters hashed",
                             "ranks": ranks})
    return _result(await run_blocking(request, engine.check_weights, obj.action))
