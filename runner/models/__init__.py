"""Model registry: HF architecture name -> model class. One decoder covers the Llama family."""

from __future__ import annotations

from runner.config import ModelConfig


def get_model_class(config: ModelConfig):
    from runner.models.llama import LlamaForCausalLM

    # Mistral, Qwen2 and Qwen3 differ from Llama only in flags ModelConfig already carries
    # (q/k/v bias, q/k norm, head_dim), so one class serves all four.
    return LlamaForCausalLM
