"""Load test of the HTTP server, with the same workload through the in-process Engine as the peer.

    python bench/serve.py [--model assets/demo-model] [--num-requests 1000] [--concurrency 64] [--client raw]

Starts `python -m rollout.launch_server` in a subprocess (so client and server do not share a GIL) in its
default layout (HTTP in the server process, the Engine in the child process it spawns; `--engine-in-process`
measures the single-process layout instead),
sends `--num-requests` streaming /generate requests with at most `--concurrency` in flight (httpx,
asyncio; or `--client raw`: a bare asyncio HTTP/1.1 client that parses only each stream's last event, so
that the client's own cost, ~230 us of CPU per SSE event with httpx, does not cap the measurement), and reports output tok/s, p50/p99 end-to-end latency and time to first token, whether every
request finished, the mean rows of a decode step (below the concurrency: slots that stood empty while a finished
request's successor was on its way), and the CPU seconds the run cost the client process and the server processes apiece
(server_cpu_s: the server and its engine process together; engine_process_cpu_s: the engine process's
share; on a shared machine the split says which side pays for the HTTP overhead). Then it runs the identical workload through `Engine.async_generate(stream=True)`
in this process and prints the HTTP overhead as the ratio of the two throughputs: `--repeat` pairs of
(server, Engine) runs back to back, both kept up throughout, and the median of the pairs' ratios. The last line also says which schedule each side
ran (`schedule`: "overlap" if any decode step was launched ahead, "plain, decode blocks" if decode steps ran in
blocks, the CPU default); `--engine-args` with `--disable-overlap-schedule` (or `--no-disable-overlap-schedule`)
or `--num-continuous-decode-steps N` sets both. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import machine  # noqa: E402
from rollout.launch_server import free_port  # noqa: E402


def workload(args) -> list[dict]:
    rng = random.Random(0)
    return [dict(input_ids=[rng.randrange(4, 60) for _ in range(args.prompt_len)],
                 sampling_params=dict(max_new_tokens=args.output_len, temperature=1.0, seed=i, ignore_eos=True))
            for i in range(args.num_requests)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of another process (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def child_pids(pid: int) -> list[int]:
    """Every descendant of pid (Linux /proc; [] elsewhere)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids = []
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return kids + [d for k in kids for d in child_pids(k)]


def tree_cpu_s(pid: int) -> tuple[float | None, float | None]:
    """(CPU seconds of pid and its live descendants, of the descendants alone)."""
    own = proc_cpu_s(pid)
    kids = [proc_cpu_s(k) for k in child_pids(pid)]
    kids_s = sum(k for k in kids if k is not None)
    return (None if own is None else own + kids_s), kids_s


def step_counts(before: dict, after: dict) -> dict:
    """Prefill and decode steps (and the decode blocks that ran them, rollout/scheduler.py) between two
    get_server_info replies: how the requests were batched."""
    counts = {k.removeprefix("num_").removesuffix("_steps"): after.get(k, 0) - before.get(k, 0)
              for k in ("num_prefill_steps", "num_decode_steps")}
    counts["decode_blocks"] = after.get("num_decode_blocks", 0) - before.get("num_decode_blocks", 0)
    return counts


def summary(name: str, wall: float, results: list[tuple[float, float, int, str]], n: int, **cpu) -> dict:
    lat = [r[0] for r in results]
    ttft = [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    done = sum(r[3] == "length" for r in results)
    steps = cpu.get("steps")
    if isinstance(steps, dict) and steps.get("decode"):
        # Each request's first token comes from its prefill step; the rest are decode rows. Fewer rows a step
        # than the concurrency means slots stood empty while a finished request's successor was on its way.
        cpu["mean_decode_rows"] = (tokens - len(results)) / steps["decode"]
    out = dict(name=name, requests=n, finished=done, tokens=tokens, seconds=round(wall, 3),
               tok_per_s=round(tokens / wall, 1), p50_latency_ms=round(1e3 * statistics.median(lat), 1),
               p99_latency_ms=round(1e3 * pct(lat, 0.99), 1), p50_ttft_ms=round(1e3 * statistics.median(ttft), 1),
               p99_ttft_ms=round(1e3 * pct(ttft, 0.99), 1),
               **{k: v if v is None or isinstance(v, dict) else round(v, 2) for k, v in cpu.items()},
               load_avg=os.getloadavg()[0])
    print(json.dumps(out), flush=True)
    return out


async def run_http(url: str, reqs: list[dict], concurrency: int, timeout_s: float):
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        async def one(body):
            async with sem:
                t0 = time.perf_counter()
                ttft, last = None, None
                async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ttft = ttft or time.perf_counter() - t0
                        last = json.loads(line[6:])
                return time.perf_counter() - t0, ttft, len(last["output_ids"]), \
                    last["meta_info"]["finish_reason"]["type"]

        t0 = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(one(b) for b in reqs)), timeout_s)
        return time.perf_counter() - t0, results


def generate_result(out: dict) -> tuple[int, str]:
    """What a /generate stream's last event says: (output tokens, finish reason)."""
    return len(out["output_ids"]), out["meta_info"]["finish_reason"]["type"]


async def run_raw(url: str, reqs: list[dict], concurrency: int, timeout_s: float, path: str = "/generate",
                  result=generate_result):
    """`concurrency` keep-alive connections, each sending the next request once its stream ended. Reads
    the chunked SSE body and JSON-decodes only the last event (the counterpart of the in-process peer,
    which receives ready dicts): each result is (latency, time to the first chunk, *result(last event))."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    pending = iter(reqs)  # shared: each connection takes the next request
    results = []

    async def connection():
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for body in pending:
                payload = json.dumps({**body, "stream": True}).encode()
                t0 = time.perf_counter()
                writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (path.encode(), host.encode(), len(payload), payload))
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200") or b"chunked" not in head.lower():
                    raise RuntimeError(f"unexpected response head: {head[:200]!r}")
                ttft, last, buf = None, None, b""
                while size := int((await reader.readline()).strip(), 16):
                    buf += (await reader.readexactly(size + 2))[:-2]
                    ttft = ttft or time.perf_counter() - t0
                    *events, buf = buf.split(b"\n\n")
                    last = next((e for e in reversed(events) if e != b"data: [DONE]"), last)
                await reader.readline()  # the empty trailer after the last chunk
                results.append((time.perf_counter() - t0, ttft, *result(json.loads(last[6:]))))
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(connection() for _ in range(concurrency))), timeout_s)
    return time.perf_counter() - t0, results


async def run_engine(engine, reqs: list[dict], concurrency: int, timeout_s: float):
    sem = asyncio.Semaphore(concurrency)

    async def one(body):
        async with sem:
            t0 = time.perf_counter()
            ttft, last = None, None
            async for chunk in await engine.async_generate(**body, stream=True):
                ttft = ttft or time.perf_counter() - t0
                last = chunk
            return time.perf_counter() - t0, ttft, len(last["output_ids"]), last["meta_info"]["finish_reason"]["type"]

    t0 = time.perf_counter()
    results = await asyncio.wait_for(asyncio.gather(*(one(b) for b in reqs)), timeout_s)
    return time.perf_counter() - t0, results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="assets/demo-model")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                   help="HTTP client: httpx (a typical client, parses every event) or a bare asyncio one")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on each phase, seconds")
    p.add_argument("--engine-args", default="--max-total-tokens 16384 --max-running-requests 64",
                   help="extra launch_server flags, also applied to the in-process Engine")
    p.add_argument("--engine-in-process", action="store_true",
                   help="measure the server with the engine in its own process (launch_server --engine-in-process) "
                        "instead of the default two-process layout")
    p.add_argument("--repeat", type=int, default=3,
                   help="timed (server, in-process Engine) pairs, run back to back; the ratio reported is the "
                        "median of the pairs' ratios (a neighbour's burst of load then hits both sides of a pair)")
    args = p.parse_args()
    reqs = workload(args)
    print(machine.line(), flush=True)
    port = free_port()
    extra = args.engine_args.split()
    # Quiet server: stdout is read only until "ready", so an access line per request would fill the pipe
    # and block the server (and logging costs server CPU the peer does not pay). `extra` may override.
    cmd = [sys.executable, "-m", "rollout.launch_server", "--model-path", args.model, "--port", str(port),
           "--no-access-log", "--log-level", "warning", *extra,
           *(["--engine-in-process"] if args.engine_in_process else [])]
    from rollout import Engine
    from rollout.server.args import parse_args

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ratios, pairs = [], []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if "ready at" in line:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start in 120 s")
        else:
            raise RuntimeError(f"server exited with {proc.wait()}")
        url = f"http://127.0.0.1:{port}"
        run = run_http if args.client == "httpx" else run_raw
        layout = "engine in-process" if args.engine_in_process else "engine process"
        _, kw = parse_args(["--model-path", args.model, *extra])
        # Both stay up for the whole run; an idle one only waits (its scheduler sleeps), so the pairs
        # alternate on a quiet machine instead of the server's phase and the engine's being minutes apart.
        with Engine(**kw) as engine:
            asyncio.run(run(url, reqs[: args.concurrency], args.concurrency, args.timeout))  # warm-ups
            asyncio.run(run_engine(engine, reqs[: args.concurrency], args.concurrency, args.timeout))
            for i in range(args.repeat):
                httpx.post(url + "/flush_cache", timeout=30)
                steps0 = httpx.get(url + "/get_server_info", timeout=30).json()
                (server0, engine0), client0 = tree_cpu_s(proc.pid), own_cpu_s()
                wall, results = asyncio.run(run(url, reqs, args.concurrency, args.timeout))
                client_s, (server1, engine1) = own_cpu_s() - client0, tree_cpu_s(proc.pid)
                steps1 = httpx.get(url + "/get_server_info", timeout=30).json()
                http = summary(f"http ({args.client} client, {layout}), pair {i + 1}", wall, results, len(reqs),
                               client_cpu_s=client_s,
                               server_cpu_s=None if server0 is None or server1 is None else server1 - server0,
                               engine_process_cpu_s=engine1 - engine0, steps=step_counts(steps0, steps1))
                engine.flush_cache()
                steps0, cpu0 = engine.get_server_info(), own_cpu_s()
                wall, results = asyncio.run(run_engine(engine, reqs, args.concurrency, args.timeout))
                inproc = summary(f"engine, pair {i + 1}", wall, results, len(reqs), engine_cpu_s=own_cpu_s() - cpu0,
                                 steps=step_counts(steps0, engine.get_server_info()))
                ratios.append(http["tok_per_s"] / inproc["tok_per_s"])
                pairs.append((http, inproc))
            # Which schedule each side ran (both take the same default from the same flags): the overlap, the plain
            # schedule with decode blocks, or single plain steps.
            def schedule(info: dict) -> str:
                if info.get("num_overlapped_steps"):
                    return "overlap"
                return "plain, decode blocks" if info.get("num_decode_blocks") else "plain"

            schedules = {"http": schedule(httpx.get(url + "/get_server_info", timeout=30).json()),
                         "engine": schedule(engine.get_server_info())}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    finished = all(h["finished"] == e["finished"] == len(reqs) for h, e in pairs)
    print(json.dumps({"http_over_engine_throughput": round(statistics.median(ratios), 3),
                      "pair_ratios": [round(r, 3) for r in ratios],
                      "p50_ttft_ms_http": [h["p50_ttft_ms"] for h, _ in pairs],
                      "p50_latency_ms_http": [h["p50_latency_ms"] for h, _ in pairs],
                      "mean_decode_rows": {"http": [h.get("mean_decode_rows") for h, _ in pairs],
                                           "engine": [e.get("mean_decode_rows") for _, e in pairs]},
                      "all_finished": finished, "schedule": schedules,
                      "load_avg": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
