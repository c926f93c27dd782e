"""CUDA-graph decode: one graph per padded batch size, replayed behind `ModelRunner.forward`.

`CudaGraphRunner` keeps the graph-runner contract of runner/graphs/graph_runner.py. At init it captures the
decode step for the padded batch sizes `cuda_graph_bs` when given, else
`capture_batch_sizes(cuda_graph_max_bs)` (1, 2, 4, 8, then steps of 8), largest first, all into one shared graph memory pool, inside the memory saver's
`cuda_graph` region (`memory_saver.graph_capture`; pauseable with torch_memory_saver in preload mode).
Each size gets two eager warm-ups on the capture stream first (flashinfer JIT, cuBLAS handles and
the allocator settle there, never inside capture). A replay copies the batch into static [max_bs]
buffers (padding rows: KV slot 0, request row PAD_REQ_ROW, length 1), re-plans the attention
backend's static metadata for that size, replays, and returns the first `batch_size` logits rows.
ModelRunner.forward never replays while the `cuda_graph` memory tag is released (decode runs
eagerly until it is resumed), and capture refuses then (memory_saver.graph_capture).

Validity: weight updates write parameters in place, so graphs stay valid. torch_memory_saver keeps
virtual addresses across release/resume, so graphs stay valid there too. The portable memory saver
moves memory on resume; it bumps `address_epoch`, and the next replay recaptures every size first.

The returned logits are a view of the graph's static output: the next replay overwrites them (the
sampler reads them before that). All torch.cuda calls go through `CudaGraphApi`, so the capture
order and padding logic can be exercised on the CPU with a named stand-in; nothing here runs a
kernel itself. This module is imported only on CUDA (ModelRunner.init_device_graphs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from runner.forward_batch import ForwardBatch, ForwardContext, ForwardMode, LogitsOutput, forward_context
from runner.graphs.graph_runner import (
    PAD_REQ_ROW,
    StaticDecodeInputs,
    capture_batch_sizes,
    is_replayable,
    padded_size,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256  # CUDA default for cuda_graph_max_bs (capped at max_running_requests)
NUM_WARMUPS = 2


def graph_sizes(sizes: list[int], max_running_requests: int) -> list[int]:
    """`cuda_graph_bs` as captured: ascending, unique, none above max_running_requests (a batch never
    gets that large, so a graph of that size would only cost memory)."""
    kept = sorted({int(s) for s in sizes if s <= max_running_requests})
    if not kept:
        raise ValueError(f"cuda_graph_bs={sorted(sizes)}: every size exceeds max_running_requests="
                         f"{max_running_requests}; give sizes <= it")
    dropped = sorted({int(s) for s in sizes} - set(kept))
    if dropped:
        logger.info("cuda_graph_bs: sizes %s exceed max_running_requests=%d and are not captured", dropped,
                    max_running_requests)
    return kept


class CudaGraphApi:
    """The torch.cuda calls of capture and replay, in one place."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def capture(self, saver, pool, stream, step: Callable[[], torch.Tensor]):
        """Capture `step()` into a new graph (pool shared with earlier ones); returns (graph, output)."""
        graph = torch.cuda.CUDAGraph()
        with saver.graph_capture(graph, pool=pool, stream=stream):
            out = step()
        return graph, out


class CudaGraphRunner:
    released_with_cuda_graph_tag = True  # ModelRunner.forward runs eagerly while that tag is released
    def __init__(self, runner, max_bs: int | None = None, capture_sizes: list[int] | None = None,
                 api: CudaGraphApi | None = None) -> None:
        self.runner = runner
        cfg = runner.server_config
        if max_bs is None:
            max_bs = getattr(cfg, "cuda_graph_max_bs", None) or DEFAULT_MAX_BS
        max_bs = min(max_bs, cfg.max_running_requests)
        if capture_sizes is None:
            capture_sizes = getattr(cfg, "cuda_graph_bs", None)
        self.capture_bs = (graph_sizes(capture_sizes, cfg.max_running_requests) if capture_sizes
                           else capture_batch_sizes(max_bs))
        self.max_bs = self.capture_bs[-1]
        self.api = api or CudaGraphApi(runner.device)
        # Static buffers live outside every memory-saver region: they are read by every graph and
        # must never come back zeroed from a resume.
        self.inputs = StaticDecodeInputs(self.max_bs, runner.device)
        runner.attn_backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bs, vocab] fp32 static logits per size
        self.pool = None
        self.capture_order: list[int] = []  # sizes in the order of the last capture (largest first)
        self.num_captures = 0  # full captures so far (1 at init; +1 per recapture)
        self.capture_seconds = 0.0
        self.capture()

    # ---- capture ----------------------------------------------------------------------------
    def _context(self) -> ForwardContext:
        r = self.runner
        return ForwardContext(r.attn_backend, r.token_to_kv_pool, r.req_to_token_pool)

    def _step(self, bs: int) -> torch.Tensor:
        inp = self.inputs
        fb = ForwardBatch(ForwardMode.DECODE, bs, inp.input_ids[:bs], inp.positions[:bs], inp.req_pool_indices[:bs],
                          inp.seq_lens[:bs], inp.out_cache_loc[:bs], [1] * bs)
        with torch.no_grad(), forward_context(self._context()):
            return self.runner.model(fb.input_ids, fb.positions, fb).next_token_logits  # [bs, vocab]

    def _pad_all(self, bs: int) -> None:
        inp = self.inputs
        for buf, fill in ((inp.input_ids, 0), (inp.positions, 0), (inp.out_cache_loc, 0), (inp.seq_lens, 1),
                          (inp.req_pool_indices, PAD_REQ_ROW)):
            buf[:bs].fill_(fill)

    def capture(self) -> None:
        """Capture every size, largest first, into one pool (dropping any earlier graphs first)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
        self.capture_order = []
        api, backend = self.api, self.runner.attn_backend
        t0 = time.perf_counter()
        stream = api.new_stream()
        for bs in reversed(self.capture_bs):
            self._pad_all(bs)  # capture on padding rows only: their K/V land in slot 0
            backend.init_forward_metadata_capture_cuda_graph(bs, self.inputs.req_pool_indices, self.inputs.seq_lens)
            api.synchronize()
            stream.wait_stream(api.current_stream())
            with api.stream(stream):
                for _ in range(NUM_WARMUPS):
                    self._step(bs)
            api.synchronize()
            graph, out = api.capture(self.runner.memory_saver, self.pool, stream, lambda bs=bs: self._step(bs))
            self.pool = graph.pool()
            self.graphs[bs], self.outputs[bs] = graph, out
            self.capture_order.append(bs)
        api.synchronize()
        self.num_captures += 1
        self.epoch = self.runner.memory_saver.address_epoch
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA-graph decode sizes (max %d) in %.1f s", len(self.capture_bs), self.max_bs,
                    self.capture_seconds)

    # ---- replay -------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        from runner.expert_distribution import recorder_is_active  # MoE hooks run only in eager steps

        return is_replayable(fb, self.max_bs) and not recorder_is_active(self.runner.model)

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        if self.epoch != self.runner.memory_saver.address_epoch or not self.graphs:
            self.capture()  # memory moved (portable saver resume) or reset(): the old graphs are stale
        bs = fb.batch_size
        padded = padded_size(bs, self.capture_bs)
        seq_lens_cpu = self.inputs.fill(fb, padded)
        self.runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            padded, self.inputs.req_pool_indices, self.inputs.seq_lens, seq_lens_cpu)
        self.graphs[padded].replay()
        return LogitsOutput(self.outputs[padded][:bs])  # [bs, vocab] fp32, a view of the static output

    def reset(self) -> None:
        """Drop every graph (and its pool); the next replay captures again."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
