"""Turn a Req into the SGLang-shaped output dict, and carry it to a waiting caller.

Sinks decouple the engine thread from callers: a thread-safe queue for blocking calls, an asyncio
queue fed through `call_soon_threadsafe` for coroutines. A sink whose consumer is gone (its event loop
closed, its stream closed or dropped unread) raises SinkClosedError on `put`; the engine then drops
that consumer's requests. Streams are iterators over one call's sink: chunks of every request of the
call in arrival order (each dict carries "index", its position in the call), ending when every request
has delivered its final output. Nothing here touches the scheduler; closing a stream calls back.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable

from rollout.request import Req
from rollout.tokenizer import TokenizerWrapper


class SinkClosedError(RuntimeError):
    """The consumer of a sink is gone: nobody will read what is put into it."""


def build_output(req: Req, tok: TokenizerWrapper, weight_version: str, final: bool) -> dict:
    try:
        text = tok.final_text(req) if final else tok.decode(req.output_ids, req)
        text_error = None
    except Exception as e:  # a request that cannot be detokenized still returns its tokens
        text, text_error = None, f"detokenization failed: {type(e).__name__}: {e}"
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finished_reason.to_dict() if req.finished_reason else None,
        "weight_version": weight_version,
        "num_retractions": req.num_retractions,
    }
    if text_error:
        meta["error"] = text_error
    if final:
        meta["e2e_latency"] = req.finished_time - req.created_time
    if req.return_logprob:
        texts = [tok.token_text(t) for t in req.output_ids] if final else [None] * len(req.output_ids)
        meta["output_token_logprobs"] = [
            (lp, t, s) for lp, t, s in zip(req.output_logprobs, req.output_ids, texts)
        ]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [(lp, t, tok.token_text(t) if final else None) for lp, t in step]
                for step in req.output_top_logprobs
            ]
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta, "index": req.index}


class SyncSink:
    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.closed = False

    def put(self, item) -> None:
        if self.closed:
            raise SinkClosedError("the stream was closed by its reader")
        self.queue.put(item)

    def get(self, timeout: float | None = None):
        return self.queue.get(timeout=timeout)


class AsyncSink:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def put(self, item) -> None:
        if self.closed:
            raise SinkClosedError("the stream was closed by its reader")
        if self.loop.is_closed():
            raise SinkClosedError("the caller's event loop is closed")
        # Raises RuntimeError if the loop closes between the check and the call; the engine catches it.
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self):
        return await self.queue.get()


class _StreamBase:
    """Shared state of the sync and async streams: how many requests are still open, and the close."""

    def __init__(self, reqs: list[Req], sink, build: Callable[[Req, bool], dict],
                 abort: Callable[[list[Req]], None]) -> None:
        self._reqs = reqs
        self._sink = sink
        self._build = build
        self._abort = abort
        self._num_open = len(reqs)

    def _on_item(self, item) -> dict:
        kind, req = item
        final = kind == "final"
        self._num_open -= final
        return self._build(req, final)

    def _close(self) -> None:
        """The reader is done early: stop generating for it (its requests finish as abort, KV freed)."""
        if self._num_open:
            self._num_open = 0
            self._abort(self._reqs)
        self._sink.closed = True

    def __del__(self) -> None:
        # Dropped unread (possibly never started): no lock here, so only mark the sink; the engine
        # drops its requests at their next delivery.
        if self._num_open:
            self._sink.closed = True


class SyncStream(_StreamBase):
    def __iter__(self) -> SyncStream:
        return self

    def __next__(self) -> dict:
        if not self._num_open:
            raise StopIteration
        try:
            item = self._sink.get()
        except BaseException:  # interrupted while waiting: the caller will not read on
            self._close()
            raise
        return self._on_item(item)

    def close(self) -> None:
        self._close()


class AsyncStream(_StreamBase):
    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> dict:
        if not self._num_open:
            raise StopAsyncIteration
        try:
            item = await self._sink.get()
        except BaseException:  # cancelled: the caller will not read on
            self._close()
            raise
        return self._on_item(item)

    async def aclose(self) -> None:
        self._close()
