"""The experience batch: one typed, padded set of tensors per RL step, built from rollout outputs.

Layout ([B, T], right padded): row b is prompt + completion of sample b. Per-token tensors use the
token alignment of `trainers.losses.sequence_logprobs`: position t holds the quantity for token t
(its logprob under the sampling policy, its value, ...), 0 where it does not apply. This module does
not compute logprobs or advantages; it only holds and moves them.
"""

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch


@dataclass
class Experience:
    input_ids: torch.Tensor  # [B, T] long, prompt + completion, right padded
    attention_mask: torch.Tensor  # [B, T] long, 1 on prompt and completion tokens
    completion_mask: torch.Tensor  # [B, T] long, 1 on sampled completion tokens (the loss tokens)
    rollout_logprobs: torch.Tensor  # [B, T] float, engine logprob of token t at index t, 0 elsewhere
    rewards: torch.Tensor  # [B] float
    advantages: torch.Tensor  # [B] (per sequence) or [B, T] (per token, e.g. from GAE)
    old_logprobs: torch.Tensor | None = None  # [B, T] trainer logprobs before the update (pi_old)
    ref_logprobs: torch.Tensor | None = None  # [B, T] reference-policy logprobs, for the KL term
    values: torch.Tensor | None = None  # [B, T] critic values (PPO)
    returns: torch.Tensor | None = None  # [B, T] value targets (PPO)
    # [B, T, num_layers, top_k] int32: the experts the rollout routed token t to, -1 where it did not
    # (MoE policies with routing replay; trainers/routing_replay.py)
    routed_experts: torch.Tensor | None = None

    def __post_init__(self):
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(self.input_ids.shape)}")
        if self.input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be torch.long, got {self.input_ids.dtype}")
        shape = tuple(self.input_ids.shape)
        num_seqs = shape[0]
        per_token = [
            "attention_mask",
            "completion_mask",
            "rollout_logprobs",
            "old_logprobs",
            "ref_logprobs",
            "values",
            "returns",
        ]
        for name in per_token:
            tensor = getattr(self, name)
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name} must have the shape of input_ids {shape}, got {tuple(tensor.shape)}"
                )
        if self.routed_experts is not None and tuple(self.routed_experts.shape[:2]) != shape:
            raise ValueError(f"routed_experts must be [B, T, num_layers, top_k] with [B, T] = {shape}, got "
                             f"{tuple(self.routed_experts.shape)}")
        if tuple(self.rewards.shape) != (num_seqs,):
            raise ValueError(f"rewards must have shape ({num_seqs},), got {tuple(self.rewards.shape)}")
        if tuple(self.advantages.shape) not in ((num_seqs,), shape):
            raise ValueError(
                f"advantages must have shape ({num_seqs},) or {shape}, got {tuple(self.advantages.shape)}"
            )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Experience":
        """A copy with every tensor on `device` (fields that are None stay None)."""
        moved = {}
        for f in fields(self):
            tensor = getattr(self, f.name)
            moved[f.name] = None if tensor is None else tensor.to(device, non_blocking=non_blocking)
        return replace(self, **moved)

    @classmethod
    def from_rollouts(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        completion_logprobs: Sequence[Sequence[float]],
        rewards: Sequence[float],
        pad_token_id: int,
        advantages: Sequence[float] | torch.Tensor | None = None,
    ) -> "Experience":
        """Pad rollout outputs into an Experience (on the CPU).

        completion_logprobs[i][j] is the engine's logprob of completion_ids[i][j]; it lands at index
        len(prompt_ids[i]) + j, the position of that token in input_ids. `advantages` defaults to zeros
        (not computed yet); fill them in with e.g. `group_advantages(exp.rewards, group_size)`.
        """
        num_seqs = len(prompt_ids)
        for name, seq in [
            ("completion_ids", completion_ids),
            ("completion_logprobs", completion_logprobs),
            ("rewards", rewards),
        ]:
            if len(seq) != num_seqs:
                raise ValueError(f"{name} has {len(seq)} entries, prompt_ids has {num_seqs}")
        max_len = max((len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)), default=0)

        input_ids = torch.full((num_seqs, max_len), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((num_seqs, max_len), dtype=torch.long)
        completion_mask = torch.zeros((num_seqs, max_len), dtype=torch.long)
        rollout_logprobs = torch.zeros((num_seqs, max_len), dtype=torch.float32)
        for i, (prompt, completion, logprobs) in enumerate(
            zip(prompt_ids, completion_ids, completion_logprobs)
        ):
            if len(prompt) == 0:
                raise ValueError(f"prompt_ids[{i}] is empty; the first completion token needs a prompt")
            if len(logprobs) != len(completion):
                raise ValueError(
                    f"completion_logprobs[{i}] has {len(logprobs)} entries, completion_ids[{i}] has "
                    f"{len(completion)}"
                )
            start, end = len(prompt), len(prompt) + len(completion)
            input_ids[i, :start] = torch.tensor(prompt, dtype=torch.long)
            input_ids[i, start:end] = torch.tensor(completion, dtype=torch.long)
            attention_mask[i, :end] = 1
            completion_mask[i, start:end] = 1
            rollout_logprobs[i, start:end] = torch.tensor(logprobs, dtype=torch.float32)

        if advantages is None:
            advantages_t = torch.zeros(num_seqs, dtype=torch.float32)
        else:
            advantages_t = torch.as_tensor(advantages, dtype=torch.float32)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            completion_mask=completion_mask,
            rollout_logprobs=rollout_logprobs,
            rewards=torch.tensor(list(rewards), dtype=torch.float32),
            advantages=advantages_t,
        )
