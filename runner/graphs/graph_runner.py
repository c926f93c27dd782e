"""The captured-decode seam: what `ModelRunner.forward` branches to, and what the attention backends
owe it. Implementations: runner/graphs/cuda_graph_runner.py (CUDA graphs) and runner/graphs/cpu_graph_runner.py
(a compiled static-shape decode step on the CPU). This file holds the contract and the pieces both
share (batch sizes, padding into static buffers); it captures nothing itself.

The contract (SGLang's names), which both implementations and every attention backend keep:

    class GraphRunner(Protocol):
        def can_run(self, fb: ForwardBatch) -> bool: ...
            # True only for a DECODE batch the runner can replay exactly: batch_size <= the largest
            # captured size, no input_embeds / replace_embeds, not return_all_logits.
        def replay(self, fb: ForwardBatch) -> LogitsOutput: ...
            # The same logits an eager forward of `fb` gives ([fb.batch_size, vocab] fp32). Pads the
            # batch to the smallest captured size >= batch_size; padding rows are ignored.

    ModelRunner.forward():
        if fb.forward_mode.is_decode() and self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
    ModelRunner.init_device_graphs(): builds it unless `disable_cuda_graph`; CUDA -> CudaGraphRunner,
        CPU -> CpuGraphRunner. Graph runners take the runner and read `runner.model`,
        `runner.attn_backend`, `runner.token_to_kv_pool`, `runner.req_to_token_pool`, `runner.device`.

    class GraphAttnBackend(Protocol):   # on top of init_forward_metadata / forward_extend / forward_decode
        def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None: ...
            # Allocate, once, every static buffer a captured decode step reads, sized for max_bs
            # requests (max_num_tokens = max_bs for decode). Called before the first capture.
        def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: Tensor,
                                                     seq_lens: Tensor) -> None: ...
            # Plan a decode step of exactly `bs` (a captured size) rows into those buffers;
            # req_pool_indices / seq_lens are the runner's static [max_bs] int64 buffers (first bs
            # rows used), filled with dummy rows (req row PAD_REQ_ROW, seq_len 1) at capture time.
        def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: Tensor,
                                                    seq_lens: Tensor, seq_lens_cpu: list[int]) -> None: ...
            # Same, before each replay, in place, from the same buffers holding the real rows then
            # the padding rows; seq_lens_cpu has bs entries (padding rows: 1). Must not allocate
            # anything a captured graph reads (CUDA graphs keep the addresses of capture time).

    Padding rows: input id 0, position 0, KV slot 0 (the pool's reserved padding slot, so their K/V
    writes land where nothing real reads), request row PAD_REQ_ROW with seq_len 1. Their logits are
    dropped. Every weight route writes parameters in place (copy_), so a graph that reads the
    parameters stays valid; a route that replaces storage must call `graph_runner.reset()`.
"""

from __future__ import annotations

import torch

from runner.forward_batch import ForwardBatch

PAD_REQ_ROW = 0  # request row padding rows point at; its row is read, never written


def capture_batch_sizes(max_bs: int, step: int = 8) -> list[int]:
    """[1, 2, 4, 8] then every `step` up to `max_bs` (always included), ascending."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs={max_bs} must be >= 1")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, step)) if step else []
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


def padded_size(bs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= bs (None when bs is beyond the largest)."""
    for s in sizes:
        if s >= bs:
            return s
    return None


class StaticDecodeInputs:
    """The static [max_bs] int64 buffers a captured decode step reads, and the padding into them."""

    def __init__(self, max_bs: int, device: torch.device) -> None:
        def buf(fill: int) -> torch.Tensor:
            return torch.full((max_bs,), fill, dtype=torch.int64, device=device)

        self.max_bs = max_bs
        self.input_ids = buf(0)
        self.positions = buf(0)
        self.out_cache_loc = buf(0)  # padding rows write K/V to the reserved slot 0
        self.req_pool_indices = buf(PAD_REQ_ROW)
        self.seq_lens = buf(1)

    def fill(self, fb: ForwardBatch, padded_bs: int) -> list[int]:
        """Copy `fb` into rows [:bs], padding into [bs:padded_bs]; returns the padded seq_lens_cpu."""
        bs = fb.batch_size
        if not bs <= padded_bs <= self.max_bs:
            raise ValueError(f"batch of {bs} cannot be padded to {padded_bs} (static buffers hold {self.max_bs})")
        for dst, src, pad in ((self.input_ids, fb.input_ids, 0), (self.positions, fb.positions, 0),
                              (self.out_cache_loc, fb.out_cache_loc, 0),
                              (self.req_pool_indices, fb.req_pool_indices, PAD_REQ_ROW),
                              (self.seq_lens, fb.seq_lens, 1)):
            dst[:bs].copy_(src)
            if padded_bs > bs:
                dst[bs:padded_bs].fill_(pad)
        return list(fb.seq_lens_cpu) + [1] * (padded_bs - bs)


def is_replayable(fb: ForwardBatch, max_bs: int) -> bool:
    """The batch properties every graph runner requires (see can_run above)."""
    return (fb.forward_mode.is_decode() and 0 < fb.batch_size <= max_bs and fb.input_embeds is None
            and fb.replace_embeds is None and not fb.return_all_logits)
