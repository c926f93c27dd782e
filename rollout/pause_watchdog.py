"""SGLang's pause watchdog: a paused engine continues by itself after SGLANG_ENGINE_PAUSE_TIMEOUT seconds.

A trainer that pauses the engine and then dies (or forgets) would otherwise leave it paused for good,
its queued requests waiting forever. The timeout is read once, when the Engine is built, as SGLang
reads its environment at launch; unset, empty or 0 means no watchdog. Each pause arms one timer; a
continue_generation() (or a newer pause) disarms it, so a timer only ever ends the pause that armed it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

ENV = "SGLANG_ENGINE_PAUSE_TIMEOUT"


def timeout_from_env() -> float | None:
    """The watchdog's seconds from the environment; ValueError naming the variable if not a number >= 0."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: give the seconds after which a paused engine continues (0 = never)") from None
    if not seconds >= 0:
        raise ValueError(f"{ENV}={raw!r} must be >= 0 seconds")
    return seconds or None


class PauseWatchdog:
    def __init__(self, timeout_s: float | None, resume: Callable[[threading.Thread], None]) -> None:
        """resume(timer): continue the pause that `timer` armed, if claim(timer) says it is still current."""
        self.timeout_s = timeout_s
        self._resume = resume
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        """A pause began: continue after timeout_s unless disarmed first."""
        if self.timeout_s is None:
            return
        timer = threading.Timer(self.timeout_s, self._fire)
        timer.daemon = True
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = timer
        timer.start()

    def disarm(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def claim(self, timer) -> bool:
        """Whether `timer` (the one firing) still guards the current pause; if so, it is spent. The resume
        callback calls this under the lock its pauses arm under, so no newer pause can slip in between this
        check and the continue (a newer pause's timer has replaced `timer`, or the pause waits for that lock)."""
        with self._lock:
            if self._timer is None or self._timer is not timer:
                return False
            self._timer = None
        logger.warning("engine paused for %.1f s (%s): continuing generation", self.timeout_s, ENV)
        return True

    def _fire(self) -> None:
        with self._lock:
            if self._timer is None or self._timer is not threading.current_thread():
                return  # disarmed, or replaced by a newer pause's timer
        self._resume(threading.current_thread())
