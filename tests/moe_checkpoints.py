"""Tiny random-weight Hugging Face mixture-of-experts checkpoints (Qwen3-MoE, Mixtral) for tests.

Same recipe as tests/checkpoints.py (transformers' `save_pretrained`, so the files carry HF's own
per-expert names `...experts.{e}.gate_proj.weight` / `...block_sparse_moe.experts.{e}.w1.weight`; the
same seeded re-draw of every parameter; the same byte-level tokenizer), plus a router gain so the
top-k choice is rarely a near-tie: a runner that drifts by float noise still picks HF's experts.

Qwen3-MoE defaults to norm_topk_prob=True (as the released models) with the dense-MLP path exercised
by `mlp_only_layers`; Mixtral always renormalizes. Nothing here downloads anything.
"""

from __future__ import annotations

import pathlib

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from tests.checkpoints import _randomize, base_config_fields, make_tokenizer

MOE_ARCHS = ("qwen3_moe", "mixtral")
NUM_EXPERTS = 8
TOP_K = 2
ROUTER_GAIN = 3.0  # router logits std ~3: the k-th and (k+1)-th expert are rarely within float noise


def _config(arch: str, num_hidden_layers: int, hidden_size: int, **overrides):
    common = base_config_fields(num_hidden_layers, hidden_size, tie_word_embeddings=False)
    common.update(num_experts_per_tok=TOP_K, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "qwen3_moe":
        common.update(head_dim=32, intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size // 2,
                      num_experts=NUM_EXPERTS, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        cls = Qwen3MoeConfig
    elif arch == "mixtral":
        common.update(intermediate_size=hidden_size, num_local_experts=NUM_EXPERTS, sliding_window=None)
        cls = MixtralConfig
    else:
        raise ValueError(f"unknown MoE arch {arch!r}; expected one of {MOE_ARCHS}")
    common.update(overrides)
    return cls(**common)


def make_moe_checkpoint(
    path: str | pathlib.Path,
    arch: str,
    *,
    seed: int = 0,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    with_tokenizer: bool = True,
    **config_overrides,
) -> pathlib.Path:
    """Write a tiny random `arch` MoE checkpoint (fp32) into `path` and return it. Same arguments, same bytes."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = _config(arch, num_hidden_layers, hidden_size, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        _randomize(model, gen)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".mlp.gate.weight"):  # the router, [num_experts, hidden] (both archs in memory)
                    p.mul_(ROUTER_GAIN)
    model.save_pretrained(path)
    if with_tokenizer:
        make_tokenizer(path)
    return path


@torch.no_grad()
def hf_routed_experts(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """HF's routing for one unpadded sequence: [len(ids), num_layers, top_k] int32, the top-k experts of
    softmax(router logits) per token and layer, best first; -1 in every slot of a dense layer."""
    out = hf_model(torch.tensor([ids]), output_router_logits=True)
    layers = hf_model.model.layers
    top_k = hf_model.config.num_experts_per_tok
    routed = torch.full((len(ids), len(layers), top_k), -1, dtype=torch.int32)
    sparse = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    assert len(sparse) == len(out.router_logits), (sparse, len(out.router_logits))
    for layer_id, logits in zip(sparse, out.router_logits):  # logits: [len(ids), num_experts]
        routed[:, layer_id] = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices.int()
    return routed


def expert_counts(routed: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[num_tokens, num_layers, top_k] expert ids (-1 = none) -> [num_layers, num_experts] int64 counts."""
    num_layers = routed.shape[1]
    counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)
    for layer_id in range(num_layers):
        ids = routed[:, layer_id].reshape(-1).long()
        ids = ids[ids >= 0]
        counts[layer_id] += torch.bincount(ids, minlength=num_experts)
    return counts
