"""What a second Python thread costs a decode step: the GIL convoy behind the CPU overlap schedule.

The overlap schedule (rollout/overlap.py) runs the forward on a worker thread while the scheduler
thread does its per-request Python. Every torch op releases the GIL and takes it back; when another
thread holds it then, the forward waits until that thread blocks or until the switch interval
(sys.getswitchinterval, 5 ms by default) forces a hand-over. This times the runner's decode step
(bench/decode_floor.py's DecodeLoop) alone and beside a thread running pure Python, at each switch
interval given, on one intra-op thread (what the engine's threads use for models under
rollout.scheduler.SINGLE_THREAD_MAX_WEIGHTS). The ratio is the cost of sharing the GIL; the load
average is printed beside it. The spinner never blocks, so this is the worst case, not the overlap
schedule's own cost (bench/overlap.py measures that).

    python -m bench.gil_convoy --preset tiny
    python -m bench.gil_convoy --preset qwen2-40m --switch-intervals 0.005,0.0005
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from bench.decode_floor import DecodeLoop
from bench.throughput import PRESETS, write_preset


def step_ms(loop: DecodeLoop, steps: int) -> float:
    loop.reset()
    loop.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loop.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def beside_spinner(loop: DecodeLoop, steps: int) -> float:
    stop = threading.Event()

    def spin() -> None:  # pure Python that never blocks, like a long stretch of per-request host work
        n = 0
        while not stop.is_set():
            n += 1

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        return step_ms(loop, steps)
    finally:
        stop.set()
        th.join()


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--switch-intervals", default="0.005,0.0005", help="comma list of seconds")
    args = p.parse_args(argv)
    intervals = [float(x) for x in args.switch_intervals.split(",")]
    if any(x <= 0 for x in intervals):
        p.error("--switch-intervals must all be > 0")
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_gil_"))
    before = sys.getswitchinterval()
    rows = []
    try:
        model_dir = write_preset(args.preset, "float32", tmp / "ckpt")
        loop = DecodeLoop(model_dir, "float32", args.batch, args.prompt_len, 3 * args.steps + 8, False, {})
        for si in intervals:
            sys.setswitchinterval(si)
            alone = step_ms(loop, args.steps)
            busy = beside_spinner(loop, args.steps)
            rows.append(dict(switch_interval=si, alone_ms=alone, beside_ms=busy, ratio=busy / alone,
                             load_avg_1m=os.getloadavg()[0]))
            print(f"{args.preset}, switch interval {si * 1e3:.2f} ms: decode step alone {alone:.3f} ms, beside a "
                  f"Python thread {busy:.3f} ms = {busy / alone:.2f}x (load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        sys.setswitchinterval(before)
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
