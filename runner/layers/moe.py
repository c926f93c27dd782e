"""Mixture-of-experts layers: top-k softmax routing, the fused experts layer, the sparse MoE block.

`FusedExperts` holds every expert's weights stacked in two tensors (`w13_weight` = gate|up per expert,
`w2_weight` = down per expert) and runs the tokens grouped per expert: the (token, slot) pairs are
sorted by expert id, each expert multiplies its contiguous group, and the results are put back and
summed with the routing weights. With `F.grouped_mm` (one call per projection, group offsets on the
device) nothing is read back to the host; where its layout rules do not hold it falls back to one
matmul per expert, which reads the group sizes once per layer. Inside a compiled decode step
(runner/graphs/cpu_graph_runner.py) the grouping runs behind one opaque op, `rollout::fused_experts`.

Per-expert Hugging Face tensors (`experts.{e}.gate_proj.weight`, ...) load into the stacked tensors
through the ordinary loader: each stacked parameter carries `view_shard(data, (expert_id, part))`,
which `runner.layers.linear.shard_view` uses for the slice one HF tensor fills.

Does not do expert parallelism, shared experts, grouped/biased routing (DeepSeek) or quantized
experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner import batch_invariant
from runner.layers.activation import silu_and_mul
from runner.layers.linear import Linear, default_weight_loader

EXPERT_PARTS = ("gate", "up", "down")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in fp32), then the top k; `renormalize` rescales those k to sum to 1.

    router_logits: [num_tokens, num_experts] -> (weights [num_tokens, top_k] fp32, ids [num_tokens, top_k] int64).
    Same order of operations as transformers' Qwen3-MoE (renormalize = norm_topk_prob) and Mixtral
    (always renormalized) routers.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _expert_shard_view(data: torch.Tensor, shard_id: tuple[int, str]) -> torch.Tensor:
    """The slice of a stacked expert tensor one HF tensor fills: (expert_id, "gate"|"up"|"down")."""
    expert_id, part = shard_id
    if part == "down":
        return data[expert_id]  # w2: [num_experts, hidden, intermediate] -> [hidden, intermediate]
    half = data.shape[1] // 2  # w13: [num_experts, 2 * intermediate, hidden], gate rows first
    return data[expert_id, :half] if part == "gate" else data[expert_id, half:]


# (device type, dtype, in_features, out_features) -> whether F.grouped_mm runs there; probed once.
_GROUPED_MM_OK: dict[tuple, bool] = {}


def _grouped_mm_works(x: torch.Tensor, weight: torch.Tensor) -> bool:
    key = (x.device.type, x.dtype, weight.shape[2], weight.shape[1])
    if key not in _GROUPED_MM_OK:
        # Its kernels have layout rules (16-byte strides; bf16 only on some CUDA parts): run it once
        # on one row of the real shapes rather than predicting them.
        try:
            probe = x.new_zeros(1, weight.shape[2])
            offs = torch.ones(weight.shape[0], dtype=torch.int32, device=x.device)
            F.grouped_mm(probe, weight.transpose(1, 2), offs=offs)
            _GROUPED_MM_OK[key] = True
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_OK[key] = False
    return _GROUPED_MM_OK[key]


def decode_graph_blocker(model: nn.Module, dtype: torch.dtype, capability: tuple[int, int],
                         deterministic: bool) -> str | None:
    """Why a CUDA graph cannot capture `model`'s decode step on a device of compute `capability`, or None.
    Only MoE layers stand in the way: capture refuses a device-to-host read, and the experts read their
    group sizes to the host unless F.grouped_mm takes its capturable kernels, which (torch's GroupedBlas.cpp)
    need bf16 on compute capability 9.x or 10.x; elsewhere it falls back to a loop that reads the offsets,
    and the deterministic mode runs one fixed-tile matmul per expert on purpose."""
    if not any(isinstance(m, FusedExperts) for m in model.modules()):
        return None
    if deterministic:
        return "the deterministic mode runs each expert's rows through its own matmul (group sizes read to the host)"
    if dtype != torch.bfloat16 or capability[0] not in (9, 10):
        return (f"F.grouped_mm captures only in bfloat16 on compute capability 9.x/10.x (here {dtype} on "
                f"{capability[0]}.{capability[1]}); elsewhere the experts read their group sizes to the host")
    return None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row group g of `x` times `weight[g]^T`, for rows sorted by group.

    x: [num_rows, in]; weight: [num_groups, out, in]; offsets: [num_groups] int32, end row of each
    group; counts: [num_groups], rows per group. Returns [num_rows, out].
    """
    deterministic = batch_invariant.is_enabled()
    if not deterministic and _grouped_mm_works(x, weight):
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    # One matmul per non-empty group: needs the group sizes on the host (one read per call). In the
    # deterministic mode each group goes through the fixed-tile linear, so a row's bits do not depend on
    # how many other rows (from other requests) chose the same expert; grouped_mm's kernels make no
    # such promise.
    chunks = x.split(counts.tolist())
    mm = batch_invariant.linear if deterministic else F.linear
    return torch.cat([mm(c, weight[g]) for g, c in enumerate(chunks) if c.shape[0]])


class FusedExperts(nn.Module):
    """All experts of one MoE layer in two stacked tensors; SiLU-gated MLP per expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = default_weight_loader
            p.view_shard = _expert_shard_view

    def param_for(self, part: str) -> str:
        """Name of the stacked parameter that expert part `part` ("gate", "up", "down") lands in."""
        return "w2_weight" if part == "down" else "w13_weight"

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]; topk_weights: [num_tokens, top_k] fp32; topk_ids: [num_tokens, top_k]
        if torch.compiler.is_compiling():
            # Inside a captured decode step (runner/graphs/cpu_graph_runner.py) the data-dependent grouping
            # runs behind one opaque op; the weights stay graph inputs, so in-place updates are seen.
            return _fused_experts_op(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Tokens grouped per expert through the stacked weights; see the module docstring.

    x: [num_tokens, hidden]; w13: [num_experts, 2 * intermediate, hidden]; w2: [num_experts, hidden,
    intermediate]; topk_weights: [num_tokens, top_k]; topk_ids: [num_tokens, top_k] -> [num_tokens, hidden].
    """
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)  # [num_tokens * top_k], row r is (token r // top_k, slot r % top_k)
    order = flat_ids.argsort(stable=True)  # rows grouped by expert
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    grouped = x[order // top_k]  # [num_tokens * top_k, hidden], sorted by expert
    hidden = silu_and_mul(grouped_linear(grouped, w13, offsets, counts))  # [rows, intermediate]
    out_sorted = grouped_linear(hidden, w2, offsets, counts)  # [rows, hidden]
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted  # back to (token, slot) order
    out = out.view(num_tokens, top_k, -1).float() * topk_weights.unsqueeze(-1)
    # A plain sum over the k slots (not atomics): the same result whatever the grouping. The
    # deterministic mode adds the slots one by one, left to right: element-wise adds, whose bits cannot
    # depend on the number of tokens (a reduction kernel may vectorise differently by shape).
    if batch_invariant.is_enabled():
        acc = out[:, 0]
        for j in range(1, top_k):
            acc = acc + out[:, j]
        return acc.to(x.dtype)  # [num_tokens, hidden]
    return out.sum(dim=1).to(x.dtype)  # [num_tokens, hidden]


@torch.library.custom_op("rollout::fused_experts", mutates_args=())
def _fused_experts_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    return fused_experts(x, w13, w2, topk_weights, topk_ids)


@_fused_experts_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(x)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, a bias-free linear to num_experts logits) + top-k routing + fused experts.

    `recorder` (runner.expert_distribution) sees every layer's chosen expert ids when it is active;
    when it is not, the cost is one attribute read per layer.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, layer_id: int, recorder) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.layer_id = layer_id
        self.recorder = recorder
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)  # [num_tokens, num_experts]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.recorder.is_active:
            self.recorder.on_select_experts(self.layer_id, topk_ids)
        return self.experts(hidden, topk_weights, topk_ids)
