"""AsyncSink batches its cross-thread hand-off per event loop without losing or reordering items: every
sink of a loop gets all its items in put order, and a closed loop is refused with SinkClosedError."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout.outputs import AsyncSink, SinkClosedError


def test_items_from_another_thread_arrive_complete_and_in_order_per_sink():
    """16 sinks on one loop, 50 rounds of one put each from a producer thread: each sink reads 0..49 in order,
    and the loop is woken fewer times than there were puts."""
    loop = asyncio.new_event_loop()
    wakeups = 0
    original = loop.call_soon_threadsafe

    def counting(*args, **kwargs):
        nonlocal wakeups
        wakeups += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counting
    sinks = [AsyncSink(loop) for _ in range(16)]

    def produce():
        for step in range(50):
            for s in sinks:
                s.put(step)

    async def main():
        producer = threading.Thread(target=produce)
        producer.start()
        got = await asyncio.wait_for(asyncio.gather(*[read(s) for s in sinks]), timeout=30)
        producer.join()
        return got

    async def read(sink):
        return [await sink.get() for _ in range(50)]

    try:
        got = loop.run_until_complete(main())
    finally:
        loop.close()
    assert got == [list(range(50))] * 16
    assert 1 <= wakeups < 16 * 50


def test_put_on_a_closed_loop_raises_sink_closed():
    """A sink whose event loop has closed refuses items with SinkClosedError (the engine then drops it)."""
    loop = asyncio.new_event_loop()
    sink = AsyncSink(loop)
    loop.close()
    with pytest.raises(SinkClosedError, match="event loop is closed"):
        sink.put(("chunk", None))
