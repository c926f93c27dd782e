"""What an idle second OpenMP pool costs the engine's steps: decode ms/step through `Engine.generate`
with the engine's pool releases (runner/openmp_pool.py) on and off, alternated in one process.

Before each call the caller's thread runs one parallel op of its own (a trainer's work between
rollouts), which gives that thread an OpenMP pool. With the releases on, generate() hands it back
before the scheduler thread steps; with them off (both call sites patched to do nothing) it stays, and
libgomp, managing more threads than cores, makes every worker sleep between parallel regions. Decode
ms/step is (64-token run - 1-token run) / 63, as in bench/throughput.py. Prints each pair, the median
ratio off/on and the load average.

    python bench/openmp_pools.py [--preset qwen2-40m] [--pairs 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from bench.throughput import PRESETS, write_preset  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2-40m")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import rollout.engine as engine_mod
    import rollout.scheduler_loop as loop_mod
    from rollout import Engine
    from runner import openmp_pool

    state = {"on": True}

    def release() -> bool:
        return openmp_pool.release_thread_pool() if state["on"] else False

    engine_mod.release_thread_pool = loop_mod.release_thread_pool = release
    with tempfile.TemporaryDirectory() as tmp:
        model = write_preset(args.preset, args.dtype, Path(tmp))
        engine = Engine(model_path=str(model), dtype=args.dtype, skip_tokenizer_init=True, log_level="error",
                        max_running_requests=max(64, args.batch))
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 1000, (32,), generator=gen).tolist() for _ in range(args.batch)]
        params = {"temperature": 0.0, "ignore_eos": True}
        user_work = torch.randn(16, 1 << 16)  # past torch's grain size: a parallel region on this thread

        def seconds(new_tokens: int) -> float:
            user_work.mul(2.0)
            t0 = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": new_tokens})
            return time.perf_counter() - t0

        seconds(64)  # warm-up
        ms = {True: [], False: []}
        for i in range(args.pairs):
            for on in (True, False):
                state["on"] = on
                short, full = seconds(1), seconds(64)
                ms[on].append((full - short) / 63 * 1e3)
            print(f"pair {i + 1}: released {ms[True][-1]:.2f} ms/step, kept {ms[False][-1]:.2f} ms/step, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        engine.shutdown()
    ratio = statistics.median(off / on for on, off in zip(ms[True], ms[False]))
    print(f"{args.preset} {args.dtype}, batch {args.batch}, {args.threads} threads: idle pool kept / released = "
          f"{ratio:.2f}x decode ms/step (median of {args.pairs} pairs; load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
