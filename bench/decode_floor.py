"""The decode step against its hardware floor, in one run: how far from "just read the weights" we are.

The floor is every linear layer of one decode step (per layer qkv, o, gate|up, down; then the LM
head) as oneDNN-prepacked weights applied to a [batch, in_features] activation, back to back: what a
step would cost if everything but the weight-bound matmuls were free. The engine figure is
`ModelRunner.forward` + `sample` (greedy, or `--temperature 1`) of one decode step of `batch` requests of `prompt_len +
step` tokens, driven directly (no scheduler), with the captured decode step on and off. Both run in
the same process on the same thread count, so their ratio holds up on a shared machine better than
either number does; the load average is printed beside them. `--profile` adds a torch.profiler table
of a few steps of each mode (what is left above the floor).

It measures one shape at one batch size; bench/throughput.py measures whole generate calls.

    python -m bench.decode_floor --preset qwen2-40m --dtype float32 --batch 16
    python -m bench.decode_floor --preset qwen2.5-0.5b --dtype bfloat16 --batch 16 --profile
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from bench import machine
from bench.throughput import PRESETS, write_preset

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def linear_shapes(cfg: dict) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(out, in) of each linear of one layer, and of the LM head."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
             (hidden, inter)]
    return layer, (cfg["vocab_size"], hidden)


def floor_step(cfg: dict, batch: int, dtype: torch.dtype):
    """A callable running the chain of every linear of one decode step as the engine runs it: oneDNN-
    prepacked (in the shadow dtype runner/layers/prepack.py picks: fp32 for bf16 on a CPU without
    native bf16, casts included), or dense `F.linear` where nothing is packed."""
    from runner.layers.ops import packed_linear
    from runner.layers.prepack import pack_dtype, packed_pair

    shadow = pack_dtype(torch.device("cpu"), dtype)
    layer, head = linear_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    ops = []  # (weight, input) per linear, distinct weights per layer so nothing stays in cache
    for shape in layer * cfg["num_hidden_layers"] + [head]:
        w = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        x = torch.randn(batch, shape[1], generator=gen).to(dtype)
        if shadow is not None:
            w = packed_pair(w, None)
        ops.append((w, x))

    def step() -> None:
        for w, x in ops:
            if shadow is not None:
                packed_linear(x, w)
            else:
                torch.nn.functional.linear(x, w)

    step.packed = shadow is not None
    return step


def interleaved_ms(floor, loop: DecodeLoop, steps: int) -> tuple[float, float, float]:
    """(floor ms, engine ms, median per-pair ratio) with floor and engine steps alternating, so a
    neighbour's burst of load hits both sides of a pair: the ratio is what to compare across runs."""
    loop.reset()
    for _ in range(3):
        loop.step()
        floor()
    fl, en = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        floor()
        t1 = time.perf_counter()
        loop.step()
        t2 = time.perf_counter()
        fl.append(t1 - t0)
        en.append(t2 - t1)
    ratio = statistics.median(e / f for e, f in zip(en, fl, strict=True))
    return statistics.median(fl) * 1e3, statistics.median(en) * 1e3, ratio


def _median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class DecodeLoop:
    """A ModelRunner with `batch` requests prefilled, stepping decode like the scheduler does."""

    def __init__(self, model_dir: Path, dtype: str, batch: int, prompt_len: int, steps: int, capture: bool,
                 runner_kwargs: dict, temperature: float = 0.0) -> None:
        from runner.model_runner import ModelRunner, RunnerConfig
        from runner.sampler import SamplingBatchInfo

        ctx = prompt_len + steps + 16
        t0 = time.perf_counter()
        self.runner = ModelRunner(RunnerConfig(
            model_path=str(model_dir), dtype=dtype, max_running_requests=batch, context_length=ctx,
            max_total_tokens=batch * ctx + 64, disable_cuda_graph=not capture,
            cuda_graph_bs=[batch] if capture else None, **runner_kwargs))  # captured at init, timed as init
        self.init_s = time.perf_counter() - t0
        self.batch, self.prompt_len = batch, prompt_len
        vocab = self.runner.model_config.vocab_size
        self.info = SamplingBatchInfo.from_lists([temperature] * batch, [1.0] * batch, [-1] * batch, [0.0] * batch,
                                                 list(range(batch)), [0] * batch, vocab, "cpu")
        self.info.need_logprobs = False  # as the scheduler's batches of requests without return_logprob
        self.rows = [self.runner.req_to_token_pool.alloc() for _ in range(batch)]
        self.reset()

    def reset(self) -> None:
        from runner.forward_batch import ForwardBatch, ForwardMode

        r, bs, n = self.runner, self.batch, self.prompt_len
        r.token_to_kv_pool.clear()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(8, r.model_config.vocab_size, (bs * n,), generator=gen)
        locs = r.token_to_kv_pool.alloc(bs * n)
        for i, row in enumerate(self.rows):
            r.req_to_token_pool.write(row, 0, locs[i * n:(i + 1) * n])
        self.seq_lens = [n] * bs
        fb = ForwardBatch(ForwardMode.EXTEND, bs, ids, torch.arange(n).repeat(bs), torch.tensor(self.rows),
                          torch.tensor(self.seq_lens), locs, list(self.seq_lens),
                          extend_prefix_lens_cpu=[0] * bs, extend_seq_lens_cpu=[n] * bs, sampling_info=self.info)
        self.next_ids = r.sample(r.forward(fb), fb).next_token_ids

    def step(self) -> None:
        from runner.forward_batch import ForwardBatch, ForwardMode

        r, bs = self.runner, self.batch
        locs = r.token_to_kv_pool.alloc(bs)
        self.seq_lens = [s + 1 for s in self.seq_lens]
        seq = torch.tensor(self.seq_lens)
        rows = torch.tensor(self.rows)
        r.req_to_token_pool.req_to_token[rows, seq - 1] = locs  # one indexed write, as rollout/kv_manager.py
        fb = ForwardBatch(ForwardMode.DECODE, bs, self.next_ids, seq - 1, rows, seq, locs,
                          list(self.seq_lens), sampling_info=self.info)
        self.next_ids = r.sample(r.forward(fb), fb).next_token_ids
        self.next_ids.tolist()  # the scheduler's one host read per step


def profile(loop: DecodeLoop, steps: int, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    loop.reset()
    loop.step()
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            loop.step()
    print(f"\n--- profile: {label}, {steps} steps ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2-40m")
    p.add_argument("--model", type=Path, help="an HF checkpoint instead of a preset")
    p.add_argument("--save-dir", type=Path, help="where --preset writes (and reuses) its checkpoint")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per mode (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--modes", default="eager,captured", help="comma list of eager, captured")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (the floor's own sampler cost); 1.0 = the sampled path bench/throughput.py runs")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_floor_"))
    try:
        model_dir = args.model or write_preset(args.preset, args.dtype, args.save_dir or tmp / "ckpt")
        cfg = json.loads((model_dir / "config.json").read_text())
        res = dict(model=str(args.model or args.preset), dtype=args.dtype, batch=args.batch, temperature=args.temperature,
                   threads=torch.get_num_threads(), load_avg_1m_start=os.getloadavg()[0])
        print(machine.line(), flush=True)
        res.update(machine.describe())
        floor = floor_step(cfg, args.batch, _DTYPES[args.dtype])
        res["floor_ms"] = _median_ms(floor, max(5, args.steps // 2))
        kind = "prepacked" if floor.packed else "dense"
        print(f"floor ({kind} linears, [{args.batch}, hidden]): {res['floor_ms']:.2f} ms/step", flush=True)
        for mode in args.modes.split(","):
            loop = DecodeLoop(model_dir, args.dtype, args.batch, args.prompt_len, args.steps, mode == "captured", {},
                              args.temperature)
            gr = loop.runner.graph_runner
            floor_now, ms, ratio = interleaved_ms(floor, loop, args.steps)
            res[f"{mode}_ms"] = ms
            res[f"{mode}_floor_ms"] = floor_now
            res[f"{mode}_ratio"] = ratio
            extra = ""
            if gr is not None and hasattr(gr, "capture_seconds"):
                res[f"{mode}_capture_s"] = dict(gr.capture_seconds)
                extra = f"  capture: {json.dumps({k: round(v, 2) for k, v in gr.capture_seconds.items()})} s"
            print(f"engine {mode}: {ms:.2f} ms/step, floor {floor_now:.2f} ms alongside: {ratio:.2f}x floor "
                  f"(median of pairs; runner init {loop.init_s:.1f} s){extra}  load {os.getloadavg()[0]:.1f}",
                  flush=True)
            if args.profile:
                profile(loop, 5, mode, 25)
            del loop
        # The floor again at the end: the machine may have changed under us.
        res["floor_ms_end"] = _median_ms(floor, max(5, args.steps // 2))
        res["load_avg_1m_end"] = os.getloadavg()[0]
        print(f"floor again: {res['floor_ms_end']:.2f} ms/step; load {res['load_avg_1m_start']:.1f} -> "
              f"{res['load_avg_1m_end']:.1f}")
        if args.json:
            args.json.write_text(json.dumps(res, indent=2))
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
