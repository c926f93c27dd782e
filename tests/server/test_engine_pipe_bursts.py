"""Bursts of requests cross the engine pipe together: the generate and abort messages one turn of the
server's loop produces go out in one write, in the order they were made, and the engine process submits
the calls it can read at once together and answers them in one write. Nothing overtakes (a control
message sent meanwhile goes after them), a message too big for a direct write takes the sender thread
with everything behind it, and a bad call in a burst fails alone."""

from __future__ import annotations

import asyncio
import pickle
import queue
import threading
import types

import pytest

from rollout import Engine
from rollout.server import engine_client, engine_deltas, engine_process
from rollout.server.engine_client import DIRECT_MAX_BYTES, TURN_MAX_BYTES, EngineClient
from rollout.server.engine_pipe import FrameBuffer, frame, write_all
from tests.server.conftest import ENGINE_KW

GREEDY = dict(temperature=0, max_new_tokens=4, ignore_eos=True)


def _writer(loop=None):
    """An EngineClient's sending half over a real pipe, reading on `loop`, with no sender thread (what
    reaches `child` was written directly; what is in `client._outbox` waits for the thread)."""
    import multiprocessing

    parent, child = multiprocessing.Pipe(duplex=True)
    client = object.__new__(EngineClient)
    client._conn, client._dead, client._closing = parent, None, False
    client._outbox, client._queued, client._turn = queue.SimpleQueue(), 0, []
    client._write_lock, client._count_lock = threading.Lock(), threading.Lock()
    client._reader = types.SimpleNamespace(loop=loop)
    return client, child


class _Writes(list):
    """The size of each write; `.written`: per write, (op, call id) of each message in it."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[list[tuple]] = []


def _recorded_writes(monkeypatch, module) -> _Writes:
    """Every write_all call of `module`, recorded (the real write still happens)."""
    sizes = _Writes()

    def record(fd, data):
        sizes.append(len(data))
        sizes.written.append([pickle.loads(f)[:2] for f in FrameBuffer().feed(bytes(data))])
        write_all(fd, data)

    monkeypatch.setattr(module, "write_all", record)
    return sizes


def _drain(child) -> list[tuple]:
    out = []
    while child.poll(0.2):
        out.append(pickle.loads(child.recv_bytes()))
    return out


def test_one_loop_turn_of_request_messages_is_one_write_in_order(monkeypatch):
    """Generate and abort messages sent on the reading loop wait for its next turn, then go out in one write,
    in the order they were sent."""
    writes = _recorded_writes(monkeypatch, engine_client)
    msgs = [("generate", i, ([[5, 6, i]], True), {"sampling_params": None}) for i in range(5)] + [("abort", 2)]

    async def burst():
        client, child = _writer(asyncio.get_running_loop())
        for m in msgs:
            client._send(m)
        assert not child.poll(0) and writes == []  # nothing before the turn
        await asyncio.sleep(0)
        return client, child

    client, child = asyncio.run(burst())
    assert len(writes) == 1 and _drain(child) == msgs
    assert client._outbox.empty() and client._queued == 0 and client._turn == []


def test_a_turn_over_the_write_bound_splits_and_a_big_message_queues_the_rest(monkeypatch):
    """A turn larger than TURN_MAX_BYTES goes out in several writes, each within it, as long as the pipe has
    room; a message over DIRECT_MAX_BYTES goes to the sender thread with every message behind it, and so do
    the messages the pipe had no room for: the order holds."""
    writes = _recorded_writes(monkeypatch, engine_client)
    ids = list(range(300))  # a ~1 KB message
    small = [("generate", i, ([ids], True), {}) for i in range(3 * TURN_MAX_BYTES // len(pickle.dumps(ids)))]
    big = ("generate", 10_000, ([list(range(3 * DIRECT_MAX_BYTES))], True), {})
    after = [("abort", 1), ("generate", 10_001, ([[5]], True), {})]

    async def burst():
        client, child = _writer(asyncio.get_running_loop())
        for m in [*small, big, *after]:
            client._send(m)
        await asyncio.sleep(0)
        return client, child

    client, child = asyncio.run(burst())
    assert len(writes) >= 2 and all(size <= TURN_MAX_BYTES for size in writes)
    written = _drain(child)  # as much as the pipe took while nobody read it; the thread writes the rest
    queued = [client._outbox.get_nowait() for _ in range(client._queued)]
    assert written + queued == [*small, big, *after] and queued[-3:] == [big, *after] and client._outbox.empty()


def test_a_control_message_from_another_thread_goes_after_the_pending_turn():
    """A message sent off the loop while a turn is pending is queued behind that turn's messages, and the
    turn then writes nothing: the pipe's order is the order of the calls."""
    msgs = [("generate", 1, ([[5]], True), {}), ("abort", 1)]

    async def burst():
        client, child = _writer(asyncio.get_running_loop())
        for m in msgs:
            client._send(m)
        call = ("call", 7, "flush_cache", (), {})
        thread = threading.Thread(target=client._send, args=(call,))
        thread.start()
        thread.join(10)
        await asyncio.sleep(0)
        return client, child, call

    client, child, call = asyncio.run(burst())
    assert not child.poll(0.1)
    assert [client._outbox.get_nowait() for _ in range(3)] == [*msgs, call] and client._queued == 3


def test_off_the_loop_a_small_request_message_is_still_written_at_once():
    """Without a reading loop (a client used from threads) a small request message is written by the
    calling thread right away, as before."""
    client, child = _writer(loop=None)
    msg = ("generate", 1, ([[5, 6, 7]], True), {"sampling_params": None})
    client._send(msg)
    assert child.poll(1) and pickle.loads(child.recv_bytes()) == msg and client._queued == 0


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with Engine(str(tiny_llama), **ENGINE_KW) as e:
        yield e


def _kwargs(**sampling) -> dict:
    return dict(sampling_params=sampling, return_logprob=False, top_logprobs_num=0, stream=False, rid=None,
                return_routed_experts=False, logprob_start_len=None, token_ids_logprob=None,
                return_original_logprob=None, lora_path=None)


def test_engine_process_submits_a_burst_together_and_a_bad_call_fails_alone(monkeypatch, engine, tiny_llama):
    """Generate calls written together are submitted together and answered in one write, each with its own
    result: the call with a bad sampling parameter gets its ValueError naming it, its neighbours their
    requests; a control call behind them is answered after them; every good request ends with the
    in-process Engine's greedy tokens."""
    import multiprocessing

    writes = _recorded_writes(monkeypatch, engine_process)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    want = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    parent, child = multiprocessing.Pipe(duplex=True)
    # Its own Engine: EngineProcess takes over the engine's step-boundary hook.
    with Engine(str(tiny_llama), **ENGINE_KW) as served:
        proc = engine_process.EngineProcess(child, served)
        thread = threading.Thread(target=proc.serve, daemon=True)
        burst = [("generate", 1, ([prompts[0]], True), _kwargs(**GREEDY)),
                 ("generate", 2, ([prompts[1]], True), _kwargs(**{**GREEDY, "temperature": -1.0})),
                 ("generate", 3, ([prompts[1]], True), _kwargs(**GREEDY)),
                 ("generate", 4, ([prompts[2]], True), _kwargs(**GREEDY)),
                 ("call", 5, "get_server_info", (), {})]
        write_all(parent.fileno(), b"".join(frame(pickle.dumps(m)) for m in burst))
        thread.start()
        submitted, reply, copies, done = {}, None, {}, set()
        while reply is None or len(done) < 3:
            assert parent.poll(30), "the engine process stopped answering"
            msg = pickle.loads(parent.recv_bytes())
            if msg[0] == "submitted":
                assert reply is None, "the control call was answered before a call ahead of it"
                submitted[msg[1]] = msg[2:]
                if msg[2]:
                    copies[msg[1]] = msg[3][0][0]  # the server's copy of the call's one request
            elif msg[0] == "reply":
                reply = msg
            elif msg[0] == "out":
                for delta in msg[1]:
                    assert delta[0] in copies, "a delta came before its call's reply"
                    engine_deltas.apply(copies[delta[0]], delta)
                    if delta[2]:
                        done.add(delta[0])
        write_all(parent.fileno(), frame(pickle.dumps(("shutdown",))))
        thread.join(30)
    assert writes.written[0] == [("submitted", c) for c in (2, 1, 3, 4)]  # one write: the error made first
    ok, err = submitted[2]
    assert not ok and isinstance(err, ValueError) and "temperature" in str(err)
    assert all(submitted[c][0] for c in (1, 3, 4)) and reply[2] is True
    for call_id, prompt, ids in zip((1, 3, 4), prompts, want):
        assert submitted[call_id][1][1] and copies[call_id].prompt_ids == prompt
        assert copies[call_id].output_ids == ids and copies[call_id].finished_reason.type == "length"
