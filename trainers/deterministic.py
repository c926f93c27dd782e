"""True on-policy logprobs: the trainer runs the engine's own model code, batch-invariant, with autograd.

With `--deterministic` the engine runs with `enable_deterministic_inference=True` (runner/batch_invariant.py)
and the trainer computes its logprobs through `RunnerPolicy`: an instance of the runner's model class
whose parameters are, at every forward, the HF policy's own tensors (fused q|k|v and gate|up are
concatenated from them, which autograd differentiates back into the HF parameters). The same layer
code, the same fixed-tile linears, the same per-token fixed-block attention and the engine sampler's
own `processed_logprobs` then give logprobs bitwise equal to the ones the engine reported for the same
weights and tokens, so the rollout/trainer mismatch is exactly 0.

Why a view over the HF parameters rather than a copy: the HF model stays the one source of truth
(optimizer, weight sync, save_pretrained, reference model, value head), nothing has to be kept in
step, and the gradient lands where the optimizer already looks. MoE models (Qwen3-MoE, Mixtral) work
the same way: each stacked expert tensor is stacked from the HF per-expert tensors, and the router runs
the engine's code on the same bits, so the trainer picks exactly the rollout's experts (routing replay
is not needed, and not combined with this mode). What this does not do: tensor parallelism, or any
attention but the causal one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from runner import batch_invariant
from runner.config import ModelConfig
from runner.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context
from runner.layers.moe import EXPERT_PARTS
from runner.models import get_model_class
from runner.sampler import SamplingBatchInfo, processed_logprobs
from runner.weights.loader import WeightNameMap
from trainers.policy import checkpoint_named_tensors


class _OwnKV:
    """The KV pool and attention backend of one trainer forward: K/V stay autograd tensors of this
    forward (no paged cache), and each token attends over its own sequence's keys."""

    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        offsets = torch.tensor([0, *seq_lens[:-1]], dtype=torch.int64).cumsum(0)
        width = max(seq_lens)
        rows = offsets.view(-1, 1) + torch.arange(width).view(1, -1)  # [B, max_len] flat index per position
        self.kv_rows = rows.clamp(max=sum(seq_lens) - 1).to(device)  # positions past a length are masked
        self.token_req = batch_invariant.token_request_index(seq_lens, device)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer_id] = (k, v)  # [num_tokens, num_kv_heads, head_dim], in token order (loc = arange)

    def forward_extend(self, q: torch.Tensor, layer, fb: ForwardBatch) -> torch.Tensor:
        k, v = self.kv[layer.layer_id]
        return batch_invariant.attention(q, k, v, self.kv_rows, self.token_req, fb.positions, layer.scaling)


class RunnerPolicy:
    """The runner's model class evaluated on an HF policy's parameters (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, model_path: str) -> None:
        self.hf_model = hf_model
        self.config = ModelConfig.from_pretrained(model_path)
        param = next(hf_model.parameters())
        # Built like ModelRunner.load_model (so the rotary table is cast the same way); its own
        # parameter storage is dropped: every forward supplies the HF tensors instead.
        with torch.device(param.device):
            model = get_model_class(self.config)(self.config)
        self.model = model.to(param.dtype).eval()
        name_map = WeightNameMap(self.model)
        self.sources: dict[str, list[str]] = {}  # runner param -> HF names, in fused shard order
        # MoE: stacked expert param -> HF tensors per expert (w13: gate then up; w2: down), experts in order
        self.expert_parts: dict[str, int] = {}
        for hf_name, target in name_map.targets.items():
            self.sources.setdefault(target.param_name, []).append((hf_name, target.shard_id))
        for pname, pieces in self.sources.items():
            p = name_map.params[pname]
            if isinstance(pieces[0][1], tuple):  # (expert_id, "gate"|"up"|"down"): runner.layers.moe
                pieces.sort(key=lambda hs: (hs[1][0], EXPERT_PARTS.index(hs[1][1])))
                self.expert_parts[pname] = len(pieces) // p.shape[0]
            else:
                pieces.sort(key=lambda hs: 0 if hs[1] is None else p.shard_offsets[hs[1]][0])
            self.sources[pname] = [hf for hf, _ in pieces]
        hf_names = self._hf_tensors()
        missing = [n for names in self.sources.values() for n in names if n not in hf_names]
        if missing:
            raise ValueError(f"the policy has no parameter {missing[0]!r} that the runner model "
                             f"{type(self.model).__name__} needs ({len(missing)} missing)")
        for p in self.model.parameters():
            p.data = p.data.new_empty(0)

    def _hf_tensors(self) -> dict[str, torch.Tensor]:
        """HF parameters under checkpoint names: transformers keeps an MoE layer's experts stacked in
        memory, the runner's name map names them per expert (views of the stacked tensors, no copy)."""
        tensors = dict(self.hf_model.named_parameters(remove_duplicate=False))
        tensors.update(checkpoint_named_tensors(self.hf_model))
        return tensors

    def parameters(self) -> dict[str, torch.Tensor]:
        """Runner parameter name -> the HF tensor(s) it is made of (differentiable)."""
        hf = self._hf_tensors()
        out = {}
        for pname, names in self.sources.items():
            parts = self.expert_parts.get(pname)
            if parts is not None:  # [num_experts, out, in]: each expert's parts concatenated, then stacked
                out[pname] = torch.stack([torch.cat([hf[n] for n in names[i: i + parts]])
                                          for i in range(0, len(names), parts)])
            else:
                out[pname] = hf[names[0]] if len(names) == 1 else torch.cat([hf[n] for n in names])
        return out

    def logits(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """[sum(len), vocab] fp32 logits at every position of each 1-D id sequence, batch-invariant."""
        lens = [int(s.numel()) for s in seqs]
        device = seqs[0].device
        ids = torch.cat(seqs)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        fb = ForwardBatch(ForwardMode.EXTEND, len(seqs), ids, positions,
                          req_pool_indices=torch.arange(len(seqs), device=device),
                          seq_lens=torch.tensor(lens, device=device), out_cache_loc=torch.arange(ids.numel()),
                          seq_lens_cpu=lens, extend_prefix_lens_cpu=[0] * len(seqs), extend_seq_lens_cpu=lens,
                          return_all_logits=True)
        params = self.parameters()
        own = _OwnKV(lens, device)
        inner = {k.removeprefix("model."): v for k, v in params.items() if k.startswith("model.")}
        head = {"weight": params.get("lm_head.weight", params["model.embed_tokens.weight"])}
        with forward_context(ForwardContext(own, own, None)), batch_invariant.mode(True):
            hidden = functional_call(self.model.model, inner, (ids, positions, fb))  # [N, hidden]
            return functional_call(self.model.lm_head, head, (hidden,)).float()  # [N, vocab]


def deterministic_sequence_logprobs(policy: RunnerPolicy, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                    temperature: float) -> torch.Tensor:
    """[B, T]: out[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) at `temperature`, 0 at t = 0 and on
    padding; bitwise what a deterministic engine reports for the same weights and tokens. Rows must be
    right padded (attention_mask a prefix of ones), as trainers.experience builds them."""
    lens = attention_mask.sum(1).tolist()
    seqs = [input_ids[b, :n] for b, n in enumerate(lens)]
    logits = policy.logits(seqs)  # [N, vocab]
    n = logits.shape[0]
    # The engine sampler's own function, row by row the same reductions as at sampling time.
    info = SamplingBatchInfo.from_lists([temperature] * n, [1.0] * n, [-1] * n, [0.0] * n, [0] * n, [0] * n,
                                        logits.shape[1], logits.device)
    logp_all = processed_logprobs(logits, info)  # [N, vocab]
    out = torch.zeros(input_ids.shape, dtype=logp_all.dtype, device=input_ids.device)
    start = 0
    for b, length in enumerate(lens):
        if length > 1:
            nxt = input_ids[b, 1:length]
            out[b, 1:length] = logp_all[start:start + length - 1].gather(1, nxt.unsqueeze(1)).squeeze(1)
        start += length
    return out
