"""One decode step's attention through the torch-native backend, the paged CPU kernel against gather + SDPA.

Both paths run through `TorchNativeAttnBackend.forward_decode` on the same pool, plan and queries (the
per-step plan included), alternating in one process; the K/V slots of each request are scattered
through the pool as decode steps leave them. Prints ms per layer for each path, the ratio, the largest
difference between the two outputs, and the load average. This is an inner-loop figure that explains
end-to-end ones; the speed goals are measured through Engine.generate (bench/throughput.py).

    python bench/decode_attention.py --batch 16 --heads 14 --kv-heads 2 --head-dim 64 --context 96,576,2048
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from runner.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context  # noqa: E402
from runner.memory.kv_pool import TokenToKVPool  # noqa: E402


def run(bs: int, hq: int, hkv: int, d: int, ctx: int, dtype: torch.dtype, layers: int, iters: int) -> dict:
    gen = torch.Generator().manual_seed(ctx)
    pool = TokenToKVPool(bs * ctx, dtype, layers, hkv, d, "cpu")
    pool.k_buffer.copy_(torch.randn(pool.k_buffer.shape, generator=gen).to(dtype))
    pool.v_buffer.copy_(torch.randn(pool.v_buffer.shape, generator=gen).to(dtype))
    # Slot of token t of request b: prompt tokens contiguous per request, decode tokens interleaved
    # across the batch, as the pool hands them out.
    prompt = min(32, ctx)
    r2t = torch.zeros(bs, ctx, dtype=torch.int64)
    for b in range(bs):
        r2t[b, :prompt] = 1 + b * prompt + torch.arange(prompt)
        r2t[b, prompt:] = 1 + bs * prompt + b + bs * torch.arange(ctx - prompt)
    runner = types.SimpleNamespace(device=torch.device("cpu"), req_to_token_pool=types.SimpleNamespace(req_to_token=r2t))
    seq = [ctx - (b % 8) for b in range(bs)]
    fb = ForwardBatch(ForwardMode.DECODE, bs, torch.zeros(bs, dtype=torch.int64), torch.tensor(seq) - 1,
                      torch.arange(bs), torch.tensor(seq), torch.zeros(bs, dtype=torch.int64), seq)
    q = torch.randn(bs, hq, d, generator=gen).to(dtype)
    layer_objs = [types.SimpleNamespace(layer_id=i, num_heads=hq, num_kv_heads=hkv, head_dim=d, scaling=d**-0.5)
                  for i in range(layers)]
    backends = {"kernel": TorchNativeAttnBackend(runner, decode_kernel=True),
                "sdpa": TorchNativeAttnBackend(runner, decode_kernel=False)}
    times = {name: [] for name in backends}
    outs = {}
    with torch.inference_mode():
        for rep in range(iters + 2):
            for name, backend in backends.items():
                with forward_context(ForwardContext(backend, pool, None)):
                    t0 = time.perf_counter()
                    backend.init_forward_metadata(fb)
                    for layer in layer_objs:
                        outs[name] = backend.forward_decode(q, layer, fb)
                    if rep >= 2:
                        times[name].append((time.perf_counter() - t0) / layers * 1e3)
    ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return dict(ms=ms, diff=(outs["kernel"].float() - outs["sdpa"].float()).abs().max().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--context", default="96,576,2048", help="comma-separated KV lengths")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--layers", type=int, default=8, help="layers per step (pool buffers rotate through caches)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    print(f"bs={a.batch} heads={a.heads}/{a.kv_heads} head_dim={a.head_dim} {a.dtype} threads={a.threads}")
    print(f"{'context':>8} {'kernel ms/layer':>16} {'sdpa ms/layer':>14} {'sdpa/kernel':>12} {'max |diff|':>11} {'load':>6}")
    for ctx in (int(c) for c in a.context.split(",")):
        r = run(a.batch, a.heads, a.kv_heads, a.head_dim, ctx, dtype, a.layers, a.iters)
        k, s = r["ms"]["kernel"], r["ms"]["sdpa"]
        print(f"{ctx:>8} {k:>16.3f} {s:>14.3f} {s / k:>11.2f}x {r['diff']:>11.2e} {os.getloadavg()[0]:>6.2f}")


if __name__ == "__main__":
    main()
