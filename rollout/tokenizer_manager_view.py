"""`engine.tokenizer_manager`: the part of SGLang's TokenizerManager that RL code reaches through an Engine.

verl's AsyncEngine subclasses sglang's Engine and awaits `self.tokenizer_manager.<call>(obj, None)` for release,
resume, weight updates and flush, and calls `self.tokenizer_manager.abort_request(rid=, abort_all=)`; other code
reads `engine.tokenizer_manager.tokenizer` (the HF tokenizer) and `engine.tokenizer_manager.server_args`. This
view answers exactly those with the Engine's own methods, each run in a worker thread (`asyncio.to_thread`), so
an awaiting event loop is never blocked by a step or an update. `obj` is SGLang's request object for the call
(`ReleaseMemoryOccupationReqInput(tags=...)`, `UpdateWeightsFromTensorReqInput(serialized_named_tensors=...,
load_format=..., flush_cache=...)`, ...) or a dict with the same field names; fields it lacks take the Engine
method's defaults. Results have the shapes SGLang's manager returns: `(success, message)` for weight updates,
`(success, message, num_paused_requests)` from disk, the flush result, the abort count.

What it does not do: tokenize, detokenize or hold request state (the Engine does), or take SGLang's own
pickled payloads (the Engine refuses them by name; see weight_sync.bucket / weight_sync.wire for the forms
it takes).
"""

from __future__ import annotations

import asyncio
from typing import Any

# GenerateReqInput's fields that Engine.async_generate takes (by these names; `text` becomes `prompt`).
GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                   "token_ids_logprob", "lora_path", "rid", "return_routed_experts", "return_hidden_states",
                   "image_data", "audio_data", "video_data", "custom_logit_processor", "return_original_logprob")
# (return_text_in_logprobs is not passed: in-process outputs carry the text in their final logprob entries)


def _fields(obj, names: tuple[str, ...]) -> dict[str, Any]:
    """The `names` that `obj` (a request object or a dict) sets, by attribute or key; None counts as unset."""
    get = obj.get if isinstance(obj, dict) else (lambda n: getattr(obj, n, None))
    return {n: v for n in names if obj is not None and (v := get(n)) is not None}


class TokenizerManagerView:
    """See the module docstring. Built by `Engine.tokenizer_manager`; holds no state of its own."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def _base(self, name: str):
        """The Engine class's own method, bound: a subclass (verl's AsyncEngine) overrides these names with
        async wrappers that call this view, so the instance's attribute would lead back here."""
        from rollout.engine import Engine

        return getattr(Engine, name).__get__(self._engine)

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer (None with skip_tokenizer_init), as SGLang's manager exposes it."""
        return getattr(self._engine.tokenizer, "tokenizer", None)

    @property
    def server_args(self):
        return self._engine.server_args

    @property
    def model_path(self) -> str:
        return self._engine.args.model_path

    @property
    def is_generation(self) -> bool:
        return True  # generation models only (is_embedding is refused)

    async def generate_request(self, obj, request=None):
        """SGLang's: an async generator of one generate call's outputs (verl's server adapter awaits its first item
        or iterates it). `obj` is a GenerateReqInput or a dict of its fields (`text` is the Engine's `prompt`);
        with `stream` every chunk as it comes (a batch's carry "index"), else the output once (a list for a
        batch), exactly what Engine.async_generate returns for the same arguments."""
        kwargs = _fields(obj, GENERATE_FIELDS)
        if "text" in kwargs:
            kwargs["prompt"] = kwargs.pop("text")
        if _fields(obj, ("stream",)).get("stream"):
            async for chunk in await self._base("async_generate")(**kwargs, stream=True):
                yield chunk
        else:
            yield await self._base("async_generate")(**kwargs)

    async def start_profile(self, **kwargs):
        return await self._run(self._base("start_profile"), **kwargs)

    async def stop_profile(self):
        return await self._run(self._base("stop_profile"))

    async def _run(self, fn, **kwargs):
        return await asyncio.to_thread(fn, **kwargs)

    async def release_memory_occupation(self, obj=None, request=None):
        return await self._run(self._base("release_memory_occupation"), **_fields(obj, ("tags",)))

    async def resume_memory_occupation(self, obj=None, request=None):
        return await self._run(self._base("resume_memory_occupation"), **_fields(obj, ("tags",)))

    async def update_weights_from_tensor(self, obj, request=None) -> tuple[bool, str]:
        kwargs = _fields(obj, ("load_format", "flush_cache", "weight_version", "abort_all_requests"))
        # SGLang's field is serialized_named_tensors (one entry per TP rank); a plain named_tensors is taken too.
        tensors = _fields(obj, ("serialized_named_tensors", "named_tensors"))
        if not tensors:
            return False, "update_weights_from_tensor failed: the request has no serialized_named_tensors"
        named = tensors.get("serialized_named_tensors", tensors.get("named_tensors"))
        return await self._run(self._base("update_weights_from_tensor"), named_tensors=named, **kwargs)

    async def update_weights_from_disk(self, obj, request=None) -> tuple[bool, str, int]:
        kwargs = _fields(obj, ("model_path", "load_format", "weight_version", "flush_cache", "abort_all_requests"))
        return await self._run(self._base("update_weights_from_disk"), **kwargs)

    async def init_weights_update_group(self, obj, request=None) -> tuple[bool, str]:
        kwargs = _fields(obj, ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                               "backend"))
        return await self._run(self._base("init_weights_update_group"), **kwargs)

    async def update_weights_from_distributed(self, obj, request=None) -> tuple[bool, str]:
        kwargs = _fields(obj, ("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format",
                               "weight_version", "abort_all_requests"))
        return await self._run(self._base("update_weights_from_distributed"), **kwargs)

    async def destroy_weights_update_group(self, obj=None, request=None) -> tuple[bool, str]:
        return await self._run(self._base("destroy_weights_update_group"), **_fields(obj, ("group_name",)))

    async def get_weights_by_name(self, obj, request=None):
        return await self._run(self._base("get_weights_by_name"), **_fields(obj, ("name", "truncate_size")))

    async def flush_cache(self):
        return await self._run(self._base("flush_cache"))

    async def pause_generation(self, obj=None):
        return await self._run(self._base("pause_generation"), **_fields(obj, ("mode",)))

    async def continue_generation(self, obj=None):
        return await self._run(self._base("continue_generation"))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """Not awaited (SGLang's is a plain call): aborts at the next step boundary, returns how many."""
        return self._base("abort_request")(rid=rid, abort_all=abort_all)
