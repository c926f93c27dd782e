"""Fixtures for the LoRA tests: tiny checkpoints with peft-written adapters, and engines shut down after use."""

from __future__ import annotations

import pytest

from tests.lora_adapters import make_adapter
from tests.rollout.conftest import make_engine, module_engines  # noqa: F401 (the same fixtures here)


@pytest.fixture(scope="session")
def adapter_factory(tmp_path_factory):
    """`adapter_factory(ckpt, **make_adapter_kwargs) -> Path`, written once per distinct arguments."""
    cache: dict = {}

    def factory(ckpt, **kwargs):
        key = (str(ckpt), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in cache:
            cache[key] = make_adapter(ckpt, tmp_path_factory.mktemp("adapter"), **kwargs)
        return cache[key]

    return factory
