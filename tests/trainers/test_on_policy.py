"""On-policy check: right after a sync, the trainer's logprobs are the engine's rollout logprobs.

The engine (our runner) and the trainer (a plain transformers model) are independent implementations;
on fp32 CPU, after `sync_weights`, the trainer's recomputed logprob of every sampled token must match
the logprob the engine reported when it sampled it (max abs diff <= 1e-4, so the importance ratio
exp(old - rollout) is 1), at the sampling temperature, before and after an optimizer step.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer

from rollout import Engine
from trainers.losses import masked_mean
from trainers.policy import load_policy, policy_logprobs
from trainers.rollouts import collect_experience
from trainers.tasks import get_task, make_toy_prompts
from weight_sync import sync_weights

TOL = 1e-4
GROUP_SIZE = 4
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("qwen2")  # biases and a separate lm_head: every kind of tensor moves


def rollout(engine, tokenizer, temperature: float, seed: int):
    """Sampled completions with the engine's logprobs, as the trainers build them."""
    prompts = make_toy_prompts(4, random.Random(seed))
    exp, _ = collect_experience(engine, tokenizer, get_task("toy"), prompts, GROUP_SIZE, temperature,
                                MAX_NEW_TOKENS, tokenizer.pad_token_id)
    assert exp.completion_mask.sum() >= len(exp)  # every sample has at least one scored token
    return exp


def gap(policy, exp, temperature: float) -> tuple[float, float]:
    """(max |trainer - rollout| logprob, max |IS ratio - 1|) over the sampled tokens."""
    with torch.no_grad():
        old = policy_logprobs(policy, exp, temperature)
    mask = exp.completion_mask.bool()
    diff = (old - exp.rollout_logprobs)[mask]
    return float(diff.abs().max()), float((diff.exp() - 1).abs().max())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_equal_rollout_logprobs_after_sync(ckpt, temperature):
    """After a sync the trainer reproduces the engine's sampled-token logprobs (<= 1e-4, IS ratio 1),
    and again after an optimizer step and a second sync; before a sync they differ."""
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    torch.manual_seed(0)
    policy = load_policy(str(ckpt), "cpu")
    with torch.no_grad():  # the trainer's weights start somewhere the engine has never been
        for p in policy.parameters():
            p.add_(0.3 * p.std().clamp_min(0.05) * torch.randn_like(p))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    with Engine(str(ckpt), show_progress=False, max_total_tokens=2048, random_seed=0) as engine:
        stale = rollout(engine, tokenizer, temperature, seed=0)
        assert gap(policy, stale, temperature)[0] > 1e-2  # the check below can fail

        ok, msg = sync_weights(policy, engine)
        assert ok, msg
        exp = rollout(engine, tokenizer, temperature, seed=1)
        max_diff, max_ratio_err = gap(policy, exp, temperature)
        assert max_diff <= TOL and max_ratio_err <= TOL, (max_diff, max_ratio_err)

        # One optimizer step (maximize the sampled tokens' likelihood: a nonzero gradient) moves the
        # weights; the engine is stale until the next sync.
        loss = -masked_mean(policy_logprobs(policy, exp, temperature), exp.completion_mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert gap(policy, exp, temperature)[0] > 1e-2

        ok, msg = sync_weights(policy, engine)
        assert ok, msg
        exp = rollout(engine, tokenizer, temperature, seed=2)
        max_diff, max_ratio_err = gap(policy, exp, temperature)
        assert max_diff <= TOL and max_ratio_err <= TOL, (max_diff, max_ratio_err)
