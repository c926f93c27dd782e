"""tests/runner: run each test single-threaded. The models are tiny, so intra-op threads only add
overhead, and on a busy 2-core machine their spin-waits made single ops 1000x slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
