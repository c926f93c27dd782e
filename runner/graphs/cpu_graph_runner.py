"""The CPU analog of CUDA graphs: the decode forward compiled once per padded batch size.

`CpuGraphRunner` keeps the graph-runner contract of runner/graphs/graph_runner.py. For each captured batch
size the model's decode forward is compiled by torch.compile (inductor, static shapes, whole graph).
Compiling costs seconds per size (measured on this shared 2-core machine: 5 s warm / 17 s cold for a
2-layer test model, 8-55 s for 8 layers, 130 s for 24 layers; inductor's on-disk cache shortens a
restart), and saves at most milliseconds per step, so on the CPU it is opt-in: the runner is built
only when the sizes are given (`cuda_graph_bs`), and they are all captured at init, as SGLang does.
Never lazily mid-run: a compiled step rounds differently from the eager one by an ulp, and a rollout
must not change numerics halfway. A replay copies the batch into static [max_bs] buffers, pads it, plans attention into
the backend's static buffers and calls the compiled step; other batches run eagerly.

What is compiled and what is not. Inductor fuses everything between the matmuls (embedding, RMSNorm
with the residual add, rotary, SiLU-and-mul, the fp32 casts) into a few C++ loops: at the per-op
overhead of eager PyTorch that is most of the step on small models. The linears and the paged
attention stay opaque ops called from the compiled code, read at run time (`rollout::linear`,
`rollout::decode_attention`; they live in runner/layers/ops.py, below the layers and this runner).
It does not compile prefill (varying token counts) or the sampler.
"""

from __future__ import annotations

import logging
import time
import types

import torch

from runner.forward_batch import (
    ForwardBatch,
    ForwardContext,
    ForwardMode,
    LogitsOutput,
    forward_context,
)
from runner.graphs.graph_runner import StaticDecodeInputs, capture_batch_sizes, is_replayable, padded_size
from runner.layers.attention import PagedAttention
from runner.layers.embedding import LMHead
from runner.layers.linear import Linear
from runner.layers.ops import register_opaque

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 32  # CPU default for cuda_graph_max_bs: decode batches beyond it run eagerly

# ---- the graph runner ----------------------------------------------------------------------------
class CpuGraphRunner:
    def __init__(self, runner) -> None:
        self.runner = runner
        cfg = runner.config
        if cfg.cuda_graph_bs:
            self.capture_bs = sorted(set(cfg.cuda_graph_bs))
        else:
            self.capture_bs = capture_batch_sizes(min(cfg.cuda_graph_max_bs or DEFAULT_MAX_BS,
                                                      cfg.max_running_requests))
        self.max_bs = self.capture_bs[-1]
        self.inputs = StaticDecodeInputs(self.max_bs, runner.device)
        runner.attn_backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        for m in runner.model.modules():
            if isinstance(m, Linear | LMHead | PagedAttention):
                register_opaque(m)
        # One compiled entry per size, all of the same function: let dynamo keep them all.
        limit = len(self.capture_bs) + 2
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 8 * limit)
        # Dynamo keeps compiled entries (and counts recompiles against its limit) per code object. A
        # private copy of `_decode`'s code per runner keeps engines in one process from filling each
        # other's entries: otherwise the fifth engine or so silently falls back to eager.
        code = CpuGraphRunner._decode.__code__.replace()
        self._decode_fn = types.MethodType(types.FunctionType(code, globals(), "_decode"), self)
        self._compiled = torch.compile(self._decode_fn, dynamic=False, fullgraph=True)
        self.captured: set[int] = set()
        self.capture_seconds: dict[int, float] = {}  # padded size -> first-call (compile) seconds
        self.num_replays = 0
        if cfg.cuda_graph_bs:
            for bs in self.capture_bs:
                self.capture(bs)

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor) -> torch.Tensor:
        # input_ids, positions, out_cache_loc: [padded_bs] -> logits [padded_bs, vocab] fp32
        bs = input_ids.shape[0]
        fb = ForwardBatch(ForwardMode.DECODE, bs, input_ids, positions, input_ids, input_ids, out_cache_loc, [])
        return self.runner.model(input_ids, positions, fb).next_token_logits

    def _context(self) -> ForwardContext:
        r = self.runner
        return ForwardContext(r.attn_backend, r.token_to_kv_pool, r.req_to_token_pool)

    def can_run(self, fb: ForwardBatch) -> bool:
        from runner.expert_distribution import recorder_is_active  # MoE hooks run only in eager steps

        if not is_replayable(fb, self.max_bs) or recorder_is_active(self.runner.model):
            return False
        return padded_size(fb.batch_size, self.capture_bs) in self.captured

    def capture(self, bs: int) -> float:
        """Compile the step for padded size `bs` now, on padding rows only (KV slot 0); returns seconds."""
        if bs not in self.capture_bs:
            raise ValueError(f"batch size {bs} is not a capture size {self.capture_bs}")
        if bs in self.captured:
            return 0.0
        inp = self.inputs
        inp.input_ids[:bs].fill_(0)
        inp.positions[:bs].fill_(0)
        inp.out_cache_loc[:bs].fill_(0)
        inp.req_pool_indices[:bs].fill_(0)
        inp.seq_lens[:bs].fill_(1)
        self.runner.attn_backend.init_forward_metadata_capture_cuda_graph(bs, inp.req_pool_indices, inp.seq_lens)
        return self._run(bs)

    def _run(self, bs: int) -> torch.Tensor:
        inp = self.inputs
        first = bs not in self.captured
        t0 = time.perf_counter()
        with torch.no_grad(), forward_context(self._context()):
            logits = self._compiled(inp.input_ids[:bs], inp.positions[:bs], inp.out_cache_loc[:bs])
        if first:
            self.captured.add(bs)
            self.capture_seconds[bs] = time.perf_counter() - t0
            logger.info("captured CPU decode step for batch size %d in %.1f s", bs, self.capture_seconds[bs])
        return logits

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        bs = fb.batch_size
        padded = padded_size(bs, self.capture_bs)
        seq_lens_cpu = self.inputs.fill(fb, padded)
        self.runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            padded, self.inputs.req_pool_indices, self.inputs.seq_lens, seq_lens_cpu)
        logits = self._run(padded)  # [padded, vocab]
        self.num_replays += 1
        return LogitsOutput(logits[:bs])

    def reset(self) -> None:
        """Forget every compiled step (the next batch of each size recompiles)."""
        torch._dynamo.reset_code(self._decode_fn.__func__.__code__)
        self._compiled = torch.compile(self._decode_fn, dynamic=False, fullgraph=True)
        self.captured.clear()
        self.capture_seconds.clear()
