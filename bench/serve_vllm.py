"""This HTTP server against vLLM's OpenAI server (its CPU build): one checkpoint, one streaming load.

    python bench/serve_vllm.py [--preset qwen2.5-0.5b --dtype bfloat16 | --model DIR] [--num-requests 64]
        [--concurrency 16] [--prompt-len 128] [--output-len 64] [--repeat 3] [--vllm-python PY]

What a client of either server times: streaming `POST /v1/completions` (token-id prompts, `ignore_eos`, so
both generate exactly `--output-len` tokens a request; temperature 1, text detokenized by each server), at
most `--concurrency` in flight on keep-alive connections (bench/serve.py's bare asyncio client, so the
client's own cost stays small). Both servers are started here (`python -m rollout.launch_server`, and
`python -m vllm.entrypoints.openai.api_server` from vLLM's venv, with the same thread binding, tcmalloc
and KV space as bench/vllm_peer.py gives its offline run) and stay up the whole run; both are warmed, each
run waits (up to 15 s) until both are idle (vLLM's engine core keeps busy a while after its last response),
and each side's CPU seconds during the other's run are printed to show what is left. Then `--repeat` pairs
of runs alternate between them, swapping which goes first each pair; each pair sends new random prompts
(the same to both sides), so no run is served from a prefix cache another run filled. Prints each run's
output tok/s, p50/p99 latency and time to first token, and each server's CPU seconds, then the median of
the pairs' tok/s ratios (this server / vLLM) with the load average. Every wait is bounded, and SIGTERM
stops both servers' process groups too.

`--preset` writes a random-weight Qwen2 checkpoint (bench/throughput.py's shapes) with a word-level
tokenizer covering the whole vocabulary (one token per id, "<id>"), so any sampled id detokenizes on both
sides. Without vLLM (no venv at `--vllm-python`), it says so and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import machine, vllm_peer  # noqa: E402
from bench.serve import pct, run_raw, tree_cpu_s  # noqa: E402
from bench.throughput import PRESETS, make_prompts, vocab_size_of, write_preset  # noqa: E402
from rollout.launch_server import free_port  # noqa: E402

MODEL_NAME = "bench-model"  # what both servers answer to (--served-model-name)


def write_word_tokenizer(model_dir: Path) -> None:
    """tokenizer.json / tokenizer_config.json with one word-level token per model row: "<i>" is id i."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size_of(model_dir))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces (transformers 5 may rebuild it)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token="<0>", eos_token="<1>",
                            pad_token="<1>").save_pretrained(model_dir)


def completion_tokens(out: dict) -> tuple[int]:
    """The last event of an OpenAI stream with include_usage is the usage chunk: its completion tokens."""
    return ((out.get("usage") or {}).get("completion_tokens", 0),)


# bench/serve.py's bare client on /v1/completions: -> (wall seconds, [(latency, ttft, completion tokens)])
run_client = functools.partial(run_raw, path="/v1/completions", result=completion_tokens)


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}:\n"
                               + "\n".join(log.read_text().splitlines()[-25:]))
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """The server's whole process group, even when its leader is gone already (vLLM's engine-core process
    outlives a killed API server): TERM, then KILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return  # the group is empty
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        if sig == signal.SIGTERM:
            time.sleep(1)  # the group's other members get their turn to exit


def summary(name: str, wall: float, results: list, n: int, want_tokens: int, **extra) -> dict:
    lat = [r[0] for r in results]
    ttft = [r[1] for r in results if r[1] is not None]
    tokens = sum(r[2] for r in results)
    out = dict(name=name, requests=n, complete=len(results) == n and tokens == want_tokens, tokens=tokens,
               seconds=round(wall, 3), tok_per_s=round(tokens / wall, 1),
               p50_latency_ms=round(1e3 * statistics.median(lat), 1), p99_latency_ms=round(1e3 * pct(lat, 0.99), 1),
               p50_ttft_ms=round(1e3 * statistics.median(ttft), 1) if ttft else None,
               p99_ttft_ms=round(1e3 * pct(ttft, 0.99), 1) if ttft else None,
               **{k: None if v is None else round(v, 2) for k, v in extra.items()}, load_avg=os.getloadavg()[0])
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    src.add_argument("--model", type=Path, help="an HF checkpoint directory with a tokenizer")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--save-dir", type=Path, help="where --preset writes (and reuses) its checkpoint")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="pairs of runs")
    p.add_argument("--vllm-python", default=None, help="python of vLLM's CPU venv (default: bench/vllm_peer.py's)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=1200.0, help="bound on each run, seconds")
    args = p.parse_args()

    for sig in (signal.SIGTERM, signal.SIGHUP):  # `timeout`, a CI cancel: still stop both servers (finally)
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    vllm_python = args.vllm_python or vllm_peer.default_python()
    missing = vllm_peer.vllm_available(vllm_python)
    if missing:
        print(f"vllm: {missing}", flush=True)
        sys.exit(2)
    print(machine.line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="serve-vllm-") as tmp:
        tmp = Path(tmp)
        model = args.model
        if model is None:
            model = write_preset(args.preset, args.dtype, args.save_dir or tmp / "ckpt")
            if not (model / "tokenizer.json").is_file():
                write_word_tokenizer(model)
        max_len = args.prompt_len + args.output_len + 16
        threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
        def requests(seed: int, num: int) -> list[dict]:
            # Fresh prompts for every pair (the same for both sides of it): no run hits a prefix another cached.
            return [dict(model=MODEL_NAME, prompt=ids, max_tokens=args.output_len, temperature=1.0, ignore_eos=True,
                         stream=True, stream_options={"include_usage": True})
                    for ids in make_prompts(num, args.prompt_len, vocab_size_of(model), seed=seed)]
        want = args.num_requests * args.output_len

        ours_port, vllm_port = free_port(), free_port()
        ours_cmd = [sys.executable, "-m", "rollout.launch_server", "--model-path", str(model), "--port",
                    str(ours_port), "--dtype", args.dtype, "--served-model-name", MODEL_NAME,
                    "--max-running-requests", str(args.concurrency), "--context-length", str(max_len),
                    "--log-level", "warning", "--no-access-log"]
        kv_gib = max(1, int(2.5 * args.concurrency * max_len * vllm_peer._kv_bytes_per_token(model, args.dtype)
                            / 2**30) + 1)
        vllm_cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port",
                    str(vllm_port), "--dtype", args.dtype, "--served-model-name", MODEL_NAME, "--max-num-seqs",
                    str(args.concurrency), "--max-model-len", str(max_len), "--seed", "0",
                    "--disable-log-stats", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        procs = {}
        try:
            ours_log, vllm_log = tmp / "ours.log", tmp / "vllm.log"
            procs["ours"] = start(ours_cmd, {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}, ours_log)
            procs["vllm"] = start(vllm_cmd, vllm_peer._env(vllm_python, threads, kv_gib), vllm_log)
            urls = {"ours": f"http://127.0.0.1:{ours_port}", "vllm": f"http://127.0.0.1:{vllm_port}"}
            wait_ready(procs["ours"], urls["ours"], ours_log, args.startup_timeout)
            wait_ready(procs["vllm"], urls["vllm"], vllm_log, args.startup_timeout)
            version = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                     capture_output=True, text=True, timeout=300).stdout.strip()
            warm = requests(0, args.concurrency)
            for side in ("ours", "vllm"):  # warm-up: the prefill and decode paths once, every stream at once
                asyncio.run(run_client(urls[side], warm, args.concurrency, args.timeout))

            def settle(limit_s: float = 15.0) -> None:
                # Both servers idle before a run starts: one finishing its previous run's work (vLLM's engine
                # core keeps busy for a while after its last response) would take CPU from the other's run.
                deadline = time.monotonic() + limit_s
                while time.monotonic() < deadline:
                    cpu0 = [tree_cpu_s(p.pid)[0] or 0.0 for p in procs.values()]
                    time.sleep(0.5)
                    if sum(tree_cpu_s(p.pid)[0] or 0.0 for p in procs.values()) - sum(cpu0) < 0.03:
                        return

            def one(side: str, pair: int) -> dict:
                other = "vllm" if side == "ours" else "ours"
                reqs = requests(pair, args.num_requests)
                settle()
                cpu0 = {s: tree_cpu_s(procs[s].pid)[0] for s in procs}
                wall, results = asyncio.run(run_client(urls[side], reqs, args.concurrency, args.timeout))
                cpu1 = {s: tree_cpu_s(procs[s].pid)[0] for s in procs}
                spent = {s: None if cpu0[s] is None or cpu1[s] is None else cpu1[s] - cpu0[s] for s in procs}
                return summary(f"{side}, pair {pair}", wall, results, args.num_requests, want,
                               server_cpu_s=spent[side], idle_peer_cpu_s=spent[other])

            ratios, rows = [], {"ours": [], "vllm": []}
            for k in range(args.repeat):
                order = ("ours", "vllm") if k % 2 == 0 else ("vllm", "ours")
                got = {side: one(side, k + 1) for side in order}
                for side in got:
                    rows[side].append(got[side])
                ratios.append(got["ours"]["tok_per_s"] / got["vllm"]["tok_per_s"])
        finally:
            for proc in procs.values():
                try:
                    stop(proc)
                except Exception as e:  # noqa: BLE001 - the other server must still be stopped
                    print(f"stopping {proc.args[:3]} failed: {e}", file=sys.stderr)
        print(json.dumps({
            "ours_over_vllm_throughput": round(statistics.median(ratios), 3),
            "pair_ratios": [round(r, 3) for r in ratios], "vllm_version": version,
            "p50_ttft_ms": {s: [r["p50_ttft_ms"] for r in rows[s]] for s in rows},
            "p50_latency_ms": {s: [r["p50_latency_ms"] for r in rows[s]] for s in rows},
            "all_complete": all(r["complete"] for s in rows for r in rows[s]),
            "workload": dict(model=str(args.model or args.preset), dtype=args.dtype, requests=args.num_requests,
                             concurrency=args.concurrency, prompt_len=args.prompt_len, output_len=args.output_len),
            "load_avg": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
