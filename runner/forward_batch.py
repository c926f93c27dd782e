"""ForwardMode, ForwardBatch and LogitsOutput: the one seam between the scheduler and the runner.

A ForwardBatch is plain tensors plus the host-side lengths the attention backend plans from (so the
hot path never reads a device tensor back). It carries no request objects, and nothing writes into it
after the scheduler built it: what the runner adds for one step (attention backend, KV pools) lives in
a `ForwardContext` it sets around the forward (as nano-vllm's `set_context`), and the model keeps its
own per-step values (rotary cos/sin) in local variables. A captured decode step can therefore replay
a padded copy of a batch without the batch ever learning about it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runner.sampler import SamplingBatchInfo


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill, also extend-after-cached-prefix and chunked prefill
    DECODE = 2  # one new token per request
    IDLE = 3  # empty batch: a no-op that keeps collectives matched across ranks

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of ReqToTokenPool
    seq_lens: torch.Tensor  # [bs] int64, tokens in the KV cache after this step
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots the new tokens are written to
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int] | None = None  # EXTEND: cached tokens before this chunk
    extend_seq_lens_cpu: list[int] | None = None  # EXTEND: new tokens in this chunk
    # Logits wanted: for every position (input logprobs, parity tests) or only each request's last.
    return_all_logits: bool = False
    # EXTEND embedding override: whole `input_embeds`, or `replace_embeds` written at
    # `replace_positions` (indices into the flattened token dimension) over the looked-up embeddings.
    input_embeds: torch.Tensor | None = None  # [num_tokens, hidden]
    replace_embeds: torch.Tensor | None = None  # [num_replaced, hidden]
    replace_positions: torch.Tensor | None = None  # [num_replaced] int64
    sampling_info: SamplingBatchInfo | None = None
    # LoRA (runner/lora/): per request, the uid of its adapter or None for the base model; None: no adapters
    lora_ids: list[int | None] | None = None
    # Each request's planned final length (prompt + max_new_tokens; None unknown): the hf_sdpa backend
    # computes every row as a forward over the whole sequence would (runner/attention/hf_sdpa.py).
    final_seq_lens_cpu: list[int | None] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def idle(cls, device: torch.device | str = "cpu") -> ForwardBatch:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return cls(ForwardMode.IDLE, 0, empty, empty, empty, empty, empty, [])


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor  # [bs, vocab] fp32, at each request's last position
    all_logits: torch.Tensor | None = None  # [num_tokens, vocab] fp32 when return_all_logits


class DeferredLogits:
    """A decode step's LogitsOutput whose fp32 logits are made from the model-dtype ones only when read. The
    one-call decode step (ModelRunner.forward_sample) samples without them, and nothing reads a decode step's
    logits after sampling, so at 64 rows x 151,936 a fresh 39 MB fp32 copy a step is not made at all."""

    all_logits = None

    def __init__(self, logits: torch.Tensor) -> None:
        self._logits = logits  # [bs, vocab] in the model dtype
        self._fp32: torch.Tensor | None = None

    @property
    def next_token_logits(self) -> torch.Tensor:  # [bs, vocab] fp32, exactly the widened model-dtype values
        if self._fp32 is None:
            self._fp32 = self._logits.float()
        return self._fp32


@dataclass(frozen=True)
class ForwardContext:
    """What the runner lends the model for one forward: read by the attention layers, owned by the
    runner. The backend keeps its own per-step plan (`attn_backend.forward_metadata`)."""

    attn_backend: Any
    token_to_kv_pool: Any
    req_to_token_pool: Any
    lora_batch: Any = None  # the step's LoRABatch (runner/lora/layer.py); None: no adapter this step


# Per thread: one process runs forwards on several threads at once (each engine's scheduler thread, the
# overlap schedule's forward worker, a trainer's own pass through the model code), and one thread's
# forward must never see, or reset, another's context.
_LOCAL = threading.local()


def _current() -> ForwardContext | None:
    return getattr(_LOCAL, "ctx", None)


def get_forward_context() -> ForwardContext:
    ctx = _current()
    if ctx is None:
        raise RuntimeError("no forward context: the model runs only inside ModelRunner.forward "
                           "(or a graph runner's capture/replay)")
    return ctx


def current_lora_batch():
    """The step's LoRABatch (runner/lora/manager.py), or None (no step, or no adapter in it)."""
    ctx = _current()
    return None if ctx is None else ctx.lora_batch


@contextmanager
def forward_context(ctx: ForwardContext):
    """Set `ctx` for the duration of one forward (nested uses restore the outer one)."""
    prev, _LOCAL.ctx = _current(), ctx
    try:
        yield ctx
    finally:
        _LOCAL.ctx = prev
