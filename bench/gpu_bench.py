"""GPU benchmarks for one H200 run (bench/gpu_check.sh calls this): each figure against a peer measured
in the same process, results appended to a JSON file after every phase (a run cut short keeps what it
measured), and `--phase table` prints them.

Phases (random weights, `load_format="dummy"` for the engine, config-only checkpoints, bf16):
- `throughput`: output tok/s of `Engine.generate` (greedy, ignore_eos, every request exactly
  `--out` tokens) against HF `generate` on the same prompts; goal >= 15x HF on the 0.5B shape.
- `gemm`: one decode step's GEMM chain (every layer's qkv, o, gate_up, down + the LM head, bf16)
  replayed in a CUDA graph, against our captured decode step (`ModelRunner.forward` + `sample`,
  one host read) at the same batch and ~128-token context; goal ratio <= 1.5.
- `prefill`: a prefill of `--batch` x `--in` tokens, eager against piecewise CUDA graphs (one bucket).
- `engine_process`: update_weights_from_tensor GB/s into an engine process over CUDA IPC against an
  in-process engine.
- `memory`: share of the engine's device memory (mem_get_info before/after it was built) that
  `release_memory_occupation()` returns; KV release + resume ms; weight backup GB/s each way (second
  cycle: the pinned host buffer exists by then); `update_weights_from_tensor` GB/s from GPU tensors
  (plain and flattened buckets); and the same buckets sent by another process over CUDA IPC.

It does not check outputs (tests/gpu does) and does not install anything (gpu_check.sh does).

    python -m bench.gpu_bench --phase throughput --shape 0.5b --batch 256 --in 128 --out 256 --json r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from bench.throughput import PRESETS

SHAPES = {
    "0.5b": PRESETS["qwen2.5-0.5b"],
    # Qwen2.5-7B's config.json, by hand (nothing downloaded).
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
               tie_word_embeddings=False, rms_norm_eps=1e-6),
}
GB = 1e9


def write_config(shape: str, root: Path) -> Path:
    """A config-only Qwen2 checkpoint dir (the engine loads with load_format='dummy')."""
    from transformers import Qwen2Config

    path = root / f"qwen2-{shape}"
    path.mkdir(parents=True, exist_ok=True)
    Qwen2Config(**SHAPES[shape], architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16").save_pretrained(path)
    return path


def record(json_path: Path, row: dict) -> None:
    """Append `row` to the JSON file and print it at once as a table row (a later phase may not finish)."""
    row = {**row, "load_avg": round(os.getloadavg()[0], 2)}
    rows = json.loads(json_path.read_text()) if json_path.is_file() else []
    rows.append(row)
    json_path.write_text(json.dumps(rows, indent=1))
    print(json.dumps(row), flush=True)
    print("ROW " + table_row(row), flush=True)


def free_gpu() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def engine(path: Path, **kw):
    from rollout import Engine

    kw = {"device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "skip_tokenizer_init": True,
          "show_progress": False, **kw}
    return Engine(str(path), **kw)


def prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (num, length), generator=gen).tolist()


# ---- throughput ------------------------------------------------------------------------------------
def phase_throughput(args, root: Path) -> dict:
    path = write_config(args.shape, root)
    ids = prompts(args.batch, args.in_len, SHAPES[args.shape]["vocab_size"])
    sp = dict(temperature=0, max_new_tokens=args.out, ignore_eos=True)
    t0 = time.perf_counter()
    eng = engine(path, max_running_requests=args.batch, mem_fraction_static=0.85)
    init_s = time.perf_counter() - t0
    eng.generate(input_ids=ids[:8], sampling_params={**sp, "max_new_tokens": 8})  # warm-up (JIT, allocator)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = eng.generate(input_ids=ids, sampling_params=sp)
    ours, ours_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert all(len(o["output_ids"]) == args.out for o in outs)
    # The decode step alone: the run minus a 1-token run of the same prompts, per extra token. CPU seconds
    # (every thread of this process) near the wall seconds say the step is bound by host work.
    eng.flush_cache()
    t0, c0 = time.perf_counter(), time.process_time()
    eng.generate(input_ids=ids, sampling_params={**sp, "max_new_tokens": 1})
    one, one_cpu = time.perf_counter() - t0, time.process_time() - c0
    step_ms = (ours - one) / (args.out - 1) * 1e3
    step_cpu_ms = (ours_cpu - one_cpu) / (args.out - 1) * 1e3
    profile_while_generating(eng, ids, sp)
    backend = type(eng.runner.attn_backend).__name__
    graphs = eng.runner.graph_runner is not None
    eng.shutdown()
    del eng
    free_gpu()

    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config.from_pretrained(path)
    with torch.device("cuda"):  # random init on the device: a 7B init on the host takes minutes
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    x = torch.tensor(ids, device="cuda")
    kw = dict(do_sample=False, use_cache=True, pad_token_id=0, attention_mask=torch.ones_like(x))
    with torch.inference_mode():
        hf.generate(input_ids=x[:8], max_new_tokens=8, min_new_tokens=8, **{**kw, "attention_mask": x[:8] * 0 + 1})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(input_ids=x, max_new_tokens=args.out, min_new_tokens=args.out, **kw)
        torch.cuda.synchronize()
        theirs = time.perf_counter() - t0
    assert out.shape[1] - x.shape[1] == args.out
    del hf, out
    free_gpu()
    tokens = args.batch * args.out
    return dict(phase="throughput", shape=args.shape, batch=args.batch, in_len=args.in_len, out=args.out,
                backend=backend, cuda_graphs=graphs, engine_init_s=round(init_s, 1),
                engine_tok_s=round(tokens / ours), hf_tok_s=round(tokens / theirs), ratio=round(theirs / ours, 2),
                decode_step_ms=round(step_ms, 3), decode_step_cpu_ms=round(step_cpu_ms, 3))


def profile_while_generating(eng, ids, sp) -> None:
    """With GPU_BENCH_PROFILE=PATH (gpu_check.sh), generate untimed for a few seconds with PATH.go present:
    the script attaches py-spy to this process while the marker exists (never to a timed run)."""
    marker = os.environ.get("GPU_BENCH_PROFILE")
    if not marker:
        return
    go = Path(marker + ".go")
    go.write_text(str(os.getpid()))
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 8.0:
            eng.flush_cache()
            eng.generate(input_ids=ids, sampling_params=sp)
    finally:
        go.unlink(missing_ok=True)


# ---- GEMM chain vs decode step -------------------------------------------------------------------
def _graph_ms(fn, iters: int = 30) -> float:
    """Median ms of `fn` captured in a CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _median_ms(g.replay, iters)


def _median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def gemm_chain_ms(shape: str, bs: int) -> float:
    c = SHAPES[shape]
    h, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    layer = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]
    ops = []  # distinct weights per layer: nothing stays in L2 between layers
    for out_f, in_f in layer * c["num_hidden_layers"] + [(c["vocab_size"], h)]:
        ops.append((torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02,
                    torch.randn(bs, in_f, device="cuda", dtype=torch.bfloat16)))

    def chain():
        for w, x in ops:
            torch.nn.functional.linear(x, w)

    ms = _graph_ms(chain)
    ops.clear()
    free_gpu()
    return ms


def decode_step_ms(path: Path, bs: int, ctx: int = 128, steps: int = 40) -> tuple[float, bool]:
    """Median ms of one decode step (forward + greedy sample + the one host read), driven directly."""
    from runner.forward_batch import ForwardBatch, ForwardMode
    from runner.model_runner import ModelRunner, RunnerConfig
    from runner.sampler import SamplingBatchInfo

    r = ModelRunner(RunnerConfig(model_path=str(path), device="cuda", load_format="dummy", max_running_requests=bs,
                                 context_length=ctx + steps + 16, max_total_tokens=bs * (ctx + steps + 16) + 64))
    dev = r.device
    info = SamplingBatchInfo.from_lists([0.0] * bs, [1.0] * bs, [-1] * bs, [0.0] * bs, list(range(bs)), [0] * bs,
                                        r.model_config.vocab_size, dev)
    rows = [r.req_to_token_pool.alloc() for _ in range(bs)]
    rows_t = torch.tensor(rows, device=dev)
    table = r.req_to_token_pool.req_to_token  # [max_reqs, max_context]
    locs = r.token_to_kv_pool.alloc(bs * ctx)
    table[rows_t, :ctx] = locs.to(dev).view(bs, ctx)  # one write for the whole batch, not one per request
    lens = [ctx] * bs
    ids = torch.randint(10, r.model_config.vocab_size, (bs * ctx,), device=dev)
    fb = ForwardBatch(ForwardMode.EXTEND, bs, ids, torch.arange(ctx, device=dev).repeat(bs),
                      rows_t, torch.tensor(lens, device=dev), locs.to(dev), list(lens),
                      extend_prefix_lens_cpu=[0] * bs, extend_seq_lens_cpu=[ctx] * bs, sampling_info=info)
    state = {"next": r.sample(r.forward(fb), fb).next_token_ids, "lens": lens}

    def step():
        new = r.token_to_kv_pool.alloc(bs).to(dev)
        seq = torch.tensor(state["lens"], device=dev)
        table[rows_t, seq] = new  # each request's next slot at its current length: one index_put
        state["lens"] = [n + 1 for n in state["lens"]]
        seq = seq + 1
        f = ForwardBatch(ForwardMode.DECODE, bs, state["next"], seq - 1, rows_t, seq, new,
                         list(state["lens"]), sampling_info=info)
        state["next"] = r.sample(r.forward(f), f).next_token_ids
        state["next"].tolist()

    ms = _median_ms(step, steps - 3)
    graphs = r.graph_runner is not None
    r.shutdown()
    return ms, graphs  # the caller frees the device memory once `r` is gone


def phase_gemm(args, root: Path) -> dict:
    path = write_config(args.shape, root)
    chain = gemm_chain_ms(args.shape, args.batch)
    step, graphs = decode_step_ms(path, args.batch)
    free_gpu()
    return dict(phase="gemm", shape=args.shape, batch=args.batch, gemm_chain_ms=round(chain, 3),
                decode_step_ms=round(step, 3), cuda_graphs=graphs, ratio=round(step / chain, 2))


# ---- release / resume / updates ---------------------------------------------------------------------
def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _random_state(runner) -> tuple[list[tuple[str, torch.Tensor]], int]:
    named = []
    for name in runner.name_map.hf_names():
        shape = runner.name_map.resolve(name).view().shape
        named.append((name, torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02))
    return named, sum(t.numel() * t.element_size() for _, t in named)


def _ipc_sender(conn, shapes: list, bucket_bytes: int) -> None:
    import torch

    from weight_sync.bucket import iter_buckets
    from weight_sync.cuda_ipc import encode_bucket

    named = [(n, torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for n, s in shapes]
    buckets = list(iter_buckets(named, bucket_bytes=bucket_bytes))
    torch.cuda.synchronize()
    conn.send(json.dumps([encode_bucket(b) for b in buckets]))
    conn.recv()  # hold the memory until the receiver has loaded it
    conn.close()


def phase_memory(args, root: Path) -> dict:
    from weight_sync.bucket import iter_buckets
    from weight_sync.cuda_ipc import decode_bucket

    path = write_config(args.shape, root)
    free_gpu()
    free0 = torch.cuda.mem_get_info()[0]
    # 0.5: the random update tensors, their buckets and the IPC sender's copies must fit beside the engine.
    eng = engine(path, enable_memory_saver=True, enable_weights_cpu_backup=True, max_running_requests=64,
                 mem_fraction_static=0.5)
    eng.generate(input_ids=prompts(4, 16, 1000), sampling_params=dict(max_new_tokens=4, ignore_eos=True))
    r = eng.runner
    saver = r.memory_saver
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    engine_bytes = free0 - free1
    eng.release_memory_occupation()
    freed_share = (torch.cuda.mem_get_info()[0] - free1) / engine_bytes
    eng.resume_memory_occupation()
    kv_ms = [1e3 * _timed(lambda: eng.release_memory_occupation(["kv_cache"])),
             1e3 * _timed(lambda: eng.resume_memory_occupation(["kv_cache"]))]
    wbytes = saver.bytes_held("weights")
    eng.release_memory_occupation(["weights"])  # first cycle allocates and pins the host buffer
    eng.resume_memory_occupation(["weights"])
    w_out = wbytes / _timed(lambda: eng.release_memory_occupation(["weights"])) / GB
    w_in = wbytes / _timed(lambda: eng.resume_memory_occupation(["weights"])) / GB

    named, nbytes = _random_state(r)
    eng.update_weights_from_tensor(named)  # warm-up
    upd = nbytes / _timed(lambda: eng.update_weights_from_tensor(named)) / GB
    buckets = [b.to_dict() for b in iter_buckets(named, bucket_bytes=1 << 30)]
    upd_bucket = nbytes / _timed(lambda: eng.update_weights_from_tensor(buckets, load_format="flattened_bucket")) / GB
    shapes = [(n, list(t.shape)) for n, t in named]
    named.clear()
    buckets.clear()
    free_gpu()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_sender, args=(child, shapes, 1 << 30))
    proc.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("IPC sender sent nothing in 300 s")
        t0 = time.perf_counter()
        descriptors = json.loads(parent.recv())
        received = [decode_bucket(d, device=torch.cuda.current_device()).to_dict() for d in descriptors]
        ok, msg = eng.update_weights_from_tensor(received, load_format="flattened_bucket")
        torch.cuda.synchronize()
        ipc = nbytes / (time.perf_counter() - t0) / GB
        assert ok, msg
        del received
        parent.send("done")
    finally:
        proc.join(120)
        if proc.is_alive():
            proc.kill()
    eng.shutdown()
    return dict(phase="memory", shape=args.shape, saver=saver.name, engine_gib=round(engine_bytes / 2**30, 2),
                freed_share=round(freed_share, 4), kv_release_ms=round(kv_ms[0], 2), kv_resume_ms=round(kv_ms[1], 2),
                weights_gb=round(wbytes / GB, 2), backup_out_gb_s=round(w_out, 1), backup_in_gb_s=round(w_in, 1),
                update_tensor_gb_s=round(upd, 1), update_bucket_gb_s=round(upd_bucket, 1),
                update_ipc_gb_s=round(ipc, 1))


# ---- piecewise prefill graphs vs eager prefill ------------------------------------------------------
def phase_prefill(args, root: Path) -> dict:
    """Median ms of a prefill of `--batch` x `--in` tokens (generate with one new token), eager against
    piecewise graphs (one bucket of exactly that many tokens), same engine options otherwise."""
    path = write_config(args.shape, root)
    ids = prompts(args.batch, args.in_len, SHAPES[args.shape]["vocab_size"])
    sp = dict(temperature=0, max_new_tokens=1, ignore_eos=True)
    res = {}
    for name, kw in (("eager", {}), ("piecewise", dict(enable_piecewise_cuda_graph=True,
                                                        piecewise_cuda_graph_tokens=[args.batch * args.in_len]))):
        t0 = time.perf_counter()
        eng = engine(path, max_running_requests=args.batch, mem_fraction_static=0.3, disable_radix_cache=True,
                     chunked_prefill_size=max(8192, args.batch * args.in_len), **kw)
        init_s = time.perf_counter() - t0
        out = eng.generate(input_ids=ids, sampling_params=sp)  # warm-up (JIT)

        def run(eng=eng):
            eng.generate(input_ids=ids, sampling_params=sp)

        ms = _median_ms(run, 5)
        res[name] = (ms, [o["output_ids"] for o in out], init_s)
        pw = eng.runner.piecewise_runner
        res[name + "_replays"] = pw.num_replays if pw is not None else 0
        eng.shutdown()
        del eng
        free_gpu()
    return dict(phase="prefill", shape=args.shape, batch=args.batch, tokens=args.batch * args.in_len,
                eager_ms=round(res["eager"][0], 2), piecewise_ms=round(res["piecewise"][0], 2),
                ratio=round(res["piecewise"][0] / res["eager"][0], 3), piecewise_replays=res["piecewise_replays"],
                capture_init_s=round(res["piecewise"][2], 1), same_tokens=res["eager"][1] == res["piecewise"][1])


# ---- weights into an engine process by CUDA IPC ----------------------------------------------------
def phase_engine_process(args, root: Path) -> dict:
    """update_weights_from_tensor GB/s from this process's GPU tensors: into an Engine in a child process
    (RemoteEngine, CUDA IPC handles) against an in-process Engine, same weights."""
    from weight_sync.cross_process import RemoteEngine

    path = write_config(args.shape, root)
    kw = {"device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "skip_tokenizer_init": True,
          "show_progress": False, "disable_cuda_graph": True, "attention_backend": "torch_native",
          "max_running_requests": 8, "mem_fraction_static": 0.25}
    local = engine(path, **kw)
    named, nbytes = _random_state(local.runner)
    local.update_weights_from_tensor(named)  # warm-up
    inproc = nbytes / _timed(lambda: local.update_weights_from_tensor(named)) / GB
    local.shutdown()
    local = None
    free_gpu()
    with RemoteEngine("rollout:Engine", weight_transport="cuda_ipc", model_path=str(path), **kw) as r:
        ok, msg = r.update_weights_from_tensor(named)  # warm-up: opens the handles
        assert ok, msg
        t0 = time.perf_counter()
        ok, msg = r.update_weights_from_tensor(named)
        ipc = nbytes / (time.perf_counter() - t0) / GB
        assert ok, msg
        served = r.get_weights_by_name(named[-1][0], truncate_size=2)
    want = named[-1][1][:2].float().cpu()
    return dict(phase="engine_process", shape=args.shape, weights_gb=round(nbytes / GB, 2),
                ipc_update_gb_s=round(ipc, 1), inproc_update_gb_s=round(inproc, 1), ratio=round(ipc / inproc, 2),
                served_equal=bool(torch.allclose(torch.tensor(served), want)))


# ---- table --------------------------------------------------------------------------------------
GOALS = {"throughput": ("ratio", ">= 15x HF (0.5B)"), "gemm": ("ratio", "<= 1.5"), "memory": ("freed_share", ">= 0.99"),
         "prefill": ("ratio", "< 1 (piecewise faster), same tokens"),
         "engine_process": ("ratio", "IPC near in-process")}


def table_row(row: dict) -> str:
    figures = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("phase", "shape", "batch"))
    return (f"| {row['phase']} | {row.get('shape', '')} | {row.get('batch', '')} | {figures} | "
            f"{GOALS.get(row['phase'], ('', ''))[1]} |")


def print_table(json_path: Path) -> None:
    rows = json.loads(json_path.read_text()) if json_path.is_file() else []
    print("\n| phase | shape | batch | figures | goal |\n|---|---|---|---|---|")
    for row in rows:
        print(table_row(row))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase", choices=("throughput", "gemm", "memory", "prefill", "engine_process", "table"),
                   required=True)
    p.add_argument("--shape", choices=tuple(SHAPES), default="0.5b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--in", dest="in_len", type=int, default=128)
    p.add_argument("--out", type=int, default=256)
    p.add_argument("--json", type=Path, default=Path("gpu_results.json"))
    p.add_argument("--workdir", type=Path, default=Path("/tmp/gpu_bench"))
    args = p.parse_args(argv)
    if args.phase == "table":
        print_table(args.json)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_bench needs CUDA")
    fn = {"throughput": phase_throughput, "gemm": phase_gemm, "memory": phase_memory, "prefill": phase_prefill,
          "engine_process": phase_engine_process}[args.phase]
    try:
        row = fn(args, args.workdir)
        free_gpu()
    except Exception as e:  # keep the run going: the table shows what failed and why
        row = dict(phase=args.phase, shape=args.shape, batch=args.batch, error=f"{type(e).__name__}: {e}"[:300])
    record(args.json, row)


if __name__ == "__main__":
    main()
