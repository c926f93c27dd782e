"""EngineClient's generate half: the calls in flight on the server's side of the engine process.

`RemoteGeneration` (mixed into EngineClient, rollout/server/engine_client.py) holds `_calls`, one `_Call`
per `async_generate` call: its sink (the stream's queue) and this side's copy of each of its requests (a
`Req`, so outputs are built by the same rollout.outputs.build_output as in-process). It sends the
"generate" and "abort" messages, and handles the "submitted" and "out" ones: per "out" message it applies
every delta (rollout/server/engine_deltas.py is the format) and makes ONE `call_soon_threadsafe` per event
loop to hand the chunks to their streams' queues. When the child dies or a message cannot be sent, the
calls it concerns end here (as abort, or with the error).

What it does not do: own the pipe, its threads or the lock (EngineClient does: `_send`, `_lock`, `_dead`,
`_ids`, `tokenizer`, `_load` and `_finish_observers` are its attributes), or run anything of the model.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from rollout.engine import prompt_token_ids
from rollout.outputs import AsyncSink, AsyncStream, build_output, gather_final_outputs
from rollout.request import FinishReason, Req
from rollout.server import engine_deltas
from rollout.server.engine_process import EngineProcessError
from rollout.sglang_generate_args import check_generate_args

logger = logging.getLogger("rollout.server.engine_client")


class _Call:
    """One generate call on this side: its sink (the stream's queue), and its requests once submitted."""

    __slots__ = ("loop", "sink", "reqs", "num_open", "submitted")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sink = AsyncSink(loop)
        self.reqs: list[Req] = []
        self.num_open = 0
        self.submitted: asyncio.Future = loop.create_future()


class RemoteGeneration:
    """async_generate over the pipe, and the handling of the generate messages that come back."""

    _calls: dict[int, _Call]

    def _fail_call(self, call_id: int, err: Exception) -> None:
        """Its "generate" message could not be sent: the caller's await raises `err`."""
        call = self._calls.pop(call_id, None)
        if call is not None:
            call.loop.call_soon_threadsafe(_set_exception, call.submitted, err)

    def _end_calls(self, calls: dict[int, _Call], reason: str) -> None:
        """The engine process is gone: every request of `calls` still open ends as abort with `reason`."""
        by_loop: dict = defaultdict(list)
        for call in calls.values():
            if not call.reqs:
                call.loop.call_soon_threadsafe(_set_exception, call.submitted, EngineProcessError(reason))
            for req in call.reqs:
                if not req.finished:
                    req.finished_reason = FinishReason("abort", message=reason)
                    req.error = reason
                    by_loop[call.loop].append((call.sink, ("final", req)))
        if calls:
            logger.error("%s: %d call(s) in flight end as abort", reason, len(calls))
        self._hand_over(by_loop)

    def _on_submitted(self, call_id: int, ok: bool, value) -> None:
        call = self._calls.get(call_id)
        if call is None:
            return
        if not ok:
            self._calls.pop(call_id, None)
            call.loop.call_soon_threadsafe(_set_exception, call.submitted, value)
            return
        skeletons, single = value
        call.reqs, call.num_open = skeletons, len(skeletons)
        call.loop.call_soon_threadsafe(_set_result, call.submitted, single)

    def _on_out(self, deltas: list, load: dict) -> None:
        self._load = load
        by_loop: dict = defaultdict(list)
        finished = []
        for delta in deltas:
            call_id, index, final = delta[:3]
            call = self._calls.get(call_id)
            if call is None:  # its process-side abort raced the final: nobody waits
                continue
            req = call.reqs[index]
            if req.finished:  # ended already (an output the engine process could not send)
                continue
            engine_deltas.apply(req, delta)
            if final:
                call.num_open -= 1
                if not call.num_open:
                    self._calls.pop(call_id, None)
                finished.append(req)
                item = ("final", req)
            else:
                item = ("chunk", req.snapshot())
            if not call.sink.closed:
                by_loop[call.loop].append((call.sink, item))
        self._hand_over(by_loop)
        for req in finished:
            for fn in self._finish_observers:
                try:
                    fn(req)
                except Exception:  # noqa: BLE001 - an observer's bug must not lose outputs
                    logger.exception("finish observer %r failed", fn)

    @staticmethod
    def _hand_over(by_loop: dict) -> None:
        """One wake-up per event loop for everything this message carried."""
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_distribute, items)
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
                             return_logprob: bool | list[bool] = False, top_logprobs_num: int | list[int] = 0,
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
            return AsyncStream(reqs, call.sink, self._output, lambda _reqs: self._abort_call(call_id))
        def cancelled() -> None:
            call.sink.closed = True
            self._abort_call(call_id)

        return await gather_final_outputs(call.sink, reqs, self._output, cancelled, single)

def _distribute(items: list) -> None:
    for sink, item in items:
        if not sink.closed:
            sink.queue.put_nowait(item)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
