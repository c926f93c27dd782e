"""Attention backends behind one interface: init_forward_metadata(batch), forward_extend(...),
forward_decode(...). The backend is chosen once, at runner init."""

from __future__ import annotations


def create_attention_backend(name: str | None, device, model_config, runner):
    name = name or "torch_native"
    if name == "torch_native":
        from runner.attention.torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend(runner)
    if name == "flashinfer":
        raise NotImplementedError(
            "attention_backend='flashinfer' is not implemented yet (GPU path, issue 6); use 'torch_native'"
        )
    raise ValueError(f"unknown attention_backend {name!r}; choose 'torch_native' or 'flashinfer'")
