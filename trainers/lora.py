"""LoRA training: the policy as a PEFT adapter over a frozen base, synced to the engine as adapter versions.

`wrap_lora` makes the trainer's HF model a PeftModel (q/k/v/o/gate/up/down, B initialised to zero, so
version 0 is the base model). `LoRAVersions.publish` sends only the adapter (weight_sync/lora.py) under a
new version name, then unloads the previous version: the engine's unload waits for any request still
using it, so a rollout started under version k finishes under k while new requests use k+1. Returns
the bytes sent (the adapter), the figure the loop logs against a full-model sync.
"""

from __future__ import annotations

from weight_sync.lora import adapter_payload, lora_result, sync_lora_adapter

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def lora_targets(model) -> list[str]:
    """Every projection of a dense model; only attention on a MoE model: peft maps gate/up/down onto fused
    expert parameters there (target_parameters), which the engine's LoRA does not serve."""
    config = getattr(model, "config", None)
    return ATTENTION if any(getattr(config, k, None) for k in MOE_CONFIG_KEYS) else TARGETS


def wrap_lora(model, rank: int, alpha: float):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=lora_targets(model), lora_dropout=0.0,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


class LoRAVersions:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.current: str | None = None

    def publish(self, model, name: str) -> int:
        """Load `model`'s adapter as `name`, make it current, unload the previous version. Returns bytes sent."""
        ok, msg = sync_lora_adapter(model, self.engine, name)
        if not ok:
            raise RuntimeError(f"LoRA adapter sync failed: {msg}")
        previous, self.current = self.current, name
        if previous is not None:
            # An Engine answers a LoRAUpdateOutput; a RemoteEngine or HttpEngine its dict form.
            ok, message = lora_result(self.engine.unload_lora_adapter(previous))
            if not ok:
                raise RuntimeError(f"unloading LoRA version {previous!r} failed: {message}")
        tensors, _ = adapter_payload(model)
        return sum(t.numel() * t.element_size() for _, t in tensors)
