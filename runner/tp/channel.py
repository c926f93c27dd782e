"""The command channel between rank 0 and one worker rank: a pipe carrying JSON headers and raw
tensor bytes, never pickles.

A message is one JSON header (`{"cmd": ..., ..., "tensors": [{"dtype", "shape"}, ...]}`) followed by
the bytes of each tensor it lists. Every receive is bounded: `recv` waits at most `timeout_s` and
checks `is_alive` (the peer process) while it waits, so a dead or stuck peer is an error, not a hang.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

from runner.config import MODEL_DTYPES

# Every plain (byte-addressable, unquantized) dtype, so any tensor a caller may send decodes on the far side,
# where the command's own checks refuse what it cannot take (an int weight): a name missing here once killed the
# receiving rank in recv. send() refuses the rest (quantized, sub-byte) before a byte goes out.
_DTYPES = {**{name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    "float8_e8m0fnu", "complex64", "complex128", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "bool") if hasattr(torch, name)}, **MODEL_DTYPES}


class ChannelClosed(RuntimeError):
    """The peer closed its end, died, or did not answer in time."""


def send(conn, header: dict, tensors: list[torch.Tensor] = ()) -> None:
    tensors = [t.detach().to("cpu").contiguous() for t in tensors]
    # Every tensor's bytes are viewed before the first byte goes out, so a message is whole or not sent: one
    # the far side could not decode once killed the receiving rank.
    raw = []
    for t in tensors:
        if _DTYPES.get(str(t.dtype).removeprefix("torch.")) != t.dtype:
            raise ValueError(f"a tensor of dtype {t.dtype} cannot be sent to another rank")
        try:
            raw.append(t.reshape(-1).view(torch.uint8))
        except RuntimeError as e:  # quantized, sub-byte: no plain bytes to send
            raise ValueError(f"a tensor of dtype {t.dtype} cannot be sent to another rank: {e}") from None
    header = {**header, "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                                    for t in tensors]}
    conn.send_bytes(json.dumps(header).encode())
    for t, b in zip(tensors, raw):
        # A copy: numpy() would pin the storage of a tensor the caller still owns (no resize_ after).
        conn.send_bytes(b.clone().numpy().tobytes() if t.numel() else b"")


def recv(conn, timeout_s: float | None = None, is_alive: Callable[[], bool] | None = None,
         what: str = "peer") -> tuple[dict, list[torch.Tensor]]:
    """(header, tensors) of the next message; ChannelClosed after `timeout_s` (None: no limit) or when
    `is_alive()` turns False."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not conn.poll(0.1):
        if is_alive is not None and not is_alive():
            raise ChannelClosed(f"{what} died")
        if deadline is not None and time.monotonic() > deadline:
            raise ChannelClosed(f"{what} did not answer within {timeout_s:.0f} s")
    try:
        header = json.loads(conn.recv_bytes())
        tensors = []
        for spec in header.pop("tensors"):
            dtype, shape = _DTYPES[spec["dtype"]], spec["shape"]
            raw = conn.recv_bytes()
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
            tensors.append(t.reshape(shape))
    except (EOFError, OSError) as e:
        raise ChannelClosed(f"{what} closed the channel ({type(e).__name__})") from None
    return header, tensors
