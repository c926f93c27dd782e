"""The CPU paged decode-attention kernel (runner/attention/csrc/paged_decode_attention.cpp): built at first
use, loaded once per process, and the rule for when the torch-native backend may call it.

Why a kernel. The torch-native decode step gathers every request's K/V out of the paged pool into a
padded [bs, max_kv, kv_heads, d] copy each layer and runs SDPA on it under a length mask; at long
contexts that copy and the kernel's padded work grow with the context. The kernel reads each
request's slots in place through req_to_token, shares each K/V row across the query heads of its
group, and runs on ATen's own thread pool. Measured on a 2-core Zen 4 (AVX-512), 16 requests, one
layer, 2 threads: 2.4-4.4x faster than the gather + SDPA it replaces at 96 to 2048 keys, fp32 and
bf16 (bench/decode_attention.py prints the comparison on the machine at hand).

How it is built. torch.utils.cpp_extension compiles the one source file with -O3 -march=native
(about 12 s on 2 cores, once: the build is cached under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions, in a directory named after this CPU's feature flags). It needs a C++
compiler and ninja (a dependency of this package). The vector path is AVX-512; a CPU without it
gets a scalar build that is slower than SDPA, so it is not used.

When it is used (`usable`): a CPU decode step of an fp32 or bf16 model (q and cache of one dtype), a
head_dim the kernel was compiled for, outside batch-invariant mode (which has its own fixed-block
kernel). `RunnerConfig.cpu_decode_kernel`: None (default) uses it when it builds and the CPU has
AVX-512, logging once why not otherwise; True requires it (a build failure is an error at start-up);
False never builds it. Numerics: fp32 accumulation like SDPA's, in a different summation order, so
logits differ from the SDPA path by float rounding (tests hold both to a float64 oracle).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the template instances in the source
DTYPES = (torch.float32, torch.bfloat16)
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "op": the loaded op or None, "reason": why not, once looked for


def _cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags: a -march=native build is only valid on a CPU
    like the one that built it, so a shared home directory keeps one build per kind of CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("flags", "model name"))][:2]
    except OSError:
        import platform

        lines = [platform.machine(), platform.processor()]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


def _build():
    """Compile (or load the cached build) and return (the op, its SIMD width: 16 with AVX-512, 1 without)."""
    from torch.utils.cpp_extension import load

    load(name=f"rollout_cpu_decode_{_cpu_tag()}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return torch.ops.rollout_cpu.paged_decode_attention, torch.ops.rollout_cpu.simd_width()


def load_kernel(required: bool = False):
    """The op torch.ops.rollout_cpu.paged_decode_attention, built on first call, or None with the reason
    logged once (no compiler, no ninja, no AVX-512). `required`: raise instead, naming the reason."""
    with _lock:
        if "op" not in _state:
            try:
                op, width = _build()
                if width < 16:
                    _state["op"], _state["reason"] = None, "this CPU has no AVX-512 (the scalar build is slower than SDPA)"
                else:
                    _state["op"], _state["reason"] = op, None
            except Exception as e:  # noqa: BLE001 - any build failure means: fall back to SDPA
                _state["op"], _state["reason"] = None, f"the kernel did not build ({type(e).__name__}: {str(e)[:500]})"
            if _state["reason"] is not None and not required:
                logger.info("CPU decode attention: gather + SDPA, not the paged kernel: %s", _state["reason"])
        if _state["op"] is None and required:
            raise RuntimeError(f"cpu_decode_kernel=True but the CPU paged decode-attention kernel is not usable: "
                               f"{_state['reason']}; set cpu_decode_kernel=None (use it when it works) or False")
        return _state["op"]


def usable(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel computes this layer's decode attention (the kernel itself must be loaded too)."""
    return dtype == cache_dtype and dtype in DTYPES and head_dim in HEAD_DIMS


def paged_decode_attention(op, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q: [bs, hq, d]; k_cache, v_cache: [slots, hkv, d] (one layer of the pool); req_to_token:
    [max_reqs, max_context] int64; req_pool_indices, seq_lens: [bs] int64, seq_lens counting this
    step's token (already written) -> [bs, hq, d] in q's dtype."""
    return op(q.contiguous(), k_cache, v_cache, req_to_token, req_pool_indices.contiguous(),
              seq_lens.contiguous(), float(scale))
