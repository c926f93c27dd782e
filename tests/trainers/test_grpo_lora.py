"""GRPO with --lora-rank end to end: only the adapter trains and only the adapter is synced, each step as a
new adapter version (the previous one unloaded); the engine under the current version generates what
the trainer's PeftModel generates (tp_size 1 and 2); the mismatch metric stays measured; refusals are by
name."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.oracle import hf_generate, random_prompts
from tests.trainers.test_grpo_e2e import PROBE, length_reward
from trainers.config import RLConfig
from trainers.grpo import GRPOTrainer
from trainers.tasks import Task, make_toy_prompts

STEPS = 3
BASE_PROBE = PROBE.replace(".weight", ".base_layer.weight")  # peft wraps the projection it adapts


@pytest.fixture(scope="module")
def lora_run(ckpt_factory, tmp_path_factory):
    ckpt = ckpt_factory("llama")
    cfg = RLConfig(model=str(ckpt), steps=STEPS, prompts_per_step=4, group_size=4, no_wandb=True, eval_every=0,
                   output_dir=str(tmp_path_factory.mktemp("grpo-lora")), lr=1e-2, lora_rank=8)
    trainer = GRPOTrainer(cfg)
    trainer.task = Task("length", make_toy_prompts, length_reward)
    base_before = trainer.policy.get_base_model().state_dict()[BASE_PROBE].detach().clone()
    try:
        history = trainer.train()
        yield trainer, history, base_before
    finally:
        trainer.close()


def test_only_the_adapter_trains_and_syncs(lora_run):
    """Base weights stay; the adapter moves; one adapter version is loaded, named after the last step;
    each sync sends the adapter's bytes, far fewer than the full model's."""
    trainer, history, base_before = lora_run
    torch.testing.assert_close(trainer.policy.get_base_model().state_dict()[BASE_PROBE], base_before, atol=0, rtol=0)
    b = [p for n, p in trainer.policy.named_parameters() if "lora_B" in n]
    assert b and any(p.abs().max() > 0 for p in b)  # B starts at zero: training moved it
    assert all(m["grad_norm"] > 0 for m in history)
    assert list(trainer.engine.runner.lora_adapters()) == [f"policy-step-{STEPS}"]
    full = sum(p.numel() * p.element_size() for p in trainer.policy.get_base_model().parameters())
    adapter = sum(p.numel() * p.element_size() for n, p in trainer.policy.named_parameters() if "lora_" in n)
    assert all(m["sync_bytes"] == adapter for m in history)  # the adapter, every tensor once, nothing else
    assert adapter < full / 4
    assert all(m["logprob_mismatch"] < 1e-3 for m in history)


def _assert_engine_equals_peft(trainer, model, prompt: list[int]) -> None:
    """6 greedy tokens under the trainer's current adapter version equal the PeftModel's, logprobs to 1e-4."""
    ids, lps = hf_generate(model, prompt, 6)
    out = trainer.engine.generate(input_ids=prompt, return_logprob=True, lora_path=trainer.lora_path,
                                  sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    assert out["output_ids"] == ids
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, torch.tensor(lps), atol=1e-4, rtol=0)


def test_engine_serves_the_trainers_adapter(lora_run):
    """Greedy generation under the current adapter version equals the trainer's PeftModel (HF + peft)."""
    trainer, _, _ = lora_run
    model = trainer.policy.eval()
    for prompt in random_prompts([5, 11], seed=9):
        _assert_engine_equals_peft(trainer, model, prompt)


def test_lora_refusals(ckpt_factory):
    """--deterministic with --lora-rank is refused by name."""
    ckpt = str(ckpt_factory("llama"))
    with pytest.raises(ValueError, match="--deterministic with --lora-rank"):
        RLConfig(model=ckpt, lora_rank=8, deterministic=True)


def test_lora_with_tp2_serves_the_trainers_adapter(ckpt_factory, tmp_path):
    """--lora-rank with --tp-size 2: each step's adapter version reaches both ranks (same uid), the previous one
    is unloaded on both, and the tp=2 engine generates what the trainer's PeftModel generates."""
    ckpt = ckpt_factory("llama")
    cfg = RLConfig(model=str(ckpt), steps=2, prompts_per_step=2, group_size=2, no_wandb=True, eval_every=0,
                   output_dir=str(tmp_path), lr=1e-2, lora_rank=4, tp_size=2)
    trainer = GRPOTrainer(cfg)
    trainer.task = Task("length", make_toy_prompts, length_reward)
    try:
        history = trainer.train()
        assert all(m["logprob_mismatch"] < 1e-3 for m in history)
        per_rank = trainer.engine.runner.rank_lora_adapters()
        assert [list(r) for r in per_rank] == [["policy-step-2"]] * 2 and per_rank[0] == per_rank[1]
        model = trainer.policy.eval()
        prompt = random_prompts([7], seed=4)[0]
        _assert_engine_equals_peft(trainer, model, prompt)
    finally:
        trainer.close()


def test_lora_on_a_moe_policy_adapts_attention_and_serves_it(tmp_path):
    """--lora-rank on a Qwen3-MoE policy wraps the attention projections only (peft would put gate/up/down on
    the fused experts, an adapter the engine refuses: the run died at step 0), trains, and the engine under the
    adapter generates what the trainer's PeftModel generates."""
    from tests.moe_checkpoints import make_moe_checkpoint

    ckpt = make_moe_checkpoint(tmp_path / "moe", "qwen3_moe")
    cfg = RLConfig(model=str(ckpt), steps=1, prompts_per_step=2, group_size=2, no_wandb=True, eval_every=0,
                   output_dir=str(tmp_path / "run"), lr=1e-2, lora_rank=4)
    trainer = GRPOTrainer(cfg)
    trainer.task = Task("length", make_toy_prompts, length_reward)
    try:
        history = trainer.train()
        adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in trainer.policy.named_parameters() if "lora_" in n}
        assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
        assert history and all(m["logprob_mismatch"] < 1e-3 for m in history)
        _assert_engine_equals_peft(trainer, trainer.policy.eval(), random_prompts([7], seed=4)[0])
    finally:
        trainer.close()
