"""Scheduler: continuous batching over the runner, with chunked prefill, the prefix cache and
retraction when the KV pool runs out.

Each `step()` runs one forward: a prefill (EXTEND) batch when there are requests to admit, else a
decode batch of everything running. Prefill takes at most `chunked_prefill_size` new tokens per step,
so a long prompt is prefilled in chunks with a decode step between chunks. Requests whose prompt
shares a long prefix with one already in the batch wait one step, so the n samples of a prompt
prefill it once and the rest hit the cache. When a decode step cannot get KV slots, the youngest
running requests are retracted (their KV handed to the prefix cache, themselves requeued); sampling
is counter-based per request, so their outputs do not change. Plain Python over Req objects; all
tensor work happens in the runner.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from rollout.batch import decode_batch, extend_batch, sampling_info
from rollout.radix_cache import RadixCache
from rollout.request import FinishReason, Req

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    chunked_prefill_size: int = 2048
    max_running_requests: int | None = None
    disable_radix_cache: bool = False
    in_batch_prefix_threshold: int = 16  # shared tokens that make a request wait for the cache

    def __post_init__(self) -> None:
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size={self.chunked_prefill_size} must be >= 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")


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


class Scheduler:
    def __init__(self, runner, config: SchedulerConfig, eos_ids: list[int], stop_checker) -> None:
        self.runner = runner
        self.config = config
        self.eos_ids = list(eos_ids)
        self.stop_checker = stop_checker  # (req) -> matched stop string or None
        self.req_pool = runner.req_to_token_pool
        self.kv_pool = runner.token_to_kv_pool
        self.max_running = min(config.max_running_requests or self.req_pool.size, self.req_pool.size)
        self.tree = None if config.disable_radix_cache else RadixCache(self.kv_pool.free)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self._admit_counter = 0
        self.last_step_was_chunk = False
        self._failed: list[Req] = []
        self.stats = dict(num_prefill_steps=0, num_decode_steps=0, num_prefill_tokens=0, num_cached_tokens=0,
                          num_prompt_tokens=0, num_generated_tokens=0, num_retractions=0, num_evicted_tokens=0)

    # ---- queue ----------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.stats["num_prompt_tokens"] += len(req.prompt_ids)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running) + (self.chunked_req is not None)

    def abort(self, rid: str) -> Req | None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = FinishReason("abort", message="aborted by abort_request")
                return req
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid:
                self._finish(req, FinishReason("abort", message="aborted by abort_request"))
                return req
        return None

    # ---- KV bookkeeping ------------------------------------------------------------------
    def _available_tokens(self) -> int:
        return self.kv_pool.available_size() + (self.tree.evictable_size if self.tree else 0)

    def _alloc(self, n: int) -> torch.Tensor:
        short = n - self.kv_pool.available_size()
        if short > 0 and self.tree is not None:
            self.stats["num_evicted_tokens"] += self.tree.evict(short)
        return self.kv_pool.alloc(n)

    def _admit(self, req: Req) -> None:
        req.req_pool_idx = self.req_pool.alloc()
        req.num_computed = 0
        if self.tree is not None:
            # Keep at least one token to compute: its logits give the next token.
            slots, node = self.tree.match_prefix(req.fill_ids[: req.seq_len - 1])
            self.tree.inc_lock_ref(node)
            req.last_node = node
            if len(slots):
                self.req_pool.write(req.req_pool_idx, 0, slots.to(self.runner.device))
            req.num_computed = len(slots)
        req.num_cached = req.num_computed
        self._admit_counter += 1
        req.admitted_order = self._admit_counter

    def _release_kv(self, req: Req) -> None:
        """Give back everything `req` holds: computed KV goes to the prefix cache (or the pool)."""
        if req.req_pool_idx is None:
            return
        row = self.req_pool.req_to_token[req.req_pool_idx, : req.num_computed].to("cpu")
        if self.tree is not None:
            key = req.fill_ids[: req.num_computed]
            in_tree = req.num_cached
            already = self.tree.insert(key, row)
            self.kv_pool.free(row[in_tree:already])  # computed twice: the tree keeps its copy
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = None
        else:
            self.kv_pool.free(row)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def _cache_unfinished(self, req: Req) -> None:
        """Put req's computed prefix in the tree now, so siblings admitted next step reuse it."""
        if self.tree is None:
            return
        row = self.req_pool.req_to_token[req.req_pool_idx, : req.num_computed].to("cpu")
        key = req.fill_ids[: req.num_computed]
        already = self.tree.insert(key, row)
        self.kv_pool.free(row[req.num_cached : already])
        slots, node = self.tree.match_prefix(key)
        self.req_pool.write(req.req_pool_idx, 0, slots.to(self.runner.device))
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = node
        req.num_cached = len(slots)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        self._release_kv(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None

    def retract(self, req: Req) -> None:
        self._release_kv(req)
        self.running.remove(req)
        req.num_computed = req.num_cached = 0
        req.num_retractions += 1
        self.stats["num_retractions"] += 1
        self.waiting.appendleft(req)

    def _requeue_chunked(self) -> None:
        """Undo the prefill in progress: its KV goes back (to the prefix cache if on), it waits first in line."""
        req = self.chunked_req
        self._release_kv(req)
        req.num_computed = req.num_cached = 0
        self.waiting.appendleft(req)
        self.chunked_req = None

    def retract_all(self) -> None:
        """Requeue every running request; their KV will be recomputed (e.g. under new weights)."""
        if self.chunked_req is not None:
            self._requeue_chunked()
        for req in sorted(self.running, key=lambda r: r.admitted_order, reverse=True):
            self.retract(req)

    def reset(self) -> None:
        """Forget every request and return every slot (after a failed step; callers own the requests)."""
        self.waiting.clear()
        self.running.clear()
        self.chunked_req = None
        self._failed.clear()
        self.req_pool.free_slots = list(range(self.req_pool.size))
        if self.tree is not None:
            self.tree.reset()
        self.kv_pool.clear()

    def flush_cache(self) -> None:
        if self.running or self.chunked_req:
            raise RuntimeError("flush_cache refused: requests are running (pause and finish or abort them first)")
        if self.tree is not None:
            self.tree.reset()
        self.kv_pool.clear()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward. Returns the requests that got a token or finished this step."""
        if self.waiting or self.chunked_req:
            interleave = self.last_step_was_chunk and self.running  # don't stall decodes on a long prompt
            if not interleave:
                items = self._schedule_prefill()
                if items:
                    return self._run_prefill(items)
        self.last_step_was_chunk = False
        failed = self._drain_failed()  # too big for the pool: finished here even when nothing runs
        if self.running:
            return self._run_decode() + failed
        return failed

    def _schedule_prefill(self) -> list[tuple[Req, int, int]]:
        budget = self.config.chunked_prefill_size
        items: list[tuple[Req, int, int]] = []
        trie = _PrefixTrie()
        if self.chunked_req is not None:
            req = self.chunked_req
            trie.match_and_insert(req.fill_ids[: req.seq_len - 1])
            if not self._take_chunk(req, items, budget) or self.chunked_req is req:
                return items
            budget -= items[-1][2]
        deferred: list[Req] = []
        while self.waiting and budget > 0:
            if len(self.running) + len(items) >= self.max_running or not self.req_pool.available_size():
                break
            req = self.waiting.popleft()
            self._admit(req)
            shared = trie.match_and_insert(req.fill_ids[: req.seq_len - 1])
            threshold = max(1, min(self.config.in_batch_prefix_threshold, req.seq_len - 1))
            if items and shared - req.num_computed >= threshold:
                # Its prefix is being computed in this batch: next step it is a cache hit instead.
                self._unadmit(req)
                deferred.append(req)
                continue
            if not self._take_chunk(req, items, budget):
                break
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
                self._unadmit(req)
                self.waiting.appendleft(req)
            return False
        if self._available_tokens() < take:
            if req is not self.chunked_req:
                self._unadmit(req)
                self.waiting.appendleft(req)
            if not items and not self.running:
                self._fail_too_long(req)
            return False
        loc = self._alloc(take)
        self.req_pool.write(req.req_pool_idx, req.num_computed, loc.to(self.runner.device))
        if not req.is_cache_counted:  # report the hit of the first admission that runs, not of one undone
            req.is_cache_counted = True
            req.cached_tokens = min(req.num_cached, len(req.prompt_ids))
            self.stats["num_cached_tokens"] += req.cached_tokens
        items.append((req, req.num_computed, take))
        self.chunked_req = req if take < remaining else (None if self.chunked_req is req else self.chunked_req)
        return True

    def _unadmit(self, req: Req) -> None:
        if self.tree is not None and req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = None
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.num_computed = req.num_cached = 0

    def _fail_too_long(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if self.chunked_req is req:
            self._release_kv(req)
            self.chunked_req = None
        req.finished_reason = FinishReason(
            "abort", message=f"the KV cache ({self.kv_pool.size} tokens) cannot hold this request "
                             f"({req.seq_len} tokens); raise max_total_tokens")
        self._failed.append(req)

    def _run_prefill(self, items: list[tuple[Req, int, int]]) -> list[Req]:
        # The slots _take_chunk just wrote, gathered where they live (no device->host read).
        locs = torch.cat([self.req_pool.req_to_token[r.req_pool_idx, s : s + n] for r, s, n in items])
        fb = extend_batch(items, locs, self.runner.device)
        reqs = [r for r, _, _ in items]
        fb.sampling_info = sampling_info(reqs, self.runner.model_config.vocab_size, self.eos_ids, self.runner.device)
        out = self.runner.sample(self.runner.forward(fb), fb)
        ids, logprobs = out.next_token_ids.tolist(), out.logprobs.tolist()  # the one device->host read
        self.stats["num_prefill_steps"] += 1
        self.stats["num_prefill_tokens"] += sum(n for _, _, n in items)
        updated = []
        self.last_step_was_chunk = False
        for i, (req, start, n) in enumerate(items):
            req.num_computed = start + n
            if req.num_computed < req.seq_len:  # a chunk; more to come
                self._cache_unfinished(req)
                self.last_step_was_chunk = True
                continue
            if req.sampling_params.max_new_tokens == 0 and not req.output_ids:
                self._finish(req, FinishReason("length", 0))
                updated.append(req)
                continue
            self._cache_unfinished(req)
            self.running.append(req)
            self._append_token(req, ids[i], logprobs[i], out, i)
            updated.append(req)
        return updated + self._drain_failed()

    def _run_decode(self) -> list[Req]:
        self.running.sort(key=lambda r: r.admitted_order)
        if self._available_tokens() < len(self.running) and self.chunked_req is not None:
            # A half-prefilled prompt is the youngest holder of KV: it goes first, or a running request
            # would be aborted as "too long" while the pool is full of someone else's chunks.
            self.chunked_req.num_retractions += 1
            self.stats["num_retractions"] += 1
            self._requeue_chunked()
        while self._available_tokens() < len(self.running) and len(self.running) > 1:
            self.retract(self.running[-1])
        if self._available_tokens() < len(self.running):
            req = self.running[0]
            self._finish(req, FinishReason("abort", message="KV cache exhausted by a single request; "
                                                            "raise max_total_tokens"))
            return [req]
        reqs = list(self.running)
        fb = decode_batch(reqs, self._alloc(len(reqs)), self.runner.device)
        # The new token of each request sits at position seq_len - 1 of its row.
        self.req_pool.req_to_token[fb.req_pool_indices, fb.positions] = fb.out_cache_loc
        fb.sampling_info = sampling_info(reqs, self.runner.model_config.vocab_size, self.eos_ids, self.runner.device)
        out = self.runner.sample(self.runner.forward(fb), fb)
        ids, logprobs = out.next_token_ids.tolist(), out.logprobs.tolist()  # the one device->host read
        self.stats["num_decode_steps"] += 1
        for i, req in enumerate(reqs):
            req.num_computed = req.seq_len
            self._append_token(req, ids[i], logprobs[i], out, i)
        return reqs

    def _drain_failed(self) -> list[Req]:
        failed, self._failed = self._failed, []
        return failed

    # ---- results -------------------------------------------------------------------------
    def _append_token(self, req: Req, token: int, logprob: float, out, i: int) -> None:
        req.output_ids.append(token)
        self.stats["num_generated_tokens"] += 1
        if req.return_logprob:
            req.output_logprobs.append(logprob)
            if req.top_logprobs_num:
                if not hasattr(out, "top_lists"):  # one device->host read per step, not per request
                    out.top_lists = (out.top_logprobs.tolist(), out.top_logprob_ids.tolist())
                vals, toks = out.top_lists[0][i], out.top_lists[1][i]
                req.output_top_logprobs.append(list(zip(vals, toks))[: req.top_logprobs_num])
        reason = self._check_finished(req, token)
        if reason is not None:
            self._finish(req, reason)

    def _check_finished(self, req: Req, token: int) -> FinishReason | None:
        sp = req.sampling_params
        num_out = len(req.output_ids)
        if num_out > sp.min_new_tokens or num_out == sp.max_new_tokens:
            if token in sp.stop_token_ids:
                return FinishReason("stop", token)
            if not sp.ignore_eos and token in self.eos_ids:
                return FinishReason("stop", token)
        if num_out >= sp.max_new_tokens:
            return FinishReason("length", sp.max_new_tokens)
        if req.seq_len >= self.runner.context_len:
            return FinishReason("length", self.runner.context_len)
        if sp.stop and num_out >= sp.min_new_tokens:
            matched = self.stop_checker(req)
            if matched is not None:
                return FinishReason("stop", matched)
        return None
