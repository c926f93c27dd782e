"""What one request may cost the server, checked before the cost is paid.

- Body size: `BodySizeLimit` refuses a body over `--max-request-bytes` (weights uploads:
  `--max-weights-request-bytes`) with 413, from its Content-Length before reading it, or as soon as a
  chunked body passes the limit.
- Prompt size: a text prompt whose character count already exceeds what the context could hold (the
  longest vocabulary entry times the context length) is refused before tokenizing; tokenizing the rest
  runs in a thread of its own pool, never on the event loop (a 10 MB prompt took seconds there).
- Response size: `check_work` refuses a request asking for more output entries than
  `--max-response-entries`: each sequence counts its new tokens, and with logprobs each scored position
  counts 1 + top_logprobs_num + len(token_ids_logprob) entries more.
- Serializing: `json_response_off_loop` encodes a large response in a worker thread.

It does not validate types or ranges (the engine does, naming the field); the estimates here only read
what parses and leave the rest for the engine to refuse.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import Response

from rollout.sampling_params import as_int
from rollout.server.common import dumpb, error_response

WEIGHT_UPLOAD_PATHS = frozenset({"/update_weights_from_tensor"})


class BodySizeLimit:
    """Pure ASGI middleware: 413 naming the flag for a body over the limit of its path."""

    def __init__(self, app, max_bytes: int, max_weights_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_weights_bytes = max_weights_bytes

    def _limit(self, path: str) -> tuple[int, str]:
        if path in WEIGHT_UPLOAD_PATHS:
            return self.max_weights_bytes, "--max-weights-request-bytes"
        return self.max_bytes, "--max-request-bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, flag = self._limit(scope["path"])

        def too_large(size: str) -> Response:
            return error_response(f"request body of {size} bytes is over this server's limit of {limit} bytes "
                                  f"({flag})", 413)

        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await too_large(length.decode())(scope, receive, send)
        received, over, started = 0, False, False

        async def counting_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body (no Content-Length): stop reading it here
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message):
            nonlocal started
            if over and not started:  # the app gave up on the body: the 413 goes out instead
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except Exception:
            if not over:
                raise
        if over and not started:
            await too_large(f"more than {limit}")(scope, receive, send)


# ---- prompt size and tokenizing off the loop --------------------------------------------------
def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (byte-level entries
    are one character per byte, which is at least one per decoded character)."""
    vocab = tokenizer.get_vocab()
    return max((len(k) for k in vocab), default=1)


def check_prompt_chars(request: Request, prompts: list[str], what: str = "prompt") -> Response | None:
    """A prompt that cannot fit the context whatever its tokenization: 400 before tokenizing it. `what`
    names the field (chat: "messages", whose contents are counted together)."""
    state = request.app.state
    limit = state.max_prompt_chars
    if limit is None:
        return None
    for i, p in enumerate(prompts):
        if isinstance(p, str) and len(p) > limit:
            ctx = state.engine.runner.context_len
            label = f"{what} {i}" if what == "prompt" else what
            return error_response(f"{label} has {len(p)} characters: more than {ctx} tokens (the context "
                                  f"length) could hold at {limit // ctx} characters per token at most", 400,
                                  param=what)
    return None


async def tokenize(request: Request, prompts: list[str]) -> list[list[int]]:
    """Encode text prompts in the tokenizer pool (HF tokenizers are thread-safe for encode)."""
    engine = request.app.state.engine
    loop = asyncio.get_running_loop()
    pool: ThreadPoolExecutor = request.app.state.tokenize_executor
    return list(await asyncio.gather(*(loop.run_in_executor(pool, engine.tokenizer.encode, p) for p in prompts)))


# ---- response size ----------------------------------------------------------------------------
def _int(x, default: int) -> int:
    v = as_int(x)  # 16.0 counts as the engine will read it (rollout.sampling_params)
    return default if v is None else v


def _per_prompt(value, num: int) -> list:
    return value if isinstance(value, list) and len(value) == num else [value] * num


def response_entries(ids_list: list[list[int]], sampling_params, context_len: int, return_logprob=False,
                     top_logprobs_num=0, token_ids_logprob=None, logprob_start_len=None) -> int:
    """Upper bound on what a request returns: new tokens, plus logprob entries when asked (see module)."""
    num = len(ids_list)
    sps = _per_prompt(sampling_params, num)
    flags, tops, starts = (_per_prompt(v, num) for v in (return_logprob, top_logprobs_num, logprob_start_len))
    ids_lists = token_ids_logprob if (isinstance(token_ids_logprob, list) and token_ids_logprob
                                      and isinstance(token_ids_logprob[0], list | type(None))) \
        else [token_ids_logprob] * num
    total = 0
    for i, ids in enumerate(ids_list):
        sp = sps[i] if isinstance(sps[i], dict) else {}
        n = max(1, _int(sp.get("n", 1), 1))
        room = max(0, context_len - len(ids))
        new = sp.get("max_new_tokens", 128)
        new = room if new is None else min(max(0, _int(new, 0)), room)
        per_token = 1
        if flags[i] is True:
            extra = len(ids_lists[i]) if i < len(ids_lists) and isinstance(ids_lists[i], list) else 0
            per_token += 1 + max(0, _int(tops[i], 0)) + extra
            start = _int(starts[i], -1)
            scored_prompt = len(ids) - start if 0 <= start < len(ids) else 1
            total += n * scored_prompt * (per_token - 1)
        total += n * new * per_token
    return total


def check_work(request: Request, ids_list: list[list[int]], sampling_params, **logprob_args) -> Response | None:
    limit = request.app.state.server_args.max_response_entries
    ctx = request.app.state.engine.runner.context_len
    entries = response_entries(ids_list, sampling_params, ctx, **logprob_args)
    if entries > limit:
        return error_response(f"request asks for up to {entries} output entries (sequences x new tokens, and "
                              f"x (1 + top_logprobs_num + len(token_ids_logprob)) with logprobs); this server's "
                              f"limit is --max-response-entries {limit}: ask for fewer sequences, tokens or "
                              f"top logprobs, or split the request", 400, param="sampling_params")
    return None


async def json_response_off_loop(request: Request, make_content, status_code: int = 200) -> Response:
    """Build (`make_content()`) and encode in the tokenizer pool: a large response must not stall every
    other client on the loop."""
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(request.app.state.tokenize_executor, lambda: dumpb(make_content()))
    return Response(body, status_code=status_code, media_type="application/json")


async def prepare_prompts(request: Request, text, input_ids):
    """-> (text, input_ids) with text prompts tokenized off the loop (then text is None), or the
    refusal to send. What the engine would refuse by name (wrong types, no tokenizer, empty prompts)
    is passed through untouched so that it does."""
    prompts = [text] if isinstance(text, str) else text
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        return text, input_ids
    refusal = check_prompt_chars(request, prompts)
    if refusal is not None:
        return refusal
    if request.app.state.engine.tokenizer.tokenizer is None:
        return text, input_ids
    try:
        ids = await tokenize(request, prompts)
    except ValueError:  # text the tokenizer refuses (a lone surrogate): the engine names it
        return text, input_ids
    if not all(ids):
        return text, input_ids
    return None, ids[0] if isinstance(text, str) else ids
