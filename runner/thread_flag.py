"""ThreadFlag: an on/off switch scoped to one thread and one `with` block.

The runner's numerics modes (batch-invariant kernels, transformers' op order) are set per forward and
per thread: one process runs several engines' scheduler threads, the overlap schedule's forward worker
and a trainer's own pass through the model code at once, and each must see only its own setting. It
holds no state beyond the flag and knows nothing of what the flag selects.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ThreadFlag:
    def __init__(self) -> None:
        self._state = threading.local()

    def is_enabled(self) -> bool:
        return getattr(self._state, "enabled", False)

    @contextmanager
    def mode(self, enabled: bool = True) -> Iterator[None]:
        """On (or off) on this thread for the duration; nested uses restore the outer setting."""
        prev = self.is_enabled()
        self._state.enabled = enabled
        try:
            yield
        finally:
            self._state.enabled = prev
