"""The one way weights enter a model: resolve HF names, check everything, then write.

`plan_weight_load` maps each (HF name, tensor) to the exact parameter slice it fills and checks
name, shape, dtype and finiteness for every tensor before anything is written; `apply_plan` then
copies. The initial load, `update_weights_from_disk`, `update_weights_from_tensor` and the
distributed update all go through these two functions, so a bad tensor anywhere in a call leaves the
model exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from runner.layers.linear import default_weight_loader, shard_view

# Present in some older checkpoints; derived, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class WeightUpdateError(ValueError):
    pass


@dataclass
class LoadTarget:
    hf_name: str
    param_name: str
    shard_id: object
    param: nn.Parameter

    def view(self) -> torch.Tensor:
        return shard_view(self.param, self.shard_id)


class WeightNameMap:
    """HF checkpoint names <-> runner parameters for one model instance."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.targets: dict[str, LoadTarget] = {}
        for pname, param in self.params.items():
            fused = [(hf, shard) for p, hf, shard in model.stacked_params_mapping if f".{p}." in f".{pname}"]
            if fused:
                for hf_piece, shard in fused:
                    runner_piece = next(p for p, hf, s in model.stacked_params_mapping if hf == hf_piece)
                    hf_name = pname.replace(runner_piece, hf_piece)
                    self.targets[hf_name] = LoadTarget(hf_name, pname, shard, param)
            else:
                self.targets[pname] = LoadTarget(pname, pname, None, param)

    def is_ignored(self, hf_name: str) -> bool:
        # A tied model's checkpoint may still carry lm_head.weight; it equals the embedding.
        return hf_name.endswith(IGNORED_SUFFIXES) or (self.tied and hf_name == "lm_head.weight")

    def resolve(self, hf_name: str) -> LoadTarget:
        try:
            return self.targets[hf_name]
        except KeyError:
            raise WeightUpdateError(f"unknown weight name {hf_name!r}: not a parameter of this model "
                                    f"(expected Hugging Face names like 'model.layers.0.self_attn.q_proj.weight')"
                                    ) from None

    def hf_names(self) -> list[str]:
        return list(self.targets)


def check_tensor(target: LoadTarget, tensor: torch.Tensor, source: str = "", check_finite: bool = True) -> None:
    where = f" (from {source})" if source else ""
    if not isinstance(tensor, torch.Tensor):
        raise WeightUpdateError(f"weight {target.hf_name!r}{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    expected = tuple(target.view().shape)
    if tuple(tensor.shape) != expected:
        raise WeightUpdateError(f"weight {target.hf_name!r}{where}: shape {tuple(tensor.shape)} does not match "
                                f"the model's {expected}")
    if not tensor.is_floating_point():
        raise WeightUpdateError(f"weight {target.hf_name!r}{where}: dtype {tensor.dtype} is not a floating-point "
                                f"dtype (the model holds {target.param.dtype})")
    # A float32 sum is finite iff every element is (barring overflow, which the exact check catches);
    # it runs ~10x faster than isfinite().all() on the CPU.
    if check_finite and not (bool(tensor.sum(dtype=torch.float32).isfinite()) or bool(torch.isfinite(tensor).all())):
        raise WeightUpdateError(f"weight {target.hf_name!r}{where}: contains NaN or inf")


def plan_weight_load(
    name_map: WeightNameMap, named_tensors: Iterable[tuple[str, torch.Tensor]], source: str = "",
    check_finite: bool = True,
) -> list[tuple[LoadTarget, torch.Tensor]]:
    plan, seen = [], set()
    for name, tensor in named_tensors:
        if not isinstance(name, str):
            raise WeightUpdateError(f"weight names must be strings, got {name!r}")
        if name_map.is_ignored(name):
            continue
        if name in seen:
            raise WeightUpdateError(f"weight {name!r} appears twice in one update")
        seen.add(name)
        target = name_map.resolve(name)
        check_tensor(target, tensor, source, check_finite)
        plan.append((target, tensor))
    return plan


@torch.no_grad()
def apply_plan(plan: list[tuple[LoadTarget, torch.Tensor]]) -> set[str]:
    for target, tensor in plan:
        loader = getattr(target.param, "weight_loader", default_weight_loader)
        loader(target.param, tensor.to(target.param.device), target.shard_id)
    return {t.hf_name for t, _ in plan}
