"""SGLang's LoRA endpoints, and the adapter an OpenAI request names in `model`.

`/load_lora_adapter` {"lora_name", "lora_path", "pinned"}, `/unload_lora_adapter` {"lora_name"},
`/load_lora_adapter_from_tensors` {"lora_name", "config_dict", "serialized_tensors", "load_format",
"pinned"}: the tensors are one base64 safetensors blob (rollout/server/tensor_codec.py, never a pickle),
PEFT-named, or a flattened bucket with load_format="flattened_bucket". Each answers SGLang's
{"success", "error_message", "loaded_adapters"} with 200, or 400 when refused. OpenAI's `model` is the
served model name (the base), a loaded adapter's name, or "<base>:<adapter>", as SGLang reads it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rollout.server.common import SGLangReqBody, error_response, run_blocking, run_on_engine
from rollout.server.tensor_codec import PayloadError, decode_buckets, decode_named_tensors

router = APIRouter()


def _answer(res) -> JSONResponse:
    return JSONResponse(res.to_dict(), status_code=200 if res.success else 400)


class LoadLoRAAdapterReqInput(SGLangReqBody):
    path_fields = ("lora_path",)
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterReqInput(SGLangReqBody):
    lora_name: str


class LoadLoRAAdapterFromTensorsReqInput(SGLangReqBody):
    lora_name: str
    config_dict: dict[str, Any]
    serialized_tensors: str
    load_format: Literal["flattened_bucket"] | None = None
    pinned: bool = False
    added_tokens_config: dict | None = None


def _name_refusal(request: Request, lora_name: str) -> JSONResponse | None:
    """An adapter may not take the served model's name: OpenAI's `model` field could not tell them apart."""
    if lora_name == request.app.state.model_name:
        return error_response(f"lora_name {lora_name!r} is the served model's name (OpenAI requests choose an "
                              f"adapter by `model`): give the adapter another name", 400, param="lora_name")
    return None


@router.post("/load_lora_adapter")
async def load_lora_adapter(obj: LoadLoRAAdapterReqInput, request: Request):
    engine = request.app.state.engine
    if (refused := _name_refusal(request, obj.lora_name)) is not None:
        return refused
    return _answer(await run_blocking(request, engine.load_lora_adapter, obj.lora_name, obj.lora_path, obj.pinned))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(obj: UnloadLoRAAdapterReqInput, request: Request):
    engine = request.app.state.engine
    return _answer(await run_blocking(request, engine.unload_lora_adapter, obj.lora_name))


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(obj: LoadLoRAAdapterFromTensorsReqInput, request: Request):
    if (refused := _name_refusal(request, obj.lora_name)) is not None:
        return refused
    if obj.added_tokens_config:
        return error_response("added_tokens_config is not supported (adapters cannot add tokens here)", 400,
                              param="added_tokens_config")
    try:  # decoded where the engine runs (its own process by default): the tensors never cross a pipe
        res = await run_on_engine(request, decode_and_load_adapter, obj.lora_name, obj.serialized_tensors,
                                  obj.config_dict, obj.load_format, obj.pinned)
    except PayloadError as e:
        return error_response(str(e), 400, param="serialized_tensors")
    return _answer(res)


def decode_and_load_adapter(engine, lora_name: str, serialized: str, config_dict: dict, load_format: str | None,
                            pinned: bool):
    """/load_lora_adapter_from_tensors next to the engine: decode (PayloadError if malformed), then load."""
    try:
        if load_format == "flattened_bucket":
            tensors = decode_buckets(serialized, "serialized_tensors")
        else:
            tensors = decode_named_tensors(serialized, "serialized_tensors")
    except ValueError as e:
        raise PayloadError(str(e)) from None
    return engine.load_lora_adapter_from_tensors(lora_name, tensors, config_dict, load_format=load_format,
                                                 pinned=pinned)


def lora_of_model(request: Request, model: str | None) -> str | None:
    """OpenAI `model` -> the adapter name (None: the base model). "<base>:<adapter>" names an adapter of
    the served model; a bare loaded adapter name works too; anything else is the base, as before."""
    if not model:
        return None
    loaded = request.app.state.engine.runner.lora_adapters()
    base = request.app.state.model_name
    if model in loaded and model != base:  # a loaded name as given, before reading "<base>:" off it
        return model  # (an adapter named "<base>:x" is listed under that id, so that id must reach it)
    if model.startswith(f"{base}:"):
        name = model[len(base) + 1:]
        if name not in loaded:
            raise ValueError(f"LoRA adapter {name!r} (model {model!r}) is not loaded; loaded: {sorted(loaded)}")
        return name
    return None


def adapter_cards(request: Request, card: dict) -> list[dict]:
    """/v1/models entries of the loaded adapters, after the base model's `card`."""
    return [{**card, "id": name, "root": info["path"], "parent": card["id"]}
            for name, info in request.app.state.engine.runner.lora_adapters().items()]
