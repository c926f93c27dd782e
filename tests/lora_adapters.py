"""PEFT adapters for the LoRA tests, written by peft itself (get_peft_model + save_pretrained).

`init_lora_weights=False` keeps nn.Linear's random init for both A and B, so B is non-zero and an
adapter visibly changes the outputs. `peft_model` is the HF + peft reference: the same checkpoint with
the same adapter, through PeftModel.from_pretrained. Nothing is downloaded.
"""

from __future__ import annotations

import pathlib

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from tests.checkpoints import load_hf_model

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(ckpt: str | pathlib.Path, path: str | pathlib.Path, *, r: int = 8, alpha: float = 16,
                 targets: list[str] | None = None, use_rslora: bool = False, seed: int = 0) -> pathlib.Path:
    """Save a random LoRA adapter of `ckpt` into `path` (adapter_config.json + adapter_model.safetensors)."""
    model = load_hf_model(ckpt)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=False, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    path = pathlib.Path(path)
    peft_model.save_pretrained(path)
    return path


def peft_model(ckpt: str | pathlib.Path, adapter: str | pathlib.Path) -> torch.nn.Module:
    """The reference: HF model + PeftModel.from_pretrained(adapter), fp32, eval mode."""
    return PeftModel.from_pretrained(load_hf_model(ckpt), str(adapter)).eval()
