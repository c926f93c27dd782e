"""Routing replay (R3) for a mixture-of-experts policy: train on the experts the rollout used.

The rollout engine and the trainer's transformers model compute the same router logits up to float
noise, but a top-k choice turns that noise into a discrete flip: a token routed to expert 3 in the
engine and to expert 5 in the trainer has a logprob the trainer cannot reproduce, and the importance
ratio on it is noise. Routing replay takes the engine's choice (`generate(...,
return_routed_experts=True)`, meta_info["routed_experts"]) and makes the trainer's forward use it:
inside `routing_replay(model, routed)` every router's top-k *indices* come from `routed`, while the
routing *weights* are recomputed from the trainer's own router logits at those indices (softmax over
all experts, gathered, renormalised exactly as the model's router does), so the router still gets its
gradient.

Layout. The engine returns, per sample, one row per position it processed (prompt positions first,
then every sampled token but the last, which it never fed back), each [num_layers][top_k] int32, -1
for a dense layer; SGLang's layout, base64 of little-endian int32 C order. `pack_routed_experts`
pads those into [B, T, num_layers, top_k] aligned with an Experience's input_ids (position t =
token t); -1 marks positions with no rollout routing (padding, the last token), where the model
routes itself.

Supported routers: transformers' Qwen3-MoE and Mixtral top-k routers. Does not replay routing in
the engine (the engine always routes itself), and does not handle expert parallelism.
"""

from __future__ import annotations

import base64
import contextlib
import re
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

# transformers router class -> how its top-k weights are renormalised: the name of its boolean
# attribute (norm_topk_prob), or True when it always renormalises.
ROUTER_RENORMALIZE: dict[str, str | bool] = {
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "MixtralTopKRouter": True,
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: nn.Module) -> dict[int, nn.Module]:
    """{decoder layer id: its top-k router} for every sparse layer of a transformers MoE model."""
    routers: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("TopKRouter") and kind not in ROUTER_RENORMALIZE:
            raise ValueError(f"routing replay does not know the router {kind} ({name}); supported: "
                             f"{sorted(ROUTER_RENORMALIZE)}")
        if kind in ROUTER_RENORMALIZE:
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"router {name} is not inside a decoder layer (model.layers.N...)")
            routers[int(match.group(1))] = module
    return routers


def is_moe_policy(model: nn.Module) -> bool:
    return bool(find_routers(model))


def num_decoder_layers(model: nn.Module) -> int:
    return int(model.config.num_hidden_layers)


def decode_routed_experts(encoded: str, num_layers: int, top_k: int) -> torch.Tensor:
    """meta_info["routed_experts"] (base64 int32, SGLang's layout) -> [num_rows, num_layers, top_k] int32."""
    raw = base64.b64decode(encoded)
    row_bytes = 4 * num_layers * top_k
    if len(raw) % row_bytes:
        raise ValueError(f"routed_experts has {len(raw)} bytes, not a whole number of rows of "
                         f"[num_layers={num_layers}][top_k={top_k}] int32 ({row_bytes} bytes)")
    array = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)
    return torch.from_numpy(array.astype(np.int32))  # a copy: frombuffer's view is read-only


def pack_routed_experts(routed: Sequence[torch.Tensor], seq_len: int) -> torch.Tensor:
    """Per-sample [num_rows_i, num_layers, top_k] -> [B, seq_len, num_layers, top_k] int32, -1 padded.

    Row p of sample i lands at position p (the experts that routed token p of its input_ids)."""
    if not routed:
        raise ValueError("pack_routed_experts needs at least one sample")
    shape = tuple(routed[0].shape[1:])
    out = torch.full((len(routed), seq_len, *shape), -1, dtype=torch.int32)
    for i, rows in enumerate(routed):
        if rows.dim() != 3 or tuple(rows.shape[1:]) != shape:
            raise ValueError(f"routed experts of sample {i} have shape {tuple(rows.shape)}; expected "
                             f"[num_rows, {shape[0]}, {shape[1]}] like sample 0")
        if rows.shape[0] > seq_len:
            raise ValueError(f"routed experts of sample {i} have {rows.shape[0]} rows, more than its "
                             f"{seq_len} positions")
        out[i, : rows.shape[0]] = rows
    return out


def _renormalizes(router: nn.Module) -> bool:
    rule = ROUTER_RENORMALIZE[type(router).__name__]
    return rule if isinstance(rule, bool) else bool(getattr(router, rule))


def _check_routed(model: nn.Module, routers: dict[int, nn.Module], routed: torch.Tensor) -> None:
    num_layers = num_decoder_layers(model)
    any_router = next(iter(routers.values()))
    top_k, num_experts = int(any_router.top_k), int(any_router.num_experts)
    if routed.dim() != 4 or tuple(routed.shape[2:]) != (num_layers, top_k):
        raise ValueError(f"routed_experts must be [B, T, num_layers={num_layers}, top_k={top_k}], got "
                         f"{tuple(routed.shape)}")
    if routed.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"routed_experts must be an integer tensor, got {routed.dtype}")
    bad = (routed < -1) | (routed >= num_experts)
    if bool(bad.any()):
        raise ValueError(f"routed_experts holds expert ids outside [-1, {num_experts}) (num_experts), e.g. "
                         f"{routed[bad][:5].tolist()}")


@contextlib.contextmanager
def routing_replay(model: nn.Module, routed: torch.Tensor | None) -> Iterator[None]:
    """Within the block, `model`'s routers pick the experts in `routed` ([B, T, num_layers, top_k],
    -1 = route this position itself) for the [B, T] batch the model is called on.

    A no-op when `routed` is None. Raises ValueError for a dense model or a tensor of the wrong shape;
    a forward on a batch of another shape raises naming both shapes.
    """
    if routed is None:
        yield
        return
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"routing replay needs a mixture-of-experts model; {type(model).__name__} has no "
                         f"top-k routers (supported: {sorted(ROUTER_RENORMALIZE)})")
    _check_routed(model, routers, routed)
    flat = routed.reshape(-1, *routed.shape[2:])  # [B * T, num_layers, top_k]
    handles = [router.register_forward_hook(_replay_hook(flat[:, layer_id], _renormalizes(router), layer_id,
                                                         tuple(routed.shape[:2])))
               for layer_id, router in routers.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replay_hook(layer_routed: torch.Tensor, renormalize: bool, layer_id: int, batch_shape: tuple):
    """A forward hook that swaps a router's (logits, weights, ids) for the replayed ids and their weights.

    layer_routed: [B * T, top_k], this layer's rollout experts per flattened position."""

    def hook(module: nn.Module, args, output):
        router_logits, own_weights, own_ids = output  # [N, E], [N, top_k], [N, top_k]
        if router_logits.shape[0] != layer_routed.shape[0]:
            raise ValueError(f"routing replay was set up for a batch of {batch_shape} (B, T) = "
                             f"{layer_routed.shape[0]} positions; layer {layer_id}'s router got "
                             f"{router_logits.shape[0]}")
        replay = layer_routed.to(own_ids.device, torch.int64)
        use = (replay >= 0).all(dim=-1, keepdim=True)  # [N, 1]: rows the rollout routed
        ids = torch.where(use, replay, own_ids)
        probs = torch.softmax(router_logits.float(), dim=-1)  # the router's own order of operations
        weights = probs.gather(-1, ids)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return router_logits, weights.to(own_weights.dtype), ids

    return hook
