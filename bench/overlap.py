"""The overlap schedule's gain: output tok/s through `Engine.generate` with it on and off, same run.

Two engines on the same checkpoint (default: the tiny preset, where host work is a large part of a
decode step), one with `disable_overlap_schedule=True` and single decode steps (`--num-continuous-decode-steps
N` gives it decode blocks instead, the CPU default: then the ratio is the overlap against the default schedule). Each is warmed up, then the timed runs
alternate on / off (`--repeat` pairs), so a change in the machine's load hits both alike; the ratio
reported is the median of the per-pair ratios (and that of the best run of each), next to the median
tok/s of each and the load average (os.getloadavg) before every pair. Under load, read the ratio with
care: the OS shares cores per thread, so a busy machine gives the two-thread schedule a larger share
than the one-thread one; tokens per CPU-second (process CPU time) show the cost of the same work. Both engines produce the same tokens (checked on the first pair:
the workload is seeded), so only the schedule differs.

Each decode forward+sample is also timed where it runs: its share of the wall time, on and off, says
whether the overlap hid the host work (on: near 100%) or the worker waited for the scheduler thread.

It does not time prefill-heavy or streaming workloads, nor latency: a whole batch's output tok/s.

    python bench/overlap.py --preset tiny --batch 16 --prompt-len 32 --output-len 128 --repeat 5
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
from bench import machine
from bench.throughput import PRESETS, make_prompts, vocab_size_of, write_preset


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=16, help="number of distinct prompts")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=5, help="timed on/off pairs")
    p.add_argument("--num-continuous-decode-steps", type=int, default=1,
                   help="the plain (off) engine's decode blocks (rollout/scheduler.py; the overlap schedule ignores "
                        "it): 1 compares the overlap with single steps, more with the plain schedule's blocks")
    p.add_argument("--cuda-graph-bs", type=int, nargs="*", default=None, help="capture (compile) the CPU "
                   "decode step at these batch sizes, on both engines (runner/graphs/cpu_graph_runner.py)")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval in seconds for "
                   "the whole run (default: Python's 0.005); how long a thread waiting for the GIL lets the "
                   "holder run, see bench/gil_convoy.py")
    p.add_argument("--no-pin", action="store_true", help="cpu_pin_overlap_threads=False: leave the overlap "
                   "schedule's two threads unpinned (rollout/thread_pinning.py)")
    args = p.parse_args(argv)
    if args.switch_interval is not None and args.switch_interval <= 0:
        p.error("--switch-interval must be > 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    with tempfile.TemporaryDirectory(prefix="bench_overlap_") as tmp:  # the checkpoint goes with the run
        return _run(args, write_preset(args.preset, args.dtype, Path(tmp) / "ckpt"))


def _run(args, model_dir: Path) -> dict:
    from rollout import Engine

    prompts = make_prompts(args.batch, args.prompt_len, vocab_size_of(model_dir), seed=0)
    num_seqs = args.batch * args.n
    seq_len = args.prompt_len + args.output_len
    kwargs = dict(device="cpu", dtype=args.dtype, max_running_requests=max(num_seqs, 16),
                  context_length=seq_len + 16, max_total_tokens=num_seqs * (seq_len + 1) + 1024,
                  show_progress=False, cuda_graph_bs=args.cuda_graph_bs, cpu_pin_overlap_threads=not args.no_pin)
    sp = dict(max_new_tokens=args.output_len, temperature=args.temperature, ignore_eos=True, n=args.n, seed=1)
    engines = {"on": Engine(str(model_dir), disable_overlap_schedule=False, **kwargs),
               "off": Engine(str(model_dir), disable_overlap_schedule=True,
                             num_continuous_decode_steps=args.num_continuous_decode_steps, **kwargs)}
    busy = {mode: _time_decode_forwards(e) for mode, e in engines.items()}
    print(f"workload: preset={args.preset} dtype={args.dtype} batch={args.batch} n={args.n} "
          f"off_decode_steps={args.num_continuous_decode_steps} "
          f"prompt_len={args.prompt_len} output_len={args.output_len} torch_threads={torch.get_num_threads()} "
          f"cpus={os.cpu_count()} switch_interval={sys.getswitchinterval()}", flush=True)
    print(machine.line(), flush=True)
    try:
        for e in engines.values():  # warm-up: first-call allocations and lazy inits are not timed
            e.generate(input_ids=prompts[:2], sampling_params={**sp, "max_new_tokens": 8})
        tok_s: dict[str, list[float]] = {"on": [], "off": []}
        tok_cpu_s: dict[str, list[float]] = {"on": [], "off": []}
        ratios, loads = [], []
        fwd_share: dict[str, list[float]] = {"on": [], "off": []}  # decode forward+sample time / wall time
        first: dict[str, list] = {}
        for i in range(args.repeat):
            loads.append(os.getloadavg()[0])
            order = ("on", "off") if i % 2 == 0 else ("off", "on")  # neither always runs second
            for mode in order:
                engine = engines[mode]
                engine.flush_cache()
                busy[mode].clear()
                t0, c0 = time.perf_counter(), time.process_time()
                outs = engine.generate(input_ids=prompts, sampling_params=sp)
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                assert tokens == num_seqs * args.output_len, f"{mode}: {tokens} tokens"
                tok_s[mode].append(tokens / seconds)
                tok_cpu_s[mode].append(tokens / cpu)
                fwd_share[mode].append(sum(busy[mode]) / seconds)
                first.setdefault(mode, [o["output_ids"] for o in outs])
            ratios.append(tok_s["on"][-1] / tok_s["off"][-1])
            print(f"pair {i}: on {tok_s['on'][-1]:.0f} tok/s ({tok_cpu_s['on'][-1]:.0f} per CPU-s), off "
                  f"{tok_s['off'][-1]:.0f} tok/s ({tok_cpu_s['off'][-1]:.0f} per CPU-s), ratio {ratios[-1]:.3f}, "
                  f"load {loads[-1]:.2f}", flush=True)
        assert first["on"] == first["off"], "overlap on and off produced different tokens"
        overlapped = engines["on"].get_server_info()["num_overlapped_steps"]
        overlap = engines["on"].scheduler.overlap
        pinned = {role: sorted(cpus) for role, cpus in overlap.pinning.pinned.items()} if overlap else {}
    finally:
        for e in engines.values():
            e.shutdown()
    result = {"on_tok_s": statistics.median(tok_s["on"]), "off_tok_s": statistics.median(tok_s["off"]),
              "ratio": statistics.median(ratios), "best_ratio": max(tok_s["on"]) / max(tok_s["off"]),
              "cpu_ratio": statistics.median(tok_cpu_s["on"]) / statistics.median(tok_cpu_s["off"]),
              "load_min": min(loads), "load_max": max(loads), "num_overlapped_steps": overlapped,
              "forward_share_on": statistics.median(fwd_share["on"]),
              "forward_share_off": statistics.median(fwd_share["off"]), "pinned": pinned}
    print(f"overlap on {result['on_tok_s']:.0f} tok/s vs off {result['off_tok_s']:.0f} tok/s: "
          f"{result['ratio']:.3f}x (median of {args.repeat} pairs; best run each {result['best_ratio']:.3f}x; "
          f"tokens per CPU-second {result['cpu_ratio']:.3f}x; load average {result['load_min']:.2f}-"
          f"{result['load_max']:.2f}; {overlapped} decode steps launched ahead; threads pinned to CPUs: "
          f"{pinned or 'no'})")
    print(f"decode forward+sample busy for {100 * result['forward_share_on']:.0f}% of the wall time with overlap "
          f"on, {100 * result['forward_share_off']:.0f}% off (the rest: host work not hidden, hand-overs, idle)")
    return result


def _time_decode_forwards(engine) -> list[float]:
    """Record the seconds of each decode forward+sample of `engine` (on whichever thread runs it; the
    read-back of its results is not counted) into the returned list: with overlap on, wall time minus
    their sum is what the worker spent on anything else or waiting."""
    sched = engine.scheduler
    inner = sched._forward_sample_device
    spans: list[float] = []

    def timed(fb, reqs, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(fb, reqs, **kwargs)
        finally:
            if fb.forward_mode.is_decode():
                spans.append(time.perf_counter() - t0)

    sched._forward_sample_device = timed
    return spans


if __name__ == "__main__":
    main()
