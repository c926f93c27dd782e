"""How long one hostile request stalls every other client of the server, in one run.

A probe client polls `/health` (the event loop) and posts `/abort_request` for an unknown id (a
control call: it takes the engine lock between steps) every 20 ms while one adversarial request runs;
the figures are the probe's worst latencies during it, beside the same probe's with no adversary (the
peer, same run, same machine) and their ratios, with the load average. Adversaries (the held-out battery's cases):

- `big_prompt`: a 50 MB text prompt (refused by --max-request-bytes, 413);
- `long_prompt`: a prompt just under the byte limit but longer than the context could hold (400);
- `regex`: a backtracking stop_regex over a forced all-'a' output (finishes as abort);
- `logprobs`: n=256 x 120 tokens x the whole vocabulary as top logprobs (refused by
  --max-response-entries), then the largest such request the default limit admits (served);
- `joins`: eight /init_weights_update_group calls to ports nobody listens on (two run, six get 503);
- `stream_logprobs`: the largest admitted logprobs request, streamed (every event a cumulative snapshot).

It measures stalls, not throughput (bench/serve.py does that).

    python -m bench.adversarial [--model assets/demo-model]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from rollout import Engine
from rollout.launch_server import ServerThread, free_port
from rollout.server import ServerArgs, create_app


def probe(url: str, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """(/health latency, /abort_request latency) pairs: the event loop's stall, and the engine lock's."""
    with httpx.Client(base_url=url, timeout=300) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get("/health")
            t1 = time.perf_counter()
            c.post("/abort_request", json={"rid": "nobody"})
            out.append((t1 - t0, time.perf_counter() - t1))
            time.sleep(0.02)


def worst_stall(url: str, attack) -> tuple[float, float, float, str]:
    """-> (worst /health s, worst /abort_request s, attack's own seconds, what the attack got)."""
    stop, lat = threading.Event(), []
    t = threading.Thread(target=probe, args=(url, stop, lat), daemon=True)
    t.start()
    while not lat:
        time.sleep(0.01)
    t0 = time.perf_counter()
    try:
        got = attack()
    except httpx.HTTPError as e:  # a 413 sent before the body was read closes the connection under it
        got = f"{type(e).__name__}: {e}"
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    return max(h for h, _ in lat), max(a for _, a in lat), took, got


def attacks(url: str, engine: Engine) -> dict:
    c = httpx.Client(base_url=url, timeout=600)
    a = engine.tokenizer.tokenizer.encode("a", add_special_tokens=False)[-1]
    vocab = engine.runner.model_config.vocab_size
    ctx = engine.runner.context_len

    def status(r):
        return f"{r.status_code} {r.text[:90]}"

    def joins():
        def one(i):
            return c.post("/init_weights_update_group", json=dict(
                master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
                group_name=f"g{i}", timeout_s=3.0)).status_code
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(one, range(8)))
        return f"codes {sorted(codes)}"

    def streamed(body):
        with c.stream("POST", "/generate", json=body) as r:
            size = sum(len(b) for b in r.iter_bytes())
        return f"{r.status_code}, {size / 1e6:.0f} MB streamed"

    admitted_n = max(1, (1 << 21) // (120 * (vocab + 3)))
    return {
        "none": lambda: "idle probe",
        "big_prompt": lambda: status(c.post("/generate", json={"text": "a" * (50 << 20)})),
        "long_prompt": lambda: status(c.post("/generate", json={"text": "ab " * ((10 << 20) // 3)})),
        "regex": lambda: status(c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": min(120, ctx - 4), "temperature": 0, "ignore_eos": True, "logit_bias": {str(a): 100},
            "stop_regex": "(a|aa)+b"}})),
        "logprobs": lambda: status(c.post("/generate", json={"input_ids": [5, 6, 7], "return_logprob": True,
                                                              "top_logprobs_num": vocab, "sampling_params": {
            "n": 256, "max_new_tokens": 120, "ignore_eos": True}})),
        f"logprobs_admitted_n{admitted_n}": lambda: status(c.post("/generate", json={
            "input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": vocab, "sampling_params": {
                "n": admitted_n, "max_new_tokens": 120, "ignore_eos": True}})),
        "joins": joins,
        # a stream's events are cumulative snapshots: each carries every earlier position's top logprobs again
        f"stream_logprobs_n{admitted_n}": lambda: streamed(dict(input_ids=[5, 6, 7], return_logprob=True,
                                                                top_logprobs_num=vocab, stream=True, sampling_params=dict(
            n=admitted_n, max_new_tokens=120, ignore_eos=True))),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "assets" / "demo-model"))
    p.add_argument("--engine-kwargs", type=json.loads, default={},
                   help='extra Engine options as JSON, e.g. \'{"num_continuous_decode_steps": 1}\'')
    args = p.parse_args()
    engine = Engine(args.model, **{"device": "cpu", "disable_cuda_graph": True, "show_progress": False,
                                   **args.engine_kwargs})
    server_args = ServerArgs(port=free_port())
    thread = ServerThread(create_app(engine, server_args), server_args).start()
    try:
        rows = []
        for name, attack in attacks(thread.url, engine).items():
            rows.append((name, *worst_stall(thread.url, attack)))
        base_h, base_a = rows[0][1], rows[0][2]
        print(f"load average {os.getloadavg()}")
        print(f"{'attack':<24} {'/health s':>9} {'x idle':>7} {'/abort s':>9} {'x idle':>7} {'attack s':>9}  result")
        for name, health, abort, took, got in rows:
            print(f"{name:<24} {health:9.3f} {health / base_h:7.1f} {abort:9.3f} {abort / base_a:7.1f} "
                  f"{took:9.2f}  {got[:70]}")
    finally:
        thread.stop()
        engine.shutdown()


if __name__ == "__main__":
    main()
