"""Release/resume and weight-update speed of the RL surface, on whatever device is at hand.

Builds (or takes, with --model) a checkpoint of a few hundred MB: a Qwen2-like config with random
weights written by transformers' `save_pretrained` into a temp dir. Then, for an engine without and
one with weight CPU backup, it times `release_memory_occupation([tag])` and `resume_memory_occupation
([tag])` per tag and for all tags at once (median over --cycles, after one warm-up cycle that allocates
the persistent backup buffer), and reports the bytes freed and the backup copy rate. Last it times
`update_weights_from_tensor` (a state dict already in device memory, as HF tensors and as 512 MB
flattened buckets) and `update_weights_from_disk` (page cache warm; every tensor is read twice: once
to validate, once to load, so a bad file never half-loads).

It does not check outputs (tests do) and does not time torch_memory_saver (the GPU issue's).

    python bench/release_resume.py                        # CPU, ~300 MB of weights, 256 MB KV
    python bench/release_resume.py --device cuda --layers 8 --kv-gb 4 --cycles 10
    python bench/release_resume.py --model /path/to/hf_checkpoint --device cuda
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from rollout import Engine  # noqa: E402
from runner.weights.checkpoint import CheckpointIndex  # noqa: E402
from weight_sync import iter_buckets  # noqa: E402

TAGS = ("weights", "kv_cache", "cuda_graph")
MB = 1e6


def write_checkpoint(out_dir: Path, hidden_size: int, layers: int, dtype: torch.dtype) -> Path:
    """A random Qwen2-like checkpoint (no tokenizer) via save_pretrained."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden_size // 64),
        num_key_value_heads=max(1, hidden_size // 256),
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        use_sliding_window=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model.save_pretrained(out_dir)
    return out_dir


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    return None


def timed(fn, device: str) -> float:
    """Seconds `fn()` takes, device work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def make_engine(model: Path, args, backup: bool) -> Engine:
    probe = Engine(
        str(model), device=args.device, load_format="dummy", max_total_tokens=1, show_progress=False
    )
    per_token = probe.runner.token_to_kv_pool.bytes_per_token
    probe.shutdown()
    del probe
    gc.collect()
    return Engine(
        str(model),
        device=args.device,
        enable_memory_saver=True,
        enable_weights_cpu_backup=backup,
        max_total_tokens=max(1, int(args.kv_gb * 1e9 // per_token)),
        show_progress=False,
        skip_tokenizer_init=True,
    )


def bench_release_resume(engine: Engine, args, full_state: list) -> list[dict]:
    """Median release/resume time per tag (and for all tags) over args.cycles, after a warm-up cycle."""
    saver, backup = engine.runner.memory_saver, engine.runner.memory_saver.has_cpu_backup("weights")
    rows = []
    for tags in [[t] for t in TAGS] + [None]:
        nbytes = sum(saver.bytes_held(t) for t in (tags or TAGS))
        rel, res, rss_drop = [], [], []
        for cycle in range(args.cycles + 1):
            before = rss_mb()
            r = timed(lambda tags=tags: engine.release_memory_occupation(tags), args.device)
            after = rss_mb()
            s = timed(lambda tags=tags: engine.resume_memory_occupation(tags), args.device)
            if not engine.runner.weights_valid:  # released without backup: reload to stay usable
                ok, msg = engine.update_weights_from_tensor(full_state)
                assert ok, msg
            engine.generate(input_ids=[5, 6, 7], sampling_params=dict(max_new_tokens=2))  # touch it again
            if cycle:  # the first one allocates the backup buffer
                rel.append(r)
                res.append(s)
                if before is not None:
                    rss_drop.append(before - after)
        name = "all" if tags is None else tags[0]
        rows.append(
            dict(
                tag=name,
                backup=backup,
                mb=nbytes / MB,
                release_ms=1e3 * statistics.median(rel),
                resume_ms=1e3 * statistics.median(res),
                rss_drop=statistics.median(rss_drop) if rss_drop else None,
            )
        )
    return rows


def bench_updates(engine: Engine, model: Path, args) -> list[dict]:
    index = CheckpointIndex(model)
    state = [(n, t.to(args.device)) for n, t in index.iter_tensors()]
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    file_bytes = sum(f.stat().st_size for f in {e.file for e in index.entries.values()})
    buckets = [b.to_dict() for b in iter_buckets(state, bucket_bytes=512 << 20)]
    runs = {
        "update_weights_from_tensor (HF names)": (nbytes, lambda: engine.update_weights_from_tensor(state)),
        f"update_weights_from_tensor ({len(buckets)} flattened bucket(s))": (
            nbytes,
            lambda: engine.update_weights_from_tensor(buckets, load_format="flattened_bucket"),
        ),
        "update_weights_from_disk (page cache warm)": (
            file_bytes,
            lambda: engine.update_weights_from_disk(str(model)),
        ),
    }
    rows = []
    for name, (n, fn) in runs.items():
        times = []
        for _ in range(max(2, min(args.cycles, 3))):
            out = {}
            times.append(timed(lambda fn=fn, out=out: out.setdefault("r", fn()), args.device))
            assert out["r"][0], out["r"][1]
        t = statistics.median(times)
        rows.append(dict(name=name, mb=n / MB, ms=1e3 * t, gbps=n / t / 1e9))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", type=Path, help="an HF checkpoint dir (else a random one is written)")
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-gb", type=float, default=0.25, help="KV cache size in GB")
    ap.add_argument("--cycles", type=int, default=5, help="timed release/resume cycles per tag")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")

    with tempfile.TemporaryDirectory(prefix="bench-release-resume-") as tmp:
        model = args.model
        if model is None:
            t0 = time.perf_counter()
            dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
            model = write_checkpoint(Path(tmp), args.hidden_size, args.layers, dtype)
            print(
                f"wrote a random Qwen2-like checkpoint (hidden {args.hidden_size}, {args.layers} layers, "
                f"{dtype}) in {time.perf_counter() - t0:.1f} s"
            )
        full_state = list(CheckpointIndex(model).iter_tensors())
        rows, updates = [], []
        for backup in (False, True):
            engine = make_engine(model, args, backup)
            rows += bench_release_resume(engine, args, full_state)
            if backup:
                updates = bench_updates(engine, model, args)
            engine.shutdown()
            del engine
            gc.collect()

    print(f"\ndevice {args.device}; median of {args.cycles} cycles (after one warm-up); MB = 1e6 bytes")
    rss = args.device == "cpu"
    print(
        f"{'backup':<7}{'tag':<11}{'freed MB':>10}{'release ms':>12}{'resume ms':>11}{'copy GB/s':>19}"
        + (f"{'RSS drop MB':>13}" if rss else "")
    )
    for r in rows:
        copy = "-"
        if r["backup"] and r["tag"] in ("weights", "all") and r["mb"]:
            w = next(x["mb"] for x in rows if x["backup"] and x["tag"] == "weights")
            copy = f"{w / r['release_ms']:.2f} / {w / r['resume_ms']:.2f}"  # MB/ms == GB/s
        line = (
            f"{'yes' if r['backup'] else 'no':<7}{r['tag']:<11}{r['mb']:>10.1f}{r['release_ms']:>12.2f}"
            f"{r['resume_ms']:>11.2f}{copy:>19}"
        )
        if rss:
            line += f"{r['rss_drop']:>13.1f}" if r["rss_drop"] is not None else f"{'-':>13}"
        print(line)
    print("copy GB/s: weights bytes / release time, / resume time (the backup copies, with the free/alloc)")
    print(f"\n{'weight update':<50}{'MB':>9}{'ms':>10}{'GB/s':>8}")
    for u in updates:
        print(f"{u['name']:<50}{u['mb']:>9.1f}{u['ms']:>10.1f}{u['gbps']:>8.2f}")


if __name__ == "__main__":
    main()
