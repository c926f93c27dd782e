"""True on-policy (issue 15): with --deterministic the trainer's logprobs are torch.equal to the engine's
for every sampled token of a GRPO step, in fp32 and bf16, before and after an update + weight sync;
they are the HF policy's logprobs to rounding, and their gradient reaches the HF parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainers.config import DEMO_MODEL, RLConfig
from trainers.deterministic import RunnerPolicy, deterministic_sequence_logprobs
from trainers.grpo import GRPOTrainer
from trainers.losses import sequence_logprobs
from trainers.policy import load_policy
from trainers.rollouts import collect_experience

MOE_DEMO_MODEL = str(Path(DEMO_MODEL).parent / "moe-demo-model")


def _trainer(tmp_path, dtype: str, model: str = DEMO_MODEL) -> GRPOTrainer:
    # The MoE demo is more confident: a hotter, wider step so some group has mixed rewards (a gradient).
    hot = model == MOE_DEMO_MODEL
    cfg = RLConfig(steps=1, prompts_per_step=12 if hot else 6, group_size=4, max_new_tokens=6,
                   temperature=1.5 if hot else 0.9, eval_every=0,
                   deterministic=True, dtype=dtype, no_wandb=True, output_dir=str(tmp_path / "run"), lr=1e-3,
                   model=model)
    return GRPOTrainer(cfg)


def _rollout(trainer: GRPOTrainer):
    cfg = trainer.cfg
    prompts = trainer.task.make_prompts(cfg.prompts_per_step, trainer.rng)
    exp, _ = collect_experience(trainer.engine, trainer.tokenizer, trainer.task, prompts, cfg.group_size,
                                cfg.temperature, cfg.max_new_tokens, trainer.pad_id)
    return exp


@pytest.mark.parametrize("dtype,model", [("float32", DEMO_MODEL), ("bfloat16", DEMO_MODEL),
                                         ("float32", MOE_DEMO_MODEL)], ids=["dense-fp32", "dense-bf16", "moe-fp32"])
def test_trainer_logprobs_equal_engine_every_token(tmp_path, dtype, model):
    """Every sampled token's trainer logprob is torch.equal to the engine's, before and after a GRPO update
    (the dense demo and the MoE demo)."""
    trainer = _trainer(tmp_path, dtype, model)
    try:
        for when in ("initial weights", "after one update + sync"):
            exp = _rollout(trainer)
            mask = exp.completion_mask.bool()
            assert mask.sum() >= 24
            with torch.no_grad():
                trainer_lp = trainer.logprobs(trainer.policy, exp)
            assert torch.equal(trainer_lp[mask], exp.rollout_logprobs[mask]), \
                f"{dtype}, {when}: max diff {(trainer_lp[mask] - exp.rollout_logprobs[mask]).abs().max()}"
            if when == "initial weights":
                before = trainer.policy.lm_head.weight.detach().clone()
                m = trainer.step(1)  # rollout, train (weights change), sync back to the engine
                assert m["logprob_mismatch"] == 0.0
                assert not torch.equal(trainer.policy.lm_head.weight.detach(), before), "the update changed nothing"
    finally:
        trainer.close()


@pytest.mark.parametrize("model", [DEMO_MODEL, MOE_DEMO_MODEL], ids=["dense", "moe"])
def test_runner_view_matches_hf_and_backpropagates(model):
    """The runner-model view computes the HF policy's logprobs (to 1e-5) and its gradient lands on HF params
    (on an MoE policy, on the experts' own HF tensors too)."""
    policy = load_policy(model, "cpu")
    view = RunnerPolicy(policy, model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 20, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    mask[2, 4:] = 0
    got = deterministic_sequence_logprobs(view, ids, mask, 0.9)
    hf = sequence_logprobs(policy(input_ids=ids, attention_mask=mask).logits, ids, 0.9)
    keep = mask.bool()
    keep[:, 0] = False
    torch.testing.assert_close(got[keep], hf[keep], atol=1e-5, rtol=1e-5)
    assert (got[~mask.bool()] == 0).all()
    got[keep].sum().backward()
    q = policy.model.layers[0].self_attn.q_proj.weight.grad
    assert q is not None and q.abs().sum() > 0
    assert policy.model.embed_tokens.weight.grad.abs().sum() > 0
    if model == MOE_DEMO_MODEL:
        mlp = policy.model.layers[0].mlp
        assert mlp.gate.weight.grad.abs().sum() > 0  # the router
        experts = mlp.experts
        grads = [p.grad for n, p in experts.named_parameters() if p.grad is not None]
        assert grads and sum(g.abs().sum() for g in grads) > 0
