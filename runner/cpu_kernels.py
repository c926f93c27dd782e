"""The engine's own CPU kernels (runner/csrc/): one C++ extension, compiled at first use, loaded once per process.

What is in it: `paged_decode_attention` / `paged_extend_attention` (runner/csrc/paged_decode_attention.cpp,
used by the torch-native attention backend, see runner/attention/cpu_decode.py), `rms_norm` /
`add_rms_norm` (runner/csrc/rms_norm.cpp, used by runner/layers/norm.py) and `rotary`
(runner/csrc/rotary.cpp, used by runner/layers/rotary.py). All are written once against 16-lane vectors
(runner/csrc/lanes.h) that compile to AVX-512 (F, BW, VL) or to AVX2 + FMA, whichever the CPU has; they exist
because at decode sizes the equivalent torch op chains cost their per-op overhead and extra passes, not
arithmetic (figures in each source and in the README). Over them, `decoder_layer` / `model_forward`
(runner/csrc/decoder_layer.cpp, used by runner/models/fused_layer.py) run a Llama layer or the whole
forward as one op, and `sample_plain` (runner/csrc/sampler.cpp, used by runner/sampler.py) the plain
sampling path: ATen and oneDNN calls in the modules' order, bitwise their results, without the GIL.

How it is built. torch.utils.cpp_extension compiles the sources with -O3 -march=native and -fopenmp
(about 25 s on 2 cores, once: the build is cached under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions, in a directory named after this CPU's model and feature flags, since a
-march=native build is only valid on CPUs like the one that built it, and after the sources). It needs a C++ compiler and
ninja (a dependency of this package). The OpenMP runtime it links is the libgomp torch already
loaded, so its threads are torch's. On a CPU with neither AVX-512 nor AVX2 + FMA nothing is built and torch's
ops run.

The switch is `RunnerConfig.cpu_kernels`: None (default) uses the kernels when they build on an AVX-512 or
AVX2 CPU, logging once why not otherwise; True requires them (a build failure is an error at start-up,
naming its cause); False never builds them. Not here: when each kernel applies (its caller decides).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode_attention.cpp", "rms_norm.cpp", "rotary.cpp",
                                                                 "decoder_layer.cpp", "sampler.cpp", "direct.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("lanes.h", "entry_points.h")]  # included by the sources; part of the build's hash
DTYPES = (torch.float32, torch.bfloat16)  # what every kernel computes; other dtypes keep torch's ops
# -ffp-contract=off: a multiply-add is fused only where the source says so (the rotary must round its
# products as torch does).
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=off"]

# bf16 extends of at least this many new tokens per request take torch's flash SDPA where the CPU has AMX
# (runner/csrc/paged_decode_attention.cpp, extend_via_sdpa): its bf16 GEMMs run on the tile unit. On a
# 2-core Xeon with AMX (14/2 heads, head_dim 64, one request) the kernel took 0.36 / 1.35 / 5.2 / 16.5 ms
# at 128 / 256 / 512 / 1024 new tokens, SDPA 0.22 / 0.66 / 2.3 / 3.8 ms. On AMD EPYCs without AMX the kernel
# was the faster (Zen 4, 4 x 512 bf16: 17.0 vs 33.0 ms a layer; Zen 5, 16 x 1024: 163 vs 254 ms), so there it
# stays the only path, as it does for fp32 (0.65-1.26x SDPA's time at 128-2048 tokens on the Xeon).
EXTEND_SDPA_MIN_TOKENS = 128


def extend_sdpa_min_tokens() -> int:
    """EXTEND_SDPA_MIN_TOKENS on a CPU with AMX tiles and native bf16, else 0 (never)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return EXTEND_SDPA_MIN_TOKENS if amx and bf16 else 0


_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": torch.ops.rollout_cpu or None, "reason": why not; once looked for


def _cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags (one build per kind of CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("flags", "model name"))][:2]
    except OSError:
        import platform

        lines = [platform.machine(), platform.processor()]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


STALE_LOCK_S = 300  # a build takes ~15 s here; a lock file this old was left by a process killed mid-build


def _clear_stale_lock(name: str) -> None:
    """torch's build lock is a file created at the start of a build and removed at its end; a process
    killed in between leaves it, and every later load would wait on it forever. Remove it once old."""
    import os
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale CPU-kernel build lock (%.0f s old, its build was interrupted): %s", age, lock)
        with contextlib.suppress(OSError):
            os.remove(lock)


AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl")  # the AVX-512 path (masked 16-bit loads: BW + VL)
AVX2_FLAGS = ("avx2", "fma")  # the AVX2 path (lanes.h: two 8-lane halves per vector)


@functools.cache  # the CPU does not change under a running process; callers ask once per engine
def kernel_isa() -> str | None:
    """Which vector path of runner/csrc/lanes.h this CPU gets ("avx512", "avx2"), or None: neither, the
    kernels are not built (Linux /proc/cpuinfo; None elsewhere)."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return None
    have = set(flags.split())
    if all(f in have for f in AVX512_FLAGS):
        return "avx512"
    if all(f in have for f in AVX2_FLAGS):
        return "avx2"
    return None


def has_kernels_isa() -> bool:
    """Whether this CPU has a vector path the kernels compile to (AVX-512 or AVX2 + FMA)."""
    return kernel_isa() is not None


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja package's binary is not on it when the environment's bin
    directory is not (a venv's python run without activating it)."""
    import os
    import shutil

    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError, AttributeError):
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def _build():
    """Compile (or load the cached build) and return (the op namespace, the direct-call module)."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    # The sources' hash in the name too: a changed source builds into a new directory instead of
    # relinking, in place, a library another running engine has loaded.
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(CFLAGS).encode()
    sources = hashlib.sha1(text).hexdigest()[:8]
    name = f"rollout_cpu_kernels_{_cpu_tag()}_{sources}"
    _clear_stale_lock(name)
    module = load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                  is_python_module=True, verbose=False)
    torch.ops.rollout_cpu.set_extend_sdpa_min_tokens(extend_sdpa_min_tokens())
    return torch.ops.rollout_cpu, module


def load(required: bool = False):
    """torch.ops.rollout_cpu (the paged attention, norm and rotary ops), built on the first call, or None
    with the reason logged once (no compiler, no ninja, neither AVX-512 nor AVX2). `required`: raise instead,
    naming it."""
    with _lock:
        if "ops" not in _state:
            try:
                if not has_kernels_isa():
                    _state["ops"], _state["reason"] = None, (f"this CPU has neither AVX-512 ({'/'.join(AVX512_FLAGS)}) "
                                                             f"nor AVX2 ({'/'.join(AVX2_FLAGS)})")
                else:
                    (_state["ops"], _state["direct"]), _state["reason"] = _build(), None
            except Exception as e:  # noqa: BLE001 - any build failure means: use torch's ops
                _state["ops"], _state["reason"] = None, f"the kernels did not build ({type(e).__name__}: {str(e)[:500]})"
            if _state["reason"] is not None and not required:
                logger.info("CPU kernels off (torch's ops instead): %s", _state["reason"])
        if _state["ops"] is None and required:
            raise RuntimeError(f"cpu_kernels=True but the engine's CPU kernels are not usable: {_state['reason']}; "
                               f"set cpu_kernels=None (use them when they work) or False")
        return _state["ops"]


def direct():
    """The extension's pybind11 module (runner/csrc/direct.cpp: FusedWeights, model_forward, sample_plain,
    called without torch.ops' GIL round trips), or None when the kernels are not loaded (`load` first)."""
    with _lock:
        return _state.get("direct") if _state.get("ops") is not None else None


def enabled(setting: bool | None, device: torch.device):
    """The op namespace when `setting` (RunnerConfig.cpu_kernels) and `device` call for the kernels, else None."""
    if torch.device(device).type != "cpu" or setting is False:
        return None
    return load(required=setting is True)


def main() -> None:
    """`python3 -c "from runner.cpu_kernels import main; main()"` (.ci/run does): build (or find the cached build of) the kernels now and say which
    vector path they took, or why they are off. Exits 0 either way: without them the engine runs torch's ops."""
    import time

    t0 = time.perf_counter()
    ops = load()
    took = time.perf_counter() - t0
    if ops is None:
        print(f"CPU kernels off (the engine uses torch's ops): {_state.get('reason')}")
    else:
        print(f"CPU kernels ready: the {kernel_isa()} path, {took:.1f} s to build or load")
