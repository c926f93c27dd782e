"""create_app(engine, server_args): the FastAPI app that serves one in-process Engine.

It wires the route modules (native.py, native_control.py, native_weights.py: SGLang's endpoints;
openai_api.py: /v1/*; metrics.py: /metrics), turns every validation failure into a 400 whose message names the field (FastAPI's default
is 422; SGLang answers 400), and installs the pure ASGI middlewares, outermost first: the body-size limit
(limits.py), the Host/Origin/method/content-type guard and, with `--api-key`, the key check
(security.py).

It does not own the engine: whoever built the engine shuts it down (launch_server.py, the tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.server import (
    http_metrics,
    limits,
    lora,
    metrics,
    native,
    native_control,
    native_weights,
    openai_api,
    security,
)
from rollout.server.args import ServerArgs
from rollout.server.chat_template import resolve_chat_template
from rollout.server.common import error_response
from rollout.server.engine_process import EngineProcessError

VERSION = "0.1.0"
logger = logging.getLogger("rollout.server")


def describe_errors(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors -> ("field: problem; ...", first field). Malformed JSON gets its own wording."""
    parts, first = [], None
    unions = _union_errors(errors)
    if unions:
        return unions
    for err in errors:
        loc = [str(x) for x in err.get("loc", ())]
        if loc and loc[0] == "body":
            loc = loc[1:]
        if err.get("type") == "lone_surrogate":
            return err["msg"], str(err.get("ctx", {}).get("where", "body")).split(".")[0].split("[")[0]
        if err.get("type") == "nul_in_path":
            return err["msg"], str(err.get("ctx", {}).get("name", "body"))
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", "body"
        if not loc and isinstance(err.get("input"), dict):  # a check across fields of the object: its own words,
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")  # naming the field it starts with
            name = msg.split(" ", 1)[0]
            return msg, name if name in err["input"] else "body"
        if not loc:  # the body itself is not an object (a list, a string, a number, null)
            return f"request body must be a JSON object, got {_json_type(err.get('input'))}", "body"
        field = ".".join(loc)
        first = first or (loc[0] if loc else "body")
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{field}: {msg}")
    # A union type reports one error per branch; a few are enough to act on.
    unique = list(dict.fromkeys(parts))
    return "; ".join(unique[:6]) + (f" (+{len(unique) - 6} more)" if len(unique) > 6 else ""), first


def body_parse_problem(e: BaseException) -> str:
    """What json.loads objected to in a request body, other than malformed JSON (which pydantic reports)."""
    if isinstance(e, UnicodeDecodeError):
        return f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})"
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return f"{type(e).__name__}: {str(e)[:200]}"  # e.g. an integer of more digits than Python converts


def _json_type(value) -> str:
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _union_errors(errors: list[dict]) -> tuple[str, str] | None:
    """A field typed as a union (`text: str | list[str]`) fails once per branch, each error's location
    tagged with its branch ("str", "list[str]"): say once which shapes the field takes and what came."""
    locs = [[str(x) for x in e.get("loc", ()) if x != "body"] for e in errors]
    if not locs or any(len(loc) < 2 for loc in locs) or len({loc[0] for loc in locs}) != 1:
        return None
    if not all("[" in loc[1] or loc[1] in ("str", "int", "float", "bool", "none") for loc in locs):
        return None
    field = locs[0][0]
    shapes = " | ".join(dict.fromkeys(loc[1] for loc in locs))
    # A branch that failed at the top level holds the field's value; when every branch failed deeper (a
    # list with one bad element) there is none, and the element's error says what came.
    tops = [e.get("input") for e, loc in zip(errors, locs) if len(loc) == 2]
    got = f"; got {_json_type(tops[0])}" if tops else ""
    deepest = max(zip(errors, locs), key=lambda p: len(p[1]))
    detail = f" (in {field}[{']['.join(deepest[1][2:])}]: {deepest[0].get('msg')})" if len(deepest[1]) > 2 else ""
    return f"{field}: must be {shapes}{got}{detail}", field


def create_app(engine, server_args: ServerArgs | None = None) -> FastAPI:
    server_args = server_args or ServerArgs()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # An EngineClient reads the engine's messages on this loop while the app runs (no thread hand-over
        # per engine step; rollout/server/engine_pipe.py), and on its own thread again before shutdown.
        attached = hasattr(app.state.engine, "attach_loop")
        if attached:
            app.state.engine.attach_loop(asyncio.get_running_loop())
        try:
            yield
        finally:
            if attached:
                app.state.engine.detach_loop()
        app.state.engine_shut_down = True
        if hasattr(app.state.engine, "remove_finish_observer"):  # the engine may outlive this app (tests)
            app.state.engine.remove_finish_observer(app.state.request_metrics)
        app.state.executor.shutdown(wait=False, cancel_futures=True)
        app.state.tokenize_executor.shutdown(wait=False, cancel_futures=True)
        app.state.join_executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollout-engine", version=VERSION, lifespan=lifespan, openapi_url=None)
    app.state.engine = engine
    app.state.server_args = server_args
    app.state.model_name = server_args.served_model_name or engine.args.model_path
    adapters = engine.runner.lora_adapters() if hasattr(engine, "runner") else {}
    if app.state.model_name in adapters:  # /load_lora_adapter refuses this name; --lora-paths must too
        raise ValueError(f"LoRA adapter {app.state.model_name!r} (--lora-paths) has the served model's name, so "
                         f"OpenAI requests (`model`) could not tell them apart: give the adapter another name")
    tokenizer = getattr(getattr(engine, "tokenizer", None), "tokenizer", None)
    app.state.chat_template = resolve_chat_template(server_args.chat_template, tokenizer)
    logger.info("chat template: %s", app.state.chat_template.source)
    app.state.created = int(time.time())
    app.state.engine_shut_down = False
    # Control calls block on the engine lock (and a distributed receive waits on the trainer): their own
    # pool, so they never starve each other of threads or the event loop of time.
    app.state.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rollout-http")
    # Tokenizing prompts and encoding big responses: CPU work that must leave the loop, in a pool of its
    # own so it never takes a control call's thread.
    app.state.tokenize_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rollout-tokenize")
    # Weight-group joins wait on the network for up to their timeout: their own small pool, and
    # native_weights.py refuses joins beyond it, so joins to dead addresses never starve the control calls.
    app.state.join_executor = ThreadPoolExecutor(max_workers=server_args.max_concurrent_weight_group_joins,
                                                 thread_name_prefix="rollout-join")
    app.state.num_joins = 0
    tok = engine.tokenizer.tokenizer
    app.state.max_prompt_chars = None if tok is None else \
        2 * engine.runner.context_len * limits.max_token_chars(tok)  # 2x: normalizers may merge characters
    app.state.metrics_registry, app.state.request_metrics = metrics.make_registry(engine, app.state.model_name)
    if hasattr(engine, "add_finish_observer"):
        engine.add_finish_observer(app.state.request_metrics)

    @app.exception_handler(RequestValidationError)
    async def on_request_validation(request: Request, exc: RequestValidationError):
        message, param = describe_errors(exc.errors())
        return error_response(message, 400, param=param)

    @app.exception_handler(ValidationError)
    async def on_validation(request: Request, exc: ValidationError):
        message, param = describe_errors(exc.errors())
        return error_response(message, 400, param=param)

    @app.exception_handler(EngineProcessError)
    async def on_engine_gone(request: Request, exc: EngineProcessError):
        # The engine process died (or its pipe broke): every route that needs it says so, as /health does.
        return error_response(f"{request.url.path}: {exc}", 503)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        cause = exc.__cause__
        if exc.status_code == 400 and cause is not None and "parsing the body" in str(exc.detail):
            # FastAPI's generic message for a body json.loads refused otherwise than as malformed JSON: name why.
            return error_response(f"{request.method} {request.url.path}: malformed JSON body: "
                                  f"{body_parse_problem(cause)}", 400, param="body")
        return error_response(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    # /generate first: a plain route (native.py says why), matched before the routers are searched.
    app.router.routes.insert(0, native.GENERATE_ROUTE)
    app.include_router(native.router)
    app.include_router(native_control.router)
    app.include_router(native_weights.router)
    app.include_router(lora.router)
    app.include_router(openai_api.router)
    app.include_router(metrics.router)
    # add_middleware puts each new one outside the previous: the key check runs last, the size limit first.
    if server_args.api_key:
        app.add_middleware(security.APIKeyMiddleware, api_key=server_args.api_key)
    hosts = security.allowed_hosts(server_args.host, server_args.allowed_hosts)
    app.add_middleware(security.RequestGuard, allowed_hosts=hosts, allowed_origins=server_args.allowed_origins or [])
    app.add_middleware(limits.BodySizeLimit, max_bytes=server_args.max_request_bytes,
                       max_weights_bytes=server_args.max_weights_request_bytes)
    # Outermost: every request is counted, refused ones too (SGLang's HTTP metrics).
    http = http_metrics.HttpMetrics()
    app.state.metrics_registry.register(http)
    app.add_middleware(http_metrics.HttpMetricsMiddleware, metrics=http,
                       route_paths=http_metrics.route_paths(app))
    security.warn_if_exposed(server_args.host, server_args.api_key)
    return app
