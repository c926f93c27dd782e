"""PPO, co-located: the GRPO loop with a learned value head and GAE instead of group baselines.

The critic is a linear head on the policy's last hidden state (shared trunk). The reward arrives on
the last completion token; GAE turns it into per-token advantages (whitened over the batch), and the
loss is the clipped surrogate plus `--vf-coef` times the clipped value loss (plus `--kl-coef` times the k3
KL to the initial policy, as GRPO's). `--gamma`, `--gae-lambda`
and `--value-lr` (the value head's own learning rate) are PPO's flags (PPOConfig). Only the policy's
weights are synced to the engine; the value head stays with the trainer. Run
`python -m trainers.ppo --help`.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from torch import nn

from trainers.config import PPOConfig, RLConfig
from trainers.grpo import GRPOTrainer, run_cli
from trainers.losses import gae, kl_k3, masked_mean, masked_whiten, policy_loss, sequence_logprobs, value_loss
from trainers.routing_replay import routing_replay


class PPOTrainer(GRPOTrainer):
    config_cls = PPOConfig

    def __init__(self, cfg: RLConfig) -> None:
        if not isinstance(cfg, PPOConfig):  # an RLConfig gets PPO's defaults for its own knobs
            cfg = PPOConfig(**{f.name: getattr(cfg, f.name) for f in fields(RLConfig)})
        super().__init__(cfg)

    def build_policy(self):
        policy = super().build_policy()
        hidden = policy.config.hidden_size
        self.value_head = nn.Linear(hidden, 1).to(self.cfg.device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        return policy

    def trainable_parameters(self):
        return list(self.policy.parameters()) + list(self.value_head.parameters())

    def param_groups(self):
        return [{"params": list(self.policy.parameters())},
                {"params": list(self.value_head.parameters()), "lr": self.cfg.value_lr or self.cfg.lr}]

    def logprobs_and_values(self, exp) -> tuple[torch.Tensor, torch.Tensor]:
        with routing_replay(self.policy, exp.routed_experts if self.cfg.routing_replay else None):
            out = self.policy(input_ids=exp.input_ids, attention_mask=exp.attention_mask, output_hidden_states=True)
        if self.cfg.deterministic:  # the engine's model code for the logprobs; HF's hidden states for V
            logp = self.logprobs(self.policy, exp)
        else:
            logp = sequence_logprobs(out.logits, exp.input_ids, self.cfg.temperature)  # [B, T]
        v = self.value_head(out.hidden_states[-1].float()).squeeze(-1)  # [B, T]: value after token t
        # Align like the logprobs: index t holds V(state before token t) = head(hidden[t - 1]).
        values = torch.nn.functional.pad(v[:, :-1], (1, 0))
        return logp, values

    def train_on(self, exp) -> dict:
        mask = exp.completion_mask
        with torch.no_grad():
            _, old_values = self.logprobs_and_values(exp)
            last = mask.cumsum(1).argmax(1)  # index of each row's last completion token
            token_rewards = torch.zeros_like(old_values)
            token_rewards[torch.arange(len(exp)), last] = exp.rewards.to(token_rewards.dtype)
            adv, returns = gae(token_rewards, old_values, mask, gamma=self.cfg.gamma, lam=self.cfg.gae_lambda)
            exp.advantages = masked_whiten(adv, mask)
            exp.values, exp.returns = old_values, returns
        out = {}
        for _ in range(self.cfg.updates_per_step):
            logp, values = self.logprobs_and_values(exp)
            pl, metrics = policy_loss(logp, exp.old_logprobs, exp.advantages, mask, clip_eps_low=self.cfg.clip_eps,
                                      rollout_logp=exp.rollout_logprobs, tis_cap=self.cfg.tis_cap or None)
            vl, vmetrics = value_loss(values, exp.values, exp.returns, mask, clip_eps=self.cfg.clip_eps)
            loss = pl + self.cfg.vf_coef * vl
            if self.ref is not None:  # --kl-coef: the k3 penalty to the initial policy, as GRPO's
                kl = masked_mean(kl_k3(logp, exp.ref_logprobs), mask)
                loss = loss + self.cfg.kl_coef * kl
                metrics["kl_ref"] = kl.detach()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.masters.grads_to_masters()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.masters.trainable(), 1.0)
            self.optimizer.step()
            self.masters.masters_to_model()
            out = {"loss": float(loss.detach()), "value_loss": float(vl.detach()), "grad_norm": float(grad_norm),
                   **{k: float(v) for k, v in {**metrics, **vmetrics}.items()}}
        return out


def main(argv=None) -> None:
    run_cli(PPOTrainer, argv, description=__doc__.split("\n\n")[0], output_dir="runs/ppo")


if __name__ == "__main__":
    main()
