"""The Llama-family forward as C++ ops on the CPU (runner/csrc/decoder_layer.cpp), and when each applies.

Two ops run the ops the modules run (this extension's norm, rotary and paged attention kernels, the
oneDNN-prepacked or dense linears, the gated MLP), in the same order, so their results are bitwise the
modules': a faster way to call the same computation, not another numerics. `model_forward` is the whole
LlamaForCausalLM forward (embedding, every layer, final norm, LM head -> next-token logits), driven by a
`FusedModel` that ModelRunner calls (`prepare_forward` / `forward`); `decoder_layer` is one layer, which
LlamaModel.forward calls per covered layer when the whole model is not fused (an MoE model's dense
layers). What they save is the interpreter between ~15 op calls per layer, at a small model's decode
sizes most of a layer's time, and the GIL for their duration, which the overlap schedule's scheduler
thread (rollout/overlap.py) or a server's event loop uses meanwhile.

`enable(model, ops)` (the runner, when the CPU kernels are loaded) marks the layers whose structure the op
covers (a dense gated MLP, one rank) and builds the FusedModel when all are covered. Per step, either
path returns None, so the modules run, wherever anything differs from the ops' assumptions: LoRA
adapters, batch-invariant or HF-numerics mode, a compiled (captured) step, autograd, a dtype or
head_dim the kernels lack, another attention backend or KV pool dtype; the whole-model op also leaves
input embeddings, all-position logits and an fp32 or vocab-parallel LM head to the modules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from runner import batch_invariant, cpu_kernels, hf_numerics
from runner.forward_batch import ForwardBatch, current_lora_batch, get_forward_context
from runner.layers.attention import PagedAttention
from runner.layers.linear import Linear, MergedLinear, QKVLinear
from runner.layers.logits import last_token_indices
from runner.layers.norm import RMSNorm
from runner.layers.ops import GatedPacked

DENSE, PACKED, GATED_PACKED = 0, 1, 2  # the op's linear kinds


def covers(layer: nn.Module) -> bool:
    """Whether the op's structure is this layer's: Llama attention (fused q|k|v, o_proj, paged attention)
    on one rank and a dense gated MLP. Judged by the parts (this module does not import the model files,
    which import it)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (attn is not None and mlp is not None and isinstance(getattr(attn, "attn", None), PagedAttention)
            and type(getattr(attn, "qkv_proj", None)) is QKVLinear and type(getattr(attn, "o_proj", None)) is Linear
            and type(getattr(mlp, "gate_up_proj", None)) is MergedLinear
            and type(getattr(mlp, "down_proj", None)) is Linear
            and isinstance(getattr(layer, "input_layernorm", None), RMSNorm)
            and isinstance(getattr(layer, "post_attention_layernorm", None), RMSNorm))


def enable(model: nn.Module, ops) -> int:
    """Give every covered decoder layer of `model` (a causal LM whose `.model.layers` are Llama-family
    layers) the op namespace (None turns the fused path off), and the model its `fused_model` (a
    FusedModel, or None); returns how many layers are covered."""
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", None) or [])
    count = 0
    for layer in layers:
        layer.fused_ops = ops if ops is not None and covers(layer) else None
        count += layer.fused_ops is not None
    if inner is not None and layers:
        inner.fused_ops = ops if count else None
    model.fused_model = FusedModel.build(model, ops) if count else None
    return count


def _linear(m: nn.Module) -> tuple[list, int]:
    packed = m.packed
    if packed is None:
        return [m.weight, m.bias], DENSE
    if isinstance(packed, GatedPacked):
        return [*packed.gate, *packed.up], GATED_PACKED
    return list(packed), PACKED


class Step(NamedTuple):
    """What every fused layer of one forward shares: the op namespace, the KV pool, the attention plan."""

    ops: object
    pool: object
    plan: tuple  # (req_to_token, req_pool_indices, seq_lens, extend_lens) as the paged kernel takes them


def prepare(ops, hidden: torch.Tensor, fb: ForwardBatch, head_dim: int) -> Step | None:
    """The per-forward half of the decision (once per step, not per layer): a Step when this forward's layers
    may run fused, else None. hidden: the embedding output [num_tokens, hidden_size]."""
    dtype = hidden.dtype
    if (ops is None or fb.forward_mode.is_idle() or dtype not in cpu_kernels.DTYPES or hidden.device.type != "cpu"
            or torch.is_grad_enabled() or torch.compiler.is_compiling() or batch_invariant.is_enabled()
            or hf_numerics.is_enabled() or current_lora_batch() is not None):
        return None
    ctx = get_forward_context()
    pool = ctx.token_to_kv_pool
    plan_of = getattr(ctx.attn_backend, "kernel_plan_of", None)
    if plan_of is None or getattr(pool, "dtype", None) != dtype:
        return None
    plan = plan_of(fb, dtype, pool.dtype, head_dim)
    return None if plan is None else Step(ops, pool, plan)


def _layer_args(layer: nn.Module, dtype: torch.dtype) -> tuple[list, list[int], float, float] | None:
    """The op's view of one layer: (14 params, 4 linear kinds, eps, qk_eps), or None when it does not fit.
    Params: [ln1, ln2, qkv_w, qkv_b, o_w, o_b, gate_up x4, down_w, down_b, q_norm, k_norm]."""
    if layer.fused_ops is None:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    if (ln1.weight.dtype != dtype or ln2.weight.dtype != dtype or ln1.eps != ln2.eps or ln1.cpu_ops is None
            or attn.rotary[0].cpu_ops is None):
        return None
    q_norm = k_norm = None
    qk_eps = 0.0
    if attn.qk_norm:
        q_norm, k_norm, qk_eps = attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps
        if q_norm.dtype != dtype or k_norm.dtype != dtype or attn.q_norm.eps != attn.k_norm.eps:
            return None
    qkv, qkv_kind = _linear(attn.qkv_proj)
    o, o_kind = _linear(attn.o_proj)
    gate_up, gate_up_kind = _linear(mlp.gate_up_proj)
    if gate_up_kind != GATED_PACKED:
        gate_up = gate_up + [None, None]
    down, down_kind = _linear(mlp.down_proj)
    return ([ln1.weight, ln2.weight, *qkv, *o, *gate_up, *down, q_norm, k_norm],
            [qkv_kind, o_kind, gate_up_kind, down_kind], ln1.eps, qk_eps)


def call(step: Step, layer: nn.Module, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
         residual: torch.Tensor | None, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mlp output, residual) of `layer` as LlamaDecoderLayer.forward computes them, or None where the
    Python layer must run. hidden, residual: [num_tokens, hidden_size]."""
    args = _layer_args(layer, hidden.dtype)
    if args is None:
        return None
    p, kinds, eps, qk_eps = args
    attn = layer.self_attn
    layer_id = attn.attn.layer_id
    pool = step.pool
    return step.ops.decoder_layer(
        hidden, residual, *cos_sin, p[0], p[1], eps, p[2:4], kinds[0], p[4:6], kinds[1], p[6:10], kinds[2],
        p[10:12], kinds[3], p[12], p[13], qk_eps, pool.k_buffer[layer_id], pool.v_buffer[layer_id],
        fb.out_cache_loc, *step.plan, attn.num_heads, attn.num_kv_heads, attn.attn.scaling)


class FusedModel:
    """LlamaForCausalLM's whole forward as one op (runner/csrc/decoder_layer.cpp model_forward): embedding,
    every layer, final norm, LM head -> next-token logits [bs, vocab] fp32, bitwise the module's.

    Built once by `enable` when every layer is covered (and the embedding and LM head are not vocab-
    parallel); what never changes after loading (the modules, dtype, eps, head geometry) is resolved then.
    The op's parameter list is cached and rebuilt only when a prepacked shadow changed (a weight update
    repacks): the Parameters themselves keep their identity through every update and release (their
    .data changes in place), and the KV pool is read from the runner at each step. `args` needs only the
    batch, the KV pool and the attention backend, not the step's forward context or the backend's plan,
    so the overlap schedule prepares a step on its scheduler thread while the previous one runs
    (runner/model_runner.py prepare_forward)."""

    def __init__(self, causal_lm: nn.Module) -> None:
        model = causal_lm.model
        self.causal_lm = causal_lm
        self.dtype = model.embed_tokens.weight.dtype
        self.layers = list(model.layers)
        self.linears = [m for layer in self.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self.linears.append(causal_lm.lm_head)
        first = self.layers[0].self_attn
        self.geometry = (first.num_heads, first.num_kv_heads, first.attn.scaling)
        self.head_dim = first.head_dim
        self.eps = self.layers[0].input_layernorm.eps
        self.qk_eps = 0.0  # set by build, from the layers' q/k norms
        self.direct = cpu_kernels.direct()  # runner/csrc/direct.cpp: the op without torch.ops' GIL round trips
        # (packed-shadow key, the direct module's FusedWeights of the parameter lists), replaced as one tuple
        # so a thread preparing a step never reads half of a refresh.
        self._cache: tuple = (None, None)

    @classmethod
    def build(cls, causal_lm: nn.Module, ops) -> FusedModel | None:
        model = getattr(causal_lm, "model", None)
        layers = getattr(model, "layers", None)
        if (ops is None or cpu_kernels.direct() is None or not layers or model.embed_tokens.tp is not None
                or causal_lm.lm_head.tp is not None
                or any(getattr(layer, "fused_ops", None) is None for layer in layers)):
            return None
        plan = cls(causal_lm)
        dtype = plan.dtype
        args = [_layer_args(layer, dtype) for layer in layers]
        if (dtype not in cpu_kernels.DTYPES or any(a is None for a in args)
                or len({(a[2], a[3]) for a in args}) != 1 or model.norm.eps != plan.eps
                or model.norm.weight.dtype != dtype or model.norm.cpu_ops is None
                or any(layer.self_attn.attn.layer_id != i or (layer.self_attn.num_heads, layer.self_attn.num_kv_heads,
                                                              layer.self_attn.attn.scaling) != plan.geometry
                       for i, layer in enumerate(layers))):
            return None
        plan.qk_eps = args[0][3]
        return plan

    def _weights(self):
        """The op's FusedWeights (the layers' and the LM head's parameter lists, held on the C++ side), rebuilt
        only when a prepacked shadow changed (a weight update repacks)."""
        key = tuple(id(m.packed) for m in self.linears)
        cache = self._cache
        if cache[0] == key:
            return cache[1]
        params, kinds = [], []
        for layer in self.layers:
            p, k, _, _ = _layer_args(layer, self.dtype)
            params += p
            kinds += k
        head = self.causal_lm.lm_head
        head_params, head_kind = ([head.weight, None], DENSE) if head.packed is None else _linear(head)
        weights = self.direct.FusedWeights(params, kinds, head_params, head_kind, self.eps, self.qk_eps, *self.geometry)
        self._cache = (key, weights)
        return weights

    def args(self, fb: ForwardBatch, pool, backend) -> tuple | None:
        """model_forward's arguments for `fb`, or None where the module's forward must run."""
        if (fb.forward_mode.is_idle() or fb.input_embeds is not None or fb.replace_embeds is not None
                or (fb.forward_mode.is_extend() and fb.return_all_logits) or self.causal_lm.lm_head.fp32
                or torch.compiler.is_compiling() or batch_invariant.is_enabled() or hf_numerics.is_enabled()
                or getattr(pool, "dtype", None) != self.dtype):
            return None
        plan_of = getattr(backend, "kernel_plan_of", None)
        plan = None if plan_of is None else plan_of(fb, self.dtype, pool.dtype, self.head_dim)
        if plan is None:
            return None
        model = self.causal_lm.model
        rotary = model.rotary_emb
        last = None if fb.forward_mode.is_decode() else last_token_indices(fb, fb.input_ids.device)
        return (self._weights(), fb.input_ids, fb.positions, model.embed_tokens.weight, rotary.cos_cached,
                rotary.sin_signed_cached, model.norm.weight, last, pool.k_buffer, pool.v_buffer, fb.out_cache_loc, *plan)

    def run(self, args: tuple) -> torch.Tensor:
        """The logits [bs, vocab] fp32 of prepared `args`. The GIL is released from the op's start to its
        return, with no hand-back in between (runner/csrc/direct.cpp says why that needs a direct call)."""
        return self.direct.model_forward(*args)

    def run_sample(self, args: tuple, fill_from: torch.Tensor | None, fill_index: torch.Tensor | None,
                   info) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step in one GIL-free call: args' input ids first set to fill_from (rows fill_index of it,
        when given), then `run`, then the sampler's plain path (runner/sampler.py plain_rows must hold for
        `info`) -> (logits [bs, vocab] in the model dtype, ids [bs] int64, logprobs [bs] fp32 or empty)."""
        return self.direct.model_forward_sample(
            *args, fill_from, fill_index, info.temperatures, info.seeds, info.seed_mix, info.steps,
            info.is_all_greedy, info.has_greedy, info.need_temperature, info.need_logprobs)

    def run_sample_steps(self, args: tuple, out_cache_locs: torch.Tensor, info,
                         stop_flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """len(out_cache_locs) decode steps of the batch `args` was prepared for (a decode batch), in one GIL-free
        call: step j > 0 takes step j - 1's ids as input, one position further on, and writes its KV into
        out_cache_locs[j] ([num_steps, bs]; already in req_to_token). The sampler's plain path must hold for
        `info` (its output positions those of step 0). No further step starts once another thread sets
        `stop_flag` (int32 [1]) non-zero -> (ids [done, bs] int64, logprobs [done, bs] fp32 or empty), done >= 1."""
        (weights, input_ids, positions, embed, cos, sin, norm, _last, k_buffer, v_buffer, _loc, req_to_token,
         req_pool_indices, seq_lens, _ext) = args
        return self.direct.model_forward_sample_steps(
            weights, input_ids, positions, embed, cos, sin, norm, k_buffer, v_buffer, out_cache_locs, req_to_token,
            req_pool_indices, seq_lens, info.temperatures, info.seeds, info.seed_mix, info.steps,
            info.is_all_greedy, info.has_greedy, info.need_temperature, info.need_logprobs, stop_flag)
