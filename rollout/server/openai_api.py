"""OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions over the in-process Engine, and
SGLang's /v1/score (rollout/score_api.py).

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

This module holds the routes and their response bodies; the request bodies are openai_protocol.py's, the
engine calls, streams and SSE plumbing openai_engine.py's.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rollout.score_api import SCORE_SAMPLING, encoder, num_items, score_outputs, score_prompts, scores_of
from rollout.server import limits
from rollout.server.chat_template import (
    ChatTemplate,
    NoChatTemplate,
    resolve_chat_template,
    takes_content_parts,
)
from rollout.server.common import JSONResponse, engine_error, error_response, run_blocking
from rollout.server.lora import adapter_cards, lora_of_model
from rollout.server.native import check_n
from rollout.server.openai_engine import (
    choice_texts,
    closing,
    finish_of,
    generate_all,
    logprob_pairs,
    metadata_of,
    openai_names,
    prepare,
    rewritten_tail,
    sse_response,
    start_stream,
    token_text,
    usage_of,
)
from rollout.server.openai_protocol import ChatCompletionRequest, CompletionRequest, ScoreRequest
from rollout.tokenizer import CONTEXT_TOKENS

router = APIRouter()


def _model_name(request: Request) -> str:
    return request.app.state.model_name


def _served_model(request: Request, model: str | None) -> str:
    """A response's `model`: the adapter the request chose by `model` (as the request named it, as vLLM and
    SGLang echo it), else the served model's name."""
    try:
        return model if lora_of_model(request, model) is not None else _model_name(request)
    except ValueError:  # an adapter that is not loaded: the request is refused by the engine call anyway
        return _model_name(request)


# ---- /v1/models --------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request):
    card = _model_card(request)
    return JSONResponse({"object": "list", "data": [card, *adapter_cards(request, card)]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request):
    card = _model_card(request)
    if model == card["id"]:
        return JSONResponse(card)
    adapter = next((c for c in adapter_cards(request, card) if c["id"] == model), None)  # as /v1/models lists them
    if adapter is None:
        return error_response(f"The model '{model}' does not exist", 404, param="model", type_="invalid_request_error")
    return JSONResponse(adapter)


def _model_card(request: Request) -> dict:
    engine = request.app.state.engine
    return {"id": _model_name(request), "object": "model", "created": request.app.state.created,
            "owned_by": "rollout-engine", "root": _model_name(request),
            "max_model_len": engine.runner.context_len}


# ---- /v1/completions ---------------------------------------------------------------------------
def _completion_logprobs(engine, pairs: list, offset: int, context: list[int], final: bool,
                         skip_special_tokens: bool = True) -> tuple[dict, int]:
    """(OpenAI's completion logprobs of `pairs`, tokens that follow the ids `context`; the offset where the text
    after them starts). `text_offset` counts each token's text from `offset` (0 for the first token; a stream
    passes on where its previous chunk's tokens ended, so its offsets are the non-streamed ones whatever text a
    chunk held back for a possible stop match). A token's text is its piece of the decoded text
    (TokenizerWrapper.token_pieces), so the tokens join into the text and each offset points at its token's
    characters there, a character spread over several tokens included; a special token the text skips shows
    its own text and takes no characters (skip_special_tokens, the request's: as its text was decoded). `final`:
    the last token ends the output (its partial character stays)."""
    tok = engine.tokenizer
    pieces = tok.token_pieces([tid for (_, tid, _), _ in pairs], context, final, skip_special_tokens)
    special = tok.special_ids if skip_special_tokens else frozenset()
    tokens, lps, tops, offsets = [], [], [], []
    for ((lp, tid, text), top), piece in zip(pairs, pieces):
        tokens.append(token_text(engine, tid, text) if not piece and tid in special else piece)
        lps.append(lp)
        offsets.append(offset)
        offset += len(piece)
        if lp is None:  # an echoed prompt's first token: nothing scores it
            tops.append(None)
            continue
        # OpenAI's "logprobs + 1": the sampled token is always in, under its text in `tokens` (also when it is one
        # of the top ones); distinct ids can share a text (e.g. partial UTF-8): the likeliest keeps it.
        d: dict[str, float] = {}
        for v, t, tt in top or ():
            d.setdefault(tokens[-1] if t == tid else token_text(engine, t, tt), v)
        d.setdefault(tokens[-1], lp)
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    engine = request.app.state.engine
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
    empty = next((i for i, p in enumerate(prompts) if isinstance(p, list) and not p), None)
    if empty is not None:  # (each prompt reaches the engine alone, which would call it an empty batch)
        return error_response(f"prompt {empty} is empty (a token-id prompt needs at least one token)", 400,
                              param="prompt")
    bad = check_n(request, len(prompts) * req.n)
    if bad is not None:
        return bad
    sampling = req.sampling_params(req.max_tokens)
    names = openai_names()
    given = prompts  # echo shows a text prompt as sent, a token-id prompt decoded
    prompts = await prepare(request, prompts, sampling, req.logprobs)
    if isinstance(prompts, Response):
        return prompts
    # a token-id prompt decoded as the completion is (skip_special_tokens), so the logprobs' tokens join into the text
    echoed = [p if isinstance(p, str) else (engine.tokenizer.decode(p, skip_special_tokens=req.skip_special_tokens)
                                            or "") for p in given] if req.echo else None
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), _served_model(request, req.model)
    # echo with logprobs: the prompt's tokens scored too (the first has no logprob), as OpenAI's and vLLM's
    start = 0 if req.echo and req.logprobs is not None else None
    if not req.stream:
        outs = await generate_all(request, prompts, sampling, req.logprobs, req.rid, names, req.model, start)
        if isinstance(outs, Response):
            return outs
        choices = []
        for i, o in enumerate(outs):
            reason, matched = finish_of(o["meta_info"])
            lp = None if req.logprobs is None else _completion_logprobs(
                engine, logprob_pairs(o["meta_info"], prompt=req.echo), 0,
                [] if req.echo else _ids(prompts[i // req.n]), True, req.skip_special_tokens)[0]
            text = o.get("text") if echoed is None else echoed[i // req.n] + (o.get("text") or "")
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                            "matched_stop": matched})
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": usage_of(outs, req.n, _cache_report(request)), "metadata": metadata_of(outs)})

    started = await start_stream(request, prompts, sampling, req.logprobs, req.model, names, req.rid, start)
    if isinstance(started, Response):
        return started
    merged, first = started

    async def events():
        finals: dict[int, dict] = {}
        unechoed = set(range(len(prompts) * req.n)) if echoed is not None else set()
        async with aclosing(choice_texts(first, merged, req.stop, len(prompts) * req.n, finals,
                                         rewritten_tail(engine))) as items:
            async for i, chunk, final, text, d in items:
                prompt_pairs = []
                if i in unechoed:  # echo: the choice's first chunk starts with its prompt (and its logprobs)
                    unechoed.discard(i)
                    text = echoed[i // req.n] + text
                    if start is not None:
                        prompt_pairs = logprob_pairs({**chunk["meta_info"], "output_token_logprobs": [],
                                                      "output_top_logprobs": []}, prompt=True)
                lp = None
                if req.logprobs is not None:
                    if d.context is None:  # the choice's first chunk: its tokens follow the prompt, unless echoed
                        d.context = [] if echoed is not None else _ids(prompts[i // req.n])
                    pairs = prompt_pairs + d.new_logprobs(chunk["meta_info"])
                    lp, d.text_offset = _completion_logprobs(engine, pairs, d.text_offset, d.context, final,
                                                             req.skip_special_tokens)
                    d.context = (d.context + [tid for (_, tid, _), _ in pairs])[-CONTEXT_TOKENS:]
                reason = finish_of(chunk["meta_info"])[0] if final else None
                if text or final or lp:
                    yield {"id": cid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": reason}],
                           **running_usage(req.stream_options, chunk["meta_info"])}
        if req.stream_options and req.stream_options.include_usage:
            outs = [finals[i] for i in sorted(finals)]
            yield {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": usage_of(outs, req.n, _cache_report(request))}

    return sse_response(closing(events(), merged))


def _ids(prompt) -> list[int]:
    """A prepared prompt's token ids ([] for a text prompt left as text: no tokenizer)."""
    return prompt if isinstance(prompt, list) else []


def _cache_report(request: Request) -> bool:
    return request.app.state.server_args.enable_cache_report


def running_usage(options, meta: dict) -> dict:
    """stream_options.continuous_usage_stats (SGLang's and vLLM's): every content chunk carries the usage of its
    choice so far ({"usage": ...}); else nothing ({})."""
    if not (options and options.continuous_usage_stats):
        return {}
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


# ---- /v1/chat/completions ----------------------------------------------------------------------
def _text_parts(content, where: str) -> list[str] | str:
    """A message's content (`where`: "messages[i].content"): a string as it is, a list of parts as their texts
    (a part is {"type": "text", "text": str}; any other type is refused by name)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text":
            raise ValueError(f"{where}[{j}]: message content part of type {part.get('type')!r} is not supported "
                             f"(text only)")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise ValueError(f"{where}[{j}].text must be a string, got {type(text).__name__}")
        parts.append(text)
    return parts


def _content_text(content, where: str) -> str:
    """A message's content as one string: text parts joined by a space, as SGLang joins them for a template
    that takes strings."""
    parts = _text_parts(content, where)
    return parts if isinstance(parts, str) else " ".join(parts)


def _template_content(content, where: str, takes_parts: bool):
    """A message's content as the template takes it: a list of text parts stays a list for a template that
    loops over content parts (SGLang's "openai" format), else one string."""
    if not takes_parts or not isinstance(content, list):
        return _content_text(content, where)
    return [{"type": "text", "text": t} for t in _text_parts(content, where)]


# apply_chat_template's own arguments: set here, never by a request's chat_template_kwargs
_RENDER_ARGS = ("conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
                "tools", "documents", "return_dict", "return_tensors", "tokenizer_kwargs")


def render_chat(engine, messages: list[dict], chat_template: ChatTemplate | str | None,
                template_kwargs: dict | None = None, continue_final_message: bool = False) -> dict:
    """-> {"input_ids": ids}: the messages through the server's chat template (see chat_template.py),
    tokenized; `template_kwargs` are the template's variables (SGLang's chat_template_kwargs) and
    `continue_final_message` leaves the last message open (no generation prompt after it). Raises
    NoChatTemplate when there is none."""
    clash = sorted(set(template_kwargs or ()) & set(_RENDER_ARGS))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {clash}: the server sets them")
    tok = engine.tokenizer.tokenizer
    if tok is None:
        raise ValueError("chat completions need a tokenizer; this engine has none")
    if not isinstance(chat_template, ChatTemplate):
        chat_template = resolve_chat_template(chat_template, tok)
    template = chat_template.require()
    parts = takes_content_parts(template) if isinstance(template, str) else False
    msgs = [{**m, "content": _template_content(m.get("content"), f"messages[{i}].content", parts)}
            for i, m in enumerate(messages)]
    text = tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                   add_generation_prompt=not continue_final_message,
                                   continue_final_message=continue_final_message, **(template_kwargs or {}))
    return {"input_ids": tok.encode(text, add_special_tokens=False)}


def _chat_logprobs(engine, pairs: list) -> dict:
    """OpenAI's chat logprobs: each token's text and its own bytes (a token holding part of a character has the
    text U+FFFD and its real bytes, so a client can join the bytes back into the characters)."""
    tok = engine.tokenizer
    content = []
    for (lp, tid, text), top in pairs:
        tops = [] if top is None else [{"token": token_text(engine, t, tt), "logprob": v, "bytes": tok.token_bytes(t)}
                                       for v, t, tt in top]
        content.append({"token": token_text(engine, tid, text), "logprob": lp, "bytes": tok.token_bytes(tid),
                        "top_logprobs": tops})
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    engine = request.app.state.engine
    if req.response_format not in (None, {"type": "text"}):
        return error_response("response_format other than text is not supported", 400, param="response_format")
    if req.tools:
        return error_response("tools are not supported", 400, param="tools")
    if req.tool_choice not in (None, "none", "auto"):  # "required" or a named function needs tools to call
        return error_response(f"tool_choice={req.tool_choice!r} needs tools, which are not supported", 400,
                              param="tool_choice")
    if req.top_logprobs and not req.logprobs:  # OpenAI's rule: top_logprobs is served with logprobs only
        return error_response("top_logprobs needs logprobs=true", 400, param="top_logprobs")
    bad = check_n(request, req.n)
    if bad is not None:
        return bad
    messages = [m.model_dump() for m in req.messages]
    try:  # the contents alone past what the context could hold: refused before rendering or tokenizing
        contents = "".join(_content_text(m.get("content"), f"messages[{i}].content") for i, m in enumerate(messages))
    except ValueError as e:
        return error_response(str(e), 400, param="messages")
    bad = limits.check_prompt_chars(request, [contents], what="messages")
    if bad is not None:
        return bad
    try:  # rendering and tokenizing take time on a long conversation: in the tokenizer pool, off the event loop
        rendered = await asyncio.get_running_loop().run_in_executor(
            request.app.state.tokenize_executor, functools.partial(
                render_chat, engine, messages, request.app.state.chat_template, req.chat_template_kwargs,
                req.continue_final_message))
    except NoChatTemplate as e:
        return error_response(str(e), 400, param="--chat-template")
    except Exception as e:  # a template error is the request's content
        return error_response(f"chat template failed: {e}", 400, param="messages")
    prompts = [rendered.get("input_ids", rendered.get("prompt"))]
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    sampling = req.sampling_params(req.max_completion_tokens if req.max_completion_tokens is not None
                                   else req.max_tokens)
    names = openai_names("max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    prompts = await prepare(request, prompts, sampling, num_top)
    if isinstance(prompts, Response):
        return prompts
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), _served_model(request, req.model)
    if not req.stream:
        outs = await generate_all(request, prompts, sampling, num_top, req.rid, names, req.model)
        if isinstance(outs, Response):
            return outs
        choices = []
        for i, o in enumerate(outs):
            reason, matched = finish_of(o["meta_info"])
            lp = None if num_top is None else _chat_logprobs(engine, logprob_pairs(o["meta_info"]))
            choices.append({"index": i, "message": {"role": "assistant", "content": o.get("text")}, "logprobs": lp,
                            "finish_reason": reason, "matched_stop": matched})
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": usage_of(outs, req.n, _cache_report(request)), "metadata": metadata_of(outs)})

    started = await start_stream(request, prompts, sampling, num_top, req.model, names, req.rid)
    if isinstance(started, Response):
        return started
    merged, first = started

    def chunk(choices, **extra):
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **extra}

    async def events():
        for i in range(req.n):  # OpenAI opens each choice with the role
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        finals: dict[int, dict] = {}
        async with aclosing(choice_texts(first, merged, req.stop, req.n, finals, rewritten_tail(engine))) as items:
            async for i, c, final, text, d in items:
                lp = _chat_logprobs(engine, d.new_logprobs(c["meta_info"])) if num_top is not None else None
                if text or final or (lp and lp["content"]):
                    yield chunk([{"index": i, "delta": {"content": text} if text else {}, "logprobs": lp,
                                  "finish_reason": finish_of(c["meta_info"])[0] if final else None}],
                                **running_usage(req.stream_options, c["meta_info"]))
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=usage_of([finals[i] for i in sorted(finals)], req.n, _cache_report(request)))

    return sse_response(closing(events(), merged))


# ---- /v1/score (SGLang's scoring API; rollout/score_api.py) ------------------------------------------
@router.post("/v1/score")
async def score(req: ScoreRequest, request: Request):
    """Prompts built (text joined and tokenized off the loop) and held to the server's limits like /generate's:
    --max-n items, --max-request-bytes and the prompt and response bounds; then one prefill per item."""
    engine = request.app.state.engine
    items = req.items
    bad = check_n(request, num_items(items))
    if bad is not None:
        return bad
    if isinstance(req.query, str) and isinstance(items, list) and all(isinstance(i, str) for i in items):
        bad = limits.check_prompt_chars(request, [req.query + i for i in items])
        if bad is not None:
            return bad
    try:
        prompts = await run_blocking(request, score_prompts, encoder(engine), req.query, items, req.label_token_ids,
                                     req.item_first)
        bad = limits.check_work(request, prompts, dict(SCORE_SAMPLING), return_logprob=True,
                                token_ids_logprob=req.label_token_ids)
        if bad is not None:
            return bad
        outs = await score_outputs(engine, prompts, req.label_token_ids) if prompts else []
    except Exception as e:  # a bad argument is a 400 naming it (engine_error)
        return engine_error(e)
    usage = usage_of(outs, 1)
    return JSONResponse({"scores": scores_of(outs, req.label_token_ids, req.apply_softmax),
                         "model": _model_name(request), "object": "scoring",
                         "usage": {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}})
