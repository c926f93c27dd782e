"""vLLM's CPU build as the peer of bench/throughput.py: the same workload in a child process.

vLLM lives in its own venv (its own torch), so it runs as a child of the benchmark (the same process
tree) from `--vllm-python`; without that flag the usual venv locations are tried. The child reads a
job file and writes a result file. It gets the benchmark's thread count: its OpenMP threads are bound
to that many cores (`VLLM_CPU_OMP_THREADS_BIND`, unless the caller set it), and tcmalloc and the venv's
Intel OpenMP are preloaded when present, as vLLM's CPU docs ask.

Like the engine row, the result has the whole-batch wall time, and the decode ms/step measured through
`LLM.generate` the way a user times it: (time with `output_len` new tokens - time with 1) / (output_len - 1),
the median over `repeat` such pairs. When vLLM is missing or fails, `vllm_available` / `run_vllm`
say why in one line and the benchmark goes on without it. It does not compare tokens with the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

_WORKER = r"""
import json, statistics, sys, time


def cpu_seconds():
    import psutil  # a vLLM dependency
    me = psutil.Process()
    return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])


def main(job_file, result_file):
    job = json.load(open(job_file))
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, seed=0,
              max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"], enable_prefix_caching=False)

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
        generate(job["warmup"], 1)  # the 1-token call of each pair below, warmed too
    runs, steps = [], []
    for _ in range(job["repeat"]):
        runs.append(generate(job["prompts"], job["output_len"]))
        if job["output_len"] > 1:  # prefix caching is off (above), so this prefills afresh too
            one = generate(job["prompts"], 1)
            steps.append((runs[-1]["seconds"] - one["seconds"]) / (job["output_len"] - 1))
    res = {**min(runs, key=lambda r: r["seconds"]), "version": vllm.__version__}
    if steps:
        res["decode_ms"] = statistics.median(steps) * 1e3
    json.dump(res, open(result_file, "w"))


if __name__ == "__main__":  # vLLM spawns its engine-core process, which re-imports this file
    main(sys.argv[1], sys.argv[2])
"""

# Where bench setups usually put vLLM's venv; the first that exists is the default --vllm-python.
_VENV_GUESSES = ("~/.cache/peers-venvs/vllm/bin/python", "/tmp/vllm-venv/bin/python")


def default_python() -> str:
    for guess in _VENV_GUESSES:
        path = Path(guess).expanduser()
        if path.is_file():
            return str(path)
    return sys.executable


def vllm_available(python: str) -> str | None:
    """None when `python` can import vllm, else one line saying why not."""
    if not Path(python).is_file():
        return f"no python at {python} (pass --vllm-python, a venv with the vllm-cpu package)"
    try:
        proc = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not run {python}: {e}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"vllm is not importable from {python} ({last}); pass --vllm-python (a venv with vllm-cpu)"
    return None


def _env(python: str, threads: int, kv_gib: int) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if Path(p).is_file()]
    venv_lib = Path(python).resolve().parent.parent / "lib"
    preload += [str(p) for p in sorted(venv_lib.glob("libiomp5.so"))]
    if preload and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def run_vllm(python: str, model_dir: Path, dtype: str, prompts: list[list[int]], n: int, output_len: int,
             temperature: float, warmup: list[list[int]], repeat: int, tmp: Path, timeout: float) -> dict:
    """The workload through vLLM: {seconds, cpu_seconds, tokens, decode_ms, version}; raises RuntimeError."""
    num_seqs = len(prompts) * n
    seq_len = len(prompts[0]) + output_len
    job = dict(model=str(model_dir), dtype=dtype, prompts=prompts, warmup=warmup, n=n, output_len=output_len,
               temperature=temperature, max_model_len=seq_len + 16, max_num_seqs=max(num_seqs, 16),
               repeat=repeat)
    job_file, result_file = tmp / "vllm_job.json", tmp / "vllm_result.json"
    job_file.write_text(json.dumps(job))
    (tmp / "vllm_worker.py").write_text(_WORKER)
    kv_gib = max(1, int(2.5 * num_seqs * seq_len * _kv_bytes_per_token(model_dir, dtype) / 2**30) + 1)
    env = _env(python, torch.get_num_threads(), kv_gib)
    proc = subprocess.run([python, str(tmp / "vllm_worker.py"), str(job_file), str(result_file)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not result_file.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"vLLM worker exited with {proc.returncode}:\n{tail}")
    res = json.loads(result_file.read_text())
    if res["tokens"] != num_seqs * output_len:
        raise RuntimeError(f"vLLM generated {res['tokens']} tokens, expected {num_seqs * output_len}")
    res["threads_bind"] = env["VLLM_CPU_OMP_THREADS_BIND"]
    return res


def _kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * _DTYPE_BYTES[dtype]
