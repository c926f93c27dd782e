"""SSEResponse: the last chunk ends the response in one message, a client that leaves mid-wait ends it quietly and
closes the iterator, and a cancellation that is not a disconnect still propagates."""

from __future__ import annotations

import asyncio

import pytest

from rollout.server.sse_response import SSEResponse

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


class Source:
    """An async iterator of byte chunks that records whether it was closed; `gate` (if set) is awaited before
    the chunk after the first, so a test can hold the stream in a wait."""

    def __init__(self, chunks: list[bytes], gate: asyncio.Event | None = None) -> None:
        self.chunks, self.gate, self.closed, self.sent = chunks, gate, False, 0

    async def gen(self):
        try:
            for i, c in enumerate(self.chunks):
                if i and self.gate is not None:
                    await self.gate.wait()
                self.sent += 1
                yield c
        finally:
            self.closed = True


def run(response: SSEResponse, disconnect_after: float | None = None) -> list[dict]:
    sent: list[dict] = []

    async def main():
        async def receive():
            if disconnect_after is None:
                await asyncio.Event().wait()  # never: the client stays
            await asyncio.sleep(disconnect_after)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await response(SCOPE, receive, send)
        await asyncio.sleep(0)  # the watcher's cancellation settles
        assert len(asyncio.all_tasks()) == 1, "the disconnect watcher outlived the response"

    asyncio.run(main())
    return sent


def bodies(sent: list[dict]) -> list[tuple[bytes, bool]]:
    return [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]


def test_the_last_chunk_closes_the_response_in_the_same_message():
    """With is_last, the chunk read when it is true goes out with more_body=False and no empty body follows."""
    src = Source([b"a", b"b", b"c"])
    sent = run(SSEResponse(src.gen(), is_last=lambda: src.sent == 3))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert bodies(sent) == [(b"a", True), (b"b", True), (b"c", False)]
    assert src.closed


def test_without_is_last_an_empty_body_closes_it():
    """Without is_last every chunk is sent with more_body=True, then one empty closing body (str chunks as UTF-8)."""
    async def gen():
        yield "é"
        yield b"x"

    assert bodies(run(SSEResponse(gen()))) == [("é".encode(), True), (b"x", True), (b"", False)]


def test_is_last_early_closes_the_rest_of_the_iterator():
    """A chunk marked last ends the response even if the iterator could go on; the iterator is closed (its finally runs)."""
    src = Source([b"a", b"b", b"c"])
    sent = run(SSEResponse(src.gen(), is_last=lambda: src.sent == 2))
    assert bodies(sent) == [(b"a", True), (b"b", False)] and src.closed


def test_a_client_that_leaves_during_a_wait_ends_the_response_quietly():
    """http.disconnect while the iterator waits: the response returns without error, the iterator is closed, and
    nothing more is sent (no closing body to a client that is gone)."""
    src = Source([b"a", b"b"], gate=asyncio.Event())  # the gate never opens: the stream waits after "a"
    sent = run(SSEResponse(src.gen(), is_last=lambda: False), disconnect_after=0.05)
    assert bodies(sent) == [(b"a", True)] and src.closed and src.sent == 1


def test_a_cancellation_that_is_not_a_disconnect_propagates():
    """The server cancelling the task (shutdown) is re-raised, not taken for a client that left; the iterator is closed."""
    src = Source([b"a", b"b"], gate=asyncio.Event())

    async def main():
        async def receive():
            await asyncio.Event().wait()

        async def send(message):
            pass

        task = asyncio.ensure_future(SSEResponse(src.gen())(SCOPE, receive, send))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert src.closed and src.sent == 1
