"""Adapter-only weight sync: a PEFT model's LoRA adapter, not its base weights, as a named adapter version.

`sync_lora_adapter(model, target, lora_name)` takes PEFT's own adapter state dict
(`get_peft_model_state_dict`: the names `save_pretrained` writes) and its config, packs the tensors into
one flattened bucket and calls `load_lora_adapter_from_tensors(lora_name, bucket, config,
load_format="flattened_bucket")` on the target (an Engine, a RemoteEngine-like handle, an EngineGroup,
or a list of engines). Megabytes per step instead of the whole model. It never unloads: keeping or
dropping older versions is the caller's (trainers/ do it once no request uses them). peft is imported
only when a PEFT model is given.
"""

from __future__ import annotations

import json

import torch

from weight_sync.bucket import FlattenedTensorBucket


def is_peft_model(source) -> bool:
    return hasattr(source, "peft_config") and hasattr(source, "base_model") and hasattr(source, "active_adapter")


def adapter_payload(model, adapter_name: str | None = None) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """(PEFT-named tensors, adapter_config dict, JSON-safe) of `model`'s adapter (default: the active one)."""
    from peft import get_peft_model_state_dict

    name = adapter_name or model.active_adapter
    state = get_peft_model_state_dict(model, adapter_name=name)
    config = model.peft_config[name].to_dict()
    config = json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    return [(k, v.detach()) for k, v in state.items()], config


def sync_lora_adapter(model, target, lora_name: str, adapter_name: str | None = None) -> tuple[bool, str]:
    """Load `model`'s adapter into `target` as `lora_name`. Returns (ok, message); nothing is unloaded."""
    if not lora_name:
        raise ValueError("sync of a PEFT model needs lora_name: the name of the adapter version it creates")
    targets = list(target) if isinstance(target, list | tuple) else [target]
    if not targets:
        raise ValueError("sync of a PEFT model: empty list of targets")
    bad = [type(t).__name__ for t in targets if not hasattr(t, "load_lora_adapter_from_tensors")]
    if bad:
        raise TypeError(f"cannot load a LoRA adapter into {bad[0]}: it has no load_lora_adapter_from_tensors (an "
                        f"adapter-only sync of a PEFT model needs an Engine, RemoteEngine, EngineGroup or server "
                        f"URL; merge the adapter, e.g. merge_and_unload(), to sync full weights)")
    tensors, config = adapter_payload(model, adapter_name)
    with torch.no_grad():
        bucket = FlattenedTensorBucket(named_tensors=tensors)
    payload = bucket.to_dict()
    nbytes = bucket.flattened_tensor.numel() * bucket.flattened_tensor.element_size()
    for i, t in enumerate(targets):
        res = t.load_lora_adapter_from_tensors(lora_name, payload, config, load_format="flattened_bucket")
        ok, msg = lora_result(res)
        if not ok:
            where = f"engine {i} " if len(targets) > 1 else ""
            return False, f"{where}refused LoRA adapter {lora_name!r}: {msg}"
    return True, f"synced LoRA adapter {lora_name!r}: {len(tensors)} tensors, {nbytes} bytes"


def lora_result(res) -> tuple[bool, str]:
    """LoRAUpdateOutput (or its dict form, over HTTP/Ray) -> (success, error_message)."""
    if isinstance(res, dict):
        return bool(res.get("success")), res.get("error_message") or ""
    return bool(res.success), res.error_message or ""
