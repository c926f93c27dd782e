"""The server's end of the engine pipe: PipeReader reads it on a thread of its own or on an event loop;
write_frame writes a message whatever the descriptor's blocking mode.

EngineClient (rollout/server/engine_client.py) reads every message of the engine process through one of
these. It starts on a thread (so a client works before any loop runs, and in a process that has none);
`attach(loop)` moves the reading onto that event loop (`loop.add_reader`), which is what the HTTP
server does for the life of its app: an engine step's outputs are then applied on the loop that streams
them as soon as it polls, with no thread hand-over. On a 2-core machine with the engine's threads busy,
the reader thread cost every step a GIL hand-over in each direction, and a waiting thread's turn on a
core took ms. `detach()` moves it back (the app's shutdown does, before the engine is shut down, so the
last messages, "bye" among them, are read without the loop). The hand-over happens between two reads,
and the bytes of a half-read message stay in the buffer: nothing is lost or read twice.

Frames are multiprocessing.Connection's (the engine process writes with `Connection.send_bytes`): a
4-byte big-endian signed length, or -1 and then an 8-byte length, then the pickle. They are parsed
from whatever each non-blocking read returns, so the loop never waits for the rest of a large reply.

An event loop's reader puts the socket in non-blocking mode (libuv's uv_poll_init does, for uvloop), and
the read and write descriptors share that mode (one socket pair). So writes do not rely on blocking:
`write_frame` waits for room with select where a write would block.

What it does not do: decide who writes when (EngineClient does), interpret messages (`on_message` does), or wait for the engine
process at EOF on the loop (`on_eof` runs on a thread: it joins the process).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import select
import socket
import threading

logger = logging.getLogger("rollout.server.engine_client")
READ_BYTES = 1 << 16  # per read: a step's outputs fit; a large reply takes several loop turns, not one long one


class FrameBuffer:
    """Bytes in, whole frames out (multiprocessing.Connection's framing)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        frames = []
        while len(self.buf) >= 4:
            size = int.from_bytes(self.buf[:4], "big", signed=True)
            start = 4
            if size == -1:  # over 2 GiB: the real length follows
                if len(self.buf) < 12:
                    break
                size, start = int.from_bytes(self.buf[4:12], "big"), 12
            elif size < 0:
                raise ValueError(f"corrupt frame header on the engine pipe (length {size})")
            if len(self.buf) < start + size:
                break
            frames.append(bytes(self.buf[start:start + size]))
            del self.buf[:start + size]
        return frames


def write_frame(fd: int, data: bytes) -> None:
    """One message, framed as Connection.send_bytes frames it, written whole to `fd` (blocking or not)."""
    size = len(data)
    header = (size.to_bytes(4, "big", signed=True) if size <= 0x7FFFFFFF
              else (-1).to_bytes(4, "big", signed=True) + size.to_bytes(8, "big"))
    # A small frame goes in one write (a direct write relies on it: see EngineClient._send_direct).
    parts = [header + data] if size <= 1 << 14 else [header, data]
    for part in parts:
        view = memoryview(part)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                select.select([], [fd], [])
            except InterruptedError:
                pass


class PipeReader:
    """Reads `conn` (the server's end of the engine pipe) and calls `on_message(msg)` per message, on the
    reading thread or the attached loop; `on_eof()` once, on a thread, when the pipe closes."""

    def __init__(self, conn, on_message, on_eof, name: str = "engine-client-reader") -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))  # its own fd: closed independently
        self._frames = FrameBuffer()
        self._on_message = on_message
        self._on_eof = on_eof
        self._name = name
        self._mode_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False  # the thread's cue to return (at its next wake-up)
        self._wake_r, self._wake_w = os.pipe()
        self._eof = threading.Event()  # set once on_eof has run
        self._at_eof = False
        self._start_thread()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that reads now, or None (the thread does)."""
        return self._loop

    # ---- moving between the thread and a loop ---------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read on `loop` from now on. Call it on that loop's thread."""
        with self._mode_lock:
            if self._at_eof or self._loop is not None:
                return
            self._stop_thread()
            if self._at_eof:  # the thread met EOF while it was being stopped (it ran on_eof)
                return
            self._loop = loop
            loop.add_reader(self._sock.fileno(), self._on_readable, loop)

    def detach(self, timeout_s: float = 5.0) -> None:
        """Read on the thread again (from any thread; bounded)."""
        loop = self._loop
        if loop is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop or loop.is_closed():
            self._detach_here(loop)
            return
        done = threading.Event()

        def detach() -> None:
            self._detach_here(loop)
            done.set()

        try:
            loop.call_soon_threadsafe(detach)
        except RuntimeError:  # closed meanwhile
            pass
        if not done.wait(timeout_s):  # the loop no longer runs: its reader never fires again (see below)
            self._detach_here(loop, remove=False)

    def _detach_here(self, loop, remove: bool = True) -> None:
        with self._mode_lock:
            if self._loop is not loop:
                return
            if remove and not loop.is_closed():
                loop.remove_reader(self._sock.fileno())
            self._loop = None
            if not self._at_eof:
                self._start_thread()

    # ---- reading ----------------------------------------------------------------------------------
    def _on_readable(self, loop) -> None:
        if self._loop is not loop:  # a loop it was moved off without removing the reader (it had stopped)
            loop.remove_reader(self._sock.fileno())
            return
        if not self._read_once():
            with self._mode_lock:
                loop.remove_reader(self._sock.fileno())
                self._loop = None
                self._at_eof = True
            threading.Thread(target=self._finish, name=self._name, daemon=True).start()

    def _read_once(self) -> bool:
        """One non-blocking read, and every whole message it completes handled. False at EOF."""
        try:
            data = self._sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        try:
            frames = self._frames.feed(data)
        except ValueError:
            logger.exception("the engine pipe is corrupt")
            return False
        for frame in frames:
            try:
                msg = pickle.loads(frame)
            except Exception:  # noqa: BLE001 - a bug: that message is lost, the others are not
                logger.exception("a message from the engine process does not unpickle")
                continue
            self._on_message(msg)
        return True

    def _start_thread(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._thread_main, name=self._name, daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._stop = True
        os.write(self._wake_w, b"x")
        thread.join()
        self._thread = None
        while select.select([self._wake_r], [], [], 0)[0]:  # leave no stale wake-up for the next thread
            os.read(self._wake_r, 512)

    def _thread_main(self) -> None:
        while True:
            ready = select.select([self._sock, self._wake_r], [], [])[0]
            if self._stop:
                return
            if self._sock in ready and not self._read_once():
                self._at_eof = True  # no lock: attach() may hold it, joining this thread
                self._finish()
                return

    def _finish(self) -> None:
        if self._eof.is_set():
            return
        try:
            self._on_eof()
        finally:
            self._eof.set()

    # ---- the end ----------------------------------------------------------------------------------
    def wait_eof(self, timeout_s: float) -> bool:
        """Wait (bounded) until the pipe closed and on_eof ran."""
        return self._eof.wait(timeout_s)

    def close(self) -> None:
        """Stop reading and close this reader's descriptors."""
        self.detach()
        with self._mode_lock:
            if self._thread is not None and self._thread is not threading.current_thread():
                self._stop_thread()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._sock.close()
