"""KVManager on real (tiny, CPU) pools, without a model: every path conserves slots, by hand-counted
expectations. A "step" is simulated by setting num_computed as the scheduler does after a forward."""

from __future__ import annotations

import pytest
import torch

from rollout.kv_manager import KVManager
from rollout.request import Req
from rollout.sampling_params import SamplingParams
from runner.memory.kv_pool import ReqToTokenPool, TokenToKVPool

NUM_SLOTS = 20


def _manager(radix: bool = True) -> KVManager:
    req_pool = ReqToTokenPool(size=4, max_context_len=32, device="cpu")
    kv_pool = TokenToKVPool(NUM_SLOTS, torch.float32, num_layers=1, num_kv_heads=1, head_dim=2, device="cpu")
    return KVManager(req_pool, kv_pool, "cpu", enable_radix_cache=radix, stats={"num_evicted_tokens": 0})


def _req(prompt: list[int], rid: str = "r") -> Req:
    return Req(rid, list(prompt), SamplingParams(), seed=0)


def _prefill(kv: KVManager, req: Req, n: int | None = None) -> None:
    """Admit-side half of a prefill step that succeeds: allocate, then mark computed."""
    n = req.seq_len - req.num_computed if n is None else n
    kv.alloc_extend(req, n)
    req.num_computed += n


def _row(kv: KVManager, req: Req, n: int) -> list[int]:
    return kv.req_pool.req_to_token[req.req_pool_idx, :n].tolist()


def _counts(kv: KVManager) -> tuple[int, int, int]:
    """(free slots, evictable cached slots, locked cached slots)."""
    tree = kv.tree
    return kv.kv_pool.available_size(), tree.evictable_size if tree else 0, tree.protected_size if tree else 0


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
def test_admit_prefill_release_conserves_slots(radix):
    """A request's prompt KV goes to the cache on release (or back to the pool without one); its row frees."""
    kv = _manager(radix)
    req = _req([3, 4, 5, 6, 7])
    kv.admit(req)
    assert kv.num_free_rows() == 3 and req.num_computed == 0
    _prefill(kv, req)
    assert _counts(kv)[0] == NUM_SLOTS - 5
    kv.release(req)
    assert kv.is_idle() and req.req_pool_idx is None
    assert _counts(kv) == ((NUM_SLOTS - 5, 5, 0) if radix else (NUM_SLOTS, 0, 0))
    kv.release(req)  # idempotent
    assert _counts(kv) == ((NUM_SLOTS - 5, 5, 0) if radix else (NUM_SLOTS, 0, 0))


def test_admission_reuses_and_locks_the_cached_prefix():
    """A second request sharing a 5-token prefix gets those very slots, locked while it holds them."""
    kv = _manager()
    a, b = _req([3, 4, 5, 6, 7], "a"), _req([3, 4, 5, 6, 7, 8, 9], "b")
    kv.admit(a)
    _prefill(kv, a)
    slots_a = _row(kv, a, 5)
    kv.release(a)
    kv.admit(b)
    assert (b.num_cached, b.num_computed) == (5, 5) and _row(kv, b, 5) == slots_a
    assert _counts(kv) == (NUM_SLOTS - 5, 0, 5)
    _prefill(kv, b)
    kv.release(b)
    assert _counts(kv) == (NUM_SLOTS - 7, 7, 0)


def test_undo_after_a_failed_step_returns_uncomputed_slots_and_lock():
    """A step that allocated 3 slots and then failed: undo frees those 3 to the pool (their KV is not
    valid), drops the cache lock and the row, and resets the request to never-admitted."""
    kv = _manager()
    a = _req([3, 4, 5, 6, 7, 8], "a")
    kv.admit(a)
    _prefill(kv, a)
    kv.release(a)  # 6 cached
    b = _req([3, 4, 5, 6, 7, 8, 10, 11, 12], "b")
    kv.admit(b)
    kv.alloc_extend(b, 3)  # the step's slots; the forward then raises, num_computed stays 6
    assert _counts(kv) == (NUM_SLOTS - 9, 0, 6)
    kv.undo(b)
    assert (b.req_pool_idx, b.num_computed, b.num_cached, b.num_allocated, b.last_node) == (None, 0, 0, 0, None)
    assert kv.is_idle() and _counts(kv) == (NUM_SLOTS - 6, 6, 0)


def test_chunk_cached_unfinished_is_shared_and_retraction_caches_decoded_kv():
    """cache_unfinished puts a computed chunk in the tree (a sibling admitted next reuses its slots);
    retracting (undo) a decoding request caches all its computed KV, prompt and generated tokens."""
    kv = _manager()
    a = _req([3, 4, 5, 6, 7, 8, 9, 10], "a")
    kv.admit(a)
    _prefill(kv, a, 4)  # first chunk
    kv.cache_unfinished(a)
    assert a.num_cached == 4 and _counts(kv) == (NUM_SLOTS - 4, 0, 4)
    sibling = _req([3, 4, 5, 6, 99], "s")
    kv.admit(sibling)
    assert sibling.num_cached == 4 and _row(kv, sibling, 4) == _row(kv, a, 4)
    kv.undo(sibling)  # an admission taken back: nothing of its own to give back
    assert _counts(kv) == (NUM_SLOTS - 4, 0, 4)
    _prefill(kv, a)  # the rest of the prompt
    kv.cache_unfinished(a)
    a.output_ids.append(42)  # sampled; its KV comes with the next decode
    locs = kv.alloc_decode([a])
    kv.write_decode(torch.tensor([a.req_pool_idx]), torch.tensor([a.seq_len - 1]), locs)
    a.num_computed = a.seq_len  # the decode forward ran
    assert _counts(kv) == (NUM_SLOTS - 9, 0, 8)
    kv.undo(a)  # retraction
    assert kv.is_idle() and _counts(kv) == (NUM_SLOTS - 9, 9, 0)
    again = _req([3, 4, 5, 6, 7, 8, 9, 10, 42, 43], "again")
    kv.admit(again)
    assert again.num_cached == 9  # the retracted request's whole KV is a cache hit


def test_allocation_evicts_unlocked_cache_lru_first():
    """When the free slots run short, the least recently used unlocked entries are evicted; locked ones never."""
    kv = _manager()
    for i, rid in enumerate("abc"):  # three cached 6-token prompts: 18 of 20 slots
        r = _req([50 + 10 * i + j for j in range(6)], rid)
        kv.admit(r)
        _prefill(kv, r)
        kv.release(r)
    keep = _req([60, 61, 62, 63, 64, 65, 66], "keep")  # locks b's entry
    kv.admit(keep)
    big = _req(list(range(100, 110)), "big")
    kv.admit(big)
    kv.alloc_extend(big, 10)  # 2 free: evicts a (LRU) and c, never the locked b
    assert kv.stats["num_evicted_tokens"] == 12
    assert _counts(kv) == (4, 0, 6)
    x = _req([1, 2, 3, 4, 5, 6], "x")
    kv.admit(x)
    with pytest.raises(RuntimeError, match="KV cache exhausted"):  # 4 free, nothing evictable
        kv.alloc_extend(x, 5)
    kv.undo(x)
    assert _counts(kv) == (4, 0, 6)


def test_flush_is_refused_while_a_row_is_held():
    """flush() returns False (and keeps the cache) while a request holds a row; True, all free, once idle."""
    kv = _manager()
    req = _req([3, 4, 5])
    kv.admit(req)
    _prefill(kv, req)
    kv.cache_unfinished(req)
    assert kv.flush() is False and kv.tree.total_size() == 3
    kv.release(req)
    assert kv.flush() is True
    assert kv.tree.total_size() == 0 and _counts(kv) == (NUM_SLOTS, 0, 0) and kv.is_idle()


def test_eviction_frees_ahead_in_lru_order_and_never_a_locked_entry():
    """Once the cache fills the pool, a one-slot shortfall evicts at least evict_ahead slots (1/32 of the pool),
    oldest entries first; the entry a running request locks stays, and slots are conserved throughout."""
    size = 640  # evict_ahead 20
    req_pool = ReqToTokenPool(size=8, max_context_len=128, device="cpu")
    kv_pool = TokenToKVPool(size, torch.float32, num_layers=1, num_kv_heads=1, head_dim=2, device="cpu")
    kv = KVManager(req_pool, kv_pool, "cpu", enable_radix_cache=True, stats={"num_evicted_tokens": 0})
    assert kv.evict_ahead == 20
    prompts = [[1000 * (i + 1) + j for j in range(8)] for i in range(80)]  # 80 cached 8-token entries: all 640
    for i, p in enumerate(prompts):
        r = _req(p, f"r{i}")
        kv.admit(r)
        _prefill(kv, r)
        kv.release(r)
    assert _counts(kv) == (0, size, 0)
    keep = _req(prompts[0] + [7], "keep")  # touches and locks the oldest entry
    kv.admit(keep)
    assert keep.num_cached == 8
    new = _req([5, 6], "new")
    kv.admit(new)
    kv.alloc_extend(new, 1)  # short by one slot
    evicted = kv.stats["num_evicted_tokens"]
    assert evicted == 24  # whole 8-token entries until >= 20: entries 1, 2, 3 (0 is locked and newest now)
    assert _counts(kv) == (evicted - 1, size - 8 - evicted, 8)
    for i, p in enumerate(prompts[:6]):
        assert kv.cached_prefix_len(_req(p + [1])) == (0 if 1 <= i <= 3 else 8), i


def test_pool_free_copies_a_borrowed_tensor_and_keeps_an_owned_one():
    """free() copies slots it is lent (the caller's row is reused), and keeps a handed-over CPU int64 tensor as is."""
    pool = TokenToKVPool(8, torch.float32, num_layers=1, num_kv_heads=1, head_dim=2, device="cpu")
    first = pool.alloc(8)
    row = first[:4].clone()
    pool.free(row)
    row.fill_(99)  # the caller reuses its row: the pool's copy is unchanged
    owned = first[4:].clone()
    pool.free(owned, owned=True)
    assert any(t is owned for t in pool._freed)
    assert sorted(pool.alloc(8).tolist()) == sorted(first.tolist())
