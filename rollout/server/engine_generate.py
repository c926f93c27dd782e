"""EngineClient's generate half: the calls in flight on the server's side of the engine process.

`RemoteGeneration` (mixed into EngineClient, rollout/server/engine_client.py) holds `_calls`, one `_Call`
per `async_generate` call: its sink (the stream's queue) and this side's copy of each of its requests (a
`Req`, so outputs are built by the same rollout.outputs.build_output as in-process). It sends the
"generate" and "abort" messages, and handles the "submitted" and "out" ones.

An "out" message (one engine step) is applied at once when it is read on the loop that owns the calls (the
HTTP server's case: EngineClient.attach_loop), and costs one `call_soon_threadsafe` per other event loop
(read on the reader's thread); either way the deltas (rollout/server/engine_deltas.py is the format) are
applied on the loop that owns the call, so the copies are only ever touched by one thread and a chunk
needs no snapshot. A stream's queue holds at most
one item per request: while one is queued and unread, later deltas only bring the copy it will be built
from up to date (a final one turns it into the final item). That is the coalescing the HTTP stream does
anyway (a chunk is a cumulative snapshot, so a newer one supersedes it, as SGLang's stream_interval skips),
done before any output is built: a reader that keeps up still sees every token. When the child dies or a
message cannot be sent, the calls it concerns end here (as abort, or with the error), on their loops,
after whatever was applied before.

What it does not do: own the pipe, its threads or the lock (EngineClient does: `_send`, `_lock`, `_dead`,
`_ids`, `tokenizer`, `_load` and `_finish_observers` are its attributes), or run anything of the model.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import defaultdict

from rollout.engine import prompt_token_ids
from rollout.outputs import AsyncSink, AsyncStream, build_output, gather_final_outputs
from rollout.request import FinishReason, Req
from rollout.server import engine_deltas
from rollout.server.engine_process import EngineProcessError
from rollout.sglang_generate_args import check_generate_args

logger = logging.getLogger("rollout.server.engine_client")


class _Call:
    """One generate call on this side: its sink (the stream's queue), its requests once submitted, and the
    unread item of each request in that queue (its index -> [kind, req], touched only on `loop`)."""

    __slots__ = ("loop", "sink", "reqs", "num_open", "submitted", "unread")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sink = AsyncSink(loop)
        self.reqs: list[Req] = []
        self.num_open = 0  # requests whose final delta has not been read yet
        self.submitted: asyncio.Future = loop.create_future()
        self.unread: dict[int, list] = {}

    def offer(self, kind: str, req: Req) -> None:
        """On `loop`: queue `req`'s output, or, while one is queued unread, let that one stand for it."""
        item = self.unread.get(req.index)
        if item is not None:
            if kind == "final":
                item[0] = "final"
            return
        if self.sink.closed:
            return
        item = self.unread[req.index] = [kind, req]
        self.sink.queue.put_nowait(item)

    def build(self, client: RemoteGeneration, req: Req, final: bool) -> dict:
        """The stream took `req`'s item out of the queue (and builds it at once, on the loop)."""
        self.unread.pop(req.index, None)
        return client._output(req, final)


class RemoteGeneration:
    """async_generate over the pipe, and the handling of the generate messages that come back."""

    _calls: dict[int, _Call]

    def _fail_call(self, call_id: int, err: Exception) -> None:
        """Its "generate" message could not be sent: the caller's await raises `err`."""
        call = self._calls.pop(call_id, None)
        if call is not None:
            self._on_loop(call.loop, _set_exception, call.submitted, err)

    def _end_calls(self, calls: dict[int, _Call], reason: str) -> None:
        """The engine process is gone: every request of `calls` still open ends as abort with `reason`, on
        its loop, after the deltas handed to that loop before."""
        by_loop: dict = defaultdict(list)
        for call in calls.values():
            if not call.reqs:
                self._on_loop(call.loop, _set_exception, call.submitted, EngineProcessError(reason))
            else:
                by_loop[call.loop].append(call)
        if calls:
            logger.error("%s: %d call(s) in flight end as abort", reason, len(calls))
        for loop, ended in by_loop.items():
            self._on_loop(loop, _abort_all, ended, reason)

    def _on_submitted(self, call_id: int, ok: bool, value) -> None:
        call = self._calls.get(call_id)
        if call is None:
            return
        if not ok:
            self._calls.pop(call_id, None)
            self._on_loop(call.loop, _set_exception, call.submitted, value)
            return
        skeletons, single = value
        call.reqs, call.num_open = skeletons, len(skeletons)
        self._on_loop(call.loop, _set_result, call.submitted, single)

    def _on_out(self, deltas: list, load: dict) -> None:
        """One engine step's deltas (as read): each call's bookkeeping here, the deltas themselves applied
        on the calls' loops (`_apply_deltas`): at once on the reading loop, one wake-up per other loop."""
        self._load = load
        by_loop: dict = defaultdict(list)
        for delta in deltas:
            call = self._calls.get(delta[0])
            if call is None:  # its process-side abort raced the final: nobody waits
                continue
            if delta[2]:  # final
                call.num_open -= 1
                if not call.num_open:
                    self._calls.pop(delta[0], None)
            by_loop[call.loop].append((call, delta))
        for loop, items in by_loop.items():
            self._on_loop(loop, _apply_deltas, items, self._finish_observers)

    @staticmethod
    def _on_loop(loop, fn, *args) -> None:
        """fn(*args) on `loop`: now, when this is that loop's thread (the pipe is read on it), else soon."""
        if asyncio._get_running_loop() is loop:
            fn(*args)
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # that loop is closed: nobody reads these
            pass

    def _abort_call(self, call_id: int, reqs=None) -> None:
        """The caller stopped reading: the engine aborts the call's requests at its next step boundary."""
        try:
            self._send(("abort", call_id))
        except RuntimeError:  # the engine is gone already: nothing runs
            pass

    def _output(self, req: Req, final: bool) -> dict:
        return build_output(req, self.tokenizer, req.weight_version, final)

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None,
                             return_logprob: bool | list[bool] | None = False,
                             top_logprobs_num: int | list[int] | None = 0,
                             stream: bool = False, rid=None, return_routed_experts: bool | list[bool] = False,
                             logprob_start_len: int | list[int] | None = None,
                             token_ids_logprob: list[int] | list[list[int]] | None = None,
                             return_original_logprob: bool | None = None,
                             lora_path: str | list[str | None] | None = None, **sglang_args):
        """Engine.async_generate, with the prompts tokenized here and the model in the engine process."""
        check_generate_args(sglang_args, "async_generate")  # refused here, before anything is sent
        encoded = prompt_token_ids(self.tokenizer, prompt, input_ids)
        kwargs = dict(sampling_params=sampling_params, return_logprob=return_logprob,
                      top_logprobs_num=top_logprobs_num, stream=stream, rid=rid,
                      return_routed_experts=return_routed_experts, logprob_start_len=logprob_start_len,
                      token_ids_logprob=token_ids_logprob, return_original_logprob=return_original_logprob,
                      lora_path=lora_path)
        call = _Call(asyncio.get_running_loop())
        call_id = next(self._ids)
        with self._lock:
            if self._dead is not None:
                raise EngineProcessError(self._dead)
            self._calls[call_id] = call
        try:
            self._send(("generate", call_id, encoded, kwargs))
            single = await call.submitted
        except asyncio.CancelledError:
            call.sink.closed = True
            self._abort_call(call_id)
            raise
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        reqs = call.reqs
        if stream:
            return AsyncStream(reqs, call.sink, functools.partial(call.build, self),
                               lambda _reqs: self._abort_call(call_id), segments=self.args.stream_output)
        def cancelled() -> None:
            call.sink.closed = True
            self._abort_call(call_id)

        return await gather_final_outputs(call.sink, reqs, functools.partial(call.build, self), cancelled, single)

def _apply_deltas(items: list, observers: list) -> None:
    """On the calls' loop: bring each copy up to date (in the engine's order), then offer the outputs to
    their streams, finished requests first: their streams are written first, and a client that waits for a
    request's end to send its next one (the engine's free slot) sends it a little sooner."""
    finals, chunks = [], []
    for call, delta in items:
        req = call.reqs[delta[1]]
        if req.finished:  # ended already (an output the engine process could not send)
            continue
        engine_deltas.apply(req, delta)
        (finals if delta[2] else chunks).append((call, req))
    for call, req in finals:
        call.offer("final", req)
        for fn in observers:
            try:
                fn(req)
            except Exception:  # noqa: BLE001 - an observer's bug must not lose outputs
                logger.exception("finish observer %r failed", fn)
    for call, req in chunks:
        call.offer("chunk", req)  # a request that also finished in this message keeps its final item


def _abort_all(calls: list, reason: str) -> None:
    """On the calls' loop: every request not finished ends as abort with `reason`."""
    for call in calls:
        for req in call.reqs:
            if not req.finished:
                req.finished_reason = FinishReason("abort", message=reason)
                req.error = reason
                # The engine process never sent this request's times: end it now. perf_counter is the
                # system's monotonic clock on Linux, the one the engine process read created_time from.
                req.finished_time = max(time.perf_counter(), req.created_time)
                call.offer("final", req)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
