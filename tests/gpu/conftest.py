"""tests/gpu: CUDA-only checks (flashinfer, CUDA graphs, torch_memory_saver, CUDA IPC). Every test here
carries the `gpu` marker and is skipped cleanly without CUDA (tests/conftest.py). Nothing CUDA-only is
imported at module level."""

from __future__ import annotations

import importlib.util

import pytest


def needs(module: str):
    """Skip when an optional CUDA library is not installed (the GPU script installs them from wheels)."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed")
