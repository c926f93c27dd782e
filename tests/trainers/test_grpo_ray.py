"""GRPO with two engines on Ray: every step syncs both, and both serve the trainer's exact policy.

Oracle: after training, a fresh in-process Engine on the trainer's own weights (written with HF's
`save_pretrained`) gives the same greedy tokens as each engine actor of the group.
"""

from __future__ import annotations

import pytest
import torch

from rollout import Engine
from tests.rollout.oracle import random_prompts
from trainers.config import RLConfig
from trainers.grpo import GRPOTrainer
from trainers.tasks import Task, make_toy_prompts

ray = pytest.importorskip("ray")


def length_reward(prompt: str, completion: str, answer: str) -> float:
    return len(completion) / 32  # varies per sample, so advantages (and the update) are nonzero


def test_grpo_two_engines_stay_on_policy(ckpt_factory, tmp_path):
    """Rollouts spread over 2 engines; after 3 steps both hold the trainer's weights (greedy = fresh engine)."""
    cfg = RLConfig(model=str(ckpt_factory("llama")), steps=3, prompts_per_step=4, group_size=4, no_wandb=True,
                   output_dir=str(tmp_path / "run"), eval_every=0, lr=1e-2, num_engines=2)
    trainer = GRPOTrainer(cfg)
    try:
        trainer.task = Task("length", make_toy_prompts, length_reward)
        history = trainer.train()
        assert [m["step"] for m in history] == [1, 2, 3]
        for m in history:
            assert m["logprob_mismatch"] < 1e-4, m  # rollout logprobs came from the synced policy
        assert trainer.engine.weight_version == "step-3"
        trainer.policy.save_pretrained(tmp_path / "policy")
        prompts = random_prompts([4, 7], seed=5, high=60)
        params = {"temperature": 0.0, "max_new_tokens": 5}
        with Engine(str(tmp_path / "policy"), show_progress=False, max_total_tokens=512) as fresh:
            want = [o["output_ids"] for o in fresh.generate(input_ids=prompts, sampling_params=params)]
        for i, handle in enumerate(trainer.engine.handles):
            got = ray.get(handle.call.remote("generate", (), dict(input_ids=prompts, sampling_params=params)),
                          timeout=120)
            assert [o["output_ids"] for o in got] == want, f"engine {i}"
        assert all(torch.isfinite(torch.tensor(m["loss"])) for m in history)
    finally:
        trainer.close()
        ray.shutdown()
