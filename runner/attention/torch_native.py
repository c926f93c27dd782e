"""torch-native attention over the paged KV cache. Runs everywhere.

On a CPU where the engine's kernels are loaded (runner/cpu_kernels.py; AVX-512), every step of an fp32 or
bf16 model goes to the paged kernel (runner/attention/cpu_decode.py), which reads the slots in place:
its plan is just the batch's request rows, lengths and new-token counts, and the gather plan below
is made only for a layer the kernel cannot run (another dtype or head_dim). Batch-invariant mode keeps
its own kernel. Otherwise, SDPA on gathered pages, as follows.

Each step is planned once in `init_forward_metadata` and kept on the backend (`forward_metadata`,
never on the batch): the KV slots of every request gathered into a padded [bs, max_kv_len] index, a
boolean mask that is causal over the cached prefix plus the new tokens, and the scatter index from
flattened new tokens into the padded query layout. Every layer then does one gather and one batched
SDPA. Decode is the extend case with one new token per request. An extend batch with no cached
prefix in any row (fresh prompts) plans no mask: query row j of each request sees keys 0..j, which is
SDPA's own `is_causal` on the padded batch (rows past a request's length are padding, dropped after),
and the kernel then skips the key blocks above the diagonal, which it computes under a mask.

For a captured decode step (runner/graphs/graph_runner.py) the plan is written into static buffers sized
once for the largest captured batch (`init_cuda_graph_state`), so every tensor the step reads has
the same shape at each replay of one padded batch size: [bs] request rows and lengths, and a
[bs, graph_kv_len] index and mask. `graph_kv_len` is the whole context when a device graph needs
fixed addresses (CUDA), or the step's longest sequence rounded up to KV_LEN_ALIGN when the consumer
is an opaque op that only needs fixed shapes per replay (the CPU captured step). On CUDA this is the
reference backend, not the fast one: it gathers K/V each layer instead of reading pages in place
(flashinfer does that there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner import batch_invariant, cpu_kernels
from runner.attention import cpu_decode
from runner.forward_batch import ForwardBatch, get_forward_context

# Captured steps on the CPU round the attended length up to this, so SDPA sees few distinct shapes.
KV_LEN_ALIGN = 64


@dataclass
class TorchNativeMetadata:
    kv_indices: torch.Tensor | None  # [bs, max_kv_len] KV slots (padding -> slot 0); None: not planned yet
    mask: torch.Tensor | None  # [bs, 1, max_q_len, max_kv_len] bool, True = attend; None when `causal`
    q_index: torch.Tensor | None  # [num_tokens] position of each new token in [bs * max_q_len]; None for decode
    max_q_len: int
    token_req: torch.Tensor | None = None  # [num_tokens] request row of each new token (deterministic mode)
    causal: bool = False  # extend with no cached prefix anywhere: SDPA's is_causal instead of the mask
    # What the paged kernel reads (runner/attention/cpu_decode.py); [bs] int64 each.
    req_pool_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    bs: int = 0
    extend_lens: torch.Tensor | None = None  # [bs] int64 new tokens per request (extend); None for decode


class TorchNativeAttnBackend:
    def __init__(self, runner, decode_kernel: bool | None = None) -> None:
        """decode_kernel: the CPU paged decode kernel (runner/attention/cpu_decode.py); None: the
        runner config's `cpu_kernels` (None there too: use it when it builds), False: gather + SDPA."""
        self.device = runner.device
        self.req_to_token = runner.req_to_token_pool.req_to_token  # [max_reqs, max_context]
        self.forward_metadata: TorchNativeMetadata | None = None
        self.graph_max_bs = 0  # static graph buffers, see init_cuda_graph_state
        # Whole-context attended length at replay (True: fixed addresses for device graphs).
        self.graph_full_kv = self.device.type == "cuda"
        if decode_kernel is None:
            decode_kernel = getattr(getattr(runner, "config", None), "cpu_kernels", None)
        self.decode_op = cpu_kernels.enabled(decode_kernel, self.device)  # the op namespace, or None

    # ---- eager steps ---------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if self.decode_op is not None and not batch_invariant.is_enabled():
            # The paged kernel reads the slots in place and needs no plan; the gather plan below is made
            # only if a layer needs it (a dtype or head_dim the kernel lacks), at its first call.
            q_lens = None if fb.forward_mode.is_decode() else fb.extend_seq_lens_cpu
            self.forward_metadata = TorchNativeMetadata(
                None, None, None, 1 if q_lens is None else max(q_lens), req_pool_indices=fb.req_pool_indices,
                seq_lens=fb.seq_lens, bs=fb.batch_size,
                extend_lens=None if q_lens is None else torch.tensor(q_lens, dtype=torch.int64))
            self._planned_for = fb
            return
        self.forward_metadata = self._plan_sdpa(fb)

    def _plan_sdpa(self, fb: ForwardBatch) -> TorchNativeMetadata:
        """The gather + SDPA plan of one step (see the module docstring)."""
        bs = fb.batch_size
        is_decode = fb.forward_mode.is_decode()
        seq_lens = fb.seq_lens_cpu
        max_kv = max(seq_lens)
        q_lens = [1] * bs if is_decode else fb.extend_seq_lens_cpu
        max_q = max(q_lens)
        dev = self.device
        seq_t = fb.seq_lens.view(bs, 1)
        kv_pos = torch.arange(max_kv, device=dev).view(1, max_kv)
        valid = kv_pos < seq_t  # [bs, max_kv]
        # Slice the columns first, so only [bs, max_kv] is copied whatever the context length;
        # slots past a row's length are stale, so they read slot 0 (masked out anyway).
        kv_indices = self.req_to_token[:, :max_kv].index_select(0, fb.req_pool_indices).mul_(valid)
        q_index = None
        # No cached prefix in any row: the keys a real query row may see are exactly those at or before
        # it (each request's KV length equals its query length), the plain causal mask of the padded batch.
        causal = not is_decode and max_q > 1 and not any(fb.extend_prefix_lens_cpu)
        if max_q == 1 and is_decode:
            mask = valid.view(bs, 1, 1, max_kv)
        elif causal:
            mask = None
        else:
            prefix_t = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64, device=dev).view(bs, 1, 1)
            q_pos = torch.arange(max_q, device=dev).view(1, max_q, 1) + prefix_t  # absolute query positions
            mask = (kv_pos.view(1, 1, max_kv) <= q_pos) & valid.view(bs, 1, max_kv)
            # Padded query rows would attend to nothing and give NaN; let them see key 0 (output dropped).
            mask[:, :, 0] = True
            mask = mask.unsqueeze(1)
        if max_q > 1:
            # Token j of request i goes to row i * max_q + j: arange over the tokens plus, per request,
            # i * max_q minus its first token's index (a fixed number of ops whatever the batch size).
            lens_t = torch.tensor(q_lens, dtype=torch.int64)
            starts = torch.cumsum(lens_t, 0) - lens_t
            shift = torch.arange(bs, dtype=torch.int64) * max_q - starts
            q_index = (torch.arange(int(lens_t.sum())) + shift.repeat_interleave(lens_t)).to(dev)
        md = TorchNativeMetadata(kv_indices, mask, q_index, max_q, causal=causal,
                                 req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens, bs=bs)
        if batch_invariant.is_enabled():
            md.token_req = batch_invariant.token_request_index(q_lens, dev)
        return md

    # ---- captured decode steps (the graph-runner protocol, runner/graphs/graph_runner.py) ------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        max_kv = self.req_to_token.shape[1]
        self.graph_max_bs = max_bs
        self.graph_kv_indices = torch.zeros(max_bs, max_kv, dtype=torch.int64, device=self.device)
        self.graph_mask = torch.zeros(max_bs, 1, 1, max_kv, dtype=torch.bool, device=self.device)
        self.graph_kv_pos = torch.arange(max_kv, device=self.device).view(1, max_kv)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        self._plan_graph(bs, req_pool_indices, seq_lens, int(seq_lens.max()) if bs else 1)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        self._plan_graph(bs, req_pool_indices, seq_lens, max(seq_lens_cpu))

    def _plan_graph(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, max_len: int) -> None:
        if bs > self.graph_max_bs:
            raise ValueError(f"padded batch size {bs} exceeds the graph state's max_bs={self.graph_max_bs}")
        full = self.graph_kv_indices.shape[1]
        kv_len = full if self.graph_full_kv else min(full, -(-max_len // KV_LEN_ALIGN) * KV_LEN_ALIGN)
        kv_pos = self.graph_kv_pos[:, :kv_len]
        seq_t = seq_lens[:bs].view(bs, 1)
        valid = kv_pos < seq_t  # [bs, kv_len]
        rows = self.req_to_token[req_pool_indices[:bs], :kv_len]
        kv_indices = self.graph_kv_indices[:bs, :kv_len]
        torch.where(valid, rows, torch.zeros_like(rows), out=kv_indices)
        mask = self.graph_mask[:bs, :, :, :kv_len]
        mask.copy_(valid.view(bs, 1, 1, kv_len))
        self.forward_metadata = TorchNativeMetadata(kv_indices, mask, None, 1, req_pool_indices=req_pool_indices[:bs],
                                                    seq_lens=seq_lens[:bs], bs=bs)

    # ---- attention -------------------------------------------------------------------------
    def _kernel_applies(self, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether a layer of this geometry attends through the paged kernel (runner/attention/cpu_decode.py)."""
        return (self.decode_op is not None and not batch_invariant.is_enabled()
                and cpu_decode.usable(dtype, cache_dtype, head_dim))

    def kernel_plan_of(self, fb: ForwardBatch, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int):
        """(req_to_token, req_pool_indices, seq_lens, extend_lens) for `fb` when a layer of this geometry runs
        the paged kernel (extend_lens None for decode), else None. Made from the batch alone, without planning
        the backend's step, so a thread may prepare a step while another one runs on the backend's current
        plan; the fused forward (runner/models/fused_layer.py) attends through it only where `_attend` would."""
        if not self._kernel_applies(dtype, cache_dtype, head_dim):
            return None
        ext = None if fb.forward_mode.is_decode() else torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)
        return self.req_to_token, fb.req_pool_indices.contiguous(), fb.seq_lens.contiguous(), ext

    def _attend(self, q: torch.Tensor, layer, fb: ForwardBatch | None) -> torch.Tensor:
        md = self.forward_metadata
        bs = md.bs
        hq, d = layer.num_heads, layer.head_dim
        pool = get_forward_context().token_to_kv_pool
        if self._kernel_applies(q.dtype, pool.dtype, d) and not (torch.is_grad_enabled() and q.requires_grad):
            return cpu_decode.paged_attention(
                self.decode_op, q.view(-1, hq, d), pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id],
                self.req_to_token, md.req_pool_indices, md.seq_lens, md.extend_lens, layer.scaling)  # [tokens, hq, d]
        if md.kv_indices is None:  # planned for the kernel, and this layer cannot use it
            self.forward_metadata = md = self._plan_sdpa(self._planned_for)
        if batch_invariant.is_enabled():  # per token, fixed KV blocks (runner/batch_invariant.py)
            return batch_invariant.attention(q, pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id],
                                             md.kv_indices, md.token_req, fb.positions, layer.scaling)
        # index_select on the flat slot list, not advanced indexing with the 2-D index: the same
        # gather, ~4x faster on the CPU at decode shapes (16 x 64 slots: 11 us vs 48 us).
        flat = md.kv_indices.reshape(-1)  # a view for eager plans; one copy per layer for graph slices
        kv_shape = (bs, md.kv_indices.shape[1], layer.num_kv_heads, d)
        # bf16 is attended in bf16 (as transformers does): at the 0.5B decode shape (16 requests, 48-96
        # keys, 2 threads) torch 2.13's CPU flash kernel took 0.72-0.77x the fp32 call with its K/V/q/out
        # casts (1 thread: the same), and fewer parallel regions per layer. fp16 is not measured on
        # the CPU: it stays in fp32.
        dt = torch.float32 if q.device.type == "cpu" and q.dtype == torch.float16 else q.dtype
        if md.q_index is None and md.max_q_len == 1:
            return self._decode_grouped(q, layer, flat, kv_shape, dt, md.mask, pool)
        k = pool.k_buffer[layer.layer_id].index_select(0, flat).view(kv_shape)  # [bs, max_kv, kv_heads, d]
        v = pool.v_buffer[layer.layer_id].index_select(0, flat).view(kv_shape)
        if md.q_index is None:
            qp = q.view(bs, 1, hq, d)
        else:
            qp = q.new_zeros(bs * md.max_q_len, hq, d)
            qp[md.q_index] = q
            qp = qp.view(bs, md.max_q_len, hq, d)
        # Fresh prompts: is_causal skips the blocks above the diagonal (one 2048-token prompt of the 0.5B
        # shape, bf16, 2 threads: 74 ms per layer against 136 ms under the same mask; 4 x 512: no change).
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2).to(dt), k.transpose(1, 2).to(dt), v.transpose(1, 2).to(dt),
            attn_mask=md.mask, is_causal=md.causal, scale=layer.scaling, enable_gqa=hq != layer.num_kv_heads,
        )  # [bs, hq, max_q, d]
        out = out.transpose(1, 2).reshape(bs * md.max_q_len, hq, d).to(q.dtype)
        return out if md.q_index is None else out[md.q_index]  # [num_tokens, hq, d]

    @staticmethod
    def _decode_grouped(q: torch.Tensor, layer, flat: torch.Tensor, kv_shape: tuple, dt: torch.dtype,
                        mask: torch.Tensor, pool) -> torch.Tensor:
        """One new token per request, the query heads that share a KV head taken as that head's query
        rows: SDPA of [bs, kv_heads, group, d] against [bs, kv_heads, max_kv, d]. The same sums as the
        GQA call per (request, head), but each gathered K/V block is read once per KV head instead of
        once per query head, in a quarter of the kernel's work items (1.5x faster at the 40M and 0.5B
        decode shapes on one thread here). Casts the gathered K/V while contiguous (one pass each) when
        `dt` is not the pool's dtype."""
        bs, _, hkv, d = kv_shape
        group = layer.num_heads // hkv
        k = pool.k_buffer[layer.layer_id].index_select(0, flat).to(dt).view(kv_shape)  # [bs, max_kv, hkv, d]
        v = pool.v_buffer[layer.layer_id].index_select(0, flat).to(dt).view(kv_shape)
        qg = q.to(dt).view(bs, hkv, group, d)  # head h reads KV head h // group, as enable_gqa
        out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=layer.scaling)  # [bs, hkv, group, d]; mask [bs, 1, 1, max_kv]
        return out.reshape(bs, layer.num_heads, d).to(q.dtype)  # [bs, hq, d]

    def forward_extend(self, q: torch.Tensor, layer, fb: ForwardBatch) -> torch.Tensor:
        return self._attend(q, layer, fb)

    def forward_decode(self, q: torch.Tensor, layer, fb: ForwardBatch | None) -> torch.Tensor:
        return self._attend(q, layer, fb)
