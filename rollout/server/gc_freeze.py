"""freeze_heap(): collect once, then move every object alive to the permanent generation (gc.freeze), what
Engine.freeze_gc does in the engine's process.

Why the server processes do it once they have started (rollout/launch_server.py for the HTTP process,
rollout/server/engine_process.py, through Engine.freeze_gc, for the engine's): each holds ~350k objects from importing torch,
transformers, pydantic and FastAPI, and a streaming server keeps enough per-request objects alive that the
collector promotes them into the oldest generation steadily. Every full collection then walked the whole
heap: streaming 1000 requests x 32 tokens of the tiny model, 64 at once, the HTTP process ran two of
them, ~250 ms each with the event loop stopped, ~0.7 s of collector time with the younger generations'
(a gc.callbacks count on this machine); frozen, the run's two full collections took ~10 ms together.
Frozen objects are never scanned again; what is allocated later is collected as before.

What it costs: a cycle among objects alive at the freeze is never freed (the process's start-up state,
which lives until exit anyway). SGLang's /freeze_gc does the same on demand; the server answers it too.
What it does not do: tune thresholds, or touch a process that embeds an in-process Engine (its owner
calls Engine.freeze_gc when it wants it).
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    gc.collect()
    gc.freeze()


def frozen_count(engine=None) -> int:
    """How many objects this process has frozen (`engine` unused: EngineClient.run_on_engine passes it)."""
    return gc.get_freeze_count()
