"""Attention backends behind one interface: init_forward_metadata(batch), forward_extend(...),
forward_decode(...), plus the CUDA-graph hooks (init_cuda_graph_state, init_forward_metadata_capture_/
replay_cuda_graph) where a backend supports graphs. The backend is chosen once, at runner init:
`attention_backend` when given, else flashinfer on CUDA when it imports, else torch-native.
flashinfer is imported only here, inside the function, and only for a CUDA device."""

from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)

# "hf_sdpa": transformers' SDPA call per request in the model dtype (rl_on_policy_target="fsdp").
BACKENDS = ("torch_native", "flashinfer", "hf_sdpa")


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def choose_attention_backend(name: str | None, device: torch.device) -> str:
    """The backend name for `device`: the explicit choice (checked), or the best one present."""
    device = torch.device(device)
    if name is None:
        return "flashinfer" if device.type == "cuda" and flashinfer_available() else "torch_native"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {list(BACKENDS)}")
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA device, got {device.type!r}; "
                             f"use 'torch_native'")
        if not flashinfer_available():
            raise ValueError("attention_backend='flashinfer' but flashinfer is not installed "
                             "(pip install flashinfer-python); use 'torch_native'")
    return name


def create_attention_backend(name: str | None, device, model_config, runner):
    name = choose_attention_backend(name, device)
    logger.info("attention backend: %s", name)
    if name == "flashinfer":
        from runner.attention.flashinfer import FlashInferAttnBackend

        return FlashInferAttnBackend(runner)
    if name == "hf_sdpa":
        from runner.attention.hf_sdpa import HFSdpaAttnBackend

        return HFSdpaAttnBackend(runner)
    from runner.attention.torch_native import TorchNativeAttnBackend

    return TorchNativeAttnBackend(runner)
