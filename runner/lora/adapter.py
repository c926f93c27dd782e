"""PEFT adapter tensors -> staged slot buffers, every check done before anything is written.

`read_adapter_dir` reads a `save_pretrained` directory (adapter_config.json + adapter_model.safetensors;
never a pickle). `stage_adapter` takes PEFT's state-dict names
(`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, the prefix optional) and checks,
naming the tensor at fault: the rank against max_lora_rank, every name (known target, enabled in
lora_target_modules, a layer the model has, not an MoE expert), both A and B present, shapes against the
base model, a floating dtype, and finiteness after the cast to the model dtype. Only then does it build
the host buffers of one slot per module (zero-padded to max_lora_rank, this rank's TP slice). Writing
them into the device pool is the manager's (runner/lora/manager.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from runner.lora.config import AdapterConfig
from runner.lora.layer import LoRAModule

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
_MODULE_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def read_adapter_dir(path: str | Path) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    config = AdapterConfig.from_dir(path)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_model.safetensors (pickled adapter_model.bin "
                         f"is not read; save with safe_serialization=True)")
    try:
        return config, load_file(str(file))
    except (SafetensorError, OSError) as e:  # safetensors' own error (a truncated or corrupt file) names no file
        raise ValueError(f"{file} is not a valid safetensors file: {e}") from None


def stage_adapter(config: AdapterConfig, tensors: dict[str, torch.Tensor], modules: dict[tuple[int, str], LoRAModule],
                  num_layers: int, max_rank: int, enabled: tuple[str, ...], dtype: torch.dtype,
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, module name): (A slot [k, R, in_local], B slot [k, R, out_local])} on the host, or
    ValueError naming the first problem. Reads `tensors`, writes nothing else."""
    if config.r > max_rank:
        raise ValueError(f"adapter rank r={config.r} exceeds max_lora_rank={max_rank}")
    scaling = torch.tensor(config.scaling, dtype=dtype)  # what B is multiplied by in the pool's dtype
    if not torch.isfinite(scaling):
        raise ValueError(f"adapter config lora_alpha={config.lora_alpha!r} gives a scaling of {config.scaling:g}, "
                         f"which overflows {dtype}")
    if config.target_modules is not None:
        extra = sorted(set(config.target_modules) - set(enabled))
        if extra:
            raise ValueError(f"adapter targets {extra} are not in lora_target_modules={list(enabled)}")
    if not tensors:
        raise ValueError("adapter has no tensors")
    by_target: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    named: dict[tuple[int, str, str], str] = {}  # (layer, target, A or B) -> the tensor name that gave it
    for name, t in tensors.items():
        m = _KEY.match(name)
        if m is None:
            raise ValueError(f"adapter tensor {name!r} is not a PEFT LoRA weight of a decoder layer "
                             f"(expected e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)")
        layer, block, target, ab = int(m[1]), m[2], m[3], m[4]
        if target in ("experts", "gate") or ".experts." in name:
            raise ValueError(f"adapter tensor {name!r}: LoRA on MoE experts or routers is not supported")
        if _MODULE_OF.get(target) != block:
            raise ValueError(f"adapter tensor {name!r}: unknown target {block}.{target}; supported: "
                             f"{sorted(_MODULE_OF)}")
        if target not in enabled:
            raise ValueError(f"adapter tensor {name!r}: target {target} is not in lora_target_modules={list(enabled)}")
        if config.target_modules is not None and target not in config.target_modules:
            # PEFT would build no LoRA layer for it and skip the tensor (with a warning): serving it would
            # give another model than the adapter's own config describes.
            raise ValueError(f"adapter tensor {name!r}: target {target} is not in the adapter's own "
                             f"target_modules={list(config.target_modules)} (adapter_config.json)")
        if layer >= num_layers:
            raise ValueError(f"adapter tensor {name!r}: layer {layer} does not exist (the model has {num_layers})")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"adapter tensor {name!r} must be a floating-point tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        first = named.setdefault((layer, target, ab), name)
        if first != name:  # two spellings of one weight (PEFT's prefix and the bare name): which one is meant?
            raise ValueError(f"adapter tensors {first!r} and {name!r} are the same weight (lora_{ab} of layer "
                             f"{layer} {target}); give it once")
        by_target.setdefault((layer, target), {})[ab] = t
    where = {(m.layer_id, t.name): (m, j) for m in modules.values() for j, t in enumerate(m.targets)}
    staged: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    r = config.r
    for (layer, target), pair in sorted(by_target.items()):
        label = f"model.layers.{layer}.{_MODULE_OF[target]}.{target}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter has lora_{next(iter(pair))} but not lora_{'B' if 'A' in pair else 'A'} "
                             f"for {label}")
        if (layer, target) not in where:
            raise ValueError(f"adapter tensor {label}: this model has no such dense projection (MoE experts "
                             f"are not supported for LoRA)")
        module, j = where[(layer, target)]
        spec = module.targets[j]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (r, spec.in_features):
            raise ValueError(f"adapter tensor {label}.lora_A.weight has shape {list(a.shape)}, expected "
                             f"[r={r}, {spec.in_features}]")
        if tuple(b.shape) != (spec.out_features, r):
            raise ValueError(f"adapter tensor {label}.lora_B.weight has shape {list(b.shape)}, expected "
                             f"[{spec.out_features}, r={r}]")
        a, b = a.detach().to("cpu", dtype), b.detach().to("cpu", dtype)
        for ab, t in (("A", a), ("B", b)):
            if not torch.isfinite(t).all():
                raise ValueError(f"adapter tensor {label}.lora_{ab}.weight has non-finite values after the cast "
                                 f"to {dtype}")
        if not torch.isfinite(b * scaling).all():
            raise ValueError(f"adapter tensor {label}.lora_B.weight times the scaling {config.scaling:g} "
                             f"(lora_alpha={config.lora_alpha!r}) overflows {dtype}")
        if spec.a_cols is not None:
            a = a.narrow(1, *spec.a_cols)
        if spec.b_rows is not None:
            b = b.narrow(0, *spec.b_rows)
        key = (module.layer_id, module.name)
        if key not in staged:
            staged[key] = module.staged_zeros()
        a_slot, b_slot = staged[key]
        a_slot[j, :r] = a  # [r, in_local]
        b_slot[j, :r, spec.out_offset:spec.out_offset + spec.out_size] = b.t()  # [r, out_size]
    return staged
