"""CPU fp32 fast path: oneDNN-prepacked copies of the linear weights, as a pass over a built model.

On the CPU, `F.linear` (MKL) on decode-sized inputs reaches about half the memory bandwidth that
oneDNN's blocked-layout linear does (measured here at M=16 on a 896->9728 linear: 3.7 ms vs 1.3 ms), and
decode is bound by reading the weights. So each Linear/LMHead may hold a prepacked shadow of its
weight. The dense parameters stay the source of truth (loading, updates, release, get_weights): the
runner drops a module's shadow before anything writes its weights and repacks after, and a module
without a shadow just uses `F.linear`. bf16 is packed too: on this AVX512-BF16 CPU (no AMX) the
packed bf16 linear took 2.7 ms against F.linear's 4.8 ms on 896->9728 at M=16, and 30 ms against
60 ms on the 151936-row LM head. Costs one extra copy of the linear weights in host memory while
resident. A gate|up projection marked `gated` is packed as its two halves, so the MLP's SiLU and
product run in oneDNN's epilogues (runner/layers/ops.py): 24 layers of the 0.5B MLP at M=16 took
25.4 ms against 26.5 ms for gate|up then F.silu and mul (2 threads; 46.0 vs 48.4 ms on 1 thread).
vLLM-CPU 0.32 calls oneDNN too (its own matmul handle), within ~10% of this path per shape at M=16
(faster on the LM head and down_proj, slower on gate|up), so the floor is a fair one.

A bf16 model on a CPU without native bf16 (AVX2 only: oneDNN refuses to pack bf16 there, and
`F.linear` emulates it) gets an **fp32 shadow** instead: the activation is upcast (exactly), multiplied
in fp32 and the output rounded to bf16 once, the same products and fp32 accumulation as a bf16 GEMM
in another summation order. On an AVX2 AMD EPYC (2 threads, M=16, 896->9728) that took 5.2 ms against
bf16 `F.linear`'s 17.6 ms. It costs twice the bf16 weights' bytes in host memory while resident.
`pack_dtype` says which shadow a (device, dtype) gets.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.layers.embedding import LMHead
from runner.layers.linear import Linear
from runner.layers.ops import GatedPacked


def native_bf16() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()  # a CPU with AVX512-BF16, AMX or AVX-NE-CONVERT


def pack_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the prepacked shadow of `dtype` weights on `device`, or None (no prepacking)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.bfloat16:
        # Native on AVX512-BF16 / AMX / AVX-NE-CONVERT; otherwise an fp32 shadow beats emulated bf16.
        return torch.bfloat16 if native_bf16() else torch.float32
    return torch.float32 if dtype == torch.float32 else None


def is_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return pack_dtype(device, dtype) is not None


# Below this many weight elements the packed call's fixed cost outweighs its bandwidth gain (a
# 64x256 linear took 17 us packed vs 7 us with F.linear here).
MIN_PACK_NUMEL = 1 << 18
DECODE_BATCH_HINT = 16  # oneDNN picks the blocking for this M; other M values work too


def packable_modules(model: nn.Module) -> list[nn.Module]:
    # An fp32 LM head of a bf16 model projects its upcast weight, never a packed bf16 shadow.
    return [m for m in model.modules() if isinstance(m, Linear | LMHead) and m.weight.numel() >= MIN_PACK_NUMEL
            and not (getattr(m, "fp32", False) and m.weight.dtype != torch.float32)]


def packed_pair(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    # The shadow's dtype may differ from the weight's (an fp32 shadow of bf16): packed_linear casts then.
    dtype = pack_dtype(weight.device, weight.dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), DECODE_BATCH_HINT)
    return packed, None if bias is None else bias.detach().to(dtype).contiguous()


@torch.no_grad()
def pack(module: nn.Module) -> None:
    bias = getattr(module, "bias", None)
    if getattr(module, "gated", False):
        # A gate|up projection (shards 0 and 1 stacked on dim 0): packed as its halves, so the MLP
        # runs SiLU-and-mul in the linears' epilogues (runner/layers/ops.py, packed_silu_and_mul).
        halves = []
        for shard in (0, 1):
            start, size = module.weight.shard_offsets[shard]
            halves.append(packed_pair(module.weight.narrow(0, start, size),
                                       None if bias is None else bias.narrow(0, start, size)))
        module.packed = GatedPacked(*halves)
        return
    module.packed = packed_pair(module.weight, bias)


def unpack(module: nn.Module) -> None:
    module.packed = None

