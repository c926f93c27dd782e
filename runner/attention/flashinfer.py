"""flashinfer attention over the paged KV cache (CUDA): paged prefill and decode, planned once per step.

Page size is 1 (one token slot per page), so the KV layout each wrapper sees is the pool's own buffer
per layer, viewed as `[num_slots, 1, num_kv_heads, head_dim]` ("NHD"); nothing is gathered or copied.

- EXTEND: the attention layer has already written this chunk's K/V into the pool, so one
  `BatchPrefillWithPagedKVCacheWrapper` plan with `causal=True` over each request's whole sequence
  (cached prefix + chunk) covers both the prefix and the new tokens (flashinfer aligns a shorter query
  to the end of its KV range).
- DECODE: `BatchDecodeWithPagedKVCacheWrapper`, with `use_tensor_cores=True` when the GQA group size
  is not 1/2/4/8 (the plain decode kernel rejects e.g. Qwen2.5's 7).
- CUDA graphs: one decode wrapper per captured batch size in `use_cuda_graph=True` mode, over static
  indptr / indices / last-page-length buffers shared by all sizes (graphs replay one at a time). The
  wrapper is planned before capture and re-planned (host work plus a copy into those buffers) before
  every replay; the launch geometry depends only on the batch size, so that is valid.

The index tensors come from `flashinfer_metadata` (pure functions, tested on the CPU). This module
imports flashinfer only when a backend is built, never at import time. Under tensor
parallelism it plans with the rank's head counts (`rank_head_counts`). It does not handle sliding
windows, logit soft-capping, fp8 KV or pages larger than one token.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

from runner.attention import flashinfer_metadata as md
from runner.forward_batch import get_forward_context

WORKSPACE_BYTES = 256 << 20  # shared float workspace (split-KV partials); flashinfer wants it zeroed
TENSOR_CORE_FREE_GROUPS = (1, 2, 4, 8)  # GQA group sizes the plain decode kernel is compiled for


def decode_uses_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    return num_qo_heads // num_kv_heads not in TENSOR_CORE_FREE_GROUPS


def rank_head_counts(num_attention_heads: int, num_key_value_heads: int, tp_size: int) -> tuple[int, int]:
    """(q heads, KV heads) one tensor-parallel rank holds: q heads split evenly, a KV head replicated
    when there are fewer KV heads than ranks (as runner/models/llama.py builds the attention)."""
    return num_attention_heads // tp_size, max(1, num_key_value_heads // tp_size)


class FlashInferAttnBackend:
    def __init__(self, runner, flashinfer_module=None) -> None:
        # `flashinfer_module` lets a test hand in a named stand-in; the engine never passes it.
        self.fi = flashinfer_module or importlib.import_module("flashinfer")
        mc = runner.model_config
        self.device = runner.device
        self.context_len = runner.context_len
        self.req_to_token = runner.req_to_token_pool.req_to_token  # [max_reqs, max_context]
        self.max_slot = runner.token_to_kv_pool.size  # slots 0..size (0 is the padding slot)
        # Under tensor parallelism each rank plans and reshapes with its own heads, not the model's.
        tp_size = getattr(getattr(runner, "tp", None), "size", 1)
        self.num_qo_heads, self.num_kv_heads = rank_head_counts(mc.num_attention_heads, mc.num_key_value_heads,
                                                                tp_size)
        self.head_dim = mc.head_dim
        pool_kv_heads = runner.token_to_kv_pool.k_buffer.shape[2]
        if pool_kv_heads != self.num_kv_heads:
            raise ValueError(f"flashinfer: the KV pool holds {pool_kv_heads} KV heads per layer, this rank "
                             f"(tp_size={tp_size}) expects {self.num_kv_heads}")
        self.sm_scale = mc.head_dim**-0.5  # the same scaling PagedAttention carries
        self.q_dtype = runner.dtype
        self.kv_dtype = runner.kv_cache_dtype
        if self.kv_dtype != self.q_dtype:
            raise ValueError(f"attention_backend='flashinfer' needs kv_cache_dtype == model dtype here "
                             f"({self.kv_dtype} != {self.q_dtype}); use kv_cache_dtype='auto' or torch_native")
        self.use_tensor_cores = decode_uses_tensor_cores(self.num_qo_heads, self.num_kv_heads)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.decode_wrapper = self._decode_wrapper()
        self.prefill_wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.forward_metadata = None  # the planned wrapper this step's layers run
        self._planned_indices: torch.Tensor | None = None  # non-graph plan() keeps a reference; so do we
        self.graph_wrappers: dict[int, object] = {}

    def _decode_wrapper(self, bs: int | None = None):
        if bs is None:
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend="fa2")
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores, backend="fa2",
            paged_kv_indptr_buffer=self.cuda_graph_kv_indptr[: bs + 1],
            paged_kv_indices_buffer=self.cuda_graph_kv_indices,
            paged_kv_last_page_len_buffer=self.cuda_graph_last_page_len[:bs],
        )

    # ---- per-step planning (eager) ----------------------------------------------------------
    def _plan_decode(self, wrapper, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: Sequence[int]) -> None:
        kv_indptr, last_page_len, total = md.decode_metadata(seq_lens_cpu)
        indices = md.kv_indices(self.req_to_token, req_pool_indices, seq_lens, total, max_slot=self.max_slot)
        wrapper.plan(kv_indptr, indices, last_page_len, self.num_qo_heads, self.num_kv_heads, self.head_dim, 1,
                     pos_encoding_mode="NONE", window_left=-1, q_data_type=self.q_dtype,
                     kv_data_type=self.kv_dtype, sm_scale=self.sm_scale)
        self._planned_indices = indices
        self.forward_metadata = wrapper

    def init_forward_metadata(self, fb) -> None:
        if fb.forward_mode.is_decode():
            self._plan_decode(self.decode_wrapper, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)
            return
        qo_indptr, kv_indptr, last_page_len, total = md.extend_metadata(fb.extend_seq_lens_cpu, fb.seq_lens_cpu)
        indices = md.kv_indices(self.req_to_token, fb.req_pool_indices, fb.seq_lens, total,
                                max_slot=self.max_slot)
        self.prefill_wrapper.plan(qo_indptr, kv_indptr, indices, last_page_len, self.num_qo_heads,
                                  self.num_kv_heads, self.head_dim, 1, causal=True, pos_encoding_mode="NONE",
                                  window_left=-1, sm_scale=self.sm_scale, q_data_type=self.q_dtype,
                                  kv_data_type=self.kv_dtype)
        self._planned_indices = indices
        self.forward_metadata = self.prefill_wrapper

    # ---- CUDA-graph planning ------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static index buffers every captured decode wrapper reads; allocated once, never in a region.

        The indices buffer must hold the largest KV total a replay can plan: every request at the
        context limit (prefix sharing lets the sum exceed the pool size).
        """
        self.cuda_graph_max_bs = max_bs
        self.cuda_graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self.cuda_graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self.cuda_graph_kv_indices = torch.zeros(max_bs * self.context_len, dtype=torch.int32,
                                                 device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        """Build and plan the graph-mode wrapper of batch size `bs`. Call before (not inside) capture."""
        if not hasattr(self, "cuda_graph_kv_indptr"):
            raise RuntimeError("init_cuda_graph_state(max_bs, max_num_tokens) must run before capture")
        if bs > self.cuda_graph_max_bs:
            raise ValueError(f"capture batch size {bs} exceeds cuda_graph_max_bs={self.cuda_graph_max_bs}")
        wrapper = self.graph_wrappers.get(bs) or self._decode_wrapper(bs)
        self.graph_wrappers[bs] = wrapper
        # Capture happens once per size, off the hot path: reading the lengths back is fine here.
        self._plan_decode(wrapper, req_pool_indices[:bs], seq_lens[:bs], seq_lens[:bs].tolist())

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu) -> None:
        """Re-plan the wrapper captured for `bs` with this batch (rows past the real ones: length 1)."""
        wrapper = self.graph_wrappers.get(bs)
        if wrapper is None:
            raise KeyError(f"no CUDA-graph decode wrapper for batch size {bs}; captured: {sorted(self.graph_wrappers)}")
        lens = list(seq_lens_cpu.tolist() if isinstance(seq_lens_cpu, torch.Tensor) else seq_lens_cpu)
        self._plan_decode(wrapper, req_pool_indices[:bs], seq_lens[:bs], md.pad_decode_batch(lens[:bs], bs))

    # ---- per-layer calls ----------------------------------------------------------------------
    def _paged_kv(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        pool = get_forward_context().token_to_kv_pool
        # [num_slots, page_size=1, num_kv_heads, head_dim] views of the pool: read in place.
        return pool.k_buffer[layer.layer_id].unsqueeze(1), pool.v_buffer[layer.layer_id].unsqueeze(1)

    def forward_extend(self, q: torch.Tensor, layer, fb=None) -> torch.Tensor:
        q = q.reshape(-1, self.num_qo_heads, self.head_dim)  # [num_tokens, hq, d]
        return self.forward_metadata.run(q, self._paged_kv(layer))  # [num_tokens, hq, d]

    def forward_decode(self, q: torch.Tensor, layer, fb=None) -> torch.Tensor:
        q = q.reshape(-1, self.num_qo_heads, self.head_dim)  # [bs, hq, d]
        return self.forward_metadata.run(q, self._paged_kv(layer))  # [bs, hq, d]
