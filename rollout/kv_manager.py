"""KVManager: every write to the KV pools and the prefix cache, on behalf of the scheduler.

The scheduler decides (who is admitted, who runs, who is retracted or fails); this class does the
bookkeeping: a request's row in ReqToTokenPool, its token slots in TokenToKVPool, its lock in the radix
cache (SGLang's cache_finished_req / cache_unfinished_req, nano-vllm's BlockManager). It is the only
code that touches those three. It knows nothing of batches, sampling or finish reasons.

A request's KV goes admit -> alloc_extend / alloc_decode -> cache_unfinished ... and ends in exactly one
of two ways: `release` (it finished: its computed KV goes to the prefix cache) or `undo` (retraction,
chunk requeue, an admission taken back, a failed step: the same release, then it starts from scratch).

Its row holds, by position (page size 1):
    [0, num_cached)               slots owned by the radix tree; the request locks `last_node`
    [num_cached, num_computed)    slots owned by the request, KV computed
    [num_computed, num_allocated) slots owned by the request for a step not run yet (or one that failed)
Without the radix cache num_cached is 0.

Prefix-cache namespaces: KV is only reused under the adapter it was computed with (the LoRA uid) and,
with weight-version isolation (`isolate_versions`), the weight version the request was admitted under:
an entry of an older version is never matched again, and goes by LRU eviction like any other.
"""

from __future__ import annotations

import functools

import torch

from rollout.radix_cache import RadixCache
from rollout.request import Req, extend_runs
from runner.memory.kv_pool import ReqToTokenPool, TokenToKVPool

# Eviction frees at least 1/32 of the pool, at most 512 slots, when it runs (0 for a pool under 32 slots).
EVICT_AHEAD_FRACTION, EVICT_AHEAD_MAX = 32, 512


class KVManager:
    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, device, enable_radix_cache: bool,
                 stats: dict) -> None:
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.device = device
        # The tree's slot tensors are its own (cloned on insert, never written): an evicted one is handed over.
        self.tree = RadixCache(functools.partial(kv_pool.free, owned=True)) if enable_radix_cache else None
        # Eviction frees at least this many slots when it runs (see _alloc).
        self.evict_ahead = min(kv_pool.size // EVICT_AHEAD_FRACTION, EVICT_AHEAD_MAX)
        self.stats = stats  # the scheduler's counters; this class adds num_evicted_tokens
        self.routed_experts: torch.Tensor | None = None  # [kv size + 1, num_layers, top_k] int32, host
        self.isolation_version = None  # None: one namespace per adapter, across weight versions
        self.slot_versions: torch.Tensor | None = None  # enable_slot_versions: [kv size + 1] int32, host

    def isolate_versions(self, key) -> None:
        """From now on requests admitted are keyed under `key` (hashable: the scheduler's (version label,
        weights generation); call on every version change)."""
        self.isolation_version = key

    def _namespace(self, req: Req):
        return req.lora_id if self.isolation_version is None else (req.lora_id, self.isolation_version)

    # ---- capacity ----------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Token slots an allocation can get: free ones plus unlocked cache entries it may evict."""
        return self.kv_pool.available_size() + (self.tree.evictable_size if self.tree else 0)

    def num_free_rows(self) -> int:
        return self.req_pool.available_size()

    def is_idle(self) -> bool:
        """No request holds a row (so none holds KV or a cache lock)."""
        return self.req_pool.available_size() == self.req_pool.size

    def _alloc(self, n: int) -> torch.Tensor:
        short = n - self.kv_pool.available_size()
        if short > 0 and self.tree is not None:
            # Evict ahead, LRU first as ever: once the cache fills the pool, exactly `short` made every decode
            # step evict one or two entries and merge the pool's free list again (a batch of 64 rows on the
            # tiny model: ~0.5 ms of a ~3 ms step, the in-process Engine 20% slower with a full cache than an
            # empty one). Freeing a few hundred slots at a time makes that once per several steps; the cache
            # only loses its oldest entries a little earlier.
            self.stats["num_evicted_tokens"] += self.tree.evict(max(short, self.evict_ahead))
        return self.kv_pool.alloc(n)

    # ---- a request's life ----------------------------------------------------------------------
    def cached_prefix_len(self, req: Req) -> int:
        """Tokens of req's prompt the prefix cache holds now (what admitting it would reuse; 0 without a cache)."""
        if self.tree is None:
            return 0
        slots, _ = self.tree.match_prefix(req.fill_ids, self._namespace(req))
        return len(slots)

    def admit(self, req: Req, max_prefix: int | None = None) -> None:
        """Give req a row and its longest cached prefix (locked so it cannot be evicted under it), of at
        most `max_prefix` tokens (positions whose logits the request needs must be computed)."""
        req.req_pool_idx = self.req_pool.alloc()
        req.num_computed = 0
        req.kv_namespace = self._namespace(req)
        if self.tree is not None:
            # Keep at least one token to compute: its logits give the next token.
            limit = req.seq_len - 1 if max_prefix is None else min(req.seq_len - 1, max_prefix)
            slots, node = self.tree.match_prefix(req.fill_ids[:limit], req.kv_namespace)
            self.tree.inc_lock_ref(node)
            req.last_node = node
            if len(slots):
                self.req_pool.write(req.req_pool_idx, 0, slots.to(self.device))
            req.num_computed = len(slots)
        req.num_cached = req.num_allocated = req.num_computed

    def alloc_extend(self, req: Req, n: int) -> None:
        """Slots for fill_ids[num_computed : num_computed + n], written into req's row."""
        loc = self._alloc(n)
        self.req_pool.write(req.req_pool_idx, req.num_computed, loc.to(self.device))
        req.num_allocated = req.num_computed + n

    def extend_locs(self, items: list[tuple[Req, int, int]]) -> torch.Tensor:
        """The slots written for each (req, start, n), gathered on the device (no host read): a slice per
        chunk, and one gather for each run of one-token rows (a mixed step's running requests)."""
        rows = self.req_pool.req_to_token
        parts: list[torch.Tensor] = []
        singles: list[tuple[int, int]] = []
        for r, s, n in items + [(None, 0, 0)]:  # the sentinel flushes the last run of singles
            if n == 1:
                singles.append((r.req_pool_idx, s))
                continue
            if singles:
                at = torch.tensor(singles, dtype=torch.int64).to(self.device).t()  # [2, k]: rows, positions
                parts.append(rows[at[0], at[1]])
                singles = []
            if n:
                parts.append(rows[r.req_pool_idx, s : s + n])
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # [sum n]

    def alloc_decode(self, reqs: list[Req], pending: int = 0) -> torch.Tensor:
        """One slot per request for the token at position seq_len - 1 + pending (pending: tokens sampled by
        a step still in flight, see rollout.overlap). Returns them ([bs], on the device); `write_decode`
        puts them into the rows once the batch's index tensors exist."""
        locs = self._alloc(len(reqs)).to(self.device)
        for req in reqs:
            req.num_allocated = req.seq_len + pending
        return locs

    def alloc_decode_steps(self, reqs: list[Req], num_steps: int) -> torch.Tensor:
        """Slots for `num_steps` decode steps of every request (a decode block, rollout/scheduler.py): step j
        writes the token at position seq_len - 1 + j. All of them go into the rows now (a block reads no
        host state between its steps). Returns them as [num_steps, bs] on the device. A request that
        finishes inside the block keeps the slots past its end as "allocated, not computed" until `release`
        frees them."""
        bs = len(reqs)
        locs = self._alloc(num_steps * bs).to(self.device).view(num_steps, bs)
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        first = torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64)
        positions = first.unsqueeze(0) + torch.arange(num_steps, dtype=torch.int64).unsqueeze(1)  # [num_steps, bs]
        self.write_decode(rows.repeat(num_steps).to(self.device), positions.reshape(-1).to(self.device),
                          locs.reshape(-1))
        for req in reqs:
            req.num_allocated = req.seq_len + num_steps - 1
        return locs

    def write_decode(self, req_pool_indices: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor) -> None:
        self.req_pool.req_to_token[req_pool_indices, positions] = locs

    def cache_unfinished(self, req: Req) -> None:
        """Put req's computed prefix in the tree now, so requests admitted next step reuse it."""
        if self.tree is None:
            return
        row = self.req_pool.req_to_token[req.req_pool_idx, : req.num_computed].to("cpu")
        key = req.fill_ids[: req.num_computed]
        already = self.tree.insert(key, row, req.kv_namespace)
        self.kv_pool.free(row[req.num_cached : already])  # computed twice: the tree keeps its copy
        slots, node = self.tree.match_prefix(key, req.kv_namespace)
        self.req_pool.write(req.req_pool_idx, 0, slots.to(self.device))
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = node
        req.num_cached = len(slots)

    def release(self, req: Req) -> None:
        """Give back everything req holds (cache_finished_req): computed KV to the prefix cache (or the
        pool), slots of a step that never ran to the pool, the cache lock, the row. Idempotent."""
        if req.req_pool_idx is None:
            return
        row = self.req_pool.req_to_token[req.req_pool_idx, : req.num_allocated].to("cpu")
        computed = row[: req.num_computed]
        if self.tree is not None:
            already = self.tree.insert(req.fill_ids[: req.num_computed], computed, req.kv_namespace)
            self.kv_pool.free(computed[req.num_cached : already])
            if req.last_node is not None:
                self.tree.dec_lock_ref(req.last_node)
            req.last_node = None
        else:
            self.kv_pool.free(computed)
        self.kv_pool.free(row[req.num_computed :])
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.num_allocated = req.num_computed

    def undo(self, req: Req) -> None:
        """The one undo path (retraction, chunk requeue, an admission taken back, a failed step): release
        what req holds and reset it to "never admitted"; its next admission starts from the cache."""
        self.release(req)
        req.num_computed = req.num_cached = req.num_allocated = 0

    # ---- routed experts per KV slot (MoE, return_routed_experts) ------------------------------------
    def enable_routed_experts(self, num_layers: int, top_k: int) -> None:
        """Keep, per KV slot, the experts its token was routed to when its KV was computed, as SGLang does:
        a request that reads a slot from the prefix cache reads its routing with it. Host memory,
        (kv size + 1) * num_layers * top_k * 4 bytes; -1 until written."""
        self.routed_experts = torch.full((self.kv_pool.size + 1, num_layers, top_k), -1, dtype=torch.int32)

    def write_routed_experts(self, locs: torch.Tensor, routed: torch.Tensor) -> None:
        """locs: [num_tokens] KV slots of one forward; routed: [num_tokens, num_layers, top_k], same order."""
        self.routed_experts[locs.cpu()] = routed.cpu()

    def routed_experts_of(self, req: Req) -> torch.Tensor:
        """[n, num_layers, top_k] for req's positions [0, n): every position whose KV exists except the
        last sampled token's (never fed back), n = min(num_computed, seq_len - 1), as SGLang returns."""
        n = min(req.num_computed, req.seq_len - 1)
        slots = self.req_pool.req_to_token[req.req_pool_idx, :n].cpu()
        return self.routed_experts[slots]  # advanced indexing: a copy, safe after the slots are reused

    # ---- weight version per KV slot (prefill_weight_versions) ----------------------------------------
    def enable_slot_versions(self) -> None:
        """Keep, per KV slot, the weight version its KV was computed under (an id into `version_names`):
        (kv size + 1) int32 on the host."""
        self.slot_versions = torch.full((self.kv_pool.size + 1,), -1, dtype=torch.int32)
        self.version_names: list[str] = []
        self._version_ids: dict[str, int] = {}

    def write_slot_versions(self, locs: torch.Tensor, weight_version: str) -> None:
        vid = self._version_ids.get(weight_version)
        if vid is None:
            vid = self._version_ids[weight_version] = len(self.version_names)
            self.version_names.append(weight_version)
        self.slot_versions[locs.cpu()] = vid

    def prompt_version_spans(self, req: Req) -> list[list]:
        """[start, end, version] runs over req's prompt positions whose KV exists, in order."""
        n = min(req.num_computed, len(req.prompt_ids))
        ids = self.slot_versions[self.req_pool.req_to_token[req.req_pool_idx, :n].cpu()].tolist()
        spans: list[list] = []
        for pos, vid in enumerate(ids):
            extend_runs(spans, pos, self.version_names[vid] if vid >= 0 else None)
        return spans

    def drop_lora_cache(self, lora_id: int) -> None:
        """An adapter was unloaded: free its prefix-cache entries (no request uses them any more)."""
        if self.tree is not None:
            for ns in [ns for ns in self.tree.roots if ns == lora_id or (isinstance(ns, tuple) and ns[0] == lora_id)]:
                self.tree.drop_namespace(ns)

    # ---- whole-pool operations ------------------------------------------------------------------
    def flush(self) -> bool:
        """Empty the prefix cache and the pool. Refused (False) while any request holds a row."""
        if not self.is_idle():
            return False
        self.reset()
        return True

    def reset(self) -> None:
        """Return every row and slot (the callers own, and have finished, every request)."""
        self.req_pool.clear()
        if self.tree is not None:
            self.tree.reset()
        self.kv_pool.clear()
