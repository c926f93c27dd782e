"""count_steps(engine): a counter around an in-process Engine's Scheduler.step, for tests that measure
control calls in scheduler steps rather than in wall time.

The wrapper counts a step once it returned (a step that raised is not counted) and is left in place for
the engine's life. What it does not do: work on an EngineClient (its scheduler is in another process), or
change what a step does.
"""

from __future__ import annotations

from collections.abc import Callable


def count_steps(engine) -> Callable[[], int]:
    """Wrap `engine.scheduler.step`; -> a function giving the number of steps finished since."""
    num_steps = 0
    real = engine.scheduler.step

    def counted():
        nonlocal num_steps
        out = real()
        num_steps += 1
        return out

    engine.scheduler.step = counted
    return lambda: num_steps
