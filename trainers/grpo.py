"""GRPO, co-located: one process alternates the device between the rollout engine and the trainer.

One iteration, top to bottom (`GRPOTrainer.step`):
  generate G samples per prompt with logprobs -> score -> release engine memory -> recompute
  logprobs with the trainer -> loss and optimizer step -> resume engine weights -> sync -> resume
  KV cache.
The rollout/trainer logprob mismatch is logged every step and corrected by truncated importance
sampling. Run `python -m trainers.grpo --help`; the defaults train the shipped demo model on the toy
task on the CPU. Does not do multi-GPU training or tensor-parallel engines.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict

import torch

from rollout import Engine
from trainers.config import RLConfig
from trainers.losses import kl_k3, logprob_mismatch, masked_mean, policy_loss
from trainers.metrics import MetricsLogger
from trainers.policy import TrainerMemory, load_policy, policy_logprobs
from trainers.rollouts import collect_experience, eval_prompts, greedy_accuracy
from trainers.tasks import get_task
from weight_sync import sync_weights

ENGINE_RESUME_AFTER_SYNC = ["kv_cache", "cuda_graph"]


class GRPOTrainer:
    def __init__(self, cfg: RLConfig) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)
        self.task = get_task(cfg.task)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            self.tokenizer.eos_token_id
        # On the CPU a small KV pool is plenty for these rollouts and keeps release/resume cheap.
        kv = {"cpu_kv_cache_bytes": 256 << 20} if cfg.device == "cpu" else {}
        self.engine = Engine(cfg.model, device=cfg.device, enable_memory_saver=True, random_seed=cfg.seed,
                             mem_fraction_static=cfg.engine_mem_fraction, show_progress=False, **kv)
        self.policy = self.build_policy()
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=cfg.lr, betas=(0.9, 0.99),
                                           weight_decay=cfg.weight_decay)
        self.memory = TrainerMemory(self.policy, self.optimizer, cfg.device, cfg.offload_trainer)
        self.memory.to_rollout_phase()
        self.eval_set = eval_prompts(self.task)
        self.logger = MetricsLogger(cfg.output_dir, asdict(cfg), not cfg.no_wandb, cfg.wandb_project)

    # Hooks PPO overrides.
    def build_policy(self):
        return load_policy(self.cfg.model, self.cfg.device)

    def trainable_parameters(self):
        return self.policy.parameters()

    def sync_source(self):
        return self.policy

    def engine_bytes(self) -> int:
        return sum(self.engine.get_server_info()["memory_bytes"].values())

    def step(self, step: int) -> dict:
        cfg, m = self.cfg, {"step": step}

        # 1-2. Rollout: G samples per prompt with the engine's logprobs, scored by the task reward.
        t0 = time.perf_counter()
        prompts = self.task.make_prompts(cfg.prompts_per_step, self.rng)
        exp, stats = collect_experience(self.engine, self.tokenizer, self.task, prompts, cfg.group_size,
                                        cfg.temperature, cfg.max_new_tokens, self.pad_id)
        m.update(stats, time_rollout=time.perf_counter() - t0)
        m["mem_engine_rollout"], m["mem_trainer_rollout"] = self.engine_bytes(), self.memory.bytes_held()

        # 3. Hand the device to the trainer: KV cache, weights and graphs go.
        t0 = time.perf_counter()
        self.engine.release_memory_occupation()
        m["time_release"] = time.perf_counter() - t0
        m["mem_engine_train"] = self.engine_bytes()

        # 4. Train: recompute logprobs (pi_old), then clipped-surrogate steps with TIS correction.
        t0 = time.perf_counter()
        self.memory.to_train_phase()
        exp = exp.to(cfg.device)
        mask = exp.completion_mask
        with torch.no_grad():
            exp.old_logprobs = policy_logprobs(self.policy, exp, cfg.temperature)
            if self.ref is not None:
                exp.ref_logprobs = policy_logprobs(self.ref, exp, cfg.temperature)
        m["logprob_mismatch"] = float(logprob_mismatch(exp.rollout_logprobs, exp.old_logprobs, mask))
        m.update(self.train_on(exp))
        m["mem_trainer_train"] = self.memory.bytes_held()
        self.memory.to_rollout_phase()
        m["time_train"] = time.perf_counter() - t0

        # 5. Give the device back: weights first, sync the new policy, then the KV cache.
        t0 = time.perf_counter()
        self.engine.resume_memory_occupation(["weights"])
        m["time_resume"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ok, msg = sync_weights(self.sync_source(), self.engine, bucket_bytes=cfg.bucket_mb << 20,
                               weight_version=f"step-{step}")
        if not ok:
            raise RuntimeError(f"weight sync failed at step {step}: {msg}")
        m["time_sync"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.engine.resume_memory_occupation(ENGINE_RESUME_AFTER_SYNC)
        m["time_resume"] += time.perf_counter() - t0

        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            m["eval_accuracy"] = greedy_accuracy(self.engine, self.tokenizer, self.task, self.eval_set,
                                                 cfg.max_new_tokens)
        self.logger.log(m)
        return m

    def policy_loss_terms(self, exp) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        logp = policy_logprobs(self.policy, exp, cfg.temperature)
        loss, metrics = policy_loss(logp, exp.old_logprobs, exp.advantages, exp.completion_mask,
                                    clip_eps_low=cfg.clip_eps, rollout_logp=exp.rollout_logprobs,
                                    tis_cap=cfg.tis_cap or None)
        if self.ref is not None:
            kl = masked_mean(kl_k3(logp, exp.ref_logprobs), exp.completion_mask)
            loss = loss + cfg.kl_coef * kl
            metrics["kl_ref"] = kl.detach()
        return loss, metrics

    def train_on(self, exp) -> dict:
        out = {}
        for _ in range(self.cfg.updates_per_step):
            loss, metrics = self.policy_loss_terms(exp)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(list(self.trainable_parameters()), 1.0)
            self.optimizer.step()
            out = {"loss": float(loss.detach()), "grad_norm": float(grad_norm), **{k: float(v) for k, v in metrics.items()}}
        return out

    def initial_eval(self) -> float | None:
        if not self.cfg.eval_every:
            return None
        return greedy_accuracy(self.engine, self.tokenizer, self.task, self.eval_set, self.cfg.max_new_tokens)

    def train(self) -> list[dict]:
        acc = self.initial_eval()
        if acc is not None:
            self.logger.initial_eval = acc
            print(f"step   0 | greedy eval accuracy {acc:.3f} (before training)", flush=True)
        t_start = time.perf_counter()
        try:
            for step in range(1, self.cfg.steps + 1):
                self.step(step)
        finally:
            plot = self.logger.plot() if self.logger.history else None
            self.logger.close()
        print(f"done: {self.cfg.steps} steps in {time.perf_counter() - t_start:.1f}s; metrics in "
              f"{self.cfg.output_dir}/metrics.jsonl" + (f", curves in {plot}" if plot else ""), flush=True)
        if self.cfg.save_final:
            self.policy.save_pretrained(f"{self.cfg.output_dir}/final")
            self.tokenizer.save_pretrained(f"{self.cfg.output_dir}/final")
        return self.logger.history

    def close(self) -> None:
        self.engine.shutdown()


def run_cli(trainer_cls, argv=None, description: str = "", **defaults) -> None:
    cfg = RLConfig.from_cli(argv, description=description, **defaults)
    trainer = trainer_cls(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()


def main(argv=None) -> None:
    run_cli(GRPOTrainer, argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()
