"""Attention with transformers' numerics, for `rl_on_policy_target="fsdp"` (an HF/FSDP trainer's logprobs).

An HF trainer scores a whole sequence of length L with one SDPA call in the model dtype: q, k, v
[1, heads, L, head_dim], `is_causal=True`, `enable_gqa`. How torch's kernel blocks and reduces row t
depends on L (its query and key blocks), not only on the keys row t sees. So this backend makes that
very call for every request, whatever the step: q, k, v of the request's planned final length L
(`ForwardBatch.final_seq_lens_cpu`: prompt + max_new_tokens), holding this step's query rows at their
positions and the K/V computed so far, zeros elsewhere (rows not computed yet; the causal mask keeps
row t from reading any key after t, so their values never matter), and keeps the rows of this step.
Each row is then what the trainer's forward computes for it, bit for bit, given the same inputs.

A sequence that stops before its planned length was computed for a longer L than the trainer will
use; rows may then differ in the last bits. Cost: one [L x L] causal SDPA per request per layer per
step (O(L^2) per decode step instead of O(L)); an opt-in numerics mode, not a fast path. The default
torch-native backend batches requests and computes in fp32 on the CPU, which rounds differently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.attention.torch_native import TorchNativeAttnBackend
from runner.forward_batch import ForwardBatch, get_forward_context


class HFSdpaAttnBackend(TorchNativeAttnBackend):
    def __init__(self, runner) -> None:
        super().__init__(runner, decode_kernel=False)  # transformers' SDPA call is the point here

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        super().init_forward_metadata(fb)
        bs = fb.batch_size
        q_lens = [1] * bs if fb.forward_mode.is_decode() else list(fb.extend_seq_lens_cpu)
        finals = fb.final_seq_lens_cpu or [None] * bs
        self._rows = [(kv, n, max(kv, final or kv)) for kv, n, final in zip(fb.seq_lens_cpu, q_lens, finals)]

    def _attend(self, q: torch.Tensor, layer, fb: ForwardBatch | None) -> torch.Tensor:
        # q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]
        md = self.forward_metadata
        pool = get_forward_context().token_to_kv_pool
        k_buf, v_buf = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        outs, start = [], 0
        for i, (kv_len, n, full) in enumerate(self._rows):
            slots = md.kv_indices[i, :kv_len]
            first = kv_len - n  # position of this step's first row
            qf = q.new_zeros(full, layer.num_heads, layer.head_dim)  # [L, heads, d]
            qf[first:kv_len] = q[start : start + n]
            kf = q.new_zeros(full, layer.num_kv_heads, layer.head_dim)  # [L, kv_heads, d]
            vf = torch.zeros_like(kf)
            kf[:kv_len] = k_buf.index_select(0, slots).to(q.dtype)
            vf[:kv_len] = v_buf.index_select(0, slots).to(q.dtype)
            out = F.scaled_dot_product_attention(  # HF's call on the whole sequence
                qf.transpose(0, 1).unsqueeze(0), kf.transpose(0, 1).unsqueeze(0), vf.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=layer.scaling, enable_gqa=True)  # [1, heads, L, d]
            outs.append(out[0, :, first:kv_len].transpose(0, 1))  # [n, heads, d]
            start += n
        return torch.cat(outs)
