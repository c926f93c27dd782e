"""LoRA benchmark: decode throughput of a batch spread over adapters vs the same batch on the base model
(the segmented LoRA formulation, the default, and the masked one beside it), and the bytes and time of an adapter-only sync vs a full weight update. Each figure is a ratio against
its peer, measured in the same run; the load average is printed (the machine may be shared).

    python bench/lora.py                       # 40M Qwen2 shape, 16 prompts over 4 adapters, 0.5B sync
    python bench/lora.py --preset tiny --skip-sync

Adapters are written by peft (random A and B, rank --rank, every target). The sync part builds the
Qwen2.5-0.5B shape with dummy weights (no checkpoint on disk) and pushes a random rank-`--rank`
adapter (flattened bucket, load_lora_adapter_from_tensors) against the full model (flattened buckets,
update_weights_from_tensor), both bf16.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import PRESETS, make_prompts, write_preset  # noqa: E402
from rollout import Engine  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(ckpt: Path, out: Path, num: int, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for i in range(num):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        torch.manual_seed(100 + i)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                init_lora_weights=False, task_type="CAUSAL_LM"))
        for n, p in peft.named_parameters():  # keep the adapted model's activations in range
            if "lora_B" in n:
                p.data.mul_(0.05)
        peft.save_pretrained(out / f"a{i}")
        paths[f"a{i}"] = str(out / f"a{i}")
    return paths


def throughput(args) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:  # checkpoint and adapters go with the run
        _throughput(args, Path(tmp))


def _throughput(args, work: Path) -> None:
    ckpt = write_preset(args.preset, "float32", work / "ckpt")
    adapters = write_adapters(ckpt, work, args.num_adapters, args.rank)
    vocab = PRESETS[args.preset].get("vocab_size", 32000)
    prompts = make_prompts(args.batch, args.prompt_len, min(vocab, 32000), seed=0)
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": args.output_len}
    names = [f"a{i % args.num_adapters}" for i in range(args.batch)]
    with Engine(str(ckpt), show_progress=False, lora_paths=adapters, max_lora_rank=args.rank,
                disable_radix_cache=True) as engine:
        engine.generate(input_ids=prompts[:2], sampling_params={**sp, "max_new_tokens": 4})  # warm up
        engine.generate(input_ids=prompts[:2], sampling_params={**sp, "max_new_tokens": 4}, lora_path=names[:2])
        manager = engine.runner.lora_manager
        runs = (("base", None, False), ("segmented", names, True), ("masked", names, False))
        times = {key: [] for key, _, _ in runs}
        for _ in range(args.repeat):  # interleaved, so drift in machine load hits every variant alike
            for key, lora, segmented in runs:
                manager.segmented = segmented
                t0 = time.perf_counter()
                engine.generate(input_ids=prompts, sampling_params=sp, lora_path=lora)
                times[key].append(time.perf_counter() - t0)
        manager.segmented = True
    toks = args.batch * args.output_len
    rate = {key: toks / min(t) for key, t in times.items()}
    print(f"throughput, preset {args.preset}, {args.batch} prompts {args.prompt_len} -> {args.output_len}, "
          f"{args.num_adapters} adapters rank {args.rank}, best of {args.repeat}, interleaved")
    print(f"  base model                  {rate['base']:9.1f} tok/s")
    print(f"  mixed adapters, segmented   {rate['segmented']:9.1f} tok/s   = {rate['segmented'] / rate['base']:.2f}x "
          f"base (the default; goal >= 0.8x)")
    print(f"  mixed adapters, masked      {rate['masked']:9.1f} tok/s   = {rate['masked'] / rate['base']:.2f}x base "
          f"(every row x every adapter)")
    print(f"  segmented / masked: {rate['segmented'] / rate['masked']:.2f}x")


def sync(args) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-lora-sync-") as tmp:
        _sync(args, Path(tmp))


def _sync(args, work: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from weight_sync.bucket import FlattenedTensorBucket

    cfg = Qwen2Config(**PRESETS["qwen2.5-0.5b"], bos_token_id=0, eos_token_id=1, use_sliding_window=False,
                      architectures=["Qwen2ForCausalLM"])
    cfg.save_pretrained(work)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Qwen2ForCausalLM(cfg).named_parameters()}
    full = [(n, torch.randn(s, dtype=torch.bfloat16) * 0.02) for n, s in shapes.items()]
    r = args.rank
    adapter = {}
    for n, s in shapes.items():
        target = n.split(".")[-2]
        if target in TARGETS and n.endswith(".weight"):
            base = "base_model.model." + n[: -len(".weight")]
            adapter[f"{base}.lora_A.weight"] = torch.randn(r, s[1], dtype=torch.bfloat16) * 0.01
            adapter[f"{base}.lora_B.weight"] = torch.randn(s[0], r, dtype=torch.bfloat16) * 0.01
    config = {"r": r, "lora_alpha": 2 * r, "target_modules": TARGETS, "peft_type": "LORA"}
    with Engine(str(work), load_format="dummy", dtype="bfloat16", show_progress=False, enable_lora=True,
                max_lora_rank=r, lora_target_modules=["all"], max_total_tokens=4096) as engine:
        lora_ms, full_ms = [], []
        for i in range(args.repeat):
            t0 = time.perf_counter()
            bucket = FlattenedTensorBucket(named_tensors=list(adapter.items()))
            res = engine.load_lora_adapter_from_tensors(f"v{i}", bucket.to_dict(), config, load_format="flattened_bucket")
            lora_ms.append((time.perf_counter() - t0) * 1e3)
            assert res.success, res.error_message
            engine.unload_lora_adapter(f"v{i}")
            t0 = time.perf_counter()
            fb = FlattenedTensorBucket(named_tensors=full)
            ok, msg = engine.update_weights_from_tensor(fb.to_dict(), load_format="flattened_bucket")
            full_ms.append((time.perf_counter() - t0) * 1e3)
            assert ok, msg
    lora_b = sum(t.numel() * t.element_size() for t in adapter.values())
    full_b = sum(t.numel() * t.element_size() for _, t in full)
    print(f"sync, Qwen2.5-0.5B shape bf16 (dummy weights), adapter rank {r} on {len(TARGETS)} targets, best of "
          f"{args.repeat} (bucket packing included)")
    print(f"  adapter  {lora_b / 2**20:9.2f} MB  {min(lora_ms):8.1f} ms")
    print(f"  full     {full_b / 2**20:9.2f} MB  {min(full_ms):8.1f} ms")
    print(f"  adapter / full: {lora_b / full_b:.4f} of the bytes, {min(lora_ms) / min(full_ms):.3f} of the time")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2-40m", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--skip-sync", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    if not args.skip_throughput:
        throughput(args)
    if not args.skip_sync:
        sync(args)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
