"""The per-step deltas between the engine process and the server, without processes: the server's copy of
a request, rebuilt from deltas, equals the engine's request; a delta that cannot be built ends the
request as abort instead of leaving its caller waiting."""

from __future__ import annotations

import asyncio
import pickle

from rollout.request import FinishReason, Req
from rollout.sampling_params import SamplingParams
from rollout.server.engine_client import EngineClient
from rollout.server.engine_process import _Batcher, _CallSink, _skeleton


class _FakeEngine:
    weight_version = "w1"

    def __init__(self) -> None:
        self.aborted: list = []

    def get_load(self) -> dict:
        return {"num_reqs": 1}

    def _abort_quietly(self, reqs) -> None:
        self.aborted += reqs


class _FakePipe:
    def __init__(self) -> None:
        self.messages: list = []

    def send(self, msg) -> None:
        self.messages.append(pickle.loads(pickle.dumps(msg)))  # what crosses the real pipe


def _parent(call_id: int, skeletons: list[Req]):
    """An EngineClient's delta-applying half, with one call registered (no process, no threads)."""
    from rollout.server.engine_client import _Call

    client = object.__new__(EngineClient)
    client._finish_observers, client._load = [], {}
    loop = asyncio.new_event_loop()
    call = _Call(loop)
    call.reqs, call.num_open = [pickle.loads(pickle.dumps(s)) for s in skeletons], len(skeletons)
    client._calls = {call_id: call}
    return client, call, loop


def _req(index: int, return_logprob: bool = True) -> Req:
    return Req(f"r{index}", [5, 6, 7], SamplingParams.from_dict({"max_new_tokens": 8}), seed=1,
               return_logprob=return_logprob, top_logprobs_num=2 * return_logprob,
               token_ids_logprob=[4] if return_logprob else None, stream=True, index=index)


def test_requests_rebuilt_from_deltas_equal_the_engines():
    """Applying each step's message reproduces every list, prompt logprobs, counters and the finish of the
    engine's requests (with and without logprobs), including lists that shrank between steps."""
    engine, pipe = _FakeEngine(), _FakePipe()
    batcher = _Batcher(engine, pipe)
    reqs = [_req(0), _req(1), _req(2, return_logprob=False)]
    sink = _CallSink(7, batcher, {7: None}, len(reqs))
    client, call, loop = _parent(7, [_skeleton(r) for r in reqs])
    try:
        for step in range(5):
            for r in reqs:
                r.output_ids.append(10 + step + r.index)
                if r.return_logprob:
                    r.output_logprobs.append(-0.5 * step)
                    r.output_top_logprobs.append([(-0.1, 3), (-0.2, 4)])
                    r.output_token_ids_logprobs.append([-1.0 - step])
                if step == 0 and r.return_logprob:
                    r.input_logprobs = {1: (-2.0, [(-1.5, 9)], [-3.0]), 2: (-2.5, None, None)}
                if step == 3 and r.index > 0:  # steps taken back: the engine's lists shrink
                    for seq in (r.output_ids, r.output_logprobs, r.output_top_logprobs, r.output_token_ids_logprobs):
                        del seq[-2:]  # below what was sent after the step before
                    r.num_retractions = 1
                if step == 4:
                    r.finished_reason = FinishReason("length", matched=5)
                    r.cached_tokens = 2
                sink.put(("final" if r.finished else "chunk", r))
            batcher.flush()
            client._on_out(*pipe.messages[-1][1:])
            assert call.sink.queue.qsize() == (0 if step == 0 else 3)  # applied on the loop, not this thread
            loop.run_until_complete(asyncio.sleep(0))
            for mine, theirs in zip(call.reqs, reqs):
                for name in ("output_ids", "output_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                             "input_logprobs", "num_retractions", "cached_tokens", "finished_reason", "prompt_ids"):
                    assert getattr(mine, name) == getattr(theirs, name), (step, name)
            # Nobody reads: each request keeps one unread item, brought up to date, final at the end.
            items = [call.sink.queue._queue[i] for i in range(call.sink.queue.qsize())]
            assert [(kind, req.index) for kind, req in items] == [("final" if step == 4 else "chunk", i) for i in range(3)]
            assert all(req is mine for (_, req), mine in zip(items, call.reqs))
        assert len(pipe.messages) == 5  # one message per step, whatever the number of requests
        assert 7 not in client._calls
    finally:
        loop.close()


def test_a_delta_that_cannot_be_built_ends_the_request_as_abort():
    """An output the engine process cannot send (here a broken routed_experts value) reaches the caller as
    a final abort naming the error, and whatever the engine delivers for it later is dropped."""
    engine, pipe = _FakeEngine(), _FakePipe()
    batcher = _Batcher(engine, pipe)
    req = _req(0)
    req.return_routed_experts, req.routed_experts = True, object()  # no .numpy()
    sink = _CallSink(3, batcher, {3: None}, 1)
    client, call, loop = _parent(3, [_skeleton(req)])
    try:
        req.output_ids.append(11)
        req.finished_reason = FinishReason("stop", matched=11)
        sink.put(("final", req))
        batcher.flush()
        client._on_out(*pipe.messages[-1][1:])
        loop.run_until_complete(asyncio.sleep(0))
        mine = call.reqs[0]
        assert mine.finished_reason.type == "abort" and "internal error" in mine.finished_reason.message
        assert 3 not in client._calls
        sink.put(("final", req))  # anything later for it is dropped
        assert not batcher.deltas
    finally:
        loop.close()


def _writer(monkeypatch=None):
    """An EngineClient's sending half over a real pipe, with no sender thread (what reaches `child` was
    written directly; what is in `client._outbox` waits for the thread)."""
    import multiprocessing
    import queue
    import threading

    parent, child = multiprocessing.Pipe(duplex=True)
    client = object.__new__(EngineClient)
    client._conn, client._dead, client._closing = parent, None, False
    client._outbox, client._queued = queue.SimpleQueue(), 0
    client._write_lock, client._count_lock = threading.Lock(), threading.Lock()
    return client, child


def test_small_request_messages_are_written_directly_and_never_overtake_queued_ones(monkeypatch):
    """A small generate or abort goes onto the pipe from the calling thread; a large one, or any message
    while one waits for the sender thread, or a pipe without room, is queued for the thread instead, so
    the pipe's order is the order of the calls."""
    from rollout.server import engine_client

    client, child = _writer()
    client._send(("generate", 1, ([[5, 6, 7]], True), {"sampling_params": None}))
    assert child.poll(1) and pickle.loads(child.recv_bytes())[:2] == ("generate", 1)
    assert client._outbox.empty() and client._queued == 0

    big = ("generate", 2, ([list(range(5000))], True), {})
    client._send(big)  # over DIRECT_MAX_BYTES: the sender thread's
    assert client._queued == 1 and client._outbox.get_nowait() is big and not child.poll(0.05)
    client._send(("abort", 2))  # small, but behind a queued message: queued too
    assert client._outbox.get_nowait() == ("abort", 2) and client._queued == 2 and not child.poll(0.05)
    client._queued = 0

    monkeypatch.setattr(engine_client.select, "select", lambda r, w, x, t: ([], [], []))  # no room
    client._send(("abort", 3))
    assert client._outbox.get_nowait() == ("abort", 3) and not child.poll(0.05)
    client._queued = 0
    client._send(("call", 4, "flush_cache", (), {}))  # control calls always take the thread
    assert client._outbox.get_nowait()[0] == "call"


def test_finished_requests_are_offered_first_and_keep_their_final():
    """In one step's message, the requests that finished reach their stream's queue before those that only
    got a token, and a request's own deltas are applied in the engine's order (a chunk and its final in
    one message leave one final item)."""
    engine, pipe = _FakeEngine(), _FakePipe()
    batcher = _Batcher(engine, pipe)
    reqs = [_req(0, return_logprob=False), _req(1, return_logprob=False)]
    sink = _CallSink(5, batcher, {5: None}, len(reqs))
    client, call, loop = _parent(5, [_skeleton(r) for r in reqs])
    try:
        reqs[0].output_ids.append(11)
        sink.put(("chunk", reqs[0]))
        reqs[1].output_ids.append(12)
        sink.put(("chunk", reqs[1]))
        reqs[1].output_ids.append(13)
        reqs[1].finished_reason = FinishReason("length", matched=2)
        sink.put(("final", reqs[1]))
        batcher.flush()
        client._on_out(*pipe.messages[-1][1:])
        loop.run_until_complete(asyncio.sleep(0))
        items = [call.sink.queue._queue[i] for i in range(call.sink.queue.qsize())]
        assert [(kind, req.index) for kind, req in items] == [("final", 1), ("chunk", 0)]
        assert call.reqs[1].output_ids == [12, 13] and call.reqs[1].finished_reason.type == "length"
    finally:
        loop.close()
