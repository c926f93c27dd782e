"""GRPO with --delta-sync: the engine serves exactly the policy's weights, and each step logs its bytes.

Oracle: every HF tensor read back from the engine equals the trainer's bf16 policy parameter bit for
bit after training (the policy is never written through the delta code, so they are independent).
The reward varies per sample (completion length) so the policy really moves, as in test_grpo_e2e.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainers.test_grpo_e2e import length_reward
from trainers.config import RLConfig
from trainers.grpo import GRPOTrainer
from trainers.tasks import Task, make_toy_prompts


def test_grpo_delta_sync_is_exact_and_logs_bytes(ckpt_factory, tmp_path):
    """--delta-sync --dtype bfloat16 --full-sync-every 3: full, delta, delta, full; bytes per step in
    metrics.jsonl; the engine ends holding the policy's exact bits."""
    cfg = RLConfig(model=str(ckpt_factory("llama")), steps=4, prompts_per_step=2, group_size=4, no_wandb=True,
                   output_dir=str(tmp_path), eval_every=0, lr=1e-3, dtype="bfloat16", delta_sync=True,
                   full_sync_every=3)
    trainer = GRPOTrainer(cfg)
    trainer.task = Task("length", make_toy_prompts, length_reward)
    try:
        history = trainer.train()
        assert [m["sync_full"] for m in history] == [1, 0, 0, 1]
        for m in history:
            assert 0 < m["sync_bytes"] <= m["sync_bytes_full"]
            if not m["sync_full"]:
                assert m["sync_bytes"] < m["sync_bytes_full"] and 0 < m["sync_changed_fraction"] < 1
        lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [ln["sync_bytes"] for ln in lines] == [m["sync_bytes"] for m in history]
        assert all("sync_bytes_full" in ln for ln in lines)
        for name, p in trainer.policy.named_parameters():
            got = torch.tensor(trainer.engine.get_weights_by_name(name, truncate_size=1 << 40))
            assert torch.equal(got.reshape(p.shape).to(torch.bfloat16).view(torch.int16),
                               p.detach().view(torch.int16)), name
    finally:
        trainer.close()


def test_full_sync_every_needs_delta_sync(ckpt_factory):
    """--full-sync-every without --delta-sync is refused by name."""
    with pytest.raises(ValueError, match="--full-sync-every"):
        RLConfig(model=str(ckpt_factory("llama")), full_sync_every=2)
