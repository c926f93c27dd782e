"""Mixture-of-experts decoders: Qwen3-MoE (Qwen3MoeForCausalLM) and Mixtral (MixtralForCausalLM).

Both are the Llama-family decoder of llama.py (same attention, norms, rotary and layer forward; the
flags in ModelConfig give Qwen3-MoE its q/k norm) with the MLP of some or all layers replaced by a
`SparseMoeBlock` (runner/layers/moe.py): softmax routing over all experts, top-k, renormalized for
Mixtral always and for Qwen3-MoE when `norm_topk_prob`. Qwen3-MoE layers are sparse when
`(layer_id + 1) % decoder_sparse_step == 0` and not in `mlp_only_layers` (those keep a dense MLP of
`intermediate_size`), as in transformers.

Runner parameter names follow the module tree `model.layers.{i}.mlp.{gate, experts.w13_weight,
experts.w2_weight}`. `extra_weight_targets()` tells the loader which HF names fill them: every
`...experts.{e}.{gate_proj|up_proj|down_proj}.weight` (Qwen3-MoE) or `...block_sparse_moe.experts.{e}.
{w1|w3|w2}.weight` (Mixtral) a slice of the stacked tensors, and Mixtral's
`...block_sparse_moe.gate.weight` the router. Each model owns an `ExpertDistributionRecorder`
(`expert_recorder`) and brackets every forward with its hooks.

Does not do shared experts (Qwen2-MoE), expert parallelism, or Mixtral's sliding window (ModelConfig
caps the context at the window instead).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from runner.config import ModelConfig
from runner.expert_distribution import ExpertDistributionRecorder
from runner.forward_batch import ForwardBatch, LogitsOutput
from runner.layers.embedding import LMHead
from runner.layers.logits import compute_logits
from runner.layers.moe import EXPERT_PARTS, FusedExperts, SparseMoeBlock
from runner.layers.rotary import RotaryEmbedding
from runner.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass(frozen=True)
class MoEConfig:
    """The MoE part of an HF config.json, validated."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    sparse_layers: frozenset[int]
    hf_block: str  # HF module name of the sparse block: "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    hf_parts: dict  # expert part -> HF projection name

    @classmethod
    def from_model_config(cls, config: ModelConfig) -> MoEConfig:
        raw, arch = config.hf_config, config.architecture
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):  # swish: transformers' other name for SiLU
            raise ValueError(f"{arch} with hidden_act={raw['hidden_act']!r} is not supported (only 'silu')")
        if arch == "MixtralForCausalLM":
            num_experts = raw["num_local_experts"]
            moe = cls(num_experts, raw["num_experts_per_tok"], config.intermediate_size, True,
                      frozenset(range(config.num_hidden_layers)), "block_sparse_moe",
                      {"gate": "w1", "up": "w3", "down": "w2"})
        elif arch == "Qwen3MoeForCausalLM":
            # Qwen's own configs say num_experts; transformers 5 writes num_local_experts.
            num_experts = raw.get("num_experts", raw.get("num_local_experts"))
            if num_experts is None:
                raise ValueError(f"{arch}: config.json has neither num_experts nor num_local_experts")
            step = raw.get("decoder_sparse_step", 1)
            if num_experts > 0 and step < 1:
                raise ValueError(f"{arch}: decoder_sparse_step={step} must be >= 1")
            dense = set(raw.get("mlp_only_layers") or [])
            sparse = frozenset(i for i in range(config.num_hidden_layers)
                               if num_experts > 0 and i not in dense and (i + 1) % step == 0)
            moe = cls(num_experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"],
                      bool(raw.get("norm_topk_prob", False)), sparse, "mlp",
                      {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
        else:
            raise ValueError(f"{arch} is not a mixture-of-experts architecture")
        if moe.sparse_layers and not 1 <= moe.top_k <= moe.num_experts:
            raise ValueError(f"{arch}: num_experts_per_tok={moe.top_k} must be in [1, {moe.num_experts}] "
                             f"(the number of experts)")
        return moe


class MoEDecoderLayer(LlamaDecoderLayer):
    """llama.py's decoder layer (attention, norms, forward) whose `mlp` is a SparseMoeBlock when sparse."""

    def __init__(self, config: ModelConfig, moe: MoEConfig, layer_id: int, rotary: RotaryEmbedding,
                 recorder: ExpertDistributionRecorder) -> None:
        sparse = layer_id in moe.sparse_layers
        # A sparse layer is built with a 1-wide placeholder dense MLP, replaced right away: everything
        # else about the layer stays exactly llama.py's.
        super().__init__(replace(config, intermediate_size=1) if sparse else config, layer_id, rotary)
        if sparse:
            self.mlp = SparseMoeBlock(config.hidden_size, moe.num_experts, moe.top_k,
                                      moe.expert_intermediate_size, moe.renormalize, layer_id, recorder)


class MoEModel(LlamaModel):
    """llama.py's model (embedding, rotary, final norm, forward) over MoE decoder layers."""

    def __init__(self, config: ModelConfig, moe: MoEConfig, recorder: ExpertDistributionRecorder) -> None:
        super().__init__(replace(config, num_hidden_layers=0))  # no Llama layers; ours come next
        self.layers = nn.ModuleList(
            MoEDecoderLayer(config, moe, i, self.rotary_emb, recorder) for i in range(config.num_hidden_layers)
        )


class MoEForCausalLM(nn.Module):
    """Qwen3MoeForCausalLM and MixtralForCausalLM: they differ only in what MoEConfig reads."""

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping  # q/k/v and dense gate/up

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.moe_config = MoEConfig.from_model_config(config)
        device = torch.empty(0).device  # the runner builds the model under `with torch.device(...)`
        self.expert_recorder = ExpertDistributionRecorder(config.num_hidden_layers, max(1, self.moe_config.num_experts),
                                                          max(1, self.moe_config.top_k), device)
        self.model = MoEModel(config, self.moe_config, self.expert_recorder)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def extra_weight_targets(self) -> Iterator[tuple[str, str, object]]:
        """(HF name, runner parameter name, shard id) for every weight not loaded by identity."""
        moe = self.moe_config
        for name, module in self.named_modules():
            if not isinstance(module, FusedExperts):
                continue
            block = name.removesuffix(".experts")  # model.layers.{i}.mlp
            hf_block = f"{block.removesuffix('.mlp')}.{moe.hf_block}"
            if hf_block != block:
                yield f"{hf_block}.gate.weight", f"{block}.gate.weight", None
            for expert_id in range(module.num_experts):
                for part in EXPERT_PARTS:
                    yield (f"{hf_block}.experts.{expert_id}.{moe.hf_parts[part]}.weight",
                           f"{name}.{module.param_for(part)}", (expert_id, part))

    @torch.no_grad()
    def forward(self, input_ids, positions, fb: ForwardBatch) -> LogitsOutput:
        recorder = self.expert_recorder
        if recorder.is_active:
            recorder.on_forward_pass_start(positions.shape[0], int(fb.forward_mode))
        hidden = self.model(input_ids, positions, fb)
        if recorder.is_active:
            recorder.on_forward_pass_end()
        return compute_logits(hidden, self.lm_head, fb)
