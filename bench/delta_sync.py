"""Delta weight sync vs a full sync, per optimizer step, on one engine (in-process, bf16).

Two models in one run:
- the Qwen2.5-0.5B shape (config written by hand, dummy weights in the engine; the trainer holds fp32
  master weights from HF's init and takes exact Adam steps with synthetic N(0, 1) gradients, tensor by
  tensor, so the optimizer state fits beside the engine on a small machine);
- the GRPO demo (assets/demo-model), fp32 master weights, torch's Adam on a real next-token loss over
  the toy task's prompts.

Per step it prints the fraction of bf16 elements that changed, the bytes of a full sync vs the delta,
the delta's encode ms (cast, compare, encode) and apply ms (the engine call: checks and write), and a
full update's ms (`sync_weights` of the same cast into the same engine, right after). The full update
invalidates the engine's cached checksums; they are recomputed untimed before the next delta (what a
steady delta loop finds). The first delta of a run also pays the one-time checksums of the baseline
(sender) and the weights (engine), so medians are over the later steps. The load average is printed
before and after. Exactness is checked at the end (SHA-256 of the engine's weights against the cast).

    python bench/delta_sync.py                        # both models, 5 steps each, lr 1e-6
    python bench/delta_sync.py --lr 1e-5 --steps 4 --skip-qwen
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.throughput import PRESETS  # noqa: E402
from rollout import Engine  # noqa: E402
from weight_sync import DeltaSync, sync_weights  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MB = 1e6


class ManualAdam:
    """torch.optim.Adam's update (no weight decay), one tensor at a time with synthetic gradients."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, seed: int = 0) -> None:
        self.params, self.lr, self.betas, self.eps = list(params), lr, betas, eps
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0
        self.g = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            grad = torch.randn(p.shape, generator=self.g)
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            p.addcdiv_(m, (v / bc2).sqrt_().add_(self.eps), value=-self.lr / bc1)


def qwen_trainer(lr: float, out_dir: Path, layers: int | None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(PRESETS["qwen2.5-0.5b"])
    if layers:
        shape["num_hidden_layers"] = layers
    cfg = Qwen2Config(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=1, use_sliding_window=False,
                      hidden_act="silu", architectures=["Qwen2ForCausalLM"])
    cfg.save_pretrained(out_dir)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)  # fp32 master weights, HF's init
    opt = ManualAdam(model.parameters(), lr)
    return model, opt.step, dict(load_format="dummy")


def demo_trainer(lr: float):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainers.tasks import make_toy_prompts

    path = ROOT / "assets" / "demo-model"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rng = random.Random(0)

    def step() -> None:
        texts = [x["prompt"] + x["answer"] for x in make_toy_prompts(16, rng)]
        batch = tok(texts, return_tensors="pt", padding=True)
        opt.zero_grad()
        model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss.backward()
        opt.step()
    return model, step, {}


def holds_cast(engine, model, dtype) -> bool:
    """Every HF tensor in the engine equals the trainer's cast bit for bit."""
    name_map = engine.runner.name_map
    return all(torch.equal(name_map.resolve(n).view().view(torch.int16), p.detach().to(dtype).view(torch.int16))
               for n, p in model.named_parameters())


def prime_hashes(engine) -> None:
    """Recompute the engine's cached per-tensor checksums (after the timed full update dropped them)."""
    runner = engine.runner
    for target in runner.name_map.targets.values():
        runner.weight_hashes.get(runner, target)


def run(name: str, model_path: str, model, step_fn, engine_kw: dict, steps: int) -> dict:
    print(f"\n== {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, engine bf16 ==")
    with Engine(model_path, dtype="bfloat16", show_progress=False, max_total_tokens=256, max_running_requests=4,
                disable_radix_cache=True, skip_tokenizer_init=True, **engine_kw) as engine:
        ds = DeltaSync(engine, bucket_bytes=64 << 20)
        ok, msg = ds.sync(model)
        assert ok, msg
        print(f"first (full) sync: {ds.last['apply_ms']:.0f} ms")
        rows = []
        print(f"{'step':>4} {'changed %':>9} {'full MB':>8} {'delta MB':>9} {'ratio':>7} {'encode ms':>9} "
              f"{'apply ms':>9} {'full upd ms':>11} {'apply/full':>10}")
        for i in range(1, steps + 1):
            step_fn()
            ok, msg = ds.sync(model)
            assert ok and ds.last["mode"] == "delta", msg
            d = dict(ds.last)
            cast = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
            t0 = time.perf_counter()
            ok, msg = sync_weights(cast, engine, bucket_bytes=64 << 20)
            full_ms = (time.perf_counter() - t0) * 1e3
            assert ok, msg
            del cast
            prime_hashes(engine)
            d["full_ms"] = full_ms
            rows.append(d)
            print(f"{i:4d} {100 * d['elements_changed'] / d['elements_total']:9.3f} {d['bytes_full'] / MB:8.1f} "
                  f"{d['bytes_sent'] / MB:9.3f} {d['bytes_full'] / d['bytes_sent']:6.1f}x {d['encode_ms']:9.0f} "
                  f"{d['apply_ms']:9.0f} {full_ms:11.0f} {d['apply_ms'] / full_ms:10.2f}", flush=True)
        exact = holds_cast(engine, model, torch.bfloat16)
    later = rows[1:] or rows
    summary = {"model": name, "median_bytes_ratio": statistics.median(r["bytes_full"] / r["bytes_sent"] for r in rows),
               "median_changed_pct": statistics.median(100 * r["elements_changed"] / r["elements_total"] for r in rows),
               "median_apply_over_full": statistics.median(r["apply_ms"] / r["full_ms"] for r in later),
               "median_encode_ms": statistics.median(r["encode_ms"] for r in later),
               "first_delta_apply_ms": rows[0]["apply_ms"], "exact": exact}
    print(f"median over steps: full/delta bytes {summary['median_bytes_ratio']:.1f}x (goal >= 20x), "
          f"changed {summary['median_changed_pct']:.3f}%, apply/full update {summary['median_apply_over_full']:.2f} "
          f"(goal <= 1, steps 2..), encode {summary['median_encode_ms']:.0f} ms; engine == cast bit for bit: {exact}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers of the 0.5B shape (a smaller machine)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); on a shared, "
                                                            "oversubscribed machine 1 gives steadier timings")
    ap.add_argument("--skip-qwen", action="store_true")
    ap.add_argument("--skip-demo", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()}; lr {args.lr}; torch threads {torch.get_num_threads()}")
    out = []
    if not args.skip_demo:
        model, step, kw = demo_trainer(args.lr)
        out.append(run("GRPO demo (assets/demo-model)", str(ROOT / "assets" / "demo-model"), model, step, kw,
                       args.steps))
        del model
    if not args.skip_qwen:
        with tempfile.TemporaryDirectory() as d:
            model, step, kw = qwen_trainer(args.lr, Path(d), args.layers)
            out.append(run("Qwen2.5-0.5B shape" + (f" ({args.layers} layers)" if args.layers else ""), d, model,
                           step, kw, args.steps))
    print(f"\nload average at end: {os.getloadavg()}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
