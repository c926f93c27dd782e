"""Helpers shared by the route modules: JSON out, errors in one shape, blocking engine calls off the loop,
and `Body`, the base of every request model (it refuses strings that are not valid Unicode, naming the field).

Every error body is `{"error": {"message", "type", "param", "code"}}` (the OpenAI shape; SGLang's native
routes send `{"error": {"message"}}`, a subset), with `param` naming the offending field when known.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
from typing import ClassVar

try:  # ~10x faster than json on the per-token stream chunks (the `server` extra installs it)
    import orjson
except ImportError:  # pragma: no cover - the stdlib path below is the fallback
    orjson = None

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


async def read_json_body(request: Request):
    """The body of a route that reads it itself (/generate, a plain Starlette route: FastAPI's body-parameter
    machinery cost ~30 us of every request there) as FastAPI reads a JSON body parameter, errors included:
    None when empty (the model then reports the body missing), malformed JSON a RequestValidationError of
    type json_invalid, any other failure (bad UTF-8, nesting too deep, a body cut off) an HTTPException 400
    caused by it. The app's handlers turn both into the same 400s as on the FastAPI routes. Content-Type is
    checked before (security.RequestGuard: a body must be application/json)."""
    try:
        body = await request.body()
        return json.loads(body) if body else None
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from e
    except Exception as e:
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e


def lone_surrogate_at(value, path: str = "") -> str | None:
    """The path ("messages[0].content") of the first string in a decoded JSON value that holds a lone
    UTF-16 surrogate, or None. JSON's "\\ud800" escape decodes to one; it cannot be encoded as UTF-8, so a
    tokenizer, a file path or a /metrics label built from it fails deep inside (a 500, or a /metrics
    broken until the value changes). Lists of ints (token ids) are skipped: their types are checked by
    the models."""
    if isinstance(value, str):
        if value.isascii():  # the common case (base64 weight payloads of GBs): a scan, no copy
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and not (value and type(value[0]) is int):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and lone_surrogate_at(key) is not None:
            return f"{path}.{key!r}" if path else repr(key)
        where = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)
        found = lone_surrogate_at(item, where)
        if found is not None:
            return found
    return None


class Body(BaseModel):
    """A request body: strict types, unknown keys refused, no string with a lone surrogate."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # Fields that name a file or directory: no path holds a NUL byte, and the OS refuses one deep inside
    # open()/stat() with a bare ValueError, so it is refused here naming the field.
    path_fields: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        where = lone_surrogate_at(data)
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "{where}: a string holds a lone UTF-16 surrogate (a \\ud800-"
                                      "\\udfff escape not in a pair): not valid Unicode text", {"where": where})
        for name in cls.path_fields if isinstance(data, dict) else ():
            if isinstance(data.get(name), str) and "\x00" in data[name]:
                raise PydanticCustomError("nul_in_path", "{name}: a path cannot hold a NUL byte", {"name": name})
        return data


class SGLangReqBody(Body):
    """The body of one of SGLang's control requests: `rid`, which every SGLang request class carries
    (BaseReq), is accepted; nothing here routes a control call by it."""

    rid: str | list[str] | None = None


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
    return JSONResponse(error_body(message, status_code, param, type_), status_code=status_code)


def error_body(message: str, status_code: int = 400, param: str | None = None, type_: str | None = None) -> dict:
    """The body error_response sends: OpenAI's `{"error": {"message", "type", "param", "code"}}`, and the same
    fields at the top level with `"object": "error"`, SGLang's ErrorResponse (its tests read `body["type"]`)."""
    kind = type_ or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                     403: "Forbidden", 405: "MethodNotAllowed", 413: "RequestTooLarge",
                     415: "UnsupportedMediaType", 503: "ServiceUnavailable"}.get(status_code, "ServerError")
    fields = {"message": truncate(message), "type": kind, "param": param, "code": status_code}
    return {"object": "error", **fields, "error": fields}


_SAMPLING_PARAM = re.compile(r"^sampling params? (\w+)")


def engine_error(e: Exception) -> JSONResponse:
    """Engine exceptions -> status: bad input is the caller's (400, `param` naming a sampling param the
    message names first); a refused state is 503."""
    if isinstance(e, ValueError | TypeError | KeyError):
        named = _SAMPLING_PARAM.match(str(e))
        return error_response(str(e), 400, param=f"sampling_params.{named.group(1)}" if named else None)
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

