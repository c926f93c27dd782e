"""Build assets/demo-model: a 1.2M-parameter Llama that half-knows single-digit addition.

The README demo trains this model with GRPO on the "toy" task (trainers/tasks.py: "3+4=" -> "7")
and must show learning on a CPU within a minute or two, so the checkpoint starts from a
deliberately *partial* skill, made in two supervised stages on all 100 prompts (full batch):

1. learn:   clean labels until the model is nearly perfect (sampled accuracy ~0.99);
2. unlearn: a few small AdamW steps towards the consistent mistake "a + b + 1", stopped as soon as
            the expected sampled accuracy (temperature 1.0) falls to --target-acc (0.3).

The result always answers in the right form (digits, then eos), puts ~27% of its probability on
the right sum and most of the rest on the sum plus one (so its greedy answer is usually wrong
too), and the damage is a small weight delta with one consistent direction: GRPO at a typical RL
learning rate (3e-6 .. 3e-5) undoes it in 5-30 steps, while shuffled rewards do not (accuracy
drifts to ~0.4 in 30 steps) and negated advantages drive it to 0. Learning rates of 3e-4 and up
wreck it, as they would a fine-tuned LLM.

What this script deliberately does not do: download anything, or train the model to be good.

    python scripts/make_demo_model.py                # writes assets/demo-model/ (~4.8 MB)
"""

import argparse
import json
import math
import string
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainers.tasks import all_toy_prompts, toy_reward  # noqa: E402

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level: one token per printable ASCII character or newline, plus 4 specials.

    A BPE model with no merges splits text into single characters; `Fuse` decodes by plain
    concatenation, so decode(encode(s)) == s. Encoding prepends <s> (like Llama tokenizers).
    """
    chars = list(string.printable[:95]) + ["\n"]  # digits, letters, punctuation, space, newline
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens([PAD, BOS, EOS, UNK])
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=128,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=math.ceil(len(tokenizer) / 8) * 8,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 64: a size every attention kernel supports
        num_key_value_heads=2,  # GQA, group size 2
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).float()


def encode_examples(tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [batch, seq] input ids and labels (-100 everywhere but answer + eos)."""
    rows = []
    for prompt, answer in pairs:
        prompt_ids = tokenizer(prompt)["input_ids"]  # <s> + characters
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, labels


def addition_batch(tokenizer, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All 100 prompts, each labelled with (a + b + offset): offset 0 is the truth."""
    pairs = [(x["prompt"], str(int(x["answer"]) + offset)) for x in all_toy_prompts()]
    return encode_examples(tokenizer, pairs)


def train_step(model, opt, input_ids, labels) -> float:
    model.train()
    loss = model(input_ids=input_ids, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    model.eval()
    return loss.item()


@torch.no_grad()
def exact_sampled_accuracy(model, tokenizer) -> float:
    """Expected accuracy at temperature 1.0 over all 100 prompts: mean P(answer + eos | prompt),
    computed by teacher forcing (exact, no sampling noise)."""
    items = all_toy_prompts()
    input_ids, labels = encode_examples(tokenizer, [(x["prompt"], x["answer"]) for x in items])
    logits = model(input_ids=input_ids).logits[:, :-1]  # [batch, seq-1, vocab]
    targets = labels[:, 1:]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    seq_logp = (logp * (targets != -100)).sum(-1)  # [batch]
    return seq_logp.exp().mean().item()


@torch.no_grad()
def generate_stats(model, tokenizer, num_samples: int, do_sample: bool, seed: int) -> dict[str, float]:
    """HF `generate` over all 100 prompts (num_samples each, temperature 1.0 or greedy): the
    accuracy, the fraction of well-formed completions (digits, then eos) and of off-by-one ones."""
    torch.manual_seed(seed)
    items = all_toy_prompts()
    enc = tokenizer([x["prompt"] for x in items], return_tensors="pt", padding=True)
    num_return = num_samples if do_sample else 1
    out = model.generate(
        **enc,
        do_sample=do_sample,
        temperature=1.0 if do_sample else None,
        top_k=0 if do_sample else None,
        max_new_tokens=4,
        num_return_sequences=num_return,
        pad_token_id=tokenizer.pad_token_id,
    )
    completions = out[:, enc["input_ids"].shape[1] :].tolist()  # [num_prompts * num_return, <=4]
    stats = {"accuracy": 0.0, "well_formed": 0.0, "off_by_one": 0.0}
    for i, ids in enumerate(completions):
        item = items[i // num_return]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        stats["accuracy"] += toy_reward(item["prompt"], text)
        stats["well_formed"] += tokenizer.eos_token_id in ids and text.isdigit()
        stats["off_by_one"] += text == str(int(item["answer"]) + 1)
    return {k: v / len(completions) for k, v in stats.items()}


def warm_start(model, tokenizer, args, start: float) -> int:
    """The two-stage supervised warm start shared by the demo models; returns the unlearn steps taken."""
    # Stage 1: learn addition (full batch, clean labels) until the model is nearly perfect.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / args.learn_steps)))
    )
    input_ids, labels = addition_batch(tokenizer, offset=0)
    for step in range(args.learn_steps):
        train_step(model, opt, input_ids, labels)
        sched.step()
        if step % 50 == 49 or step == args.learn_steps - 1:
            acc = exact_sampled_accuracy(model, tokenizer)
            print(f"learn   step {step:4d}  expected sampled acc {acc:.3f}  ({time.time() - start:.0f}s)")

    # Stage 2: a deliberately partial fine-tune towards "a + b + 1", stopped as soon as the
    # expected sampled accuracy falls to --target-acc. The damage is a small weight delta with
    # one consistent direction, which is what lets RL undo it in a few dozen steps.
    opt = torch.optim.AdamW(model.parameters(), lr=args.unlearn_lr, weight_decay=0.0, betas=(0.9, 0.98))
    input_ids, labels = addition_batch(tokenizer, offset=1)
    unlearn_steps = 0
    while (acc := exact_sampled_accuracy(model, tokenizer)) > args.target_acc:
        if unlearn_steps == args.max_unlearn_steps:
            raise RuntimeError(
                f"accuracy still {acc:.3f} after {unlearn_steps} unlearn steps; raise --unlearn-lr"
            )
        train_step(model, opt, input_ids, labels)
        unlearn_steps += 1
    print(f"unlearn: {unlearn_steps} steps  expected sampled acc {acc:.3f}  ({time.time() - start:.0f}s)")
    return unlearn_steps


def parse_args(description: str, out_dir: str, learn_steps: int, lr: float, max_unlearn_steps: int):
    """The command line both demo-model scripts share (only the defaults differ)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "assets" / out_dir))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learn-steps", type=int, default=learn_steps)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--unlearn-lr", type=float, default=1e-5)
    parser.add_argument("--max-unlearn-steps", type=int, default=max_unlearn_steps)
    parser.add_argument("--target-acc", type=float, default=0.3)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return args


def describe(model, tokenizer) -> None:
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M params, vocab {model.config.vocab_size} (tokenizer {len(tokenizer)})")


def main() -> None:
    args = parse_args(__doc__, "demo-model", learn_steps=250, lr=1e-3, max_unlearn_steps=200)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    describe(model, tokenizer)

    start = time.time()

    unlearn_steps = warm_start(model, tokenizer, args, start)
    model.eval()

    exact = exact_sampled_accuracy(model, tokenizer)
    sampled = generate_stats(model, tokenizer, num_samples=20, do_sample=True, seed=args.seed)
    greedy = generate_stats(model, tokenizer, num_samples=1, do_sample=False, seed=args.seed)["accuracy"]
    print(
        f"starting accuracy: sampled at T=1.0 {sampled['accuracy']:.3f} over 2000 samples (exact expectation "
        f"{exact:.3f}; well-formed {sampled['well_formed']:.3f}, off-by-one {sampled['off_by_one']:.3f}), "
        f"greedy {greedy:.3f}"
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        max_new_tokens=4,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "warm_start.json").write_text(
        json.dumps(
            {
                "task": "toy",
                "seed": args.seed,
                "learn_steps": args.learn_steps,
                "lr": args.lr,
                "unlearn_lr": args.unlearn_lr,
                "unlearn_steps": unlearn_steps,
                "target_acc": args.target_acc,
                "sampled_accuracy_t1": round(exact, 4),
                "greedy_accuracy": greedy,
            },
            indent=2,
        )
        + "\n"
    )
    for path in sorted(out.iterdir()):
        print(f"  {path.name:28s} {path.stat().st_size / 1024:8.1f} KiB")
    print(f"wrote {out} in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
