"""tests/gpu: CUDA-only checks (flashinfer, CUDA graphs, torch_memory_saver, CUDA IPC). Every test here
carries the `gpu` marker and is skipped cleanly without CUDA (tests/conftest.py). Nothing CUDA-only is
imported at module level."""

from __future__ import annotations

import importlib.util

import pytest


def needs(module: str):
    """Skip when an optional CUDA library is not installed (the GPU script installs them from wheels)."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed")


def pytest_runtest_logreport(report) -> None:
    """With GPU_TEST_RESULTS set (bench/gpu_check.sh), append each tests/gpu result as one JSON line the
    moment it is known, so a run killed at its time limit keeps every result before it."""
    import json
    import os

    path = os.environ.get("GPU_TEST_RESULTS")
    if not path or "tests/gpu" not in report.nodeid.replace("\\", "/"):
        return
    if report.when == "call" or report.outcome != "passed":  # setup failures and skips count too
        with open(path, "a") as f:
            f.write(json.dumps({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                                "seconds": round(report.duration, 2),
                                "reason": str(report.longrepr)[-400:] if report.longrepr else ""}) + "\n")
