"""Everything at once: eight asyncio clients against a controller that aborts, pauses in all three modes,
updates weights (disk and tensors), releases and resumes memory, flushes and relabels versions.

The invariants are the oracle, not any one interleaving: every request ends with a finish reason, a call
is refused only with the engine's own ValueError/RuntimeError, an update made while paused always
succeeds, no KV slot, row or cache lock leaks, and afterwards greedy output equals a fresh engine's on
the checkpoint loaded last. Seeded, but threads decide the interleaving: it runs a few seconds.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import torch

from rollout import Engine
from tests.rl_surface.conftest import assert_kv_clean

SECONDS = 5.0
GREEDY = dict(temperature=0, max_new_tokens=16, ignore_eos=True)


async def _client(engine: Engine, seed: int, end: float, out: dict) -> None:
    rng = random.Random(seed)
    while time.monotonic() < end:
        prompts = [[rng.randint(5, 200) for _ in range(rng.randint(1, 80))] for _ in range(rng.randint(1, 3))]
        sp = dict(temperature=rng.choice([0, 0.7, 1.0]), max_new_tokens=rng.randint(0, 40), n=rng.choice([1, 2]),
                  top_p=rng.choice([1.0, 0.9]), stop_token_ids=rng.choice([None, [7]]))
        try:
            if rng.random() < 0.3:
                stream = await engine.async_generate(input_ids=prompts, sampling_params=sp, stream=True)
                async for _ in stream:
                    if rng.random() < 0.05:
                        break  # a reader that goes away mid-stream
            else:
                outs = await engine.async_generate(input_ids=prompts, sampling_params=sp,
                                                   return_logprob=rng.random() < 0.5)
                for o in outs if isinstance(outs, list) else [outs]:
                    reason = o["meta_info"]["finish_reason"]
                    if reason is None:
                        out["errors"].append(f"no finish reason: {o['meta_info']}")
                    else:
                        out["finished"] += 1
        except (ValueError, RuntimeError):  # refused by the engine (paused, released...): named, expected
            out["refused"] += 1
        except Exception as e:  # noqa: BLE001 - anything else is a bug
            out["errors"].append(f"client: {e!r}")


def _controller(engine: Engine, paths: list, end: float, out: dict) -> None:
    rng = random.Random(99)
    ops = ["abort", "pause_abort", "pause_retract", "pause_in_place", "disk", "tensor", "release", "flush", "version"]
    while time.monotonic() < end:
        time.sleep(rng.uniform(0.01, 0.1))
        op = rng.choice(ops)
        try:
            if op == "abort":
                engine.abort_request(abort_all=True)
            elif op.startswith("pause"):
                engine.pause_generation(mode=op.removeprefix("pause_"))
                if rng.random() < 0.5:
                    ok, msg, _ = engine.update_weights_from_disk(str(rng.choice(paths)))
                    if not ok:
                        out["errors"].append(f"update while paused failed: {msg}")
                engine.continue_generation()
            elif op == "disk":
                engine.update_weights_from_disk(str(rng.choice(paths)))  # refused while requests run: fine
            elif op == "tensor":
                engine.update_weights_from_tensor([("model.norm.weight", torch.ones(64))])
            elif op == "release":
                engine.pause_generation(mode="retract")
                engine.release_memory_occupation()
                engine.resume_memory_occupation()
                engine.continue_generation()
            elif op == "flush":
                engine.flush_cache()
            else:
                engine.update_weight_version(f"v{rng.randint(0, 9)}", abort_all_requests=rng.random() < 0.5)
        except Exception as e:  # noqa: BLE001 - control calls document no exceptions here
            out["errors"].append(f"{op}: {e!r}")


def test_chaos_keeps_every_invariant(ckpt_factory):
    """Under concurrent clients and every control call, nothing hangs, leaks or errs unexpectedly, and
    the engine then generates exactly what a fresh engine on the same checkpoint does."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    out = {"errors": [], "finished": 0, "refused": 0}
    with Engine(str(a), enable_memory_saver=True, enable_weights_cpu_backup=True, max_total_tokens=400,
                max_running_requests=12, chunked_prefill_size=48, show_progress=False) as engine:
        end = time.monotonic() + SECONDS
        ctl = threading.Thread(target=_controller, args=(engine, [a, b], end, out))
        ctl.start()

        async def clients():
            await asyncio.gather(*[_client(engine, i, end, out) for i in range(8)])

        asyncio.run(clients())
        ctl.join(30)
        assert not ctl.is_alive()
        engine.continue_generation()
        assert engine.drain(timeout=30)["success"]
        assert out["errors"] == [] and out["finished"] > 50, out
        assert_kv_clean(engine)
        ok, msg, _ = engine.update_weights_from_disk(str(a))
        assert ok, msg
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    with Engine(str(a), show_progress=False, max_total_tokens=400) as fresh:
        want = [o["output_ids"] for o in fresh.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert got == want
