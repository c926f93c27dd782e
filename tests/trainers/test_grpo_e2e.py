"""GRPO and PPO end to end on a tiny checkpoint: release, train, resume and sync every step.

The toy task's exact-answer reward is 0 for every sample of a random tiny model, so every GRPO
advantage would be 0 and the weights could not move. These tests swap in a reward that varies from
sample to sample (the completion's length in characters, / 32): groups then have nonzero advantages,
so the policy gradient is nonzero (asserted through `grad_norm`) and the weights must change.
Everything else is the real loop through the public `GRPOTrainer` / `PPOTrainer` API.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.config import PPOConfig, RLConfig
from trainers.grpo import GRPOTrainer
from trainers.ppo import PPOTrainer
from trainers.tasks import Task, make_toy_prompts

REPO = Path(__file__).resolve().parents[2]
PROBE = "model.layers.0.self_attn.q_proj.weight"
REQUIRED_KEYS = ("step", "reward_mean", "logprob_mismatch", "time_rollout", "time_train", "time_release",
                 "time_resume", "time_sync")


def length_reward(prompt: str, completion: str, answer: str) -> float:
    return len(completion) / 32


def run(trainer_cls, ckpt, output_dir, steps: int):
    """Train `steps` steps; returns (trainer, history, PROBE before training). Caller closes."""
    cfg = RLConfig(model=str(ckpt), steps=steps, prompts_per_step=4, group_size=4, no_wandb=True,
                   output_dir=str(output_dir), eval_every=0, lr=1e-2)
    trainer = trainer_cls(cfg)
    trainer.task = Task("length", make_toy_prompts, length_reward)
    before = trainer.policy.state_dict()[PROBE].detach().clone()
    try:
        history = trainer.train()
    except BaseException:
        trainer.close()
        raise
    return trainer, history, before


@pytest.fixture(scope="module")
def grpo(ckpt_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    trainer, history, before = run(GRPOTrainer, ckpt_factory("llama"), out, steps=3)
    yield trainer, history, before, out
    trainer.close()


def assert_trained(trainer, history, before, steps: int) -> None:
    """Each step released and resumed the engine and synced; metrics finite; weights changed and served."""
    assert [m["step"] for m in history] == list(range(1, steps + 1))
    for m in history:
        for key in REQUIRED_KEYS:
            assert key in m, key
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert m["mem_engine_train"] == 0  # the engine held nothing while the trainer trained
        assert m["mem_engine_rollout"] > 0
        assert min(m["time_release"], m["time_resume"], m["time_sync"]) > 0
        assert m["grad_norm"] > 0
        assert m["weight_version"] == ("default" if m["step"] == 1 else f"step-{m['step'] - 1}")
    after = trainer.policy.state_dict()[PROBE].detach()
    assert (after - before).abs().max() > 1e-4
    served = torch.tensor(trainer.engine.get_weights_by_name(PROBE, truncate_size=8))  # first 8 rows
    assert torch.equal(served, after[:8])
    out = trainer.engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 4})
    assert out[0]["meta_info"]["weight_version"] == f"step-{steps}"


def test_grpo_steps_release_resume_sync_and_change_weights(grpo):
    """Three GRPO steps: released/resumed/synced each step, finite metrics, new weights in the engine."""
    trainer, history, before, _ = grpo
    assert_trained(trainer, history, before, steps=3)


def test_grpo_writes_metrics_jsonl_and_plot(grpo):
    """metrics.jsonl holds one JSON object per step with the required keys; the PNG plot exists."""
    _, history, _, out = grpo
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert set(REQUIRED_KEYS) <= set(row)
        assert all(math.isfinite(row[k]) for k in REQUIRED_KEYS)
    png = out / "curves.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ppo_steps_change_weights(ckpt_factory, tmp_path):
    """Two PPO steps (value head + GAE): same phases, finite metrics, the policy's new weights served
    by the engine; the value head trains but never reaches the engine."""
    trainer, history, before = run(PPOTrainer, ckpt_factory("llama"), tmp_path, steps=2)
    try:
        assert_trained(trainer, history, before, steps=2)
        assert all("value_loss" in m for m in history)
        assert trainer.value_head.weight.abs().max() > 0  # zero-initialized, then trained
    finally:
        trainer.close()


def test_cli_help_lists_the_flags():
    """`python -m trainers.grpo --help` exits 0 and documents every flag the issue names."""
    proc = subprocess.run([sys.executable, "-m", "trainers.grpo", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--model", "--task", "--group-size", "--prompts-per-step", "--lr", "--kl-coef", "--steps",
                 "--device", "--engine-mem-fraction", "--bucket-mb", "--seed", "--output-dir", "--no-wandb"):
        assert flag in proc.stdout, flag


@pytest.mark.parametrize("field,value,flag", [
    ("steps", 0, "--steps"),
    ("prompts_per_step", 0, "--prompts-per-step"),
    ("group_size", 1, "--group-size"),
    ("lr", 0.0, "--lr"),
    ("kl_coef", -0.1, "--kl-coef"),
    ("temperature", 0.0, "--temperature"),
    ("device", "tpu", "--device"),
    ("engine_mem_fraction", 1.5, "--engine-mem-fraction"),
    ("bucket_mb", 0, "--bucket-mb"),
    ("lr", float("inf"), "--lr"),  # passed `lr > 0` once, and failed at the first weight sync
    ("temperature", float("inf"), "--temperature"),
    ("weight_decay", -1.0, "--weight-decay"),
    ("eval_every", -1, "--eval-every"),
    ("task", "foo", "--task"),
])  # fmt: skip
def test_invalid_config_names_the_flag(ckpt_factory, field, value, flag):
    """An invalid value raises ValueError whose message names the CLI flag to fix."""
    with pytest.raises(ValueError, match=flag):
        RLConfig(model=str(ckpt_factory("llama")), **{field: value})


def test_model_must_be_a_checkpoint_dir(tmp_path):
    """--model pointing at a directory without config.json is refused by name."""
    with pytest.raises(ValueError, match="--model"):
        RLConfig(model=str(tmp_path))


def test_grpo_with_the_engine_in_its_own_process(ckpt_factory, tmp_path):
    """--engine-process: the engine lives in a child process; two GRPO steps release, train, resume and sync
    through it (shared memory on the CPU) and it serves the trained weights."""
    import os

    from weight_sync.cross_process import RemoteEngine

    cfg = RLConfig(model=str(ckpt_factory("llama")), steps=2, prompts_per_step=4, group_size=4, no_wandb=True,
                   output_dir=str(tmp_path), eval_every=0, lr=1e-2, engine_process=True)
    trainer = GRPOTrainer(cfg)
    try:
        assert isinstance(trainer.engine, RemoteEngine) and trainer.engine.pid != os.getpid()
        trainer.task = Task("length", make_toy_prompts, length_reward)
        before = trainer.policy.state_dict()[PROBE].detach().clone()
        assert_trained(trainer, trainer.train(), before, steps=2)
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="--engine-process runs one engine"):
        RLConfig(model=cfg.model, engine_process=True, num_engines=2)


def test_ppo_applies_kl_coef(ckpt_factory, tmp_path):
    """--kl-coef adds PPO's k3 penalty to the initial policy (it had built the reference and never used it):
    with three updates in a step the policy moves off the reference, so kl_ref > 0 is reported and the loss
    differs from the same step without it; with kl_coef 0 no reference exists and no kl_ref is reported."""
    metrics = {}
    for kl in (0.0, 5.0):
        cfg = PPOConfig(model=str(ckpt_factory("llama")), steps=1, prompts_per_step=2, group_size=2, no_wandb=True,
                        output_dir=str(tmp_path / f"kl{kl}"), eval_every=0, lr=1e-2, kl_coef=kl,
                        updates_per_step=3, seed=0)
        trainer = PPOTrainer(cfg)
        trainer.task = Task("length", make_toy_prompts, length_reward)
        try:
            metrics[kl] = trainer.step(1)
        finally:
            trainer.close()
    assert "kl_ref" not in metrics[0.0]
    assert metrics[5.0]["kl_ref"] > 0 and math.isfinite(metrics[5.0]["kl_ref"])
    assert metrics[5.0]["loss"] != metrics[0.0]["loss"]


def test_grpo_in_bfloat16_learns_the_demo_task(tmp_path):
    """--dtype bfloat16 on the demo checkpoint: 20 GRPO steps at the default learning rate reach a greedy eval of
    >= 0.9 and a mean reward >= 0.8, as in fp32 (fp32 master weights; stepping bf16 parameters directly stalled at
    an eval of ~0.3: most updates rounded away)."""
    cfg = RLConfig(model=str(REPO / "assets" / "demo-model"), steps=20, eval_every=20, no_wandb=True,
                   output_dir=str(tmp_path), dtype="bfloat16", seed=0)
    trainer = GRPOTrainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    evals = [h["eval_accuracy"] for h in history if "eval_accuracy" in h]
    assert evals and evals[-1] >= 0.9, evals
    assert history[-1]["reward_mean"] >= 0.8, history[-1]["reward_mean"]
    assert next(trainer.policy.parameters()).dtype == torch.bfloat16  # the policy itself stays bf16
