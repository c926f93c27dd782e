"""Piecewise CUDA graphs for EXTEND (prefill): the model forward captured per token-count bucket, with
attention left outside the graphs.

A prefill's attention depends on how its tokens split into requests and on their cached prefixes (the
plan changes every step), but everything between two attention calls (norms, projections, rotary, the
K/V write into the pool, the MLP) depends only on the number of tokens. So, per bucket of N tokens,
the forward of `model.model` (hidden states, not logits) is captured as L+1 CUDA graphs for L layers:
piece 0 runs from the embedding to layer 0's attention input, piece i from layer i-1's attention
output to layer i's attention input, the last piece to the final norm. The split is made at the
attention backend's `forward_extend`: during capture the runner puts `_SplitAtAttention` in the
forward context as the backend; each call copies q into a static buffer (inside the graph), ends the
graph being captured, runs the real attention eagerly on the dummy batch into a static output the
next piece reads, and begins the next graph (all pieces share one memory pool). A replay copies the batch into static [max_tokens]
buffers (padding tokens: id 0, position 0, KV slot 0, the pool's padding slot), plans the real
attention for the real batch, replays piece 0, then per layer runs the backend's `forward_extend` on
the first n rows of the static q, copies the result into the static output and replays the next piece; logits are computed eagerly from the first n hidden rows (they select each request's
last token, a per-batch choice). Padding rows only ever meet row-wise ops inside the graphs and never
reach attention, so they cannot change the real rows.

What runs eagerly instead (`can_run`): batches above the largest bucket, decode/idle batches,
input_embeds / replace_embeds, a model that is not the dense Llama family (`LlamaForCausalLM`: the
MoE layers read routing state and sync with the host), an active expert recorder, and everything
while the `cuda_graph` memory tag is released. Releasing that tag drops these graphs (their pool is
ordinary torch memory); the first prefill after the resume captures them again.

This is the GPU path only (enabled by `enable_piecewise_cuda_graph`, CUDA only). All torch.cuda calls
go through `PiecewiseGraphApi`, so the bucketing, padding, splitting and replay order are tested on
the CPU with a named stand-in; nothing here is imported on the CPU path of an engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from runner.forward_batch import ForwardBatch, ForwardContext, ForwardMode, LogitsOutput, forward_context
from runner.graphs.graph_runner import PAD_REQ_ROW, padded_size
from runner.layers.attention import PagedAttention
from runner.layers.logits import compute_logits

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 4096  # SGLang's default piecewise_cuda_graph_max_tokens
PIECEWISE_MODELS = ("LlamaForCausalLM",)  # dense models whose forward has no host syncs between attentions


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets up to `max_tokens` (included): every 16 to 256, every 64 to 1024, every 256 to
    4096, every 512 beyond: padding adds fewer than 16 tokens up to 256, under a quarter above."""
    if max_tokens < 1:
        raise ValueError(f"piecewise_cuda_graph_max_tokens={max_tokens} must be >= 1")
    sizes = [*range(16, 257, 16), *range(320, 1025, 64), *range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    sizes = [s for s in sizes if s <= max_tokens]
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sorted(set(sizes))


class StaticExtendInputs:
    """The static [max_tokens] int64 buffers a captured prefill reads, and the padding into them."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # padding: slot 0

    def fill(self, fb: ForwardBatch, padded: int) -> int:
        """Copy `fb`'s tokens into rows [:n], padding rows [n:padded] (id 0, position 0, slot 0); returns n."""
        n = int(fb.input_ids.shape[0])
        if not n <= padded <= self.max_tokens:
            raise ValueError(f"{n} tokens cannot be padded to {padded} (static buffers hold {self.max_tokens})")
        for dst, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.out_cache_loc, fb.out_cache_loc)):
            dst[:n].copy_(src)
            dst[n:padded].zero_()
        return n


class PiecewiseGraphApi:
    """The torch.cuda calls of a piecewise capture and its replay, in one place."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def begin(self, pool):
        graph = torch.cuda.CUDAGraph()
        # thread_local: a recapture (after a resume) runs on the scheduler thread while other threads
        # may make CUDA calls; only this thread's calls must be capture-safe.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        return graph

    def end(self, graph) -> None:
        graph.capture_end()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass
class _Bucket:
    tokens: int
    graphs: list = field(default_factory=list)  # L + 1
    layers: list = field(default_factory=list)  # the L attention layers, in call order
    hidden: torch.Tensor | None = None  # [N, hidden_size], written by the last graph


class _SplitAtAttention:
    """The attention backend the model sees while a bucket is captured: splits the capture at each call.

    Each piece ends by copying its q into the one static q buffer (a copy inside the graph), and the
    next piece starts from the one static attention output: two [max_tokens, heads, head_dim] buffers
    for every layer and bucket, instead of a q and an output per layer per bucket (gigabytes at 7B).
    """

    def __init__(self, real, api, bucket: _Bucket, pool, static_q: torch.Tensor, static_out: torch.Tensor) -> None:
        self.real, self.api, self.bucket, self.pool = real, api, bucket, pool
        self.static_q, self.static_out = static_q, static_out
        self.graph = None

    def begin(self) -> None:
        self.graph = self.api.begin(self.pool)
        self.bucket.graphs.append(self.graph)

    def end(self) -> None:
        self.api.end(self.graph)
        if self.pool is None:
            self.pool = self.graph.pool()  # every later piece (and bucket) shares the first graph's pool
        self.graph = None

    def forward_extend(self, q: torch.Tensor, layer, fb=None) -> torch.Tensor:
        n = q.shape[0]
        qs = self.static_q[:n]
        qs.copy_(q.reshape(qs.shape))  # captured: the piece's last op
        self.end()
        out = self.real.forward_extend(qs, layer, fb)  # eager, on the dummy batch
        self.static_out[:n].copy_(out.reshape(qs.shape))
        self.bucket.layers.append(layer)
        self.begin()
        return self.static_out[:n]  # [n, heads, head_dim], read by the next piece

    def forward_decode(self, q, layer, fb=None):
        raise RuntimeError("piecewise capture runs EXTEND batches only")


class PiecewiseExtendRunner:
    def __init__(self, runner, buckets: list[int] | None = None, api: PiecewiseGraphApi | None = None) -> None:
        self.runner = runner
        cfg = runner.config
        max_tokens = getattr(cfg, "piecewise_cuda_graph_max_tokens", None) or DEFAULT_MAX_TOKENS
        max_tokens = min(max_tokens, runner.context_len)  # one request of N tokens is the capture batch
        if buckets is None:
            buckets = getattr(cfg, "piecewise_cuda_graph_tokens", None)
        self.buckets = sorted({b for b in buckets if b <= max_tokens}) if buckets else token_buckets(max_tokens)
        if not self.buckets:
            raise ValueError(f"piecewise_cuda_graph_tokens={sorted(buckets)}: no bucket <= {max_tokens} tokens "
                             f"(piecewise_cuda_graph_max_tokens / context length)")
        self.max_tokens = self.buckets[-1]
        self.api = api or PiecewiseGraphApi(runner.device)
        self.inputs = StaticExtendInputs(self.max_tokens, runner.device)
        self.captured: dict[int, _Bucket] = {}
        self.pool = None
        attn = next((m for m in runner.model.modules() if isinstance(m, PagedAttention)), None)
        shape = (self.max_tokens, attn.num_heads, attn.head_dim) if attn is not None else (0,)
        # Static q and attention output shared by every layer and bucket (see _SplitAtAttention).
        self.static_q = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
        self.static_out = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
        self.num_captures = 0
        self.num_replays = 0
        self.capture_seconds = 0.0
        self.epoch = None  # the memory saver's address epoch the pieces were captured at

    # ---- what runs eagerly -----------------------------------------------------------------------
    def supports_model(self) -> bool:
        return type(self.runner.model).__name__ in PIECEWISE_MODELS

    def can_run(self, fb: ForwardBatch) -> bool:
        from runner.expert_distribution import recorder_is_active

        return (fb.forward_mode.is_extend() and 0 < int(fb.input_ids.shape[0]) <= self.max_tokens
                and fb.input_embeds is None and fb.replace_embeds is None and self.supports_model()
                and not recorder_is_active(self.runner.model))

    # ---- capture -------------------------------------------------------------------------------------
    def _dummy_batch(self, n: int) -> ForwardBatch:
        """One request of n new tokens, all in the padding slot; its row is the padding row."""
        dev = self.runner.device
        inp = self.inputs
        return ForwardBatch(ForwardMode.EXTEND, 1, inp.input_ids[:n], inp.positions[:n],
                            torch.full((1,), PAD_REQ_ROW, dtype=torch.int64, device=dev),
                            torch.full((1,), n, dtype=torch.int64, device=dev), inp.out_cache_loc[:n], [n],
                            extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n])

    def _context(self, backend) -> ForwardContext:
        r = self.runner
        return ForwardContext(backend, r.token_to_kv_pool, r.req_to_token_pool)

    def capture(self) -> None:
        """Capture every bucket, largest first, into one pool (dropping earlier graphs first)."""
        self.reset()
        api, real = self.api, self.runner.attn_backend
        t0 = time.perf_counter()
        stream = api.new_stream()
        for n in reversed(self.buckets):
            for buf in (self.inputs.input_ids, self.inputs.positions, self.inputs.out_cache_loc):
                buf[:n].zero_()
            fb = self._dummy_batch(n)
            real.init_forward_metadata(fb)
            api.synchronize()
            with api.stream(stream), torch.no_grad():
                with forward_context(self._context(real)):  # warm-up: JIT, cuBLAS, allocator
                    self.runner.model.model(fb.input_ids, fb.positions, fb)
                api.synchronize()
                bucket = _Bucket(n)
                split = _SplitAtAttention(real, api, bucket, self.pool, self.static_q, self.static_out)
                split.begin()
                with forward_context(self._context(split)):
                    bucket.hidden = self.runner.model.model(fb.input_ids, fb.positions, fb)  # [n, hidden]
                split.end()
                self.pool = split.pool
            self.captured[n] = bucket
        api.synchronize()
        self.num_captures += 1
        self.epoch = self.runner.memory_saver.address_epoch
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured piecewise prefill graphs for %d token buckets (max %d) in %.1f s", len(self.buckets),
                    self.max_tokens, self.capture_seconds)

    # ---- replay --------------------------------------------------------------------------------------
    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        if not self.captured or self.epoch != self.runner.memory_saver.address_epoch:
            # First use, after a release of the cuda_graph tag dropped them, or after a resume that moved the
            # weights or the KV cache (the portable saver): the pieces hold the old addresses.
            self.capture()
        n_tokens = int(fb.input_ids.shape[0])
        padded = padded_size(n_tokens, self.buckets)
        bucket = self.captured[padded]
        n = self.inputs.fill(fb, padded)
        backend = self.runner.attn_backend
        with torch.no_grad(), forward_context(self._context(backend)):
            backend.init_forward_metadata(fb)  # the real batch's attention plan
            q, out = self.static_q[:n], self.static_out[:n]
            bucket.graphs[0].replay()
            for layer, graph in zip(bucket.layers, bucket.graphs[1:]):
                out.copy_(backend.forward_extend(q, layer, fb).reshape(out.shape))  # real rows only
                graph.replay()
            self.num_replays += 1
            return compute_logits(bucket.hidden[:n], self.runner.model.lm_head, fb)

    def reset(self) -> None:
        """Drop every captured bucket and the pool (the next replay captures again)."""
        self.captured.clear()
        self.pool = None
        if self.runner.device.type == "cuda":
            self.api.empty_cache()
