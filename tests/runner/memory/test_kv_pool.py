"""KV pool allocators: distinct slots, slot 0 never handed out, freed slots reused, exhaustion is a
KVPoolExhaustedError that says what was asked for and what was left."""

from __future__ import annotations

import pytest
import torch

from runner.memory.kv_pool import KVPoolExhaustedError, ReqToTokenPool, TokenToKVPool


def _pool(size: int = 16) -> TokenToKVPool:
    return TokenToKVPool(size, torch.float32, num_layers=2, num_kv_heads=2, head_dim=4, device="cpu")


def test_alloc_hands_out_distinct_nonzero_slots():
    """Successive allocations are disjoint, within 1..size, and never slot 0 (the padding slot)."""
    pool = _pool(16)
    chunks = [pool.alloc(n) for n in (3, 1, 5, 7)]
    slots = torch.cat(chunks).tolist()
    assert len(slots) == len(set(slots)) == 16
    assert set(slots) == set(range(1, 17))
    assert pool.available_size() == 0
    assert pool.k_buffer.shape[1] == pool.v_buffer.shape[1] == 17  # slot 0 exists, as padding


def test_free_then_reuse():
    """Freed slots return to the pool and are handed out again; nothing else is lost."""
    pool = _pool(8)
    a, b = pool.alloc(5), pool.alloc(3)
    pool.free(a[1:4])
    assert pool.available_size() == 3
    c = pool.alloc(3)
    assert set(c.tolist()) == set(a[1:4].tolist())
    pool.free(torch.tensor([], dtype=torch.int64))  # freeing nothing is fine
    pool.free(torch.cat([a[:1], a[4:], b, c]))
    assert pool.available_size() == 8
    assert set(pool.alloc(8).tolist()) == set(range(1, 9))


def test_clear_returns_every_slot():
    """clear() (used on KV release) makes the whole pool free again."""
    pool = _pool(8)
    pool.alloc(6)
    pool.clear()
    assert pool.available_size() == 8 and set(pool.alloc(8).tolist()) == set(range(1, 9))


def test_set_kv_writes_only_the_given_slots():
    """set_kv writes K and V at exactly the given slots of the given layer."""
    pool = _pool(8)
    locs = torch.tensor([5, 2])
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool.set_kv(1, locs, k, v)
    assert torch.equal(pool.k_buffer[1, locs], k) and torch.equal(pool.v_buffer[1, locs], v)
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[locs] = False
    assert (pool.k_buffer[1, untouched] == 0).all() and (pool.k_buffer[0] == 0).all()


def test_exhaustion_raises_with_numbers():
    """Asking for more slots than are free raises KVPoolExhaustedError naming need, free and size,
    and leaves the pool as it was."""
    pool = _pool(10)
    pool.alloc(7)
    with pytest.raises(KVPoolExhaustedError, match=r"need 4 token slots, 3 free of 10"):
        pool.alloc(4)
    assert pool.available_size() == 3
    assert len(pool.alloc(3)) == 3


def test_req_to_token_pool():
    """Request rows are distinct, reusable after free, exhaustion names the limit; write() fills the
    row's positions [start, start + n)."""
    pool = ReqToTokenPool(3, max_context_len=8, device="cpu")
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    with pytest.raises(KVPoolExhaustedError, match="all 3 request slots"):
        pool.alloc()
    pool.free(rows[1])
    assert pool.alloc() == rows[1]
    pool.write(rows[0], 2, torch.tensor([7, 9, 4]))
    assert pool.req_to_token[rows[0]].tolist() == [0, 0, 7, 9, 4, 0, 0, 0]


def test_freed_slots_are_copied_not_aliased():
    """Freeing a view of a req_to_token row, then reusing that row, must not change what was freed."""
    from runner.memory.kv_pool import TokenToKVPool

    pool = TokenToKVPool(8, torch.float32, 1, 1, 2, "cpu")
    locs = pool.alloc(8)
    row = torch.zeros(8, dtype=torch.int64)
    row[:] = locs
    pool.free(row[:3])
    row[:3] = torch.tensor([99, 98, 97])  # the row is reused for another request
    got = pool.alloc(3)
    assert sorted(got.tolist()) == sorted(locs[:3].tolist())
