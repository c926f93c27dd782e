"""Attention backends behind one interface: init_forward_metadata(batch), forward_extend(...),
forward_decode(...), plus the CUDA-graph hooks (init_cuda_graph_state, init_forward_metadata_capture_/
replay_cuda_graph) where a backend supports graphs. The backend is chosen once, at runner init:
`attention_backend` when given (checked against the device and dtype), else flashinfer on CUDA when
`import flashinfer` succeeds and the model dtype is one its kernels have (fp16/bf16), else torch-native,
with one log line saying why. flashinfer is imported only here, inside a function, and only for CUDA."""

from __future__ import annotations

import importlib
import logging

import torch

logger = logging.getLogger(__name__)

# "hf_sdpa": transformers' SDPA call per request in the model dtype (rl_on_policy_target="fsdp").
BACKENDS = ("torch_native", "flashinfer", "hf_sdpa")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)  # its JIT dtype map has fp16/bf16/fp8, no fp32

_import_error: dict[str, str | None] = {}  # "flashinfer" -> None (imports) or the reason it does not


def flashinfer_import_error() -> str | None:
    """None when `import flashinfer` works in this process, else the reason (cached: imported once)."""
    if "flashinfer" not in _import_error:
        try:
            importlib.import_module("flashinfer")
            _import_error["flashinfer"] = None
        except Exception as e:  # noqa: BLE001 - a broken install (missing .so, CUDA mismatch) is a reason too
            _import_error["flashinfer"] = f"{type(e).__name__}: {e}"
    return _import_error["flashinfer"]


def flashinfer_available() -> bool:
    return flashinfer_import_error() is None


def choose_attention_backend(name: str | None, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The backend name for `device` and model `dtype`: the explicit choice (checked), or the best one
    that works, logging once why flashinfer was passed over on CUDA."""
    device = torch.device(device)
    if name is None:
        if device.type != "cuda":
            return "torch_native"
        if dtype is not None and dtype not in FLASHINFER_DTYPES:
            logger.info("attention backend torch_native: flashinfer has no %s kernels", dtype)
            return "torch_native"
        reason = flashinfer_import_error()
        if reason is not None:
            logger.info("attention backend torch_native: `import flashinfer` failed (%s)", reason)
            return "torch_native"
        return "flashinfer"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {list(BACKENDS)}")
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA device, got {device.type!r}; "
                             f"use 'torch_native'")
        if dtype is not None and dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"attention_backend='flashinfer' has no kernels for dtype {dtype}; use "
                             f"dtype='bfloat16' or 'float16', or attention_backend='torch_native'")
        reason = flashinfer_import_error()
        if reason is not None:
            raise ValueError(f"attention_backend='flashinfer' but `import flashinfer` failed ({reason}); "
                             f"pip install flashinfer-python, or use 'torch_native'")
    return name


def create_attention_backend(name: str | None, device, model_config, runner):
    name = choose_attention_backend(name, device, getattr(runner, "dtype", None))
    logger.info("attention backend: %s", name)
    if name == "flashinfer":
        from runner.attention.flashinfer import FlashInferAttnBackend

        return FlashInferAttnBackend(runner)
    if name == "hf_sdpa":
        from runner.attention.hf_sdpa import HFSdpaAttnBackend

        return HFSdpaAttnBackend(runner)
    from runner.attention.torch_native import TorchNativeAttnBackend

    return TorchNativeAttnBackend(runner)
