"""Shared helpers for the RL-surface tests: two checkpoints of one shape, engines, oracles.

Checkpoint A (seed 0) is what an engine starts from, B (seed 1) is the "trainer's new policy" with the
same config. Every claim is checked against something the engine did not compute itself: a fresh
Engine loaded from B, the safetensors files read with `safetensors`, `torch.equal` on parameters, and
the process RSS from /proc/self/status.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file

from rollout import Engine

# Prompts of different lengths (so the batch has padding) plus one seeded sampled request.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 40, 41, 42] * 5, [7]]
SAMPLING = [dict(temperature=0, max_new_tokens=8, ignore_eos=True)] * 3 + [
    dict(temperature=1.0, top_p=0.9, seed=1234, max_new_tokens=8, ignore_eos=True)
]
ENGINE_KW = dict(device="cpu", max_total_tokens=2048, max_running_requests=16, show_progress=False)


def make_engine(path, **kw) -> Engine:
    return Engine(str(path), **{**ENGINE_KW, **kw})


def run(engine: Engine) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of the fixed batch; compared with == so any bit of difference fails.

    The prefix cache is flushed first: a cache hit computes the same logits through other matmul
    shapes, which may move a logprob by an ulp, and these tests are about weights, not the cache.
    """
    engine.flush_cache()
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SAMPLING, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def versions(engine: Engine) -> set[str]:
    return {
        o["meta_info"]["weight_version"]
        for o in engine.generate(input_ids=PROMPTS[:2], sampling_params=SAMPLING[0])
    }


def read_state_dict(path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint dir, read with safetensors (not with our loader)."""
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def params(engine: Engine) -> dict[str, torch.Tensor]:
    """Runner parameters (runner names, fused q/k/v and gate/up included) by reference."""
    return dict(engine.runner.model.named_parameters())


def snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer (rope tables included)."""
    model = engine.runner.model
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_same_tensors(before: dict[str, torch.Tensor], engine: Engine) -> None:
    model = engine.runner.model
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert now.keys() == before.keys()
    for name, t in before.items():
        assert torch.equal(now[name], t), f"{name} changed"


def at_step(engine: Engine, n: int, fn: Callable[[], object]) -> dict:
    """Run `fn()` right after the scheduler's `n`-th step from now, in its thread with the engine lock held:
    exactly where a control call from another thread lands between steps n and n+1, but deterministic
    (no race with a request that might finish first). Returns {"done": Event, "result"/"error": ...}."""
    real_step = engine.scheduler.step
    state: dict = {"done": threading.Event(), "steps": 0}
    # Until it fires, one decode step per scheduler step: a decode block (num_continuous_decode_steps) would
    # count several as one. A control call from another thread stops a block after its current step anyway.
    blocks, engine.scheduler.decode_block_steps = engine.scheduler.decode_block_steps, 1

    def step():
        out = real_step()
        state["steps"] += 1
        if state["steps"] == n:
            engine.scheduler.step = real_step
            engine.scheduler.decode_block_steps = blocks
            try:
                with engine._cv:  # a step boundary, as a control call sees it (a step launched ahead rolls back)
                    state["result"] = fn()
            except Exception as e:  # handed to the test, not to the engine loop
                state["error"] = e
            state["done"].set()
        return out

    engine.scheduler.step = step
    return state


def rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="session")
def ckpt_pair(ckpt_factory):
    """`ckpt_pair(arch, **kw) -> (A, B)`: same config, different random weights."""

    def pair(arch: str = "llama", **kw):
        return ckpt_factory(arch, seed=0, **kw), ckpt_factory(arch, seed=1, **kw)

    return pair


@pytest.fixture(scope="session")
def reference_outputs():
    """`reference_outputs(path, **engine_kw)`: run() of a fresh engine on `path`, cached per session."""
    cache: dict = {}

    def get(path, **kw):
        key = (str(path), tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            with make_engine(path, **kw) as fresh:
                cache[key] = run(fresh)
        return cache[key]

    return get


def assert_kv_clean(engine: Engine) -> None:
    """Nothing in flight, no row or cache lock held, every KV slot free or in the prefix cache."""
    with engine._cv:
        kv = engine.scheduler.kv
        assert not engine._reqs and kv.is_idle()
        cached = kv.tree.evictable_size if kv.tree else 0
        assert kv.tree is None or kv.tree.protected_size == 0
        assert kv.kv_pool.available_size() + cached == kv.kv_pool.size
