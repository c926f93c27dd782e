"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on the runner's layers.

Parameter names are Hugging Face's except the fused `qkv_proj` and `gate_up_proj`;
`stacked_params_mapping` tells the loader where each HF shard goes. Does not handle sliding-window
attention (ModelConfig caps the context at the window instead).

Tensor parallelism is decided at construction: built inside `runner.tp.group.building(tp)`, the
attention takes this rank's heads (column-parallel q|k|v, row-parallel o_proj), the MLP its slice of the
intermediate size, and the embedding and LM head their vocabulary rows (runner/layers/linear.py,
embedding.py). Parameter names stay the same, so the loader and every weight route are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.config import ModelConfig
from runner.forward_batch import ForwardBatch, LogitsOutput
from runner.layers.activation import gated_silu_and_mul
from runner.layers.attention import PagedAttention
from runner.layers.embedding import LMHead, VocabEmbedding
from runner.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedLinear,
    QKVLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from runner.layers.logits import compute_logits
from runner.layers.norm import RMSNorm
from runner.layers.rotary import RotaryEmbedding
from runner.models import fused_layer
from runner.tp.group import current_tp


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        tp = current_tp()
        tp_size = 1 if tp is None else tp.size
        # This rank's heads; a KV head is replicated when there are fewer KV heads than ranks.
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        if tp is None:
            self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                                      config.attention_bias)
            self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        else:
            self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                              config.num_key_value_heads, config.attention_bias, tp)
            self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                            config.o_proj_bias, tp)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.attn = PagedAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(n, self.num_heads, self.head_dim))  # [num_tokens, num_heads, head_dim]
            k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
            q, k = self.rotary[0].apply(q, k, *cos_sin)
        else:
            # q and k heads rotated as one tensor: half the elementwise launches, the same value per
            # element (per-op overhead is a large part of a small model's decode step).
            qk = qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = self.rotary[0].apply_one(qk, *cos_sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [num_tokens, heads, head_dim] views
        return self.o_proj(self.attn(q, k, v, fb))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter, tp = config.intermediate_size, current_tp()
        if tp is None:
            self.gate_up_proj = MergedLinear(config.hidden_size, {0: inter, 1: inter})
            self.down_proj = Linear(inter, config.hidden_size)
        else:
            size = inter // tp.size
            rows = (inter, tp.rank * size, size)
            self.gate_up_proj = ColumnParallelLinear(config.hidden_size, {0: rows, 1: rows})
            self.down_proj = RowParallelLinear(inter, config.hidden_size, False, tp)
        self.gate_up_proj.gated = True  # prepacked as gate and up halves (runner/layers/prepack.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_silu_and_mul(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    fused_ops = None  # torch.ops.rollout_cpu when this layer may run as one C++ op (runner/models/fused_layer.py)

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin, hidden, residual, fb):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, current_tp())
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head_dim = config.head_dim
        self.fused_ops = None  # set with the layers' by runner/models/fused_layer.py enable()

    def forward(self, input_ids, positions, fb: ForwardBatch) -> torch.Tensor:
        if fb.input_embeds is not None:
            hidden = fb.input_embeds.to(self.embed_tokens.weight.dtype)
        else:
            hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
            if fb.replace_embeds is not None:
                hidden = hidden.index_copy(0, fb.replace_positions, fb.replace_embeds.to(hidden.dtype))
        # Looked up once per forward and handed to every layer; never stored on the batch.
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)  # 2 x [num_tokens, 1, head_dim]
        residual = None
        # Each covered layer as one C++ op when this step allows it (runner/models/fused_layer.py): bitwise
        # the same result as the module's forward.
        step = fused_layer.prepare(self.fused_ops, hidden, fb, self.head_dim)
        for layer in self.layers:
            out = None if step is None else fused_layer.call(step, layer, cos_sin, hidden, residual, fb)
            hidden, residual = layer(cos_sin, hidden, residual, fb) if out is None else out
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # (runner param, HF name piece, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied, tp=current_tp())

    @torch.no_grad()
    def forward(self, input_ids, positions, fb: ForwardBatch) -> LogitsOutput:
        hidden = self.model(input_ids, positions, fb)
        return compute_logits(hidden, self.lm_head, fb)
