"""Fixtures for the rollout tests: engines that are always shut down, HF reference models.

Engines get a small KV pool (`max_total_tokens`) so building one is cheap; tests that need memory
pressure pass a smaller one.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import load_hf_model
from tests.rollout.oracle import EnginePool


@pytest.fixture
def make_engine():
    """`make_engine(path, **engine_kwargs)`, shut down at the end of the test."""
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def module_engines():
    """Like make_engine, but the engines live until the end of the module."""
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def hf_models():
    """`hf_models(path) -> HF model`, loaded once per session per checkpoint."""
    cache: dict[str, torch.nn.Module] = {}

    def get(path) -> torch.nn.Module:
        key = str(path)
        if key not in cache:
            cache[key] = load_hf_model(path)
        return cache[key]

    return get
