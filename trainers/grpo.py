"""GRPO, co-located: one process alternates the device between the rollout engine and the trainer.

One iteration, top to bottom (`GRPOTrainer.step`):
  generate G samples per prompt with logprobs -> score -> release engine memory -> recompute
  logprobs with the trainer -> loss and optimizer step -> resume engine weights -> sync -> resume
  KV cache.
The rollout/trainer logprob mismatch is logged every step and corrected by truncated importance
sampling. Run `python -m trainers.grpo --help`; the defaults train the shipped demo model on the toy
task on the CPU; `--deterministic` makes the engine batch-invariant and computes the trainer's logprobs
through the engine's own model code, so the mismatch is exactly 0 (trainers/deterministic.py);
`--num-engines N` spreads rollouts over N engines on Ray; `--routing-replay` (MoE
policies, e.g. `--model assets/moe-demo-model`) trains on the experts the rollout routed each token
to; `--lora-rank R` trains a PEFT LoRA adapter and syncs only the adapter, as a new adapter version each
step (trainers/lora.py). Does not do multi-GPU training.
"""

from __future__ import annotations

import copy
import random
import sys
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from trainers.config import RLConfig
from trainers.deterministic import RunnerPolicy, deterministic_sequence_logprobs
from trainers.engines import engine_bytes, make_engine
from trainers.lora import LoRAVersions, wrap_lora
from trainers.losses import kl_k3, logprob_mismatch, masked_mean, policy_loss
from trainers.master_weights import MasterWeights
from trainers.metrics import MetricsLogger
from trainers.policy import TrainerMemory, checkpoint_named_tensors, load_policy, policy_logprobs
from trainers.rollouts import collect_experience, eval_prompts, greedy_accuracy, tokenize_prompts
from trainers.routing_replay import find_routers, num_decoder_layers
from trainers.tasks import get_task
from weight_sync import DeltaSync, sync_weights

ENGINE_RESUME_AFTER_SYNC = ["kv_cache", "cuda_graph"]


class GRPOTrainer:
    config_cls = RLConfig  # the CLI's flags

    def __init__(self, cfg: RLConfig) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.rng = random.Random(cfg.seed)
        self.task = get_task(cfg.task)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            self.tokenizer.eos_token_id
        check_prompts_fit(cfg, self.task, self.tokenizer)  # before any engine is started
        self.engine = make_engine(cfg)
        # --delta-sync: a full sync first, then exact sparse deltas against the last synced cast
        self.delta = DeltaSync(self.engine, bucket_bytes=cfg.bucket_mb << 20, full_sync_every=cfg.full_sync_every) \
            if cfg.delta_sync else None
        self.runner_views: dict[int, RunnerPolicy] = {}  # --deterministic: id(HF model) -> its runner view
        self.policy = self.build_policy()
        self.lora = LoRAVersions(self.engine) if cfg.lora_rank else None
        if self.lora is not None:
            self.policy = wrap_lora(self.policy, cfg.lora_rank, cfg.lora_alpha or 2 * cfg.lora_rank)
            self.lora.publish(self.policy, "policy-step-0")
        self.routed_experts_shape = self.replay_shape() if cfg.routing_replay else None
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        # bf16 policy: the optimizer steps fp32 masters (trainers/master_weights.py); fp32: its own parameters
        self.masters = MasterWeights(self.param_groups())
        self.optimizer = torch.optim.AdamW(self.masters.groups, lr=cfg.lr, betas=(0.9, 0.99),
                                           weight_decay=cfg.weight_decay)
        self.memory = TrainerMemory(self.policy, self.optimizer, cfg.device, cfg.offload_trainer, self.masters)
        self.memory.to_rollout_phase()
        self.eval_set = eval_prompts(self.task)
        self.logger = MetricsLogger(cfg.output_dir, asdict(cfg), not cfg.no_wandb, cfg.wandb_project)

    # Hooks PPO overrides.
    def build_policy(self):
        return load_policy(self.cfg.model, self.cfg.device, getattr(torch, self.cfg.dtype))

    def logprobs(self, model, exp, replay: bool = False) -> torch.Tensor:
        """[B, T] logprobs of `model` (the policy or the reference) at the rollout temperature. With
        --deterministic through the engine's own model code, bitwise what the engine reported."""
        if not self.cfg.deterministic:
            return policy_logprobs(model, exp, self.cfg.temperature, replay)
        if id(model) not in self.runner_views:
            self.runner_views[id(model)] = RunnerPolicy(model, self.cfg.model)
        return deterministic_sequence_logprobs(self.runner_views[id(model)], exp.input_ids, exp.attention_mask,
                                               self.cfg.temperature)

    def trainable_parameters(self):
        return [p for p in self.policy.parameters() if p.requires_grad]  # a LoRA policy: the adapter only

    def param_groups(self):
        """What the optimizer gets: one group at --lr here; PPO gives its value head its own rate."""
        return self.trainable_parameters()

    def replay_shape(self) -> tuple[int, int]:
        """(num_layers, top_k) of the routed experts the engine returns for this MoE policy."""
        routers = find_routers(self.policy)
        if not routers:
            raise ValueError(f"--routing-replay needs a mixture-of-experts model; {self.cfg.model} "
                             f"({type(self.policy).__name__}) has no expert routers")
        return num_decoder_layers(self.policy), int(next(iter(routers.values())).top_k)

    def sync_source(self):
        return checkpoint_named_tensors(self.policy)  # MoE experts under their per-expert checkpoint names

    def engine_bytes(self) -> int:
        return engine_bytes(self.engine)

    def step(self, step: int) -> dict:
        cfg, m = self.cfg, {"step": step}

        # 1-2. Rollout: G samples per prompt with the engine's logprobs, scored by the task reward.
        t0 = time.perf_counter()
        prompts = self.task.make_prompts(cfg.prompts_per_step, self.rng)
        exp, stats = collect_experience(self.engine, self.tokenizer, self.task, prompts, cfg.group_size,
                                        cfg.temperature, cfg.max_new_tokens, self.pad_id, self.routed_experts_shape,
                                        self.lora_path)
        m.update(stats, time_rollout=time.perf_counter() - t0)
        m["mem_engine_rollout"], m["mem_trainer_rollout"] = self.engine_bytes(), self.memory.bytes_held()

        # 3. Hand the device to the trainer: KV cache, weights and graphs go.
        t0 = time.perf_counter()
        self.engine.release_memory_occupation()
        m["time_release"] = time.perf_counter() - t0
        m["mem_engine_train"] = self.engine_bytes()

        # 4. Train: recompute logprobs (pi_old), then clipped-surrogate steps with TIS correction. With
        # routing replay every trainer forward routes tokens through the rollout's experts.
        t0 = time.perf_counter()
        self.memory.to_train_phase()
        exp = exp.to(cfg.device)
        mask = exp.completion_mask
        replay = cfg.routing_replay
        with torch.no_grad():
            exp.old_logprobs = self.logprobs(self.policy, exp, replay)
            if self.ref is not None:
                exp.ref_logprobs = self.logprobs(self.ref, exp, replay)
            if replay:  # what the mismatch would be without it (one more forward, logged only)
                own = policy_logprobs(self.policy, exp, cfg.temperature)
                m["logprob_mismatch_no_replay"] = float(logprob_mismatch(exp.rollout_logprobs, own, mask))
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
        if self.lora is not None:  # only the adapter, as a new version; the previous one unloads when unused
            m["sync_bytes"] = self.lora.publish(self.policy, f"policy-step-{step}")
            m["sync_bytes_full"] = sum(p.numel() * p.element_size() for p in self.policy.parameters())
            ok, msg = True, ""
        elif self.delta is not None:  # a refused delta (stale base) falls back to a full sync, said in msg
            ok, msg = self.delta.sync(self.sync_source(), fallback=True, weight_version=f"step-{step}")
            last = self.delta.last
            m["sync_bytes"], m["sync_bytes_full"] = last["bytes_sent"], last["bytes_full"]
            m["sync_full"] = int(last["mode"] == "full")
            m["sync_changed_fraction"] = last["elements_changed"] / max(1, last["elements_total"])
        else:
            source = list(self.sync_source())
            ok, msg = sync_weights(source, self.engine, bucket_bytes=cfg.bucket_mb << 20,
                                   weight_version=f"step-{step}")
            m["sync_bytes"] = m["sync_bytes_full"] = sum(t.numel() * t.element_size() for _, t in source)
        if not ok:
            raise RuntimeError(f"weight sync failed at step {step}: {msg}")
        m["time_sync"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.engine.resume_memory_occupation(ENGINE_RESUME_AFTER_SYNC)
        m["time_resume"] += time.perf_counter() - t0

        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            m["eval_accuracy"] = greedy_accuracy(self.engine, self.tokenizer, self.task, self.eval_set,
                                                 cfg.max_new_tokens, self.lora_path)
        self.logger.log(m)
        return m

    def policy_loss_terms(self, exp) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        logp = self.logprobs(self.policy, exp, cfg.routing_replay)
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
            self.masters.grads_to_masters()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.masters.trainable(), 1.0)
            self.optimizer.step()
            self.masters.masters_to_model()
            out = {"loss": float(loss.detach()), "grad_norm": float(grad_norm), **{k: float(v) for k, v in metrics.items()}}
        return out

    def initial_eval(self) -> float | None:
        if not self.cfg.eval_every:
            return None
        return greedy_accuracy(self.engine, self.tokenizer, self.task, self.eval_set, self.cfg.max_new_tokens,
                               self.lora_path)

    @property
    def lora_path(self) -> str | None:
        """The engine's name of the current policy: its latest adapter version (None: the full model)."""
        return None if self.lora is None else self.lora.current

    def train(self) -> list[dict]:
        acc = self.initial_eval()
        if acc is not None:
            self.logger.initial_eval = acc
            print(f"step   0 | greedy eval accuracy {acc:.3f} (before training)", flush=True)
        t_start = time.perf_counter()
        # The run-level bar (stderr; steps done, elapsed, ETA) under the per-step lines (stdout).
        bar = tqdm(total=self.cfg.steps, desc="run", unit="step", disable=self.cfg.no_progress, file=sys.stderr,
                   dynamic_ncols=True)
        try:
            for step in range(1, self.cfg.steps + 1):
                m = self.step(step)
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", refresh=False)
                bar.update(1)
        finally:
            bar.close()
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


def check_prompts_fit(cfg: RLConfig, task, tokenizer) -> None:
    """ValueError naming --task when the task's prompts (its eval set) leave no room for a new token in the
    model's context (max_position_embeddings), which the engine would refuse at the first rollout or eval."""
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(cfg.model), "max_position_embeddings", None)
    if not context:
        return
    longest = max((len(ids) for ids in tokenize_prompts(tokenizer, eval_prompts(task))), default=0)
    if longest >= context:
        raise ValueError(f"--task {cfg.task}: its prompts run to {longest} tokens, and {cfg.model}'s context holds "
                         f"{context} (max_position_embeddings), leaving no room for a new token: pick a model with a "
                         f"longer context or another --task")


def run_cli(trainer_cls, argv=None, description: str = "", **defaults) -> None:
    cfg = trainer_cls.config_cls.from_cli(argv, description=description, **defaults)
    try:
        trainer = trainer_cls(cfg)
    except (ValueError, RuntimeError, OSError) as e:  # an option the engine or the machine refuses: one line, as
        # the config's own checks answer (no CUDA for --device cuda, a --tp-size that does not divide the heads,
        # an --output-dir that cannot be made, --routing-replay on a dense model)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        trainer.train()
    finally:
        trainer.close()


def main(argv=None) -> None:
    run_cli(GRPOTrainer, argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()
