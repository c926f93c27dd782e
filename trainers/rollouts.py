"""Rollout phase helpers shared by GRPO and PPO: sample G completions per prompt through the Engine
API, score them with the task's reward, and pack an Experience (with the routed experts of every
sample, for routing replay, when asked). Uses only public Engine methods."""

from __future__ import annotations

import random

import torch

from trainers.experience import Experience
from trainers.losses import group_advantages
from trainers.routing_replay import decode_routed_experts, pack_routed_experts
from trainers.tasks import Task, all_toy_prompts


def tokenize_prompts(tokenizer, prompts: list[dict]) -> list[list[int]]:
    return [tokenizer(p["prompt"])["input_ids"] for p in prompts]


def collect_experience(engine, tokenizer, task: Task, prompts: list[dict], group_size: int, temperature: float,
                       max_new_tokens: int, pad_token_id: int,
                       routed_experts_shape: tuple[int, int] | None = None,
                       lora_path: str | None = None) -> tuple[Experience, dict]:
    """Sample, score and pack one step's experience. With `routed_experts_shape` = (num_layers, top_k) of
    a MoE policy, the engine also returns each sample's routed experts, packed into exp.routed_experts."""
    prompt_ids = tokenize_prompts(tokenizer, prompts)
    extra = {"return_routed_experts": True} if routed_experts_shape is not None else {}
    if lora_path is not None:  # the policy is a LoRA adapter version loaded in the engine
        extra["lora_path"] = lora_path
    outs = engine.generate(
        input_ids=prompt_ids,
        sampling_params={"n": group_size, "temperature": temperature, "max_new_tokens": max_new_tokens},
        return_logprob=True,
        **extra,
    )  # n-expanded, prompt-major: outs[i * G + j] is sample j of prompt i
    expanded = [(prompts[i // group_size], prompt_ids[i // group_size]) for i in range(len(outs))]
    rewards = [task.reward(p["prompt"], tokenizer.decode(o["output_ids"], skip_special_tokens=True), p["answer"])
               for (p, _), o in zip(expanded, outs)]
    exp = Experience.from_rollouts(
        prompt_ids=[ids for _, ids in expanded],
        completion_ids=[o["output_ids"] for o in outs],
        completion_logprobs=[[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs],
        rewards=rewards,
        pad_token_id=pad_token_id,
    )
    exp.advantages = group_advantages(exp.rewards, group_size)
    if routed_experts_shape is not None:
        routed = [decode_routed_experts(o["meta_info"]["routed_experts"], *routed_experts_shape) for o in outs]
        exp.routed_experts = pack_routed_experts(routed, exp.input_ids.shape[1])
    stats = {
        # float64: equal non-dyadic rewards would show a float32 rounding std (~1e-8) instead of ~0
        "reward_mean": float(exp.rewards.double().mean()),
        "reward_std": float(exp.rewards.double().std()) if len(rewards) > 1 else 0.0,
        "completion_len_mean": float(exp.completion_mask.sum(1).float().mean()),
        "weight_version": outs[0]["meta_info"]["weight_version"],
        "cache_hit_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
    }
    return exp, stats


def eval_prompts(task: Task, seed: int = 12345) -> list[dict]:
    return all_toy_prompts() if task.name == "toy" else task.make_prompts(64, random.Random(seed))


def greedy_accuracy(engine, tokenizer, task: Task, prompts: list[dict], max_new_tokens: int,
                    lora_path: str | None = None) -> float:
    extra = {} if lora_path is None else {"lora_path": lora_path}
    outs = engine.generate(input_ids=tokenize_prompts(tokenizer, prompts),
                           sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens}, **extra)
    texts = [tokenizer.decode(o["output_ids"], skip_special_tokens=True) for o in outs]
    return float(torch.tensor([task.reward(p["prompt"], t, p["answer"]) for p, t in zip(prompts, texts)]).mean())
