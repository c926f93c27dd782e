"""The engine's CPU kernels end to end: Engine.generate wall time with them off, with the paged attention
kernels only, with the fused RMSNorm and rotary too (all through the modules), and with the fused forward
(the whole model and the plain sampler as one op each, runner/models/fused_layer.py), alternating in one
process on the same prompts.

Two engines on one checkpoint (cpu_kernels=False and True), both on the plain schedule (the overlap
schedule's default differs by model size; bench/overlap.py measures it). The variants of the second are
switched per call (norm and rotary `cpu_ops` cleared, the fused forward and sampler op turned off), so they
share weights and threads. Prints the median seconds of each over --pairs rounds, the speed-ups against
off and the load average. Needs a benchmark checkpoint (bench/throughput.py --save-dir writes one).

    python bench/cpu_kernels.py --model /tmp/ckpt40f --dtype float32 --prompt-len 32 --output-len 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import make_prompts, vocab_size_of  # noqa: E402
from rollout import Engine  # noqa: E402
from runner.layers.norm import RMSNorm  # noqa: E402
from runner.layers.rotary import RotaryEmbedding  # noqa: E402
from runner.models import fused_layer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--pairs", type=int, default=5)
    a = p.parse_args()
    off = Engine(a.model, show_progress=False, dtype=a.dtype, cpu_kernels=False, disable_overlap_schedule=True)
    on = Engine(a.model, show_progress=False, dtype=a.dtype, cpu_kernels=True, disable_overlap_schedule=True)
    small = [m for m in on.runner.model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding))]
    ops = small[0].cpu_ops
    prompts = make_prompts(a.batch, a.prompt_len, vocab_size_of(Path(a.model)), 0)
    params = dict(max_new_tokens=a.output_len, temperature=0.0, ignore_eos=True)

    def run(engine, variant: str) -> float:
        if engine is on:
            for m in small:
                m.cpu_ops = ops if variant != "attention" else None
            fused_layer.enable(on.runner.model, ops if variant == "fused" else None)
            on.runner.sampler.cpu_ops = ops if variant == "fused" else None
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - t0

    run(off, "off")
    run(on, "fused")  # warm-up of both
    times: dict[str, list[float]] = {"off": [], "attention": [], "kernels": [], "fused": []}
    loads = []
    for _ in range(a.pairs):
        for variant in times:
            times[variant].append(run(off if variant == "off" else on, variant))
        loads.append(os.getloadavg()[0])
    off.shutdown()
    on.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{a.model} {a.dtype}, {a.batch} x {a.prompt_len} -> {a.output_len} greedy, median of {a.pairs} rounds")
    for k, v in med.items():
        print(f"  {k:<16} {v:.3f} s")
    print(f"attention kernels: {med['off'] / med['attention']:.3f}x; with the fused RMSNorm and rotary: "
          f"{med['off'] / med['kernels']:.3f}x; the fused forward and sampler: {med['off'] / med['fused']:.3f}x "
          f"({med['kernels'] / med['fused']:.3f}x the modules with the kernels); "
          f"load {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()
