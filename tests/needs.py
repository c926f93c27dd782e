"""Marks for tests that need something of the machine, each with the reason it skips elsewhere."""

from __future__ import annotations

import pytest

from runner import cpu_kernels

# Tests where the engine or backend must run on the C++ CPU kernels: without AVX-512 or AVX2 + FMA they are
# not built and the engine keeps torch's ops (the tests of those paths still run).
needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.has_kernels_isa(),
                                       reason="neither AVX-512 nor AVX2 on this CPU: the engine uses torch's ops, "
                                              "not the CPU kernels")
