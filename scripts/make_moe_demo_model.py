"""Build assets/moe-demo-model: a ~0.4M-parameter Qwen3-MoE that half-knows single-digit addition.

The MoE twin of scripts/make_demo_model.py (same character tokenizer, same two-stage warm start on
the toy task, reused from that script): learn addition until nearly perfect, then a few small steps
towards the consistent mistake "a + b + 1" until the expected sampled accuracy falls to
--target-acc. Two decoder layers, both sparse: 8 experts, top-2, renormalised top-k weights
(norm_topk_prob, as the released Qwen3-MoE models), so every token goes through a router whose
choice the engine reports and the trainer can replay:

    python -m trainers.grpo --model assets/moe-demo-model --routing-replay --no-wandb

Shipped rather than generated at first run: it is 1.7 MB, building it takes minutes of CPU, and a
checked-in file makes the demo's starting point the same for everyone. What this script
deliberately does not do: download anything, or train the model to be good.

    python scripts/make_moe_demo_model.py        # writes assets/moe-demo-model/ (~1.7 MB)
"""

import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_demo_model import (  # noqa: E402
    addition_batch,
    build_tokenizer,
    describe,
    exact_sampled_accuracy,
    generate_stats,
    parse_args,
    warm_start,
)

NUM_EXPERTS = 8
TOP_K = 2


def build_model(tokenizer, seed: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=math.ceil(len(tokenizer) / 8) * 8,
        hidden_size=128,
        intermediate_size=256,  # only for dense layers; there are none
        moe_intermediate_size=48,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3MoeForCausalLM(config).float()


@torch.no_grad()
def expert_load(model, tokenizer) -> list[list[int]]:
    """Per layer, how many (token, slot) choices of the 100 prompts + answers pick each expert."""
    input_ids, _ = addition_batch(tokenizer, offset=0)
    out = model(input_ids=input_ids, output_router_logits=True)
    return [torch.bincount(torch.topk(logits.float(), TOP_K, dim=-1).indices.reshape(-1),
                           minlength=NUM_EXPERTS).tolist() for logits in out.router_logits]


def main() -> None:
    args = parse_args(__doc__, "moe-demo-model", learn_steps=300, lr=2e-3, max_unlearn_steps=300)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    describe(model, tokenizer)
    start = time.time()

    unlearn_steps = warm_start(model, tokenizer, args, start)  # the Llama demo's two stages
    model.eval()

    exact = exact_sampled_accuracy(model, tokenizer)
    sampled = generate_stats(model, tokenizer, num_samples=20, do_sample=True, seed=args.seed)
    greedy = generate_stats(model, tokenizer, num_samples=1, do_sample=False, seed=args.seed)["accuracy"]
    load = expert_load(model, tokenizer)
    print(f"starting accuracy: sampled at T=1.0 {sampled['accuracy']:.3f} (exact expectation {exact:.3f}; "
          f"well-formed {sampled['well_formed']:.3f}, off-by-one {sampled['off_by_one']:.3f}), greedy {greedy:.3f}")
    print(f"expert load per layer (token-slots per expert): {load}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0,
                                               max_new_tokens=4)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "warm_start.json").write_text(json.dumps({
        "task": "toy", "seed": args.seed, "learn_steps": args.learn_steps, "lr": args.lr,
        "unlearn_lr": args.unlearn_lr, "unlearn_steps": unlearn_steps, "target_acc": args.target_acc,
        "sampled_accuracy_t1": round(exact, 4), "greedy_accuracy": greedy, "expert_load": load,
    }, indent=2) + "\n")
    for path in sorted(out.iterdir()):
        print(f"  {path.name:28s} {path.stat().st_size / 1024:8.1f} KiB")
    print(f"wrote {out} in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
