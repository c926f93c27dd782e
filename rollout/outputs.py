"""Turn a Req into the SGLang-shaped output dict, and carry it to a waiting caller.

Sinks decouple the engine thread from callers: a thread-safe queue for blocking calls, an asyncio
queue fed through `call_soon_threadsafe` for coroutines (one call per batch of items for all the sinks
of one event loop, so a step streaming to many requests wakes the loop once). A sink whose consumer is gone (its event loop
closed, its stream closed or dropped unread) raises SinkClosedError on `put`; the engine then drops
that consumer's requests. Streams are iterators over one call's sink: chunks of every request of the
call in arrival order (each dict carries "index", its position in the call), ending when every request
has delivered its final output. Nothing here touches the scheduler; closing a stream calls back.
"""

from __future__ import annotations

import asyncio
import base64
import queue
import threading
import weakref
from collections.abc import Callable, Container

from rollout.request import Req
from rollout.tokenizer import TokenizerWrapper


class SinkClosedError(RuntimeError):
    """The consumer of a sink is gone: nobody will read what is put into it."""


def build_output(req: Req, tok: TokenizerWrapper, weight_version: str, final: bool) -> dict:
    try:
        if final:
            text = tok.final_text(req)
        else:  # a chunk never ends in a partial character that the next token completes (SGLang holds it too)
            ids = req.output_ids
            n = tok.stable_len(ids)  # all but a byte-piece run a later token may rewrite
            text = tok.output_text(ids if n == len(ids) else ids[:n], req)
            if text and text[-1] == "\ufffd":
                text = text.rstrip("\ufffd")
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
        # SGLang's pair: the version when the request was submitted and when it finished (the current
        # one in a stream chunk); they differ when an update landed in between (pause in place).
        "weight_version_start": req.weight_version_start,
        "weight_version_end": weight_version,
        "num_retractions": req.num_retractions,
        # SGLang's spans: which weight version sampled which output tokens ([start, end) over output_ids).
        "weight_versions": [{"start": s, "end": e, "version": v} for s, e, v in req.output_version_spans],
    }
    if req.prefill_version_spans is not None:
        meta["prefill_weight_versions"] = [{"start": s, "end": e, "version": v} for s, e, v in req.prefill_version_spans]
    if text_error:
        meta["error"] = text_error
    if final:
        meta["e2e_latency"] = req.finished_time - req.created_time
    if final and req.return_routed_experts:
        # SGLang's wire format, in-process too: base64 of int32 [rows, num_layers, top_k], C order.
        routed = req.routed_experts
        meta["routed_experts"] = "" if routed is None else base64.b64encode(routed.numpy().tobytes()).decode("ascii")
    if req.return_logprob:
        meta.update(logprob_meta(req, tok, final))
    if tok.tokenizer is None:  # token ids in, token ids out: SGLang's outputs then have no "text" key at all
        return {"output_ids": list(req.output_ids), "meta_info": meta, "index": req.index}
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta, "index": req.index}


def logprob_meta(req: Req, tok: TokenizerWrapper, final: bool) -> dict:
    """SGLang's logprob keys: input_token_logprobs / output_token_logprobs as [(logprob, token id, text)]
    (text only in the final output); input_top_logprobs / output_top_logprobs with top_logprobs_num;
    input_token_ids_logprobs / output_token_ids_logprobs with token_ids_logprob. Input lists start at
    prompt position logprob_start_len, whose entry has logprob None (SGLang pads the first one)."""
    def text(t: int) -> str | None:
        return tok.token_text(t) if final else None

    def entries(pairs) -> list:
        return [(lp, t, text(t)) for lp, t in pairs]

    prompt_pos = range(req.logprob_start_len, len(req.prompt_ids))
    scored = [req.input_logprobs.get(p) for p in prompt_pos]  # None where not scored (the first)
    # A chunk's output entries (no text) come from the request's cache, built once per position; the final
    # output's (with text) are built whole, once.
    cache = None if final else req.chunk_cache
    out_ids = req.output_ids
    meta = {
        "input_token_logprobs": _prompt_entries(
            cache, "in_lp", scored, lambda: [(e[0] if e else None, req.prompt_ids[p], text(req.prompt_ids[p]))
                                             for p, e in zip(prompt_pos, scored)]),
        "output_token_logprobs": _entries_per_position(
            cache, "lp", req.output_logprobs, lambda i, lp: (lp, out_ids[i], None),
            lambda: entries(zip(req.output_logprobs, out_ids))),
    }
    if req.top_logprobs_num:
        meta["input_top_logprobs"] = _prompt_entries(
            cache, "in_top", scored, lambda: [entries(e[1]) if e else None for e in scored], nested=True)
        meta["output_top_logprobs"] = _entries_per_position(
            cache, "top", req.output_top_logprobs, lambda i, step: entries(step),
            lambda: [entries(step) for step in req.output_top_logprobs], nested=True)
    ids = req.token_ids_logprob
    if ids is not None:
        meta["input_token_ids_logprobs"] = _prompt_entries(
            cache, "in_ids", scored, lambda: [entries(zip(e[2], ids)) if e and ids else ([] if e else None)
                                              for e in scored], nested=True)
        if ids:
            meta["output_token_ids_logprobs"] = _entries_per_position(
                cache, "ids", req.output_token_ids_logprobs, lambda i, step: entries(zip(step, ids)),
                lambda: [entries(zip(step, ids)) for step in req.output_token_ids_logprobs], nested=True)
        else:
            meta["output_token_ids_logprobs"] = [[] for _ in out_ids]
    return meta


def _prompt_entries(cache: dict | None, key: str, scored: list, whole, nested: bool = False) -> list:
    """A chunk's prompt entries: built once while the prompt's scored records are the same objects (they
    change only when a retraction recomputes the prompt), else anew; a new list (`nested`: inner lists
    copied too) either way. No cache (a final output): `whole()`."""
    if cache is None:
        return whole()
    hit = cache.get(key)
    if hit is None or len(hit[0]) != len(scored) or any(a is not b for a, b in zip(hit[0], scored)):
        hit = cache[key] = (scored, whole())
    return [None if e is None else list(e) for e in hit[1]] if nested else list(hit[1])


def _entries_per_position(cache: dict | None, key: str, src: list, one, whole, nested: bool = False) -> list:
    """The entries of `src` (`one(i, src[i])` each), as a new list: `whole()` when there is no cache (a final
    output); else the cached entries of the positions seen before, and only the new positions built. A
    chunk is a cumulative snapshot, so building every position each time made a stream of L tokens cost
    O(L^2) entries (seconds of the server's event loop for long streams with top logprobs). The cache holds
    while `src` only grew: its item at the last cached position must be the same object (a step taken back
    cuts the list and appends new objects, so a cut is seen and everything is built anew). `nested`:
    each position's entry is a list, copied so a caller's change to a chunk never reaches the next one."""
    if cache is None:
        return whole()
    built, last = cache.get(key, ([], None))
    k = len(built)
    if not (k <= len(src) and (k == 0 or src[k - 1] is last)):
        built, k = [], 0
    built.extend(one(i, src[i]) for i in range(k, len(src)))
    cache[key] = (built, src[-1] if src else None)
    return [list(e) for e in built] if nested else list(built)


class SyncSink:
    def __init__(self, producer_alive: Callable[[], bool] = lambda: True) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.closed = False
        self._producer_alive = producer_alive

    def put(self, item) -> None:
        if self.closed:
            raise SinkClosedError("the stream was closed by its reader")
        self.queue.put(item)

    def get(self):
        # Polls so that a producer that is gone is an error, not a wait forever.
        while True:
            try:
                return self.queue.get(timeout=1.0)
            except queue.Empty:
                if not self._producer_alive():
                    raise RuntimeError("the engine's scheduler thread is not running (engine shut down?); "
                                       "this request will get no output") from None


class _LoopFeeder:
    """Hands items from the scheduler thread to the asyncio queues of one event loop, with one
    `call_soon_threadsafe` (one self-pipe write, one loop wake-up) per batch, not per item: a decode
    step streaming to 64 requests wakes their loop once, not 64 times. FIFO over all its sinks, so
    each sink sees its items in put order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def put(self, q: asyncio.Queue, item) -> None:
        with self._lock:
            self._pending.append((q, item))
            if len(self._pending) > 1:
                return  # a drain is already scheduled and has not run yet
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed meanwhile: nobody will read what is pending
            with self._lock:
                self._pending.clear()
            raise

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for q, item in batch:
            q.put_nowait(item)


_feeders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _LoopFeeder
_feeders_lock = threading.Lock()


def _feeder(loop: asyncio.AbstractEventLoop) -> _LoopFeeder:
    with _feeders_lock:
        feeder = _feeders.get(loop)
        if feeder is None:
            feeder = _feeders[loop] = _LoopFeeder(loop)
        return feeder


class AsyncSink:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self._feeder = _feeder(loop)

    def put(self, item) -> None:
        if self.closed:
            raise SinkClosedError("the stream was closed by its reader")
        if self.loop.is_closed():
            raise SinkClosedError("the caller's event loop is closed")
        # Raises RuntimeError if the loop closes between the check and the call; the engine catches it.
        self._feeder.put(self.queue, item)

    async def get(self):
        return await self.queue.get()


class _StreamBase:
    """Shared state of the sync and async streams: how many requests are still open, and the close.

    `segments` (SGLang's stream_output): each chunk's output_ids holds only the ids after those of the same
    request's previous chunk taken from this stream. Cut when a chunk is built, so a consumer that builds only
    the newest of several pending chunks (ready_nowait) still loses no id: the newest is cut from where the last
    one built ended."""

    def __init__(self, reqs: list[Req], sink, build: Callable[[Req, bool], dict],
                 abort: Callable[[list[Req]], None], segments: bool = False) -> None:
        self._reqs = reqs
        self._sink = sink
        self._build = build
        self._abort = abort
        self._num_open = len(reqs)
        self.segments = segments
        self._sent: dict[int, int] = {}  # request index -> output ids in the chunks built so far (segments)

    @property
    def done(self) -> bool:
        """Every request's final output has been taken (nothing more will come)."""
        return not self._num_open

    def _on_item(self, item) -> dict:
        kind, req = item
        final = kind == "final"
        self._num_open -= final
        out = self._build(req, final)
        if self.segments:
            ids, start = out["output_ids"], self._sent.get(req.index, 0)
            self._sent[req.index] = len(ids)
            out["output_ids"] = ids[start:]
        return out

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

    def ready_nowait(self, keep_first_of: Container[int] | None = None) -> list[dict]:
        """Every output already delivered, without waiting (the HTTP server writes them as one batch).
        A stream chunk is a cumulative snapshot, so only the newest one of each request is built: a later
        chunk or the request's final output supersedes it and loses nothing. With `keep_first_of`, a
        request whose index is not in it also keeps its first pending item (its first token's event)."""
        items = []
        while not self._sink.queue.empty():
            items.append(self._sink.queue.get_nowait())
        newest = {req.index: i for i, (_, req) in enumerate(items)}
        first: dict[int, int] = {}
        if keep_first_of is not None:
            for i, (_, req) in enumerate(items):
                if req.index not in keep_first_of:
                    first.setdefault(req.index, i)
        return [self._on_item(item) for i, item in enumerate(items)
                if newest[item[1].index] == i or item[0] == "final" or first.get(item[1].index) == i]

    async def aclose(self) -> None:
        self._close()


BUILD_INLINE_BELOW = 1 << 15  # output entries an awaited call builds on the event loop itself


async def gather_final_outputs(sink, reqs: list, build, on_cancel, single: bool):
    """Await the final output of every request of one async call from `sink`, then build their dicts
    with `build(req, final=True)`, in request order; `on_cancel()` runs if the caller is cancelled
    (its requests should stop generating). Outputs with many logprobs take seconds to build: past
    BUILD_INLINE_BELOW entries they are built in a worker thread, not on the caller's loop."""
    finished = []
    try:
        for _ in range(len(reqs)):
            _, req = await sink.get()
            finished.append(req)
    except asyncio.CancelledError:
        on_cancel()
        raise
    results: list = [None] * len(reqs)

    def build_all() -> None:
        for req in finished:
            results[req.index] = build(req, final=True)

    if sum(len(r.output_ids) * (1 + r.top_logprobs_num) for r in finished) > BUILD_INLINE_BELOW:
        await asyncio.to_thread(build_all)
    else:
        build_all()
    return results[0] if single else results
