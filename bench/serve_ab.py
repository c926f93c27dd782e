"""Two HTTP server configurations side by side: the same streaming load alternated between them, same run.

    python bench/serve_ab.py --b-args=--no-disable-overlap-schedule [--repeat 6]
    python bench/serve_ab.py --b-checkout /path/to/an/older/clone        # this code against another one

Starts `python -m rollout.launch_server` twice (A: this checkout with `--a-args`; B: `--b-checkout`, default
this one, with `--b-args`), both up for the whole run (an idle server costs nothing: its loop and the
engine's scheduler sleep), warms both, then runs bench/serve.py's raw-client workload (`--num-requests`
streams, `--concurrency` in flight) against A and B in turn, `--repeat` pairs, swapping which goes first
each pair so a burst of a neighbour's load hits both alike. Prints each pair's tok/s and ratio with the
load average, then the median of the pair ratios (A/B) and the CPU seconds a run cost each server (its
two processes together, Linux /proc). bench/serve.py compares a server with the
in-process Engine; this compares two servers, where a code or flag change should show. Every wait is
bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import machine  # noqa: E402
from bench.serve import run_raw, tree_cpu_s, workload  # noqa: E402
from rollout.launch_server import free_port  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(checkout: str, model: str, extra: list[str], timeout_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "rollout.launch_server", "--model-path", model, "--port", str(port),
           "--no-access-log", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=checkout)
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if "ready at" in line:
            return proc, f"http://127.0.0.1:{port}"
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"server in {checkout} with {extra} did not start (exit {proc.poll()})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(HERE, "assets/demo-model"))
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--common-args", default="--max-total-tokens 16384 --max-running-requests 64",
                   help="launch_server flags for both")
    p.add_argument("--a-args", default="", help="extra launch_server flags for A")
    p.add_argument("--b-args", default="", help="extra launch_server flags for B")
    p.add_argument("--b-checkout", default=HERE, help="the repository B runs from (default: this one)")
    p.add_argument("--repeat", type=int, default=6, help="timed (A, B) pairs")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on each run and on each start, seconds")
    args = p.parse_args()
    print(machine.line(), flush=True)
    reqs = workload(args)
    common = args.common_args.split()
    servers = []
    try:
        servers.append(start(HERE, args.model, [*common, *args.a_args.split()], args.timeout))
        servers.append(start(args.b_checkout, args.model, [*common, *args.b_args.split()], args.timeout))
        urls = [u for _, u in servers]
        for url in urls:  # warm-ups
            asyncio.run(run_raw(url, reqs[: 2 * args.concurrency], args.concurrency, args.timeout))
        ratios, tps, cpus = [], ([], []), ([], [])
        for i in range(args.repeat):
            got = {}
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                cpu0 = tree_cpu_s(servers[side][0].pid)[0]
                wall, results = asyncio.run(run_raw(urls[side], reqs, args.concurrency, args.timeout))
                cpu1 = tree_cpu_s(servers[side][0].pid)[0]
                if cpu0 is not None and cpu1 is not None:
                    cpus[side].append(cpu1 - cpu0)
                if sum(r[3] == "length" for r in results) != len(reqs):
                    raise RuntimeError(f"side {'AB'[side]}: not every request finished")
                got[side] = sum(r[2] for r in results) / wall
                tps[side].append(got[side])
            ratios.append(got[0] / got[1])
            print(f"pair {i + 1}: A {got[0]:.0f} tok/s, B {got[1]:.0f} tok/s, A/B {ratios[-1]:.3f}, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        print(f"A/B {statistics.median(ratios):.3f} (median of {len(ratios)} pairs; A > B in "
              f"{sum(r > 1 for r in ratios)}); A {statistics.median(tps[0]):.0f} tok/s, "
              f"B {statistics.median(tps[1]):.0f} tok/s (medians); A: {args.a_args or '(defaults)'}; "
              f"B: {args.b_args or '(defaults)'} in {args.b_checkout}", flush=True)
        if cpus[0] and cpus[1]:  # the server and its engine process together, per run of the workload
            print(f"server CPU-s per run (both processes, medians): A {statistics.median(cpus[0]):.2f}, "
                  f"B {statistics.median(cpus[1]):.2f}", flush=True)
    finally:
        for proc, _ in servers:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
