"""Helpers shared by the route modules: JSON out, errors in one shape, blocking engine calls off the loop.

Every error body is `{"error": {"message", "type", "param", "code"}}` (the OpenAI shape; SGLang's native
routes send `{"error": {"message"}}`, a subset), with `param` naming the offending field when known.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math

try:  # ~10x faster than json on the per-token stream chunks (the `server` extra installs it)
    import orjson
except ImportError:  # pragma: no cover - the stdlib path below is the fallback
    orjson = None

from fastapi import Request
from fastapi.responses import Response


def _finite(x):
    """Replace NaN/inf (e.g. a -inf top logprob) with None: strict JSON has no such numbers."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def dumpb(obj) -> bytes:
    """Compact UTF-8 JSON; floats as their shortest round-trip form (orjson and json agree on the value);
    NaN/inf as null; non-string keys as strings, as json.dumps does."""
    if orjson is not None:
        try:
            return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:  # what orjson does not know (e.g. a >64-bit int): the stdlib path decides
            pass
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":")).encode("utf-8")


def dumps(obj) -> str:
    return dumpb(obj).decode("utf-8")


class JSONResponse(Response):
    """Floats in shortest round-trip form (so logprobs over HTTP equal the engine's bit for bit)."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return dumpb(content)


MAX_ERROR_CHARS = 2000  # error bodies never echo a huge input back whole


def truncate(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Keep the head and the tail (where messages often say what to do), drop the middle."""
    if len(message) <= limit:
        return message
    head, tail = limit * 3 // 4, limit // 4
    return f"{message[:head]} ...[{len(message) - head - tail} characters omitted]... {message[-tail:]}"


def error_response(message: str, status_code: int = 400, param: str | None = None,
                   type_: str | None = None) -> JSONResponse:
    message = truncate(message)
    kind = type_ or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                     403: "Forbidden", 405: "MethodNotAllowed", 413: "RequestTooLarge",
                     415: "UnsupportedMediaType", 503: "ServiceUnavailable"}.get(status_code, "ServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status_code}},
                        status_code=status_code)


def engine_error(e: Exception) -> JSONResponse:
    """Engine exceptions -> status: bad input is the caller's (400); a refused state is 503."""
    if isinstance(e, ValueError | TypeError | KeyError):
        return error_response(str(e), 400)
    if isinstance(e, RuntimeError):
        return error_response(str(e), 503)
    return error_response(f"{type(e).__name__}: {e}", 500)


async def run_on_engine(request: Request, fn, *args, **kwargs):
    """fn(engine, *args, **kwargs) where the engine lives: in the control pool for an in-process Engine,
    in the engine process for an EngineClient (fn is module-level: it crosses the pipe by name), so that
    what fn decodes from a request (tensors) is rebuilt next to the engine."""
    engine = request.app.state.engine
    if hasattr(engine, "run_on_engine"):
        return await run_blocking(request, engine.run_on_engine, fn, *args, **kwargs)
    return await run_blocking(request, fn, engine, *args, **kwargs)


async def run_blocking(request: Request, fn, *args, **kwargs):
    """Run a blocking engine call in the server's control thread pool, never on the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app.state.executor, functools.partial(fn, *args, **kwargs))

