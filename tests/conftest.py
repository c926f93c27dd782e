"""Suite-wide pytest setup: tiny checkpoint fixtures and the `gpu` marker's skip.

Checkpoints come from tests/checkpoints.py and are written once per session per distinct argument set
(`ckpt_factory`), into pytest's tmp dir. Nothing here touches a real model or the network.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from transformers.utils import logging as hf_logging

from tests.checkpoints import ARCHS, make_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # read lazily; quiets the fork warning
hf_logging.disable_progress_bar()  # "Loading weights" bars drown test output


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """`ckpt_factory(arch, **make_checkpoint_kwargs) -> Path`, written once per distinct arguments.

    Treat the directory as read-only: other tests get the same path. Copy it to modify it.
    """
    cache: dict[tuple, pathlib.Path] = {}

    def factory(arch: str = "llama", **kwargs) -> pathlib.Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(ckpt_factory) -> pathlib.Path:
    return ckpt_factory("llama")


@pytest.fixture(scope="session")
def tiny_mistral(ckpt_factory) -> pathlib.Path:
    return ckpt_factory("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(ckpt_factory) -> pathlib.Path:
    return ckpt_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(ckpt_factory) -> pathlib.Path:
    return ckpt_factory("qwen3")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_ckpt(request, ckpt_factory) -> pathlib.Path:
    """Every supported architecture in turn (tests using it run once per arch)."""
    return ckpt_factory(request.param)


@pytest.fixture(scope="session", params=ARCHS)
def tiny_tied_ckpt(request, ckpt_factory) -> pathlib.Path:
    """Every architecture with `tie_word_embeddings=True` (no lm_head.weight in the file)."""
    return ckpt_factory(request.param, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def cpu_ops():
    """torch.ops.rollout_cpu, the engine's C++ CPU kernels (runner/cpu_kernels.py). On an AVX-512 or AVX2 CPU
    they must load (CI installs g++; ninja is a dependency); without either they are never built and the tests
    skip."""
    from runner import cpu_kernels

    if not cpu_kernels.has_kernels_isa():
        pytest.skip("neither AVX-512 nor AVX2 on this CPU: the CPU kernels are not built, the engine uses torch's ops")
    ops = cpu_kernels.load()
    if ops is None:
        pytest.fail(f"the CPU kernels did not load on an {cpu_kernels.kernel_isa()} CPU: "
                    f"{cpu_kernels._state.get('reason')}")
    return ops


@pytest.fixture(scope="session")
def cpu_direct(cpu_ops):
    """The same kernels' pybind11 module (runner/csrc/direct.cpp), what the runner calls every step."""
    from runner import cpu_kernels

    return cpu_kernels.direct()
