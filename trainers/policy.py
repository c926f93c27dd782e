"""The trainer's side of the co-located loop: the HF policy model, its logprobs, and its memory.

The policy is a plain transformers model (an implementation independent of the engine's, which is
what makes the rollout/trainer logprob mismatch meaningful). Between updates the trainer frees its
gradients and, with `offload`, moves optimizer state and parameters to host memory so the engine
can have the device. It never reaches into the engine: weights leave through weight_sync. A MoE
policy's forward can replay the rollout's expert routing (`policy_logprobs(..., replay=True)`), and its
stacked experts leave under per-expert checkpoint names (`checkpoint_named_tensors`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from trainers.experience import Experience
from trainers.losses import sequence_logprobs
from trainers.routing_replay import routing_replay


def load_policy(model_path: str, device: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="eager")
    return model.to(device).train()


# transformers >= 5 holds each MoE layer's experts stacked in memory (`mlp.experts.gate_up_proj`
# [num_experts, 2 * intermediate, hidden], gate rows first; `mlp.experts.down_proj` [num_experts, hidden,
# intermediate]) while checkpoints, and so the engine's loader, name them per expert:
# model_type -> (checkpoint block name, (gate, up, down) projection names).
_CHECKPOINT_EXPERTS = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
_STACKED = re.compile(r"(.*\.layers\.\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)")


def checkpoint_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's parameters under checkpoint names, for a weight sync: a transformers MoE's stacked
    experts become per-expert tensors (views, no copy) and Mixtral's router its checkpoint name; every
    other parameter passes as named_parameters() has it."""
    spec = _CHECKPOINT_EXPERTS.get(getattr(model.config, "model_type", ""))
    for name, param in model.named_parameters():
        match = _STACKED.fullmatch(name) if spec is not None else None
        if match is None:
            yield name, param
            continue
        layer, what = match.groups()
        block, (gate, up, down) = spec
        if what == "gate.weight":
            yield f"{layer}.{block}.gate.weight", param
        elif what == "experts.gate_up_proj":
            half = param.shape[1] // 2
            for e in range(param.shape[0]):
                yield f"{layer}.{block}.experts.{e}.{gate}.weight", param[e, :half]
                yield f"{layer}.{block}.experts.{e}.{up}.weight", param[e, half:]
        else:
            for e in range(param.shape[0]):
                yield f"{layer}.{block}.experts.{e}.{down}.weight", param[e]


def policy_logprobs(model: nn.Module, exp: Experience, temperature: float, replay: bool = False) -> torch.Tensor:
    """[B, T] logprob of token t at index t under `model` at the rollout temperature (0 at t=0).

    replay=True routes every token through the experts the rollout used (exp.routed_experts; see
    trainers/routing_replay.py): a MoE policy then computes the logprobs of the rollout's own routing."""
    if replay and exp.routed_experts is None:
        raise ValueError("routing replay asked for, but the experience has no routed_experts (collect it with "
                         "return_routed_experts=True)")
    with routing_replay(model, exp.routed_experts if replay else None):
        logits = model(input_ids=exp.input_ids, attention_mask=exp.attention_mask).logits  # [B, T, V]
    return sequence_logprobs(logits, exp.input_ids, temperature)


def tensor_bytes(tensors, device_type: str) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type != device_type:
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen and key[1]:
            seen.add(key)
            total += key[1]
    return total


def trainer_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, device_type: str) -> int:
    """Bytes the trainer holds on `device_type`: parameters, gradients, optimizer state."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(tensors, device_type)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step":
                state[k] = v.to(device, non_blocking=True)


class TrainerMemory:
    """Puts the trainer's state where the current phase wants it."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: str, offload: bool,
                 masters=None) -> None:
        self.model, self.optimizer, self.device, self.offload = model, optimizer, torch.device(device), offload
        self.masters = masters  # trainers/master_weights.py: fp32 copies the optimizer steps, moved with its state

    def to_rollout_phase(self) -> None:
        """Free gradients; with offload, park optimizer state and parameters in host memory."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.offload and self.device.type != "cpu":
            move_optimizer_state(self.optimizer, "cpu")
            if self.masters is not None:
                self.masters.to("cpu")
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def to_train_phase(self) -> None:
        if self.offload and self.device.type != "cpu":
            self.model.to(self.device)
            if self.masters is not None:
                self.masters.to(self.device)
            move_optimizer_state(self.optimizer, self.device)

    def bytes_held(self) -> int:
        on_device = self.masters is not None and self.masters.pairs and \
            self.masters.pairs[0][1].device.type == self.device.type
        return trainer_bytes(self.model, self.optimizer, self.device.type) + (self.masters.bytes() if on_device else 0)
