"""Output-token throughput of this engine against HF `generate` (and optionally vLLM) on one workload.

Every backend gets the same requests: `batch` prompts of `prompt_len` random token ids, `n` samples
each, exactly `output_len` new tokens (`ignore_eos`; HF gets `min_new_tokens = max_new_tokens`),
greedy or temperature-1.0 sampling with top-k/top-p off. Each backend is loaded, warmed up once on a
small batch, then timed with the wall clock around the one generate call (loading is not timed);
with `--repeat k` the fastest of k calls counts. Backends run one after another and free their model
before the next starts, so they never compete for cores or memory. vLLM runs in a subprocess,
usually from its own venv (`--vllm-python`). On a shared machine wall time swings with the
neighbours' load, so the table also shows tokens per CPU-second and the load average at each start.

It does not check that the backends produce the same tokens (tests do that) and does not measure
time to first token or latency percentiles: only output tokens per second of a whole batch.

    python -m bench.throughput --preset tiny --batch 16 --prompt-len 32 --output-len 64
    python -m bench.throughput --preset tiny --batch 16 --skip-hf --deterministic   # the mode's cost
    python -m bench.throughput --preset qwen2.5-0.5b --dtype bfloat16 --batch 64 --n 8 \
        --vllm --vllm-python /tmp/vllm-venv/bin/python --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

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
               warmup: list[list[int]], repeat: int = 1, engine_kwargs: dict | None = None) -> dict:
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
    with Engine(str(model_dir), **kwargs) as engine:
        if warmup:
            engine.generate(input_ids=warmup, sampling_params={**sp, "max_new_tokens": min(8, output_len)},
                            show_progress=False)
        runs = []
        for _ in range(repeat):
            engine.flush_cache()  # each run prefills its prompts afresh
            before = engine.get_server_info()

            def call() -> int:
                outs = engine.generate(input_ids=prompts, sampling_params=sp, show_progress=False)
                return sum(o["meta_info"]["completion_tokens"] for o in outs)

            run = _timed(call)
            after = engine.get_server_info()
            run["stats"] = {k: after[k] - before[k] for k in stat_keys if k in after}
            assert run["tokens"] == num_seqs * output_len, f"engine generated {run['tokens']} tokens"
            runs.append(run)
    return min(runs, key=lambda r: r["seconds"])



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

# vLLM runs in a child process (its own venv, its own torch); it reads a job file and writes a result file.
_VLLM_WORKER = r"""
import json, sys, time


def cpu_seconds():
    import psutil  # a vLLM dependency
    me = psutil.Process()
    return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])


def main(job_file, result_file):
    job = json.load(open(job_file))
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, seed=0,
              max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"])

    def generate(ids, new_tokens):
        sp = SamplingParams(n=job["n"], temperature=job["temperature"], top_k=-1 if job["temperature"] else 0,
                            top_p=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True,
                            detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in ids]
        t0, c0 = time.perf_counter(), cpu_seconds()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt, dc = time.perf_counter() - t0, cpu_seconds() - c0
        return dict(seconds=dt, cpu_seconds=dc, tokens=sum(len(c.token_ids) for o in outs for c in o.outputs))

    if job["warmup"]:
        generate(job["warmup"], min(8, job["output_len"]))
    runs = [generate(job["prompts"], job["output_len"]) for _ in range(job["repeat"])]
    json.dump({**min(runs, key=lambda r: r["seconds"]), "version": vllm.__version__}, open(result_file, "w"))


if __name__ == "__main__":  # vLLM spawns its engine-core process, which re-imports this file
    main(sys.argv[1], sys.argv[2])
"""


def run_vllm(python: str, model_dir: Path, dtype: str, prompts: list[list[int]], n: int, output_len: int,
             temperature: float, warmup: list[list[int]], repeat: int, tmp: Path, timeout: float) -> dict:
    num_seqs = len(prompts) * n
    seq_len = len(prompts[0]) + output_len
    job = dict(model=str(model_dir), dtype=dtype, prompts=prompts, warmup=warmup, n=n, output_len=output_len,
               temperature=temperature, max_model_len=seq_len + 16, max_num_seqs=max(num_seqs, 16),
               repeat=repeat)
    job_file, result_file = tmp / "vllm_job.json", tmp / "vllm_result.json"
    job_file.write_text(json.dumps(job))
    (tmp / "vllm_worker.py").write_text(_VLLM_WORKER)
    kv_gib = max(1, int(2.5 * num_seqs * seq_len * _kv_bytes_per_token(model_dir, dtype) / 2**30) + 1)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))}
    proc = subprocess.run([python, str(tmp / "vllm_worker.py"), str(job_file), str(result_file)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not result_file.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"vLLM worker exited with {proc.returncode}:\n{tail}")
    res = json.loads(result_file.read_text())
    assert res["tokens"] == num_seqs * output_len, f"vLLM generated {res['tokens']} tokens"
    return res


def _kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * _DTYPES[dtype].itemsize


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
    p.add_argument("--vllm-python", default=sys.executable, help="python of a venv with vLLM installed")
    p.add_argument("--vllm-timeout", type=float, default=1800.0)
    p.add_argument("--tp-size", type=int, default=1, help="also run the engine with tensor parallelism over "
                   "this many ranks (gloo on the CPU) and report its tok/s as a ratio to one engine, same run")
    p.add_argument("--num-engines", type=int, default=1, help="also run N engines on a local Ray cluster "
                   "(rollout.ray) on the same workload, reported as a ratio to one engine in this run")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "output_len", "n", "repeat", "num_engines"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
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
        rows: dict[str, dict] = {}
        common = (model_dir, args.dtype, prompts, args.n, args.output_len, args.temperature, warmup)
        backends = []
        if not args.skip_hf:
            backends.append(("hf", lambda: run_hf(*common, args.repeat)))
        if not args.skip_engine:
            backends.append(("engine", lambda: run_engine(*common, args.repeat, args.engine_kwargs)))
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
            backends.append(("vllm", lambda: run_vllm(args.vllm_python, *common, args.repeat, tmp,
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
        for row in rows.values():
            if "seconds" in row:
                row["tokens_per_s"] = row["tokens"] / row["seconds"]
                row["tokens_per_cpu_s"] = row["tokens"] / row["cpu_seconds"] if row["cpu_seconds"] else None
                row["ratio_vs_hf"] = row["tokens_per_s"] / hf["tokens_per_s"] if hf else None
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


def print_table(workload: dict, rows: dict) -> None:
    w = workload
    print(f"\n{w['model']} {w['dtype']}  {w['batch']} prompts x n={w['n']} x {w['prompt_len']} prompt "
          f"-> {w['output_len']} new tokens, temperature {w['temperature']}, {w['torch_threads']} threads, "
          f"best of {w['repeat']}")
    print(f"{'backend':<10}{'seconds':>10}{'out tok/s':>12}{'vs HF':>8}{'tok/CPU-s':>12}{'load':>6}")
    for name, row in rows.items():
        if "seconds" not in row:
            print(f"{name:<10}{'failed':>10}  (see the log above)")
            continue
        ratio = f"{row['ratio_vs_hf']:.2f}x" if row.get("ratio_vs_hf") else "-"
        per_cpu = f"{row['tokens_per_cpu_s']:.1f}" if row.get("tokens_per_cpu_s") else "-"
        print(f"{name:<10}{row['seconds']:>10.2f}{row['tokens_per_s']:>12.1f}{ratio:>8}"
              f"{per_cpu:>12}{row['load_avg_1m']:>6.1f}")


if __name__ == "__main__":
    main()
