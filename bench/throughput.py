"""Output-token throughput of this engine against HF `generate` (and optionally vLLM) on one workload.

Every backend gets the same requests: `batch` prompts of `prompt_len` random token ids, `n` samples
each, exactly `output_len` new tokens (`ignore_eos`; HF gets `min_new_tokens = max_new_tokens`),
greedy or temperature-1.0 sampling with top-k/top-p off. Each backend is loaded, warmed up once on a
small batch, then timed with the wall clock around the one generate call (loading is not timed);
with `--repeat k` the fastest of k calls counts. Backends run one after another and free their model
before the next starts, so they never compete for cores or memory. vLLM runs in a child process from
its own venv (bench/vllm_peer.py; `--vllm-python`), at this process's thread count; when it is not
installed its row says so and the rest still runs. On a shared machine wall time swings with the
neighbours' load, so the table also shows tokens per CPU-second and the load average of each figure.

The decode step as users see it: for the engine (and vLLM), each timed call is paired with a call of
the same prompts for 1 new token, and (t(output_len) - t(1)) / (output_len - 1) is the decode ms/step
through `Engine.generate` (scheduler, batch building, sampling and output handling included; the
prefill cancels out). Beside it, timed just before and after each 1-token run, the prepacked-linear
floor of bench/decode_floor.py for that many sequences: `/floor` is the median of the per-pair ratios.
`CPU /floor` is the same ratio in CPU seconds of this process (all threads): a neighbour's load
delays a step without adding to its CPU time, so at `--threads 1` it is the steadier figure on a
shared machine (with more threads, OpenMP's spin-waits count as CPU time). Where decode is under a
quarter of a run (long prompts, few new tokens) the difference is prefill noise, so the row drops its
decode figure and says so (`drop_unreliable_decode`).

It does not check that the backends produce the same tokens (tests do that) and does not measure
time to first token or latency percentiles (bench/serve.py does).

    python -m bench.throughput --preset tiny --batch 16 --prompt-len 32 --output-len 64
    python -m bench.throughput --preset qwen2-40m --temperature 0 --skip-hf --repeat 3   # decode vs floor
    python -m bench.throughput --preset tiny --batch 16 --skip-hf --deterministic   # the mode's cost
    python -m bench.throughput --preset qwen2.5-0.5b --dtype bfloat16 --batch 16 --skip-hf \
        --vllm --vllm-python ~/.cache/peers-venvs/vllm/bin/python --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from bench import machine, vllm_peer  # noqa: E402

PRESETS = {
    # Qwen2-like, small enough that per-step overhead, not matmuls, dominates. head_dim 32: vLLM's CPU
    # attention has no kernel for head_dim 16.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=1024, max_position_embeddings=4096, rope_theta=10000.0,
                 tie_word_embeddings=True),
    # ~40M parameters (8 layers, hidden 512, 32k vocab): big enough that weights, not per-op
    # overhead, set the decode floor, small enough to run in seconds.
    "qwen2-40m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=32768, max_position_embeddings=4096, rope_theta=10000.0,
                      tie_word_embeddings=True),
    # Qwen2.5-0.5B's config.json, written by hand so nothing is downloaded.
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---- workload and checkpoint -------------------------------------------------------------------
def write_preset(preset: str, dtype: str, out_dir: Path) -> Path:
    """A random-weight Qwen2 checkpoint in `out_dir` via save_pretrained; reused if already there."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    marker = out_dir / "bench_preset.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"preset": preset, "dtype": dtype}:
        return out_dir
    cfg = Qwen2Config(**PRESETS[preset], bos_token_id=0, eos_token_id=1, pad_token_id=1,
                      use_sliding_window=False, hidden_act="silu")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(_DTYPES[dtype])
    model.save_pretrained(out_dir)
    marker.write_text(json.dumps({"preset": preset, "dtype": dtype}))
    del model
    return out_dir


def make_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Keep clear of the low ids, where presets put bos/eos/pad.
    return torch.randint(8, vocab_size, (num, length), generator=gen).tolist()


def vocab_size_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


# ---- backends: each returns the best timed run as {seconds, cpu_seconds, tokens} ----------------
# Wall clock is the number that counts; CPU seconds (all threads, and for vLLM all its processes) are
# kept beside it because this machine may be shared, and a busy neighbour inflates wall time only.
def _timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = fn()
    return dict(seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0, tokens=tokens)


def run_hf(model_dir: Path, dtype: str, prompts: list[list[int]], n: int, output_len: int, temperature: float,
           warmup: list[list[int]], repeat: int = 1) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype]).eval()
    do_sample = temperature > 0

    def generate(ids: list[list[int]], new_tokens: int) -> dict:
        input_ids = torch.tensor(ids, dtype=torch.int64)  # [batch, prompt_len]; equal lengths, no padding
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=do_sample, use_cache=True,
                      pad_token_id=model.generation_config.pad_token_id or 0)
        if do_sample:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0, num_return_sequences=n)
        else:  # greedy does not take num_return_sequences; replicate the prompts instead (what HF does anyway)
            input_ids = input_ids.repeat_interleave(n, dim=0)
        attention_mask = torch.ones_like(input_ids)

        def call() -> int:
            with torch.inference_mode():
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            num_new = out.shape[1] - input_ids.shape[1]
            assert num_new == new_tokens, f"HF generated {num_new} tokens, asked {new_tokens}"
            return out.shape[0] * num_new

        return _timed(call)

    torch.manual_seed(0)
    if warmup:
        generate(warmup, min(8, output_len))
    return min((generate(prompts, output_len) for _ in range(repeat)), key=lambda r: r["seconds"])


def run_engine(model_dir: Path, dtype: str, prompts: list[list[int]], n: int, output_len: int, temperature: float,
               warmup: list[list[int]], repeat: int = 1, engine_kwargs: dict | None = None,
               floor=None) -> dict:
    """The workload through Engine.generate: the fastest of `repeat` runs, plus (output_len > 1) the
    decode ms/step from paired 1-token runs and, given `floor` (a callable, one floor step), the
    floor ms timed around each 1-token run and the median per-pair decode/floor ratio (wall and CPU)."""
    from rollout import Engine

    num_seqs = len(prompts) * n
    seq_len = len(prompts[0]) + output_len
    max_pos = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    kwargs = dict(device="cpu", dtype=dtype, max_running_requests=max(num_seqs, 16),
                  context_length=min(seq_len + 16, max_pos),
                  # Room for every sequence at once, so the workload never retracts.
                  max_total_tokens=num_seqs * (seq_len + 1) + 1024, random_seed=0)
    kwargs.update(engine_kwargs or {})
    sp = dict(max_new_tokens=output_len, temperature=temperature, ignore_eos=True, n=n)
    stat_keys = ("num_prefill_steps", "num_decode_steps", "num_prefill_tokens", "num_cached_tokens",
                 "num_retractions")
    steps, floors, ratios, loads = [], [], [], []
    cpu_steps, cpu_floors, cpu_ratios = [], [], []  # CPU ms (all threads): less swayed by neighbours
    with Engine(str(model_dir), **kwargs) as engine:
        if warmup:
            for new_tokens in (min(8, output_len), 1):  # the 1-token call of each pair below, warmed too
                engine.generate(input_ids=warmup, sampling_params={**sp, "max_new_tokens": new_tokens},
                                show_progress=False)

        def timed_generate(params: dict) -> dict:
            engine.flush_cache()  # each run prefills its prompts afresh
            before = engine.get_server_info()

            def call() -> int:
                outs = engine.generate(input_ids=prompts, sampling_params=params, show_progress=False)
                return sum(o["meta_info"]["completion_tokens"] for o in outs)

            run = _timed(call)
            after = engine.get_server_info()
            run["stats"] = {k: after[k] - before[k] for k in stat_keys if k in after}
            return run

        runs = []
        for _ in range(repeat):
            run = timed_generate(sp)
            assert run["tokens"] == num_seqs * output_len, f"engine generated {run['tokens']} tokens"
            runs.append(run)
            if output_len > 1:
                floor_before = floor_samples(floor) if floor is not None else None
                one = timed_generate({**sp, "max_new_tokens": 1})
                steps.append((run["seconds"] - one["seconds"]) / (output_len - 1) * 1e3)
                cpu_steps.append((run["cpu_seconds"] - one["cpu_seconds"]) / (output_len - 1) * 1e3)
                loads.append(os.getloadavg()[0])
                if floor is not None:  # timed before and after the 1-token run: the pair's neighbourhood
                    floor_after = floor_samples(floor)
                    floors.append(statistics.median(floor_before[0] + floor_after[0]))
                    cpu_floors.append(statistics.median(floor_before[1] + floor_after[1]))
                    ratios.append(steps[-1] / floors[-1])
                    cpu_ratios.append(cpu_steps[-1] / cpu_floors[-1])
    best = min(runs, key=lambda r: r["seconds"])
    if steps:
        best["decode_ms"] = statistics.median(steps)
        best["decode_ms_all"] = [round(x, 3) for x in steps]
        best["decode_cpu_ms"] = statistics.median(cpu_steps)
        best["load_avg_1m_pairs"] = loads
    if floors:
        best["floor_ms"] = statistics.median(floors)
        best["decode_over_floor"] = statistics.median(ratios)
        best["floor_cpu_ms"] = statistics.median(cpu_floors)
        best["decode_over_floor_cpu"] = statistics.median(cpu_ratios)
    return best


def floor_samples(floor, iters: int = 5) -> tuple[list[float], list[float]]:
    """(wall ms, CPU ms of this process) of `iters` floor steps, after one untimed step."""
    floor()
    wall, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        floor()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return wall, cpu


def run_engine_group(model_dir: Path, dtype: str, prompts: list[list[int]], n: int, output_len: int,
                     temperature: float, warmup: list[list[int]], repeat: int, engine_kwargs: dict,
                     num_engines: int) -> dict:
    """The same workload over `num_engines` engines on a local Ray cluster (rollout.ray.launch_engines).

    The group sends each prompt (with its n samples) to the least-loaded engine. The cluster gets this
    machine's cores, split evenly over the engines (Ray sets each actor's thread count from its CPUs).
    CPU seconds are not measured: the work runs in the actors' processes, not in this one."""
    import ray

    from rollout.ray import launch_engines

    num_seqs = len(prompts) * n
    seq_len = len(prompts[0]) + output_len
    max_pos = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    kwargs = dict(device="cpu", dtype=dtype, max_running_requests=max(num_seqs, 16),
                  context_length=min(seq_len + 16, max_pos),
                  max_total_tokens=num_seqs * (seq_len + 1) + 1024, random_seed=0)  # as run_engine
    kwargs.update(engine_kwargs or {})
    sp = dict(max_new_tokens=output_len, temperature=temperature, ignore_eos=True, n=n)
    cores = os.cpu_count() or num_engines
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(cores, num_engines), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        group = launch_engines(num_engines, str(model_dir), num_cpus_per_engine=max(1, cores // num_engines),
                               **kwargs)
        with group:
            if warmup:
                group.generate(input_ids=warmup, sampling_params={**sp, "max_new_tokens": min(8, output_len)})
            runs = []
            for _ in range(repeat):
                group.flush_cache()

                def call() -> int:
                    outs = group.generate(input_ids=prompts, sampling_params=sp)
                    return sum(o["meta_info"]["completion_tokens"] for o in outs)

                run = _timed(call)
                run["cpu_seconds"] = None
                assert run["tokens"] == num_seqs * output_len, f"engine group generated {run['tokens']} tokens"
                runs.append(run)
    finally:
        if started:
            ray.shutdown()
    return min(runs, key=lambda r: r["seconds"])

# ---- CLI -----------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="HF checkpoint directory")
    src.add_argument("--preset", choices=sorted(PRESETS), help="write a random-weight checkpoint of this shape")
    p.add_argument("--save-dir", type=Path, help="where --preset writes (and reuses) its checkpoint; "
                                                  "default: a temp dir removed at exit")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--batch", type=int, default=16, help="number of distinct prompts")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0, choices=[0.0, 1.0],
                   help="0 = greedy, 1 = plain sampling (top-k/top-p off); the same for every backend")
    p.add_argument("--warmup", type=int, default=2, help="prompts in the untimed warm-up batch (0 = none)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per backend; the fastest is reported "
                                                          "(the machine may be shared)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--skip-hf", action="store_true", help="do not run HF generate (e.g. while profiling)")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--engine-kwargs", type=json.loads, default={}, help='extra Engine kwargs as JSON, e.g. '
                                                                        '\'{"disable_radix_cache": true}\'')
    p.add_argument("--deterministic", action="store_true", help="also run the engine with "
                   "enable_deterministic_inference=True (row 'engine-det') and report its throughput as a "
                   "ratio of the default engine's, same workload, same run")
    p.add_argument("--vllm", action="store_true", help="also run vLLM (its CPU build) on the same workload")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build (default: "
                   "~/.cache/peers-venvs/vllm/bin/python if present, else this python)")
    p.add_argument("--vllm-timeout", type=float, default=1800.0)
    p.add_argument("--tp-size", type=int, default=1, help="also run the engine with tensor parallelism over "
                   "this many ranks (gloo on the CPU) and report its tok/s as a ratio to one engine, same run")
    p.add_argument("--num-engines", type=int, default=1, help="also run N engines on a local Ray cluster "
                   "(rollout.ray) on the same workload, reported as a ratio to one engine in this run")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's); "
                   "vLLM gets as many")
    p.add_argument("--no-floor", action="store_true", help="do not time the prepacked-linear floor")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "output_len", "n", "repeat", "num_engines"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_throughput_"))
    try:
        if args.model is not None:
            model_dir = args.model
        else:
            model_dir = write_preset(args.preset, args.dtype, args.save_dir or tmp / "ckpt")
        vocab = vocab_size_of(model_dir)
        prompts = make_prompts(args.batch, args.prompt_len, vocab, args.seed)
        warmup = make_prompts(args.warmup, args.prompt_len, vocab, args.seed + 1) if args.warmup else []
        workload = dict(model=str(args.model or args.preset), dtype=args.dtype, batch=args.batch,
                        prompt_len=args.prompt_len, output_len=args.output_len, n=args.n,
                        temperature=args.temperature, repeat=args.repeat, torch_threads=torch.get_num_threads())
        print("workload:", json.dumps(workload), flush=True)
        print(machine.line(), flush=True)
        rows: dict[str, dict] = {}
        common = (model_dir, args.dtype, prompts, args.n, args.output_len, args.temperature, warmup)
        floor = None
        if not args.no_floor and not args.skip_engine and args.output_len > 1:
            from bench.decode_floor import floor_step  # imports this module: imported late

            floor = floor_step(json.loads((model_dir / "config.json").read_text()), args.batch * args.n,
                               _DTYPES[args.dtype])
        backends = []
        if not args.skip_hf:
            backends.append(("hf", lambda: run_hf(*common, args.repeat)))
        if not args.skip_engine:
            backends.append(("engine", lambda: run_engine(*common, args.repeat, args.engine_kwargs, floor)))
        if args.tp_size > 1:
            tp_kwargs = {**args.engine_kwargs, "tp_size": args.tp_size}
            backends.append((f"engine-tp{args.tp_size}", lambda: run_engine(*common, args.repeat, tp_kwargs)))
        if args.num_engines > 1:
            backends.append((f"engines-x{args.num_engines}",
                             lambda: run_engine_group(*common, args.repeat, args.engine_kwargs, args.num_engines)))
        if args.deterministic:
            det_kwargs = {**args.engine_kwargs, "enable_deterministic_inference": True}
            backends.append(("engine-det", lambda: run_engine(*common, args.repeat, det_kwargs)))
        if args.vllm:
            vllm_python = args.vllm_python or vllm_peer.default_python()
            missing = vllm_peer.vllm_available(vllm_python)
            if missing:
                print(f"vllm: skipped: {missing}", flush=True)
                rows["vllm"] = dict(error=missing, load_avg_1m=os.getloadavg()[0])
            else:
                backends.append(("vllm", lambda: vllm_peer.run_vllm(vllm_python, *common, args.repeat, tmp,
                                                                    args.vllm_timeout)))
        for name, run in backends:
            load = os.getloadavg()[0]
            try:
                row = run()
            except (RuntimeError, subprocess.TimeoutExpired, FileNotFoundError) as e:
                if name != "vllm":
                    raise
                row = dict(error=str(e))
            gc.collect()  # free this backend's model before the next one loads
            row["load_avg_1m"] = load
            rows[name] = row
            print(f"{name}: {json.dumps(row)}", flush=True)
        hf = rows.get("hf")
        engine_row = rows.get("engine", {})
        for row in rows.values():
            drop_unreliable_decode(row, args.output_len)
            drop_implausible_floor(row)
            if "seconds" in row:
                row["tokens_per_s"] = row["tokens"] / row["seconds"]
                row["tokens_per_cpu_s"] = row["tokens"] / row["cpu_seconds"] if row["cpu_seconds"] else None
                row["ratio_vs_hf"] = row["tokens_per_s"] / hf["tokens_per_s"] if hf else None
        if "seconds" in engine_row and "seconds" in rows.get("vllm", {}):
            v = rows["vllm"]
            v["engine_over_vllm"] = engine_row["tokens_per_s"] / v["tokens_per_s"]
            print(f"engine / vLLM-CPU {v.get('version', '')} throughput: {v['engine_over_vllm']:.3f}x "
                  f"(load {engine_row['load_avg_1m']:.1f} / {v['load_avg_1m']:.1f})", flush=True)
        if "seconds" in rows.get("engine", {}) and "seconds" in rows.get("engine-det", {}):
            # The cost of batch invariance: deterministic over default throughput, measured in this run.
            rows["engine-det"]["ratio_vs_engine"] = rows["engine-det"]["tokens_per_s"] / rows["engine"]["tokens_per_s"]
            print(f"deterministic / default engine throughput: {rows['engine-det']['ratio_vs_engine']:.3f}x",
                  flush=True)
        tp_row = rows.get(f"engine-tp{args.tp_size}", {})
        if "seconds" in rows.get("engine", {}) and "seconds" in tp_row:
            # Worker ranks run in child processes: their CPU time is not in tokens_per_cpu_s.
            tp_row["ratio_vs_engine"] = tp_row["tokens_per_s"] / rows["engine"]["tokens_per_s"]
            print(f"tp_size={args.tp_size} / one engine throughput: {tp_row['ratio_vs_engine']:.3f}x", flush=True)
        group_row = rows.get(f"engines-x{args.num_engines}", {})
        if "seconds" in rows.get("engine", {}) and "seconds" in group_row:
            group_row["ratio_vs_engine"] = group_row["tokens_per_s"] / rows["engine"]["tokens_per_s"]
            print(f"{args.num_engines} engines (Ray) / one engine throughput: {group_row['ratio_vs_engine']:.3f}x",
                  flush=True)
        result = dict(workload=workload, results=rows)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        print_table(workload, rows)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# Below this share of a run's wall time, the decode estimate (t(output_len) - t(1)) is the difference of
# two prefill-dominated timings, and run-to-run noise in prefill (seconds on a shared machine) swamps it.
MIN_DECODE_SHARE = 0.25


def drop_unreliable_decode(row: dict, output_len: int) -> None:
    """Replace a row's decode ms/step by a note when decode is under MIN_DECODE_SHARE of its run (or the
    estimate is not positive): a figure there says nothing about the step."""
    ms = row.get("decode_ms")
    if ms is None or "seconds" not in row:
        return
    decode_s = ms * (output_len - 1) / 1e3
    if ms > 0 and decode_s >= MIN_DECODE_SHARE * row["seconds"]:
        return
    for key in ("decode_ms", "decode_ms_all", "decode_cpu_ms", "floor_ms", "decode_over_floor", "floor_cpu_ms",
                "decode_over_floor_cpu"):
        row.pop(key, None)
    row["decode_ms_note"] = (f"decode estimate {ms:.2f} ms/step dropped: decode is under "
                             f"{MIN_DECODE_SHARE:.0%} of the run, so it is noise; use a longer --output-len")


# A decode step runs the floor's linears and more: a median ratio below this means the floor's own timing was
# disturbed (descheduled on a shared machine: a 0.13 ms floor once read 40 ms), not that the step beat it.
MIN_PLAUSIBLE_FLOOR_RATIO = 0.5


def drop_implausible_floor(row: dict) -> None:
    """Replace a row's floor figures by a note when decode / floor is below MIN_PLAUSIBLE_FLOOR_RATIO."""
    ratio = row.get("decode_over_floor")
    if ratio is None or ratio >= MIN_PLAUSIBLE_FLOOR_RATIO:
        return
    floor = row.get("floor_ms")
    for key in ("floor_ms", "decode_over_floor", "floor_cpu_ms", "decode_over_floor_cpu"):
        row.pop(key, None)
    row["floor_note"] = (f"floor dropped: the decode step measured {ratio:.2f}x its floor ({floor:.2f} ms), less "
                         f"than its own linears alone take, so the floor's timing was disturbed; run again")


def print_table(workload: dict, rows: dict) -> None:
    w = workload
    print(f"\n{w['model']} {w['dtype']}  {w['batch']} prompts x n={w['n']} x {w['prompt_len']} prompt "
          f"-> {w['output_len']} new tokens, temperature {w['temperature']}, {w['torch_threads']} threads, "
          f"best of {w['repeat']}")
    print(f"{'backend':<10}{'seconds':>10}{'out tok/s':>12}{'vs HF':>8}{'tok/CPU-s':>12}{'load':>6}"
          f"{'decode ms':>11}{'floor ms':>10}{'/floor':>8}{'CPU /floor':>12}")
    for name, row in rows.items():
        if "seconds" not in row:
            print(f"{name:<10}{'failed':>10}  {row.get('error', '(see the log above)').splitlines()[0][:90]}")
            continue
        ratio = f"{row['ratio_vs_hf']:.2f}x" if row.get("ratio_vs_hf") else "-"
        per_cpu = f"{row['tokens_per_cpu_s']:.1f}" if row.get("tokens_per_cpu_s") else "-"
        step = f"{row['decode_ms']:.2f}" if "decode_ms" in row else "-"
        fl = f"{row['floor_ms']:.2f}" if "floor_ms" in row else "-"
        over = f"{row['decode_over_floor']:.2f}x" if "decode_over_floor" in row else "-"
        cpu_over = f"{row['decode_over_floor_cpu']:.2f}x" if "decode_over_floor_cpu" in row else "-"
        print(f"{name:<10}{row['seconds']:>10.2f}{row['tokens_per_s']:>12.1f}{ratio:>8}"
              f"{per_cpu:>12}{row['load_avg_1m']:>6.1f}{step:>11}{fl:>10}{over:>8}{cpu_over:>12}")
    for name, row in rows.items():
        for note in ("decode_ms_note", "floor_note"):
            if note in row:
                print(f"{name}: {row[note]}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
