"""True on-policy (issue 15): with --deterministic the trainer's logprobs are torch.equal to the engine's
for every sampled token of a GRPO step, in fp32 and bf16, before and after an update + weight sync;
they are the HF policy's logprobs to rounding, and their gradient reaches the HF parameters."""

from __future__ import annotations

import pytest
import torch

from trainers.config import DEMO_MODEL, RLConfig
from trainers.deterministic import RunnerPolicy, deterministic_sequence_logprobs
from trainers.grpo import GRPOTrainer
from trainers.losses import sequence_logprobs
from trainers.policy import load_policy
from trainers.rollouts import collect_experience


def _trainer(tmp_path, dtype: str) -> GRPOTrainer:
    cfg = RLConfig(steps=1, prompts_per_step=6, group_size=4, max_new_tokens=6, temperature=0.9, eval_every=0,
                   deterministic=True, dtype=dtype, no_wandb=True, output_dir=str(tmp_path / "run"), lr=1e-3)
    return GRPOTrainer(cfg)


def _rollout(trainer: GRPOTrainer):
    cfg = trainer.cfg
    prompts = trainer.task.make_prompts(cfg.prompts_per_step, trainer.rng)
    exp, _ = collect_experience(trainer.engine, trainer.tokenizer, trainer.task, prompts, cfg.group_size,
                                cfg.temperature, cfg.max_new_tokens, trainer.pad_id)
    return exp


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_logprobs_equal_engine_every_token(tmp_path, dtype):
    """Every sampled token's trainer logprob is torch.equal to the engine's, before and after a GRPO update."""
    trainer = _trainer(tmp_path, dtype)
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


def test_runner_view_matches_hf_and_backpropagates():
    """The runner-model view computes the HF policy's logprobs (to 1e-5) and its gradient lands on HF params."""
    policy = load_policy(DEMO_MODEL, "cpu")
    view = RunnerPolicy(policy, DEMO_MODEL)
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
