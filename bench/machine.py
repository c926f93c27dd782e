"""What machine a benchmark figure was taken on: the CPU's model name, the vector ISA torch dispatches to
(AVX2, AVX512, AVX512-BF16/AMX via oneDNN) and the core count, printed next to every figure.

Figures from an AVX2 CPU and from an AVX512-BF16 one are not comparable (bf16 linears run as an fp32 shadow on
the first and native on the second), so each benchmark's first line names the machine. It reads
/proc/cpuinfo where present and torch's own capability probe; it measures nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runner.layers.prepack import pack_dtype


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def describe() -> dict:
    """{"cpu": model name, "isa": torch's CPU capability, "bf16_native": oneDNN bf16 available, "cpus": n}."""
    return dict(cpu=cpu_model(), isa=torch.backends.cpu.get_cpu_capability(),
                bf16_native=pack_dtype(torch.device("cpu"), torch.bfloat16) == torch.bfloat16,
                cpus=os.cpu_count())


def line() -> str:
    d = describe()
    return (f"machine: {d['cpu']}, {d['isa']}, bf16 linears {'native' if d['bf16_native'] else 'as an fp32 shadow'}, "
            f"{d['cpus']} cpus")
