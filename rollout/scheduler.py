"""Scheduler: continuous batching over the runner, with chunked prefill, the prefix cache and
retraction when the KV pool runs out.

Each `step()` runs one forward: a prefill (EXTEND) batch when there are requests to admit, else a
decode batch of everything running, or, with `num_continuous_decode_steps` > 1 (the CPU default) and nothing
waiting to act, a decode block: up to that many decode steps of the batch chained on the device (one C++ call
where the fused CPU step applies), their tokens processed together afterwards, stopped after its current step
by `interrupt_block` when a request or a control call arrives. Prefill takes at most `chunked_prefill_size` new tokens per step,
so a long prompt is prefilled in chunks with a decode step between chunks. Waiting requests are admitted in
the order `schedule_policy` gives (SGLang's fcfs, lpm, lof or random). With `enable_mixed_chunk`
(plain schedule only) a step that admits prompts carries every running request's next token too, as a
one-token extend, so nobody waits through a prefill step. Requests whose prompt
shares a long prefix with one already in the batch wait one step, so the n samples of a prompt
prefill it once and the rest hit the cache. When a decode step cannot get KV slots, the youngest
running requests are retracted (their KV handed to the prefix cache, themselves requeued); sampling
is counter-based per request, so their outputs do not change.

A step that raises fails only the requests that caused it: the batch is re-run in halves until the
failure is pinned on single requests (requests are independent within a batch and sampling is
counter-based, so the others' tokens do not change), and the per-request host work after the forward
(appending the token, stop checks) fails its own request alone. A cause that no split can avoid (the
weights are invalid) fails the batch at once.

The scheduler decides; rollout.kv_manager.KVManager does every write to the pools and the prefix
cache. Plain Python over Req objects; all tensor work happens in the runner (the scheduler only picks
its own thread's intra-op thread count, see SINGLE_THREAD_MAX_WEIGHTS).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rollout.batch import SamplingInfoCache, decode_batch, extend_batch, prompt_logprob_rows
from rollout.kv_manager import KVManager
from rollout.overlap import OverlapDecoder
from rollout.request import FinishReason, Req, extend_runs
from rollout.thread_pinning import OverlapPinning
from runner.sampler import prompt_logprobs

logger = logging.getLogger(__name__)

# CPU models with fewer weight elements than this step on one intra-op thread when the scheduler runs
# off the main thread. With OpenMP (libgomp), a second thread that opens parallel regions while the
# main thread's team still exists runs with more managed threads than cores, so its workers barely
# spin and every parallel region pays a futex wake-up: on 2 cores the tiny bench preset (150k
# weights) took 175 ms on 2 threads against 75 ms on 1, while qwen2-40m (40M) still gained from 2
# (1.59 s against 1.90 s). Between the two, 2M: ops with under ~10k weights per row of work do not
# repay the wake-up.
SINGLE_THREAD_MAX_WEIGHTS = 2_000_000


def _steps_on_one_thread(model) -> bool:
    """Whether a CPU model is small enough to step on one intra-op thread (SINGLE_THREAD_MAX_WEIGHTS)."""
    return sum(p.numel() for p in model.parameters()) < SINGLE_THREAD_MAX_WEIGHTS


def _overlap_by_default(runner) -> bool:
    """disable_overlap_schedule=None: the overlap schedule on CUDA only. On the CPU the plain schedule's decode
    blocks (num_continuous_decode_steps, on by default there) measured faster than the overlap on every shape
    tried, because a block takes the per-step host work off the step itself instead of onto a second core:
    the tiny preset through Engine.generate 1.45x the overlap at batch 16, 1.14x at batch 64, 1.5x with n=4
    groups (bench/overlap.py --num-continuous-decode-steps 8, a 2-core Xeon); before blocks the overlap was the
    default for a small model with the fused forward on AVX-512 (1.1-1.3x the single-step plain schedule, which
    it still beats: bench/overlap.py). A model stepping on every core never gained from it (40M 1.02x, 0.5B
    0.98x)."""
    device = getattr(runner, "device", None)
    return getattr(device, "type", "cpu") == "cuda"


# num_continuous_decode_steps=None: decode blocks of this many steps on the CPU (1 on CUDA, SGLang's default,
# where the overlap schedule and CUDA graphs take the host work off the step instead). 8 measured at or above
# 16 and 4 on the tiny preset's streaming server load (bench/serve.py, 2-core Xeon): 4 left ~10% of the
# per-step host work, 16 made a stream's chunks longer without a clear gain.
CPU_DECODE_STEPS = 8


SCHEDULE_POLICIES = ("fcfs", "lpm", "lof", "random")
LPM_MAX_WAITING = 128  # past this many waiting requests, lpm admits in arrival order (SGLang's cut-off)


@dataclass
class SchedulerConfig:
    chunked_prefill_size: int = 2048
    max_running_requests: int | None = None
    disable_radix_cache: bool = False
    enable_return_routed_experts: bool = False  # MoE: keep each KV slot's routed experts for return_routed_experts
    in_batch_prefix_threshold: int = 16  # shared tokens that make a request wait for the cache
    # SGLang's --enable-weight-version-kv-isolation: KV is cached per weight version (the one a request was
    # admitted under), so a request never reuses KV computed under another version, whatever flush_cache says.
    enable_weight_version_kv_isolation: bool = False
    # SGLang's --enable-prefill-weight-versions: meta_info["prefill_weight_versions"], the weight version each
    # prompt position's KV was computed under (kept per KV slot, so prefix-cache hits report theirs).
    enable_prefill_weight_versions: bool = False
    # SGLang's name: True runs every step on the scheduler thread, one after the other (rollout.overlap).
    # None: on for CUDA; on the CPU only where it measured faster (_overlap_by_default).
    disable_overlap_schedule: bool | None = None
    # With the overlap schedule on the CPU and a worker stepping on one intra-op thread: pin the worker and
    # the scheduler thread to distinct CPUs (rollout.thread_pinning says why: unpinned, a run lands on
    # one core or two by chance, 0.83x or 1.3x the plain schedule on the tiny preset).
    cpu_pin_overlap_threads: bool = True
    # SGLang's --enable-mixed-chunk: a step that admits prompts also carries every running request's next
    # token (one forward), instead of a prefill step during which the running requests wait. Plain schedule
    # only (the overlap schedule keeps its own decode steps), never with enable_deterministic_inference.
    enable_mixed_chunk: bool = False
    # SGLang's --schedule-policy, the order waiting requests are admitted in: "fcfs" (arrival), "lpm" (longest
    # cached prefix first; arrival order past 128 waiting, as SGLang), "lof" (longest max_new_tokens first),
    # "random" (shuffled, seeded by the engine's random_seed). It orders admission only: a request's tokens do not
    # depend on it. SGLang's "dfs-weight" is refused.
    schedule_policy: str = "fcfs"
    # SGLang's --num-continuous-decode-steps: the plain schedule runs up to this many decode steps of one batch
    # back to back (a decode block: one batch built, the steps chained on the device, their tokens processed
    # and delivered together), which spreads the scheduler's per-step host work over several tokens. A block
    # runs only while nothing waits to be admitted or to act at a step boundary, stops after its current step
    # when something arrives, and never runs past a row's length limit; its tokens are those of as many single
    # steps. The cost: a stream's chunks carry a block's tokens at once. The overlap schedule hides that host
    # work instead and ignores this. 1: every step is scheduled; None (default): CPU_DECODE_STEPS on the CPU,
    # 1 on CUDA.
    num_continuous_decode_steps: int | None = None

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy={self.schedule_policy!r}: choose one of {SCHEDULE_POLICIES} "
                             f"(SGLang's 'dfs-weight' is not implemented)")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size={self.chunked_prefill_size} must be >= 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")
        if self.disable_overlap_schedule is not None and not isinstance(self.disable_overlap_schedule, bool):
            raise ValueError(f"disable_overlap_schedule={self.disable_overlap_schedule!r} must be a bool or None "
                             f"(None: on for CUDA, on the CPU where it measured faster)")
        if not isinstance(self.cpu_pin_overlap_threads, bool):
            raise ValueError(f"cpu_pin_overlap_threads={self.cpu_pin_overlap_threads!r} must be a bool")
        if not isinstance(self.enable_mixed_chunk, bool):
            raise ValueError(f"enable_mixed_chunk={self.enable_mixed_chunk!r} must be a bool")
        k = self.num_continuous_decode_steps
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"num_continuous_decode_steps={k!r} must be an int >= 1 (1: every decode step is "
                             f"scheduled on its own) or None (the default: {CPU_DECODE_STEPS} on the CPU, 1 on "
                             f"CUDA)")


class _Sampled(NamedTuple):
    """One row of a step's host-side result."""

    token: int
    logprob: float | None  # None when no request of the step asked for logprobs
    top: list[tuple[float, int]] | None  # (logprob, token id) of the top tokens, if asked
    ids_logprobs: list[float] | None = None  # at the request's token_ids_logprob, if asked
    prompt: list[tuple[int, tuple]] | None = None  # (position, Req.input_logprobs entry) scored this step


class _StepFailure(NamedTuple):
    message: str


class _PrefixTrie:
    """In-batch prompt trie: how many leading tokens a candidate shares with prompts already chosen."""

    def __init__(self) -> None:
        self.root: dict = {}

    def match_and_insert(self, key: list[int]) -> int:
        node, n = self.root, 0
        for t in key:
            if t not in node:
                break
            node, n = node[t], n + 1
        node = self.root
        for t in key:
            node = node.setdefault(t, {})
        return n


def _match_in_batch(trie: _PrefixTrie, req: Req) -> int:
    """Prompt tokens req shares with requests already in the batch, on the same adapter (KV under another
    adapter, or the base, is not reusable: the first key element is the adapter's namespace)."""
    ids = req.fill_ids[: req.seq_len - 1]
    if req.lora_id is None:
        return trie.match_and_insert(ids)
    return max(0, trie.match_and_insert([("lora", req.lora_id), *ids]) - 1)


class Scheduler:
    def __init__(self, runner, config: SchedulerConfig, eos_ids: list[int], stop_checker) -> None:
        self.runner = runner
        self.config = config
        self.eos_ids = list(eos_ids)
        self.stop_checker = stop_checker  # (req) -> matched stop string or None
        self.stats = dict(num_prefill_steps=0, num_decode_steps=0, num_prefill_tokens=0, num_cached_tokens=0,
                          num_prompt_tokens=0, num_generated_tokens=0, num_retractions=0, num_evicted_tokens=0,
                          num_failed_requests=0, num_overlapped_steps=0, num_mixed_steps=0, num_decode_blocks=0)
        req_pool = runner.req_to_token_pool
        self.kv = KVManager(req_pool, runner.token_to_kv_pool, runner.device, not config.disable_radix_cache,
                            self.stats)
        # The version of the weights the steps run with; set by the engine between steps (never mid-step),
        # so a token's version is the one current when its step's output is processed.
        self.set_weight_version("default")
        if config.enable_prefill_weight_versions:
            self.kv.enable_slot_versions()
        # MoE routed experts (return_routed_experts): the model captures every forward's routing, the KV
        # manager files it per KV slot, so prefix-cache hits return the prompt's rows too.
        self.recorder = getattr(getattr(runner, "model", None), "expert_recorder", None)
        if config.enable_return_routed_experts:
            if self.recorder is None:
                raise ValueError(f"enable_return_routed_experts=True needs a mixture-of-experts model; "
                                 f"{runner.model_config.architecture} has no experts")
            self.kv.enable_routed_experts(self.recorder.num_layers, self.recorder.top_k)
            self.recorder.set_capture_routed_experts(True)
        self.max_running = min(config.max_running_requests or req_pool.size, req_pool.size)
        runner_cfg = getattr(runner, "config", None)
        self.max_loras_per_batch = getattr(runner_cfg, "max_loras_per_batch", 1) if getattr(
            runner_cfg, "enable_lora", False) else 0
        self.waiting: deque[Req] = deque()
        # schedule_policy="random": reproducible from the engine's random_seed when one is given
        self._policy_rng = random.Random(getattr(getattr(runner, "config", None), "random_seed", 0))
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self._admit_counter = 0
        self.last_step_was_chunk = False
        self._failed: list[Req] = []
        self._sampling_cache: SamplingInfoCache | None = None  # built at the first forward
        self._threads_set_for: set[int] = set()  # the threads whose intra-op threads are set
        # The overlap schedule (rollout.overlap): decode forwards on a worker, the next one built meanwhile.
        disable = config.disable_overlap_schedule
        if disable is None:
            disable = not _overlap_by_default(runner)
        self.overlap = None
        if not disable:
            # The worker steps on one intra-op thread where _set_step_threads makes it so (or one is all there is).
            model = getattr(runner, "model", None)
            one_thread = torch.get_num_threads() == 1 or (model is not None and _steps_on_one_thread(model))
            pin = (config.cpu_pin_overlap_threads and getattr(runner.device, "type", None) == "cpu" and one_thread)
            self.overlap = OverlapDecoder(self, OverlapPinning(pin))
        # Mixed steps: the plain schedule only, and not where a token's numerics must not depend on its
        # batch-mates (the deterministic mode runs decode rows through the decode path only).
        self.mix = (config.enable_mixed_chunk and self.overlap is None
                    and not getattr(runner_cfg, "enable_deterministic_inference", False))
        self._kv_reserve = 0  # KV slots held back for the running requests while a mixed step is planned
        # Set by the engine: True while something (a control call, a new request) waits to act at the next step
        # boundary; no decode block starts then. A block already running stops after its current step once
        # `interrupt_block()` is called (the engine calls it whenever something new waits), so whatever
        # arrives waits for one step at most, as without blocks.
        self.hold_back = lambda: False
        self._block_stop = torch.zeros(1, dtype=torch.int32)  # read by the block's C++ loop between its steps
        steps = config.num_continuous_decode_steps
        if steps is None:
            steps = 1 if getattr(getattr(runner, "device", None), "type", "cpu") == "cuda" else CPU_DECODE_STEPS
        self.decode_block_steps = steps  # 1: no blocks
        self.last_block_steps = 0  # the decode steps the last step() ran as a block (0: it was no block)

    # Read-only views for callers that inspect the cache (tests, server info); writes go through self.kv.
    @property
    def tree(self):
        return self.kv.tree

    @property
    def kv_pool(self):
        return self.kv.kv_pool

    # ---- queue ----------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.stats["num_prompt_tokens"] += len(req.prompt_ids)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running) + (self.chunked_req is not None)

    def abort(self, req: Req, message: str) -> bool:
        """Finish `req` as abort with what it generated so far and free its KV. False if it is not in
        flight here (already finished, or never added)."""
        self.cancel_ahead()
        if req.finished:
            return False
        reason = FinishReason("abort", message=message)
        if any(r is req for r in self.waiting):
            self.waiting.remove(req)
            req.finished_reason = reason
            self.kv.release(req)  # a no-op unless it was admitted; kept for safety
            return True
        if req is self.chunked_req or any(r is req for r in self.running):
            self._finish(req, reason)
            return True
        return False

    def is_waiting(self, req: Req) -> bool:
        """In the waiting queue: not admitted yet, or retracted back to it (not the chunked prefill)."""
        return req is not self.chunked_req and any(r is req for r in self.waiting)

    def set_weight_version(self, weight_version: str, generation: int = 0) -> None:
        """The engine's served version changed (under its lock, between steps): new tokens carry it and, with
        weight-version KV isolation, requests admitted from now on cache their KV under it and `generation`
        (the engine's count of weight changes: a label may repeat, the generation does not)."""
        self.weight_version = weight_version
        if self.config.enable_weight_version_kv_isolation:
            self.kv.isolate_versions((weight_version, generation))

    # ---- decisions that move requests between queues (the KV work is self.kv's) ------------
    def _admit(self, req: Req) -> None:
        self.kv.admit(req, req.max_cached_prefix)
        self._admit_counter += 1
        req.admitted_order = self._admit_counter

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        if req.return_routed_experts and req.req_pool_idx is not None:
            req.routed_experts = self.kv.routed_experts_of(req)
        if self.kv.slot_versions is not None and req.req_pool_idx is not None:
            req.prefill_version_spans = self.kv.prompt_version_spans(req)
        if self.overlap is None or not self.overlap.defer_release(req):  # else freed after the step in flight
            self.kv.release(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None

    def _fail(self, req: Req, message: str) -> None:
        """This request (alone) made the step raise: finish it as abort with the reason."""
        logger.warning("request %s failed in a scheduler step: %s", req.rid, message)
        req.error = message
        self.stats["num_failed_requests"] += 1
        self._finish(req, FinishReason("abort", message=f"request failed in the scheduler step: {message}"))

    def _requeue(self, req: Req) -> None:
        """Take back req's admission (or its progress) and put it first in line."""
        self.kv.undo(req)
        if self.chunked_req is req:
            self.chunked_req = None
        if req.needs_input_logprobs:  # a partial set is recomputed whole (the weights may change meanwhile)
            req.input_logprobs.clear()
        self.waiting.appendleft(req)

    def retract(self, req: Req) -> None:
        self.cancel_ahead()
        self.running.remove(req)
        req.num_retractions += 1
        self.stats["num_retractions"] += 1
        self._requeue(req)

    def retract_all(self) -> None:
        """Requeue every running request; their KV will be recomputed (e.g. under new weights)."""
        self.cancel_ahead()
        if self.chunked_req is not None:
            self._requeue(self.chunked_req)
        for req in sorted(self.running, key=lambda r: r.admitted_order, reverse=True):
            self.retract(req)

    def reset(self) -> None:
        """Forget every request and return every slot (last resort after an unexpected error; the
        caller owns, and finishes, the requests)."""
        self.cancel_ahead()
        self.waiting.clear()
        self.running.clear()
        self.chunked_req = None
        self._failed.clear()
        if self._sampling_cache is not None:
            self._sampling_cache.clear()
        self.kv.reset()

    def flush_cache(self) -> bool:
        """Empty the prefix cache. False (nothing done) while a request holds KV (running or mid-prefill);
        waiting requests hold none and do not block it."""
        self.cancel_ahead()
        if self.running or self.chunked_req:
            return False
        return self.kv.flush()

    def cancel_ahead(self) -> None:
        """Roll back a decode step launched ahead (the overlap schedule), so the state is that of a step
        boundary: every control call and mutation goes through here first."""
        if self.overlap is not None:
            self.overlap.cancel()

    def close(self) -> None:
        """Stop the overlap worker thread (at engine shutdown)."""
        if self.overlap is not None:
            self.overlap.close()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward. Returns the requests that got a token or finished this step. Under the
        overlap schedule the next decode step may be in flight when it returns (see rollout.overlap)."""
        self.last_block_steps = 0
        if threading.get_ident() not in self._threads_set_for:
            self._set_step_threads()
        if self.overlap is not None and self.overlap.ahead is not None:
            return self.overlap.advance()
        if (self.waiting or self.chunked_req) and self.mix and self.running:
            mixed = self._run_mixed()
            if mixed is not None:
                return mixed + self._drain_failed()
        if self.waiting or self.chunked_req:
            interleave = self.last_step_was_chunk and self.running  # don't stall decodes on a long prompt
            if not interleave:
                items = self._schedule_prefill()
                if items:
                    return self._run_prefill(items) + self._drain_failed()
        self.last_step_was_chunk = False
        failed = self._drain_failed()  # too big for the pool: finished here even when nothing runs
        if self.running:
            return self._run_decode() + failed
        return failed

    def _set_step_threads(self) -> None:
        """Once per stepping thread: one intra-op thread for a small CPU model off the main thread (see
        SINGLE_THREAD_MAX_WEIGHTS). Only this thread's setting changes: torch.set_num_threads sets the
        calling thread's OpenMP team size and also the default of threads created later, so a helper
        thread puts that default back (the main thread's own setting is never touched)."""
        self._threads_set_for.add(threading.get_ident())
        model = getattr(self.runner, "model", None)
        if (threading.current_thread() is threading.main_thread() or model is None
                or getattr(self.runner.device, "type", None) != "cpu"):
            return
        before = torch.get_num_threads()
        if before > 1 and _steps_on_one_thread(model):
            torch.set_num_threads(1)
            restore = threading.Thread(target=torch.set_num_threads, args=(before,), name="restore-num-threads")
            restore.start()
            restore.join(timeout=10)
        overlap = getattr(self, "overlap", None)  # None on the worker's first call (the decoder is being built)
        if overlap is not None and not overlap.worker.is_current_thread():
            overlap.pinning.pin_scheduler()  # the worker pins itself (OverlapDecoder)

    def _schedule_prefill(self, reserve: int = 0) -> list[tuple[Req, int, int]]:
        """The prompt chunks of the next step. reserve: tokens of the chunk budget and KV slots kept for
        the running requests of a mixed step."""
        budget = self.config.chunked_prefill_size - reserve
        self._kv_reserve = reserve
        self._order_waiting()
        try:
            return self._schedule_prefill_within(budget)
        finally:
            self._kv_reserve = 0

    def _order_waiting(self) -> None:
        """Put the waiting queue in the schedule policy's order (stable: ties keep arrival order)."""
        policy = self.config.schedule_policy
        if policy == "fcfs" or len(self.waiting) < 2:
            return
        reqs = list(self.waiting)
        if policy == "lof":
            reqs.sort(key=lambda r: -(r.sampling_params.max_new_tokens or self.runner.context_len))
        elif policy == "random":
            self._policy_rng.shuffle(reqs)
        elif len(reqs) <= LPM_MAX_WAITING:  # lpm
            cached = {id(r): self.kv.cached_prefix_len(r) for r in reqs}
            reqs.sort(key=lambda r: -cached[id(r)])
        self.waiting = deque(reqs)

    def _schedule_prefill_within(self, budget: int) -> list[tuple[Req, int, int]]:
        items: list[tuple[Req, int, int]] = []
        trie = _PrefixTrie()
        # LoRA: a batch holds at most max_loras_per_batch adapters; requests on another one wait.
        loras = {r.lora_id for r in self.running if r.lora_id is not None}
        if self.chunked_req is not None:
            req = self.chunked_req
            if req.lora_id is not None:
                loras.add(req.lora_id)
            _match_in_batch(trie, req)
            if not self._take_chunk(req, items, budget) or self.chunked_req is req:
                return items
            budget -= items[-1][2]
        deferred: list[Req] = []
        while self.waiting and budget > 0:
            if len(self.running) + len(items) >= self.max_running or not self.kv.num_free_rows():
                break
            req = self.waiting.popleft()
            if req.lora_id is not None and req.lora_id not in loras and len(loras) >= self.max_loras_per_batch:
                deferred.append(req)
                continue
            self._admit(req)
            shared = _match_in_batch(trie, req)
            if req.max_cached_prefix is not None:  # it could not use more of the cache anyway
                shared = min(shared, req.max_cached_prefix)
            threshold = max(1, min(self.config.in_batch_prefix_threshold, req.seq_len - 1))
            if items and shared - req.num_computed >= threshold:
                # Its prefix is being computed in this batch: next step it is a cache hit instead.
                self.kv.undo(req)
                deferred.append(req)
                continue
            if not self._take_chunk(req, items, budget):
                break
            if req.lora_id is not None:
                loras.add(req.lora_id)
            budget -= items[-1][2]
            if self.chunked_req is req:
                break
        self.waiting.extendleft(reversed(deferred))
        return items

    def _take_chunk(self, req: Req, items: list, budget: int) -> bool:
        remaining = req.seq_len - req.num_computed
        take = min(remaining, budget)
        if take < remaining and items and take < 64:
            # Not worth a sliver of a chunk now; the next step starts it fresh.
            if req is not self.chunked_req:
                self._requeue(req)
            return False
        if self.kv.available_tokens() - self._kv_reserve < take:
            if req is not self.chunked_req:
                self._requeue(req)
            if not items and not self.running:
                self._fail_too_long(req)
            return False
        self.kv.alloc_extend(req, take)
        if not req.is_cache_counted:  # report the hit of the first admission that runs, not of one undone
            req.is_cache_counted = True
            req.cached_tokens = min(req.num_cached, len(req.prompt_ids))
            self.stats["num_cached_tokens"] += req.cached_tokens
        items.append((req, req.num_computed, take))
        self.chunked_req = req if take < remaining else (None if self.chunked_req is req else self.chunked_req)
        return True

    def _fail_too_long(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, FinishReason(
            "abort", message=f"the KV cache ({self.kv.kv_pool.size} tokens) cannot hold this request "
                             f"({req.seq_len} tokens); raise max_total_tokens"))
        self._failed.append(req)

    def _run_mixed(self) -> list[Req] | None:
        """One EXTEND forward of the prompt chunks to admit plus each running request's next token (a
        one-token extend over its cached sequence), or None (nothing to admit, or no KV slot to spare for
        the running requests: the caller falls back to the separate steps)."""
        num_running = len(self.running)
        if self.kv.available_tokens() <= num_running or self.config.chunked_prefill_size <= num_running:
            return None
        items = self._schedule_prefill(reserve=num_running)
        if not items:
            return None
        self.running.sort(key=lambda r: r.admitted_order)
        decoding = list(self.running)
        # One slot each for its one uncomputed token, fill_ids[seq_len - 1], written into the rows at once.
        locs = self.kv.alloc_decode(decoding)
        at = torch.tensor([[r.req_pool_idx for r in decoding], [r.seq_len - 1 for r in decoding]],
                          dtype=torch.int64).to(self.runner.device)
        self.kv.write_decode(at[0], at[1], locs)
        self.stats["num_mixed_steps"] += 1  # counted as a prefill step too (_run_prefill)
        return self._run_prefill(items, [(req, req.num_computed, 1) for req in decoding])

    def _run_prefill(self, items: list[tuple[Req, int, int]],
                     decoding: list[tuple[Req, int, int]] = ()) -> list[Req]:
        """items: the prompt chunks; decoding: running requests' one-token rows riding in a mixed step."""
        self.stats["num_prefill_steps"] += 1
        self.stats["num_prefill_tokens"] += sum(n for _, _, n in items)
        self.last_step_was_chunk = False
        running = {id(req) for req, _, _ in decoding}
        items = list(items) + list(decoding)

        def run(sub: list[tuple[Req, int, int]]) -> list[_Sampled]:
            rows = prompt_logprob_rows(sub, self.runner.device)
            fb = extend_batch(sub, self.kv.extend_locs(sub), self.runner.device, return_all_logits=rows is not None)
            return self._forward_sample(fb, [r for r, _, _ in sub], rows)

        updated = []
        for (req, start, n), res in self._run_attributed(items, run):
            if isinstance(res, _StepFailure):
                self._fail(req, res.message)
                updated.append(req)
                continue
            try:
                req.num_computed = start + n
                if id(req) in running:
                    self._append_token(req, res)
                    updated.append(req)
                    continue
                req.input_logprobs.update(res.prompt or ())
                if req.num_computed < req.seq_len:  # a chunk; more to come
                    self.kv.cache_unfinished(req)
                    self.last_step_was_chunk = True
                    continue
                if req.sampling_params.max_new_tokens == 0 and not req.output_ids:  # scoring the prompt only
                    self._finish(req, FinishReason("length", 0))
                else:
                    self.kv.cache_unfinished(req)
                    self.running.append(req)
                    self._append_token(req, res)
            except Exception as e:  # this request's own host work: it fails alone
                self._fail(req, f"{type(e).__name__}: {e}")
            updated.append(req)
        return updated

    def _run_decode(self) -> list[Req]:
        self.running.sort(key=lambda r: r.admitted_order)
        if self.kv.available_tokens() < len(self.running) and self.chunked_req is not None:
            # A half-prefilled prompt is the youngest holder of KV: it goes first, or a running request
            # would be aborted as "too long" while the pool is full of someone else's chunks.
            self.chunked_req.num_retractions += 1
            self.stats["num_retractions"] += 1
            self._requeue(self.chunked_req)
        while self.kv.available_tokens() < len(self.running) and len(self.running) > 1:
            self.retract(self.running[-1])
        if self.kv.available_tokens() < len(self.running):
            req = self.running[0]
            self._finish(req, FinishReason("abort", message="KV cache exhausted by a single request; "
                                                            "raise max_total_tokens"))
            return [req]
        reqs = list(self.running)
        if self.overlap is None:
            num_steps = self._block_steps(reqs)
            if num_steps > 1:
                updated = self._run_decode_block(reqs, num_steps)
                if updated is not None:
                    return updated
        locs = self.kv.alloc_decode(reqs)  # [bs] on the device
        if self.overlap is not None:
            return self.overlap.run_decode(reqs, locs)
        self.stats["num_decode_steps"] += 1

        def run(sub: list[tuple[Req, int]]) -> list[_Sampled]:
            # Sub-batches from the bisection are contiguous, so their slots are a slice.
            batch = [r for r, _ in sub]
            fb = decode_batch(batch, locs[sub[0][1] : sub[-1][1] + 1], self.runner.device)
            # The new token of each request sits at position seq_len - 1 of its row.
            self.kv.write_decode(fb.req_pool_indices, fb.positions, fb.out_cache_loc)
            return self._forward_sample(fb, batch)

        return self._process_decode(self._run_attributed([(r, i) for i, r in enumerate(reqs)], run))

    # ---- decode blocks (num_continuous_decode_steps) -------------------------------------------
    def _block_steps(self, reqs: list[Req]) -> int:
        """How many decode steps the next one may chain (1: a single step): at most the configured number,
        and only where each of them is exactly what the plain schedule would run next. So none while a request
        waits that could be admitted, a prompt is half prefilled, or the engine holds steps back; none with
        penalties (their counts need each step's tokens on the host), a min_new_tokens ban still in force (it
        lifts within the block), routed experts recorded (one forward's record), top / token-id logprobs or a
        stop_regex (per-token host work that dwarfs the step's); and never past the step at
        which some row reaches its length limit (max_new_tokens, the context, the pool), so no row is known
        finished before the block ends. A row that stops on a token inside it has its later tokens dropped."""
        k = self.decode_block_steps
        if k < 2:
            return 1
        self._block_stop[0] = 0  # before hold_back: what arrives after it stops the block (interrupt_block)
        if self.chunked_req is not None or self.kv.routed_experts is not None or self.hold_back():
            return 1
        if self.waiting and len(self.running) < self.max_running and self.kv.num_free_rows():
            return 1
        room_of_all = min(self.runner.context_len, self.kv.kv_pool.size)
        for req in reqs:
            sp = req.sampling_params
            num_out = len(req.output_ids)
            if sp.repetition_penalty != 1 or sp.frequency_penalty or sp.presence_penalty or num_out < sp.min_new_tokens:
                return 1
            if req.top_logprobs_num or req.token_ids_logprob or sp.stop_regex:
                # Their per-token host work (a row of top logprobs read back, built and delivered; a regex run over
                # the output's tail) is what a step costs then, so a block saves little, and a control call would
                # wait for a whole block's worth of it after the interrupt (bench/adversarial.py's backtracking
                # stop_regex: /abort 0.07-0.10 s against 0.04 s).
                return 1
            room = room_of_all - req.seq_len  # the token of step j makes seq_len + j + 1
            if sp.max_new_tokens is not None:
                room = min(room, sp.max_new_tokens - num_out)
            if room < k:
                k = room
                if k < 2:
                    return 1
        if self.kv.available_tokens() < k * len(reqs):
            return 1  # the single step's retraction logic decides what happens when KV runs short
        return k

    def interrupt_block(self) -> None:
        """Any thread: a decode block in progress starts no further step (something waits for a boundary)."""
        self._block_stop[0] = 1

    def _run_decode_block(self, reqs: list[Req], num_steps: int) -> list[Req] | None:
        """Up to `num_steps` decode steps of `reqs`, step j fed step j - 1's sampled ids on the device (fewer
        where `interrupt_block` stops it early); then each row's tokens in order, as the single steps would
        have appended them (a row finished by one drops the rest). None, with nothing changed, if the block
        could not run (a step raised): the single step, with its failure attribution, runs instead."""
        locs = self.kv.alloc_decode_steps(reqs, num_steps)  # [num_steps, bs] on the device
        try:
            rows = self._block_forward(reqs, locs)
        except Exception as e:  # noqa: BLE001 - the single step re-runs it and pins the failure on its rows
            logger.debug("a decode block failed (%s: %s); running a single step instead", type(e).__name__, e)
            rows = None
        done = 0 if rows is None else len(rows)
        if done < num_steps:  # the slots of the steps that did not run go back (all of them if none did)
            self.kv.kv_pool.free(locs[done:].reshape(-1).to("cpu"))
            for req in reqs:
                req.num_allocated = req.seq_len + done - 1
        if rows is None:
            return None
        self.stats["num_decode_steps"] += done
        self.stats["num_decode_blocks"] += 1
        self.last_block_steps = done
        for i, req in enumerate(reqs):
            for step in rows:
                if req.finished:  # by a token earlier in the block: the rest is dropped, its slots freed
                    break
                try:
                    req.num_computed = req.seq_len
                    self._append_token(req, step[i])
                except Exception as e:  # this request's own host work: it fails alone
                    self._fail(req, f"{type(e).__name__}: {e}")
        return reqs

    def _block_forward(self, reqs: list[Req], locs: torch.Tensor) -> list[list[_Sampled]]:
        """The block's forwards and sampling -> per step, one _Sampled per row. One C++ call where the fused
        CPU step applies (ModelRunner.forward_sample_steps), else one forward per step, each filled from the
        one before on the device (as the overlap schedule's steps), read back once all have run."""
        device = self.runner.device
        num_steps = locs.shape[0]
        fb = decode_batch(reqs, locs[0], device)
        fb.sampling_info = self._sampling_info(reqs)
        chained = getattr(self.runner, "forward_sample_steps", None)
        if chained is not None:
            prepared = self.runner.prepare_forward(fb)
            res = None if prepared is None else chained(fb, prepared, locs, self._block_stop)
            if res is not None:
                ids, logprobs = res
                if self.kv.slot_versions is not None:
                    self.kv.write_slot_versions(locs[: len(ids)].reshape(-1), self.weight_version)
                ids = ids.tolist()  # the block's one device->host read (two with logprobs)
                lps = logprobs.tolist() if logprobs is not None else [[None] * len(reqs)] * len(ids)
                return [[_Sampled(t, lp, None) for t, lp in zip(step_ids, step_lps)]
                        for step_ids, step_lps in zip(ids, lps)]
        outs, prev = [], None
        for j in range(num_steps):
            if j:
                if self._block_stop[0]:
                    break
                fb = decode_batch(reqs, locs[j], device, pending=j)
                fb.sampling_info = self._sampling_info(reqs, step_offset=j)
            out, _ = self._forward_sample_device(fb, reqs, fill=None if prev is None else (prev, None))
            prev = out.next_token_ids
            outs.append(out)
        return [self._host_rows(out, reqs) for out in outs]

    def _process_decode(self, results: list[tuple]) -> list[Req]:
        """((req, i), _Sampled or _StepFailure) of a decode step -> the requests it updated."""
        for (req, _), res in results:
            if isinstance(res, _StepFailure):
                self._fail(req, res.message)
                continue
            try:
                req.num_computed = req.seq_len
                self._append_token(req, res)
            except Exception as e:
                self._fail(req, f"{type(e).__name__}: {e}")
        return [req for (req, _), _ in results]

    # ---- forward with failure attribution ---------------------------------------------------
    def _sampling_info(self, reqs: list[Req], step_offset: int = 0):
        if self._sampling_cache is None:
            self._sampling_cache = SamplingInfoCache(self.runner.model_config.vocab_size, self.eos_ids,
                                                     self.runner.device)
        return self._sampling_cache(reqs, step_offset)

    def _forward_sample(self, fb, reqs: list[Req], prompt_rows=None) -> list[_Sampled]:
        if (self.overlap is not None and self.runner.device.type == "cpu"
                and not self.overlap.worker.is_current_thread()):
            # With the overlap schedule on the CPU, prefill runs on the forward worker too: every step on
            # one thread means one OpenMP pool, and a second would slow every step (runner/openmp_pool.py).
            # The worker runs jobs in order and nothing is in flight before a prefill, so this only waits.
            return self.overlap.worker.submit(lambda: self._forward_sample_ids(fb, reqs, prompt_rows)[1]).result()
        return self._forward_sample_ids(fb, reqs, prompt_rows)[1]

    def _forward_sample_ids(self, fb, reqs: list[Req], prompt_rows=None,
                            prepared=None) -> tuple[torch.Tensor, list[_Sampled]]:
        """(sampled ids [bs] on the device, host rows). fb.sampling_info, when set, was built by the caller
        (the overlap schedule builds it on the scheduler thread; this may run on its worker), and so was
        `prepared`, the runner's fused forward of fb (ModelRunner.prepare_forward), when given."""
        out, logits_out = self._forward_sample_device(fb, reqs, prepared=prepared)
        return out.next_token_ids, self._host_rows(out, reqs, logits_out if prompt_rows is not None else None,
                                                   prompt_rows)

    def _forward_sample_device(self, fb, reqs: list[Req], prepared=None, fill=None):
        """The forward and sampling of fb, and the per-slot records they leave on the device: (the
        SampleOutput, the LogitsOutput), nothing read back yet. fill: (ids, index or None), the overlap
        schedule's step N+1: fb.input_ids first becomes step N's sampled ids (rows `index` of them). The
        overlap schedule runs this on its worker and `_host_rows` on the scheduler thread (on the CPU), so
        the worker's own Python per step is only this; with a prepared fused forward and the sampler's
        plain path it is one C++ call (ModelRunner.forward_sample)."""
        if fb.sampling_info is None:
            fb.sampling_info = self._sampling_info(reqs)
        both = None
        one_call = getattr(self.runner, "forward_sample", None)
        if one_call is not None:
            if prepared is None:
                prepared = self.runner.prepare_forward(fb)
            if prepared is not None:
                both = one_call(fb, prepared, *(fill or (None, None)))
        if both is not None:
            logits_out, out = both
        else:
            if fill is not None:
                ids, index = fill
                fb.input_ids.copy_(ids if index is None else ids.index_select(0, index))
            logits_out = self.runner.forward(fb) if prepared is None else self.runner.forward(fb, prepared=prepared)
            out = self.runner.sample(logits_out, fb)
        if self.kv.slot_versions is not None:  # every slot this forward computed, under the current version
            self.kv.write_slot_versions(fb.out_cache_loc, self.weight_version)
        if self.kv.routed_experts is not None and self.recorder.last_routed_experts is not None:
            # [num_tokens, num_layers, top_k] in the batch's token order, as out_cache_loc
            self.kv.write_routed_experts(fb.out_cache_loc, self.recorder.last_routed_experts)
        return out, logits_out

    def _host_rows(self, out, reqs: list[Req], logits_out=None, prompt_rows=None) -> list[_Sampled]:
        """A step's SampleOutput read back to the host, one _Sampled per request (on CUDA: on the stream
        that produced it; the read is the step's sync)."""
        ids = out.next_token_ids.tolist()  # the one device->host read (two with logprobs)
        logprobs = [None] * len(ids) if out.logprobs is None else out.logprobs.tolist()
        tops = [None] * len(reqs)
        if out.top_logprobs is not None and any(r.return_logprob and r.top_logprobs_num for r in reqs):
            vals, toks = out.top_logprobs.tolist(), out.top_logprob_ids.tolist()
            tops = [list(zip(v, t))[: r.top_logprobs_num] for r, v, t in zip(reqs, vals, toks)]
        ids_lps = [None] * len(reqs)
        if out.token_ids_logprobs is not None:  # only requests that asked, and only then: extra reads
            ids_lps = [v[: len(r.token_ids_logprob or [])] for r, v in zip(reqs, out.token_ids_logprobs.tolist())]
        prompt = [None] * len(reqs)
        if prompt_rows is not None:
            prompt = self._prompt_logprobs(logits_out.all_logits, reqs, prompt_rows)
        return [_Sampled(t, lp, top, il, p) for t, lp, top, il, p in zip(ids, logprobs, tops, ids_lps, prompt)]

    def _prompt_logprobs(self, all_logits, reqs: list[Req], rows) -> list[list[tuple[int, tuple]]]:
        """Per request, the (position, (logprob, top, token_ids logprobs)) of the prompt positions this
        step's logits score (rows: rollout.batch.PromptLogprobRows)."""
        k = max((r.top_logprobs_num for r in reqs), default=0)
        res = prompt_logprobs(all_logits, rows.rows, rows.targets, rows.temperatures, k, rows.token_ids)
        lps = res.token_logprobs.tolist()
        top_v = res.top_logprobs.tolist() if res.top_logprobs is not None else None
        top_i = res.top_logprob_ids.tolist() if res.top_logprobs is not None else None
        ids_v = res.token_ids_logprobs.tolist() if res.token_ids_logprobs is not None else None
        out: list[list[tuple[int, tuple]]] = [[] for _ in reqs]
        for m, (b, pos) in enumerate(zip(rows.owners, rows.positions)):
            req = reqs[b]
            top = list(zip(top_v[m], top_i[m]))[: req.top_logprobs_num] if req.top_logprobs_num else None
            ids = ids_v[m][: len(req.token_ids_logprob)] if req.token_ids_logprob else None
            out[b].append((pos, (lps[m], top, ids)))
        return out

    def _run_attributed(self, units: list, run) -> list[tuple]:
        """(unit, result) per unit: `run(units)`'s rows, or, where it raised, a _StepFailure for the
        units it is pinned on by re-running the halves (each unit's outputs do not depend on its
        batch-mates, so re-running a half reproduces exactly what the whole batch would have given)."""
        try:
            return list(zip(units, run(units), strict=True))
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
            if len(units) == 1 or not self._failure_can_be_attributed():
                if len(units) > 1:
                    logger.exception("scheduler step failed for all %d requests of the batch", len(units))
                return [(u, _StepFailure(message)) for u in units]
            mid = len(units) // 2
            return self._run_attributed(units[:mid], run) + self._run_attributed(units[mid:], run)

    def _failure_can_be_attributed(self) -> bool:
        """False when the runner cannot run any batch (invalid weights): no split would help."""
        return bool(getattr(self.runner, "weights_valid", True))

    def _drain_failed(self) -> list[Req]:
        failed, self._failed = self._failed, []
        return failed

    # ---- results -------------------------------------------------------------------------
    def _append_token(self, req: Req, sampled: _Sampled) -> None:
        req.output_ids.append(sampled.token)
        extend_runs(req.output_version_spans, len(req.output_ids) - 1, self.weight_version)
        req.last_token_time = time.perf_counter()  # latency metrics (time to first token, inter-token)
        if len(req.output_ids) == 1:
            req.first_token_time = req.last_token_time
        self.stats["num_generated_tokens"] += 1
        if req.return_logprob:
            req.output_logprobs.append(sampled.logprob)
            if req.top_logprobs_num:
                req.output_top_logprobs.append(sampled.top)
            if req.token_ids_logprob:
                req.output_token_ids_logprobs.append(sampled.ids_logprobs)
        reason = self._check_finished(req, sampled.token)
        if reason is not None:
            self._finish(req, reason)

    def _check_finished(self, req: Req, token: int) -> FinishReason | None:
        sp = req.sampling_params
        num_out = len(req.output_ids)
        # ignore_eos also ignores stop_token_ids, as SGLang's token-based finish check does (vLLM's does not).
        if not sp.ignore_eos and (num_out > sp.min_new_tokens or num_out == sp.max_new_tokens):
            if token in sp.stop_token_ids or token in self.eos_ids:  # (max_new_tokens None: only the context)
                return FinishReason("stop", token)
        # Stop strings before the limits, as stop tokens above: a stop the last allowed token completes is a
        # stop (its text trimmed), not a truncation that keeps the stop text.
        if sp.stop or sp.stop_regex:  # before min_new_tokens it only marks a stop prefix a chunk must hold back
            matched = self.stop_checker(req)
            if isinstance(matched, FinishReason):  # a stop_regex that ran out of time (rollout.stop_match)
                return matched
            if matched is not None:
                return FinishReason("stop", matched)
        if sp.max_new_tokens is not None and num_out >= sp.max_new_tokens:
            return FinishReason("length", sp.max_new_tokens)
        # Out of room: SGLang clips max_new_tokens to the room left, so its "length" is the number of tokens
        # generated; so is this one.
        if req.seq_len >= self.runner.context_len:
            return FinishReason("length", num_out)
        # SGLang clips max_new_tokens to what the pool can hold for the request alone: it ends as length, not
        # as an abort once the pool is full (RL clients resubmit an aborted sample, which would fail again).
        if req.seq_len >= self.kv.kv_pool.size:
            return FinishReason("length", num_out)
        return None
