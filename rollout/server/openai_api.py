"""OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions over the in-process Engine.

The official `openai` Python client works unchanged against these routes: bodies, streaming chunks
(`data: {...}` then `data: [DONE]`), `n`, `stop`, `seed`, `logprobs` and `usage` follow the OpenAI API
reference; SGLang's extra sampling keys (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, ...) are
accepted as SGLang accepts them. Penalties and `logit_bias` are forwarded to the Engine, which refuses
what it does not implement (400 naming the key).

Chat prompts use `--chat-template` if given, else the tokenizer's own chat template
(rollout/server/chat_template.py); with neither, chat completions are refused (400 naming the flag),
never silently rendered as a plain prompt (`--chat-template plain` asks for that one explicitly).

Streaming several choices (n > 1 or a list of prompts) runs one engine stream per choice; choice j of
a seeded request uses seed + j, so streamed choices are reproducible (though not the same samples as
the non-streamed batch, whose per-choice seeds the Engine derives itself).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from rollout.server import limits
from rollout.server.chat_template import ChatTemplate, NoChatTemplate, resolve_chat_template
from rollout.server.common import JSONResponse, dumps, engine_error, error_response, run_blocking
from rollout.server.lora import adapter_cards, lora_of_model
from rollout.server.native import await_unless_disconnected, check_n

router = APIRouter()
MAX_TOP_LOGPROBS = 20


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(Body):
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang's extra keys
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_token_ids: list[int] | None = None
    rid: str | None = None
    # sglang-router re-serialises OpenAI bodies with SGLang's extras; unset (false/null) they change nothing.
    return_hidden_states: Literal[False] = False
    lora_path: None = None
    session_params: None = None
    regex: None = None
    json_schema: None = None
    ebnf: None = None

    def sampling_params(self, max_new_tokens: int | None) -> dict:
        sp: dict[str, Any] = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  min_p=self.min_p, n=self.n, stop=self.stop, seed=self.seed,
                                  min_new_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                                  skip_special_tokens=self.skip_special_tokens, no_stop_trim=self.no_stop_trim)
        if max_new_tokens is not None:
            sp["max_new_tokens"] = max_new_tokens
        if self.stop_token_ids:
            sp["stop_token_ids"] = self.stop_token_ids
        # Forwarded only when set, so the Engine's refusal names exactly what was asked for.
        for key, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, key) != default:
                sp[key] = getattr(self, key)
        if self.logit_bias:
            sp["logit_bias"] = self.logit_bias
        return {k: v for k, v in sp.items() if v is not None}


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None


# ---- shared: engine calls ---------------------------------------------------------------------
def _openai_names(max_tokens_field: str = "max_tokens") -> dict[str, str]:
    """Engine sampling keys -> the OpenAI request fields they came from (the others are spelled alike)."""
    return {"max_new_tokens": max_tokens_field, "min_new_tokens": "min_tokens"}


def _openai_error(e: Exception, names: dict[str, str]) -> Response:
    """engine_error, with the Engine's key names replaced by the OpenAI fields the client sent, and
    `param` set to the first of them: an OpenAI client never sent `max_new_tokens`."""
    resp = engine_error(e)
    message = json.loads(resp.body)["error"]["message"]  # engine_error's wording (and any shortening)
    hits = sorted((m.start(), names[k]) for k in names if (m := re.search(rf"\b{k}\b", message)))
    if not hits:
        return resp
    found = [field for _, field in hits]  # in the message's order: the first one named is the param
    for engine_key, field in names.items():
        message = re.sub(rf"\b{engine_key}\b", field, message)
    return error_response(message, resp.status_code, param=found[0])


def _finish(meta: dict) -> tuple[str | None, Any]:
    """-> (OpenAI finish_reason, matched stop string/token id or None)."""
    fr = meta.get("finish_reason")
    if not fr:
        return None, None
    return fr["type"], fr.get("matched") if fr["type"] == "stop" else None


def _metadata(outs: list[dict]) -> dict:
    """SGLang's response `metadata`: the weight version that finished the request (its first choice)."""
    return {"weight_version": outs[0]["meta_info"]["weight_version"] if outs else None}


def _usage(outs: list[dict], n: int) -> dict:
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])  # each prompt counted once
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_text(engine, tid: int, text: str | None) -> str:
    return text if text is not None else (engine.tokenizer.token_text(tid) or "")


async def _prepare(request: Request, prompts: list, sampling: dict, num_top: int | None) -> list | Response:
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


async def _generate(request: Request, prompts: list, sampling: dict, num_top: int | None, rid,
                    names: dict[str, str], model=None):
    """One engine call for every choice: the outputs in choice order (prompt-major, then n), or the
    error Response to send (499 for a client gone mid-request, the engine's error otherwise, naming
    the OpenAI fields: `names`)."""
    engine = request.app.state.engine
    key = "input_ids" if prompts and isinstance(prompts[0], list) else "prompt"
    try:
        out = await await_unless_disconnected(request, engine.async_generate(
            **{key: prompts}, sampling_params=sampling, return_logprob=num_top is not None,
            top_logprobs_num=num_top or 0, rid=rid, lora_path=lora_of_model(request, model)))
    except asyncio.CancelledError:
        return Response(status_code=499)
    except Exception as e:
        return _openai_error(e, names)
    return out if isinstance(out, list) else [out]


async def _stream_choices(request: Request, prompts: list, sampling: dict, num_top: int | None, model=None):
    """Yield (choice_index, chunk_dict, is_final) from one engine stream per choice, as they come."""
    engine = request.app.state.engine
    key = "input_ids" if prompts and isinstance(prompts[0], list) else "prompt"
    n = sampling.get("n", 1)
    queue: asyncio.Queue = asyncio.Queue()
    base = uuid.uuid4().hex
    rids = [f"{base}-{k}" for k in range(len(prompts) * n)]
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
                if sp.get("seed") is not None:
                    sp["seed"] = sp["seed"] + j
                streams.append(await engine.async_generate(**{key: p}, sampling_params=sp, stream=True,
                                                           return_logprob=num_top is not None,
                                                           top_logprobs_num=num_top or 0, rid=rids[len(streams)],
                                                           lora_path=lora_path))
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


class _Delta:
    """Turns cumulative stream text into deltas. Holds back a trailing partial UTF-8 character and, when
    stop strings are set, the last len(longest stop) - 1 characters (they may become a stop match that
    the final text trims)."""

    def __init__(self, stop) -> None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = ""
        self.num_tokens = 0

    def step(self, text: str | None, final: bool) -> str:
        text = text or ""
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: max(0, len(text) - self.hold)]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def new_logprobs(self, meta: dict) -> list:
        entries = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [None] * len(entries)
        new = list(zip(entries[self.num_tokens:], tops[self.num_tokens:]))
        self.num_tokens = len(entries)
        return new


def _sse_response(gen) -> StreamingResponse:
    async def body():
        try:
            async for item in gen:
                yield f"data: {dumps(item)}\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band as OpenAI does
            yield f"data: {dumps({'error': {'message': str(e), 'type': type(e).__name__, 'code': 400}})}\n\n"
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _model_name(request: Request) -> str:
    return request.app.state.model_name


# ---- /v1/models --------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request):
    card = _model_card(request)
    return JSONResponse({"object": "list", "data": [card, *adapter_cards(request, card)]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request):
    if model != _model_name(request):
        return error_response(f"The model '{model}' does not exist", 404, param="model", type_="invalid_request_error")
    return JSONResponse(_model_card(request))


def _model_card(request: Request) -> dict:
    engine = request.app.state.engine
    return {"id": _model_name(request), "object": "model", "created": request.app.state.created,
            "owned_by": "rollout-engine", "root": _model_name(request),
            "max_model_len": engine.runner.context_len}


# ---- /v1/completions ---------------------------------------------------------------------------
def _completion_logprobs(engine, pairs: list, offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for (lp, tid, text), top in pairs:
        s = _token_text(engine, tid, text)
        tokens.append(s)
        lps.append(lp)
        offsets.append(offset)
        offset += len(s)
        if top is None:
            tops.append(None)
            continue
        d: dict[str, float] = {}
        for v, t, tt in top:  # distinct ids can share a text (e.g. partial UTF-8): keep the likeliest
            d.setdefault(_token_text(engine, t, tt), v)
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if any(t is not None for t in tops)
            else None, "text_offset": offsets}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    engine = request.app.state.engine
    if req.echo:
        return error_response("echo=true is not supported", 400, param="echo")
    if req.suffix is not None:
        return error_response("suffix is not supported", 400, param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        return error_response(f"best_of={req.best_of} must equal n={req.n} (no server-side ranking)", 400,
                              param="best_of")
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        return error_response("prompt is empty", 400, param="prompt")
    bad = check_n(request, len(prompts) * req.n)
    if bad is not None:
        return bad
    sampling = req.sampling_params(req.max_tokens)
    names = _openai_names()
    prompts = await _prepare(request, prompts, sampling, req.logprobs)
    if isinstance(prompts, Response):
        return prompts
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), _model_name(request)
    if not req.stream:
        outs = await _generate(request, prompts, sampling, req.logprobs, req.rid, names, req.model)
        if isinstance(outs, Response):
            return outs
        choices = []
        for i, o in enumerate(outs):
            reason, matched = _finish(o["meta_info"])
            lp = None
            if req.logprobs is not None:
                meta = o["meta_info"]
                pairs = list(zip(meta["output_token_logprobs"],
                                 meta.get("output_top_logprobs") or [None] * len(meta["output_token_logprobs"])))
                lp = _completion_logprobs(engine, pairs, 0)
            choices.append({"index": i, "text": o["text"], "logprobs": lp, "finish_reason": reason,
                            "matched_stop": matched})
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": _usage(outs, req.n), "metadata": _metadata(outs)})

    try:
        merged = _stream_choices(request, prompts, sampling, req.logprobs, req.model)
        first = await merged.__anext__()  # surfaces a bad request as a 400 before the stream starts
    except Exception as e:
        return _openai_error(e, names)

    async def events():
        deltas = [_Delta(req.stop) for _ in range(len(prompts) * req.n)]
        finals: dict[int, dict] = {}
        item = first
        while item is not None:
            i, chunk, final = item
            d = deltas[i]
            text = d.step(chunk["text"], final)
            lp = None
            if req.logprobs is not None:
                lp = _completion_logprobs(engine, d.new_logprobs(chunk["meta_info"]), len(d.sent) - len(text))
            reason = _finish(chunk["meta_info"])[0] if final else None
            if final:
                finals[i] = chunk
            if text or final or lp:
                yield {"id": cid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": reason}]}
            item = await anext(merged, None)
        if req.stream_options and req.stream_options.include_usage:
            outs = [finals[i] for i in sorted(finals)]
            yield {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": _usage(outs, req.n)}

    return _sse_response(_closing(events(), merged))


async def _closing(gen, inner):
    """Iterate `gen`; on close (normal end or client gone) close `inner` too."""
    try:
        async for item in gen:
            yield item
    finally:
        await gen.aclose()
        await inner.aclose()


# ---- /v1/chat/completions ----------------------------------------------------------------------
def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"message content part of type {part.get('type')!r} is not supported (text only)")
        parts.append(part.get("text", ""))
    return "".join(parts)


def render_chat(engine, messages: list[dict], chat_template: ChatTemplate | str | None) -> dict:
    """-> {"input_ids": ids}: the messages through the server's chat template (see chat_template.py),
    tokenized. Raises NoChatTemplate when there is none."""
    tok = engine.tokenizer.tokenizer
    if tok is None:
        raise ValueError("chat completions need a tokenizer; this engine has none")
    if not isinstance(chat_template, ChatTemplate):
        chat_template = resolve_chat_template(chat_template, tok)
    template = chat_template.require()
    msgs = [{**m, "content": _content_text(m.get("content"))} for m in messages]
    text = tok.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True)
    return {"input_ids": tok.encode(text, add_special_tokens=False)}


def _chat_logprobs(engine, pairs: list) -> dict:
    content = []
    for (lp, tid, text), top in pairs:
        s = _token_text(engine, tid, text)
        tops = [] if top is None else [
            {"token": (ts := _token_text(engine, t, tt)), "logprob": v, "bytes": list(ts.encode())} for v, t, tt in top]
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": tops})
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    engine = request.app.state.engine
    if req.response_format not in (None, {"type": "text"}):
        return error_response("response_format other than text is not supported", 400, param="response_format")
    if req.tools:
        return error_response("tools are not supported", 400, param="tools")
    bad = check_n(request, req.n)
    if bad is not None:
        return bad
    try:
        rendered = render_chat(engine, [m.model_dump() for m in req.messages], request.app.state.chat_template)
    except NoChatTemplate as e:
        return error_response(str(e), 400, param="--chat-template")
    except Exception as e:  # a template error is the request's content
        return error_response(f"chat template failed: {e}", 400, param="messages")
    prompts = [rendered.get("input_ids", rendered.get("prompt"))]
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    sampling = req.sampling_params(req.max_completion_tokens if req.max_completion_tokens is not None
                                   else req.max_tokens)
    names = _openai_names("max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    prompts = await _prepare(request, prompts, sampling, num_top)
    if isinstance(prompts, Response):
        return prompts
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), _model_name(request)
    if not req.stream:
        outs = await _generate(request, prompts, sampling, num_top, req.rid, names, req.model)
        if isinstance(outs, Response):
            return outs
        choices = []
        for i, o in enumerate(outs):
            reason, matched = _finish(o["meta_info"])
            lp = None
            if num_top is not None:
                meta = o["meta_info"]
                lp = _chat_logprobs(engine, list(zip(meta["output_token_logprobs"], meta.get(
                    "output_top_logprobs") or [None] * len(meta["output_token_logprobs"]))))
            choices.append({"index": i, "message": {"role": "assistant", "content": o["text"]}, "logprobs": lp,
                            "finish_reason": reason, "matched_stop": matched})
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": _usage(outs, req.n), "metadata": _metadata(outs)})

    try:
        merged = _stream_choices(request, prompts, sampling, num_top, req.model)
        first = await merged.__anext__()
    except Exception as e:
        return _openai_error(e, names)

    def chunk(choices, **extra):
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **extra}

    async def events():
        for i in range(req.n):  # OpenAI opens each choice with the role
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        deltas = [_Delta(req.stop) for _ in range(req.n)]
        finals: dict[int, dict] = {}
        item = first
        while item is not None:
            i, c, final = item
            d = deltas[i]
            text = d.step(c["text"], final)
            lp = _chat_logprobs(engine, d.new_logprobs(c["meta_info"])) if num_top is not None else None
            if final:
                finals[i] = c
            if text or final or (lp and lp["content"]):
                yield chunk([{"index": i, "delta": {"content": text} if text else {}, "logprobs": lp,
                              "finish_reason": _finish(c["meta_info"])[0] if final else None}])
            item = await anext(merged, None)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=_usage([finals[i] for i in sorted(finals)], req.n))

    return _sse_response(_closing(events(), merged))
