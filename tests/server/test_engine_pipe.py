"""The server's end of the engine pipe (rollout/server/engine_pipe.py): frames as multiprocessing's, every
message read once and in order across moves between the reader thread and an event loop, writes whole on a
non-blocking descriptor, and EOF reported once."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import threading
import time

import pytest

from rollout.server.engine_pipe import FrameBuffer, PipeReader, write_frame


def _wait(pred, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_frame_buffer_parses_connection_frames_from_any_split():
    """Frames written by Connection.send_bytes come out whole and in order, whatever the read sizes."""
    a, b = multiprocessing.Pipe(duplex=True)
    payloads = [b"", b"x", os.urandom(5000), os.urandom(70_000), b"tail"]
    sender = threading.Thread(target=lambda: [a.send_bytes(p) for p in payloads])
    sender.start()
    raw = bytearray()
    expected = sum(len(p) + 4 for p in payloads)
    while len(raw) < expected:
        raw += os.read(b.fileno(), 65536)
    sender.join()
    for step in (1, 3, 4097, len(raw)):
        fb, got = FrameBuffer(), []
        for i in range(0, len(raw), step):
            got += fb.feed(bytes(raw[i:i + step]))
        assert got == payloads and not fb.buf, step
    # The 8-byte length form (frames over 2 GiB), with a small body: parsed the same way.
    assert FrameBuffer().feed((-1).to_bytes(4, "big", signed=True) + (3).to_bytes(8, "big") + b"abc") == [b"abc"]
    with pytest.raises(ValueError, match="corrupt frame header"):
        FrameBuffer().feed((-7).to_bytes(4, "big", signed=True))
    a.close(), b.close()


def test_write_frame_is_read_by_connection_even_non_blocking():
    """write_frame on a non-blocking socket (as an event loop's reader leaves it) writes a frame larger than
    the socket buffer whole; Connection.recv_bytes reads what was written, small and large."""
    a, b = multiprocessing.Pipe(duplex=True)
    os.set_blocking(a.fileno(), False)
    big = os.urandom(3 << 20)
    got = []
    reader = threading.Thread(target=lambda: got.extend(b.recv_bytes() for _ in range(3)))
    reader.start()
    for data in (b"small", big, b""):
        write_frame(a.fileno(), data)
    reader.join(30)
    assert got == [b"small", big, b""]
    a.close(), b.close()


def _loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def test_reader_moves_between_thread_and_loop_losing_nothing():
    """Messages sent before, during and after attach/detach (one larger than a read, split across reads) are
    each handled once, in order; while attached they are handled on the loop's thread; EOF calls on_eof once."""
    server_end, child_end = multiprocessing.Pipe(duplex=True)
    got, where, eofs = [], [], []
    lock = threading.Lock()

    def on_message(msg):
        with lock:
            got.append(msg)
            where.append(threading.current_thread())

    reader = PipeReader(server_end, on_message, lambda: eofs.append(threading.current_thread().name))
    loop, loop_thread = _loop_thread()
    big = os.urandom(1 << 20)
    sent = []

    def send(msg):
        sent.append(msg)
        child_end.send_bytes(pickle.dumps(msg))

    try:
        for i in range(50):
            send(("n", i))
        for k in range(3):  # attach and detach with messages in flight each time
            sender = threading.Thread(target=lambda k=k: [send(("m", k, i)) for i in range(200)])
            sender.start()
            attached = threading.Event()
            loop.call_soon_threadsafe(lambda ev=attached: (reader.attach(loop), ev.set()))
            assert attached.wait(10)
            assert reader.loop is loop
            sender.join()
            send(("big", k, big))
            _wait(lambda: len(got) == len(sent), what="the messages sent while attached")
            reader.detach()
            assert reader.loop is None
            send(("after", k))
            _wait(lambda: len(got) == len(sent), what="the messages sent after detach")
        with lock:
            assert got == sent
            on_loop = [w is loop_thread for w, m in zip(where, got) if m[0] == "big"]
        assert all(on_loop)  # the large message arrived while attached: handled on the loop's thread
        loop.call_soon_threadsafe(reader.attach, loop)
        _wait(lambda: reader.loop is loop, what="attach")
        child_end.close()  # EOF while attached: on_eof runs once, on a thread (it may block)
        assert reader.wait_eof(10)
        time.sleep(0.1)
        assert len(eofs) == 1 and eofs[0] != loop_thread.name
        assert reader.loop is None
    finally:
        reader.close()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        loop.close()
        server_end.close()


def test_detach_from_a_stopped_loop_goes_back_to_the_thread():
    """A loop that stopped without detaching: detach() returns (bounded) and the thread reads again."""
    server_end, child_end = multiprocessing.Pipe(duplex=True)
    got = []
    reader = PipeReader(server_end, got.append, lambda: None)
    loop, loop_thread = _loop_thread()
    try:
        loop.call_soon_threadsafe(reader.attach, loop)
        _wait(lambda: reader.loop is loop, what="attach")
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        t0 = time.monotonic()
        reader.detach(timeout_s=0.5)
        assert time.monotonic() - t0 < 5 and reader.loop is None
        child_end.send_bytes(pickle.dumps("hello"))
        _wait(lambda: got == ["hello"], what="the thread to read again")
    finally:
        reader.close()
        loop.close()
        child_end.close(), server_end.close()
