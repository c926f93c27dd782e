"""Model registry: HF architecture name -> model class. One decoder covers the Llama family, one its
mixture-of-experts relatives (Qwen3-MoE, Mixtral)."""

from __future__ import annotations

from runner.config import ModelConfig

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


def get_model_class(config: ModelConfig):
    if config.architecture in MOE_ARCHITECTURES:
        from runner.models.moe import MoEForCausalLM

        return MoEForCausalLM
    from runner.models.llama import LlamaForCausalLM

    # Mistral, Qwen2 and Qwen3 differ from Llama only in flags ModelConfig already carries
    # (q/k/v bias, q/k norm, head_dim), so one class serves all four.
    return LlamaForCausalLM
