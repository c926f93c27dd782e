"""create_app(engine, server_args): the FastAPI app that serves one in-process Engine.

It wires the route modules (native.py: SGLang's endpoints; openai_api.py: /v1/*; metrics.py:
/metrics), turns every validation failure into a 400 whose message names the field (FastAPI's default
is 422; SGLang answers 400), and, with `--api-key`, requires `Authorization: Bearer <key>` on every path
but /health (a pure ASGI middleware, so streaming and disconnect detection are untouched).

It does not own the engine: whoever built the engine shuts it down (launch_server.py, the tests).
"""

from __future__ import annotations

import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.server import lora, metrics, native, openai_api
from rollout.server.args import ServerArgs
from rollout.server.chat_template import resolve_chat_template
from rollout.server.common import error_response

VERSION = "0.1.0"
OPEN_PATHS = frozenset({"/health"})
logger = logging.getLogger("rollout.server")


def describe_errors(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors -> ("field: problem; ...", first field). Malformed JSON gets its own wording."""
    parts, first = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ())]
        if loc and loc[0] == "body":
            loc = loc[1:]
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", "body"
        if not loc:  # the body itself is not an object (not JSON, or a list/str/number)
            return f"request body must be a JSON object: {err.get('msg')}", "body"
        field = ".".join(loc)
        first = first or (loc[0] if loc else "body")
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{field}: {msg}")
    # A union type reports one error per branch; a few are enough to act on.
    unique = list(dict.fromkeys(parts))
    return "; ".join(unique[:6]) + (f" (+{len(unique) - 6} more)" if len(unique) > 6 else ""), first


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        message = "missing Authorization header" if not given else "invalid API key"
        resp = error_response(f"Unauthorized: {message}; send 'Authorization: Bearer <key>'", 401)
        await resp(scope, receive, send)


def create_app(engine, server_args: ServerArgs | None = None) -> FastAPI:
    server_args = server_args or ServerArgs()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.engine_shut_down = True
        if hasattr(app.state.engine, "remove_finish_observer"):  # the engine may outlive this app (tests)
            app.state.engine.remove_finish_observer(app.state.request_metrics)
        app.state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollout-engine", version=VERSION, lifespan=lifespan, openapi_url=None)
    app.state.engine = engine
    app.state.server_args = server_args
    app.state.model_name = server_args.served_model_name or engine.args.model_path
    tokenizer = getattr(getattr(engine, "tokenizer", None), "tokenizer", None)
    app.state.chat_template = resolve_chat_template(server_args.chat_template, tokenizer)
    logger.info("chat template: %s", app.state.chat_template.source)
    app.state.created = int(time.time())
    app.state.engine_shut_down = False
    # Control calls block on the engine lock (and a distributed receive waits on the trainer): their own
    # pool, so they never starve each other of threads or the event loop of time.
    app.state.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rollout-http")
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

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        return error_response(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    app.include_router(native.router)
    app.include_router(lora.router)
    app.include_router(openai_api.router)
    app.include_router(metrics.router)
    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)
    return app
