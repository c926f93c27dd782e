"""torch-native attention over the paged KV cache (SDPA on gathered pages). Runs everywhere.

Each step is planned once in `init_forward_metadata`: the KV slots of every request gathered into a
padded [bs, max_kv_len] index, a boolean mask that is causal over the cached prefix plus the new
tokens, and the scatter index from flattened new tokens into the padded query layout. Every layer
then does one gather and one batched SDPA. Decode is the extend case with one new token per request.
This is the reference backend, not the fast one: it gathers K/V each layer instead of reading pages
in place (flashinfer does that on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner.forward_batch import ForwardBatch


@dataclass
class TorchNativeMetadata:
    kv_indices: torch.Tensor  # [bs, max_kv_len] KV slots (padding -> slot 0)
    mask: torch.Tensor  # [bs, 1, max_q_len, max_kv_len] bool, True = attend
    q_index: torch.Tensor | None  # [num_tokens] position of each new token in [bs * max_q_len]; None for decode
    max_q_len: int


class TorchNativeAttnBackend:
    def __init__(self, runner) -> None:
        self.device = runner.device

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        bs = fb.batch_size
        seq_lens = fb.seq_lens_cpu
        max_kv = max(seq_lens)
        if fb.forward_mode.is_decode():
            q_lens, prefix_lens = [1] * bs, [s - 1 for s in seq_lens]
        else:
            q_lens, prefix_lens = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        max_q = max(q_lens)
        dev = self.device
        seq_t = fb.seq_lens.view(bs, 1)
        kv_pos = torch.arange(max_kv, device=dev).view(1, max_kv)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_kv]
        kv_indices = torch.where(kv_pos < seq_t, rows, torch.zeros_like(rows))
        prefix_t = torch.tensor(prefix_lens, dtype=torch.int64, device=dev).view(bs, 1, 1)
        q_pos = torch.arange(max_q, device=dev).view(1, max_q, 1) + prefix_t  # absolute query positions
        mask = (kv_pos.view(1, 1, max_kv) <= q_pos) & (kv_pos.view(1, 1, max_kv) < seq_t.view(bs, 1, 1))
        # Padded query rows would attend to nothing and give NaN; let them see key 0 (output dropped).
        mask[:, :, 0] = True
        q_index = None
        if max_q > 1:
            q_index = torch.cat([
                torch.arange(n, dtype=torch.int64) + i * max_q for i, n in enumerate(q_lens)
            ]).to(dev)
        fb.attn_metadata = TorchNativeMetadata(kv_indices, mask.unsqueeze(1), q_index, max_q)

    def _attend(self, q: torch.Tensor, layer, fb: ForwardBatch) -> torch.Tensor:
        md: TorchNativeMetadata = fb.attn_metadata
        bs, hq, d = fb.batch_size, layer.num_heads, layer.head_dim
        pool = fb.token_to_kv_pool
        k = pool.k_buffer[layer.layer_id][md.kv_indices]  # [bs, max_kv, kv_heads, d]
        v = pool.v_buffer[layer.layer_id][md.kv_indices]
        if md.q_index is None:
            qp = q.view(bs, 1, hq, d)
        else:
            qp = q.new_zeros(bs * md.max_q_len, hq, d)
            qp[md.q_index] = q
            qp = qp.view(bs, md.max_q_len, hq, d)
        # CPU SDPA in bf16/fp16 ran ~5x slower than in fp32 at decode shapes here: compute in fp32.
        dt = torch.float32 if q.device.type == "cpu" else q.dtype
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2).to(dt), k.transpose(1, 2).to(dt), v.transpose(1, 2).to(dt),
            attn_mask=md.mask, scale=layer.scaling, enable_gqa=hq != layer.num_kv_heads,
        )  # [bs, hq, max_q, d]
        out = out.transpose(1, 2).reshape(bs * md.max_q_len, hq, d).to(q.dtype)
        return out if md.q_index is None else out[md.q_index]  # [num_tokens, hq, d]

    def forward_extend(self, q: torch.Tensor, layer, fb: ForwardBatch) -> torch.Tensor:
        return self._attend(q, layer, fb)

    def forward_decode(self, q: torch.Tensor, layer, fb: ForwardBatch) -> torch.Tensor:
        return self._attend(q, layer, fb)
