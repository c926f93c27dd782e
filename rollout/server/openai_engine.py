"""What the OpenAI-compatible routes (rollout/server/openai_api.py) share around the engine.

Text prompts tokenized off the event loop and sized (`prepare`); one engine call for every choice
(`generate_all`); one engine stream per streamed choice, merged as chunks come (`stream_choices`; choice j
of a seeded request uses seed + j) and started so that a bad request is a 400 before the stream begins
(`start_stream`); cumulative text turned into deltas that never split a UTF-8 character or a possible stop
match (`TextDelta`, per choice: `choice_texts`); the SSE body (`data: {...}` then `data: [DONE]`, errors in-band); engine errors
reworded with the OpenAI field names the client sent (`openai_error`); finish reasons, usage, metadata.

What it does not do: define routes or response bodies (openai_api.py), or validate request bodies
(openai_protocol.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from rollout.engine import Engine, sample_seed
from rollout.server import limits
from rollout.server.common import dumps, engine_error, error_response, run_blocking
from rollout.server.lora import lora_of_model
from rollout.server.native import await_unless_disconnected
from rollout.server.sse_response import SSEResponse


def openai_names(max_tokens_field: str = "max_tokens") -> dict[str, str]:
    """Engine sampling keys -> the OpenAI request fields they came from (the others are spelled alike)."""
    return {"max_new_tokens": max_tokens_field, "min_new_tokens": "min_tokens"}


def openai_error(e: Exception, names: dict[str, str]) -> Response:
    """engine_error, with the Engine's key names replaced by the OpenAI fields the client sent, and
    `param` set to the first of them: an OpenAI client never sent `max_new_tokens`."""
    resp = engine_error(e)
    error = json.loads(resp.body)["error"]
    message, param = error["message"], error["param"]  # engine_error's wording (and any shortening)
    if param and param.startswith("sampling_params."):  # the OpenAI body has these at its top level
        key = param.removeprefix("sampling_params.")
        param = names.get(key, key)
    hits = sorted((m.start(), names[k]) for k in names if (m := re.search(rf"\b{k}\b", message)))
    if hits:
        param = hits[0][1]  # in the message's order: the first one named is the param
        for engine_key, field in names.items():
            message = re.sub(rf"\b{engine_key}\b", field, message)
    return error_response(message, resp.status_code, param=param)


def finish_of(meta: dict) -> tuple[str | None, Any]:
    """-> (OpenAI finish_reason, matched stop string/token id or None)."""
    fr = meta.get("finish_reason")
    if not fr:
        return None, None
    return fr["type"], fr.get("matched") if fr["type"] == "stop" else None


def metadata_of(outs: list[dict]) -> dict:
    """SGLang's response `metadata`: the weight version that finished the request (its first choice), and the
    version spans of its tokens. OpenAI types metadata as a map of strings (the openai client validates it so),
    so the spans go in as JSON text: `json.loads(metadata["weight_versions"])` gives meta_info's list."""
    if not outs:
        return {"weight_version": None}
    meta = outs[0]["meta_info"]
    out = {"weight_version": meta["weight_version"], "weight_versions": dumps(meta["weight_versions"])}
    if "prefill_weight_versions" in meta:
        out["prefill_weight_versions"] = dumps(meta["prefill_weight_versions"])
    return out


def usage_of(outs: list[dict], n: int, cache_report: bool = False) -> dict:
    """OpenAI's usage of a request's outputs (n per prompt); with cache_report (--enable-cache-report),
    SGLang's prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix cache."""
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])  # each prompt counted once
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cache_report:
        # per prompt, as its prompt_tokens (SGLang counts its first choice's): never more than prompt_tokens
        usage["prompt_tokens_details"] = {"cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs[::n])}
    return usage


def token_text(engine, tid: int, text: str | None) -> str:
    return text if text is not None else (engine.tokenizer.token_text(tid) or "")


async def prepare(request: Request, prompts: list, sampling: dict, num_top: int | None) -> list | Response:
    """Text prompts tokenized off the event loop, and the request's size checked (limits.py)."""
    if prompts and isinstance(prompts[0], str):
        prepared = await limits.prepare_prompts(request, prompts, None)
        if isinstance(prepared, Response):
            return prepared
        prompts = prepared[1] if prepared[1] is not None else prompts
    if prompts and isinstance(prompts[0], list):
        too_much = limits.check_work(request, prompts, sampling, return_logprob=num_top is not None,
                                     top_logprobs_num=num_top or 0)
        if too_much is not None:
            return too_much
    return prompts


async def generate_all(request: Request, prompts: list, sampling: dict, num_top: int | None, rid,
                    names: dict[str, str], model=None, logprob_start_len: int | None = None):
    """One engine call for every choice: the outputs in choice order (prompt-major, then n), or the
    error Response to send (499 for a client gone mid-request, the engine's error otherwise, naming
    the OpenAI fields: `names`)."""
    engine = request.app.state.engine
    key = "input_ids" if prompts and isinstance(prompts[0], list) else "prompt"
    if len(prompts) == 1 and sampling.get("n", 1) == 1:
        prompts = prompts[0]  # one choice: sent singly, so the request runs as `rid` itself (abortable by it)
    try:
        out = await await_unless_disconnected(request, engine.async_generate(
            **{key: prompts}, sampling_params=sampling, return_logprob=num_top is not None,
            top_logprobs_num=num_top or 0, rid=rid, lora_path=lora_of_model(request, model),
            **({} if logprob_start_len is None else {"logprob_start_len": logprob_start_len})))
    except asyncio.CancelledError:
        return Response(status_code=499)
    except Exception as e:
        return openai_error(e, names)
    return out if isinstance(out, list) else [out]


async def stream_choices(request: Request, prompts: list, sampling: dict, num_top: int | None, model=None,
                         rid: str | list[str] | None = None, logprob_start_len: int | None = None):
    """Yield (choice_index, chunk_dict, is_final) from one engine stream per choice, as they come. The choices
    run as the ids an unstreamed request's would (SGLang's: `rid` for one choice, else `{rid}_{k}`; a list, one
    per prompt, `{rid[i]}_{j}` with n > 1), abortable by those ids."""
    engine = request.app.state.engine
    key = "input_ids" if prompts and isinstance(prompts[0], list) else "prompt"
    n = sampling.get("n", 1)
    queue: asyncio.Queue = asyncio.Queue()
    num = len(prompts) * n
    if rid is None:
        base = uuid.uuid4().hex
        rids = [f"{base}-{k}" for k in range(num)]
    else:
        rids = Engine._expand_rids(rid, [n] * len(prompts), num == 1)
    streams, finished = [], set()

    async def abort_unfinished():
        # A stream never iterated has no generator frame to abort from: abort by id (unknown ids and
        # finished ones are no-ops for the engine).
        for k in range(len(streams)):
            if k not in finished:
                try:
                    await run_blocking(request, engine.abort_request, rids[k])
                except Exception:  # noqa: BLE001 - finished in the meantime
                    pass

    try:  # start all (each validated by the engine) before any runs; a refusal aborts those started
        lora_path = lora_of_model(request, model)
        for p in prompts:
            for j in range(n):
                sp = {**sampling, "n": 1}
                if sp.get("seed") is not None:  # choice j as the Engine seeds sample j of n (unstreamed)
                    sp["seed"] = sample_seed(sp["seed"], j)
                streams.append(await engine.async_generate(
                    **{key: p}, sampling_params=sp, stream=True, return_logprob=num_top is not None,
                    top_logprobs_num=num_top or 0, rid=rids[len(streams)], lora_path=lora_path,
                    **({} if logprob_start_len is None else {"logprob_start_len": logprob_start_len})))
                streams[-1].segments = False  # OpenAI deltas are cut from cumulative chunks here, whatever --stream-output
    except BaseException:
        await abort_unfinished()
        raise

    async def pump(index, stream):
        try:
            async for chunk in stream:
                await queue.put((index, chunk, chunk["meta_info"]["finish_reason"] is not None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer as an error event
            await queue.put((index, e, True))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while len(finished) < len(tasks):
            index, chunk, final = await queue.get()
            if isinstance(chunk, Exception):
                raise chunk
            if final:
                finished.add(index)
            yield index, chunk, final
    finally:  # a client gone mid-stream: cancel every pump and abort what is still generating
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await abort_unfinished()


async def start_stream(request: Request, prompts: list, sampling: dict, num_top: int | None, model,
                       names: dict[str, str], rid: str | list[str] | None = None, logprob_start_len: int | None = None):
    """-> (the merged choice stream, its first item), or the error Response: every stream is started (and
    validated by the engine) before the status line is sent, so a bad request is still a 400. A client gone
    before the first item (a request waiting out a pause) aborts its choices then, as an unstreamed one (499)."""
    try:
        merged = stream_choices(request, prompts, sampling, num_top, model, rid, logprob_start_len)
        first = await await_unless_disconnected(request, merged.__anext__())
    except asyncio.CancelledError:
        return Response(status_code=499)  # stream_choices aborted every choice on its way out
    except Exception as e:
        return openai_error(e, names)
    return merged, first


def logprob_pairs(meta: dict, prompt: bool = False) -> list:
    """A final output's (token logprob entry, its top logprobs or None) per output token; `prompt`: per prompt
    token first (the first one's logprob None), as echo shows them."""
    pairs = []
    for kind in (("input", "output") if prompt else ("output",)):
        entries = meta[f"{kind}_token_logprobs"]
        tops = meta.get(f"{kind}_top_logprobs") or [None] * len(entries)
        pairs += list(zip(entries, [t or None for t in tops]))
    return pairs


# A tokenizer that cleans up tokenization spaces rewrites the text's tail when the next token comes (" ," becomes
# ",", " n't" becomes "n't"): a stream holds back this many characters, the longest such rewrite less one.
CLEAN_UP_TAIL = len(" n't") - 1


def rewritten_tail(engine) -> int:
    """TextDelta's `tail` for this engine's tokenizer."""
    return CLEAN_UP_TAIL if getattr(engine.tokenizer, "cleans_up_spaces", False) else 0


class TextDelta:
    """Turns cumulative stream text into deltas. Holds back a trailing partial UTF-8 character, when
    stop strings are set the last len(longest stop) - 1 characters (they may become a stop match that
    the final text trims), and `tail` characters a later token may rewrite (CLEAN_UP_TAIL). A text that
    still rewrote what was sent goes on from the same length (as SGLang's incremental detokenizer does),
    rather than sending nothing more."""

    def __init__(self, stop, tail: int = 0) -> None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        self.hold = max(max((len(s) for s in stops), default=1) - 1, tail)
        self.sent = ""
        self.num_tokens = 0
        self.text_offset = 0  # /v1/completions logprobs: where the next token's text starts
        self.context: list[int] | None = None  # and the last tokens before the next chunk's (None: none yet)

    def step(self, text: str | None, final: bool) -> str:
        text = text or ""
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: max(0, len(text) - self.hold)]
        if len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def new_logprobs(self, meta: dict) -> list:
        entries = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [None] * len(entries)
        new = list(zip(entries[self.num_tokens:], tops[self.num_tokens:]))
        self.num_tokens = len(entries)
        return new


async def choice_texts(first, merged, stop, num_choices: int, finals: dict[int, dict], tail: int = 0):
    """Yield (choice index, chunk, is_final, new text, the choice's TextDelta) for `first` and every later
    item of the merged stream (`start_stream`); each choice's final chunk is also kept in `finals`. `tail`:
    TextDelta's, for a tokenizer that rewrites the text's tail."""
    deltas = [TextDelta(stop, tail) for _ in range(num_choices)]
    item = first
    while item is not None:
        i, chunk, final = item
        d = deltas[i]
        text = d.step(chunk.get("text"), final)
        if final:
            finals[i] = chunk
        yield i, chunk, final, text, d
        item = await anext(merged, None)


def sse_response(gen) -> SSEResponse:
    async def body():
        try:
            async for item in gen:
                yield f"data: {dumps(item)}\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band as OpenAI does
            yield f"data: {dumps({'error': {'message': str(e), 'type': type(e).__name__, 'code': 400}})}\n\n"
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    return SSEResponse(body())


async def closing(gen, inner):
    """Iterate `gen`; on close (normal end or client gone) close `inner` too."""
    try:
        async for item in gen:
            yield item
    finally:
        await gen.aclose()
        await inner.aclose()
