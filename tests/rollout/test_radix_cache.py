"""RadixCache's eviction (rollout/radix_cache.py) is exact LRU over unlocked leaves, the same slots in the
same order as a naive reference that walks the whole tree every call, over random inserts, matches,
locks, unlocks, evictions and namespace drops; its leaf set always equals a walk's."""

from __future__ import annotations

import random

import torch

from rollout.radix_cache import RadixCache


def _walk_leaves(cache: RadixCache) -> list:
    """The leaves found by walking every namespace's tree (what the cache's kept leaf set must equal)."""
    out, stack = [], list(cache.roots.values())
    while stack:
        node = stack.pop()
        if not node.children and node.parent is not None:
            out.append(node)
        stack.extend(node.children.values())
    return out


class NaiveEvictCache(RadixCache):
    """The reference: every call walks every node and evicts the least recently used unlocked leaf,
    one at a time, until enough is freed (the leaf set and sizes are checked against a walk separately)."""

    def evict(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens:
            leaves = [(n.last_access, id(n), n) for n in _walk_leaves(self) if n.lock_ref == 0]
            if not leaves:
                break
            _, _, leaf = min(leaves)
            freed += len(leaf.key)
            self._remove_leaf(leaf)  # the unlinking is shared; which leaf goes is what is checked
        return freed


def _run(seed: int, steps: int = 600):
    rng = random.Random(seed)
    logs = ([], [])
    caches = (RadixCache(lambda v: logs[0].append(v.tolist())), NaiveEvictCache(lambda v: logs[1].append(v.tolist())))
    locked: list[tuple] = []  # (node in cache 0, node in cache 1)
    next_slot = [1]
    for _ in range(steps):
        op = rng.random()
        if op < 0.45:  # insert a sequence: a shared-ish prefix plus a random tail
            prefix = [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
            key = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            value = torch.arange(next_slot[0], next_slot[0] + len(key), dtype=torch.int64)
            next_slot[0] += len(key)
            ns = rng.choice([None, None, "lora-a"])
            assert caches[0].insert(key, value, ns) == caches[1].insert(key, value, ns)
        elif op < 0.65:  # match a prefix and maybe lock it (a running request)
            key = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            ns = rng.choice([None, "lora-a"])
            (s0, n0), (s1, n1) = caches[0].match_prefix(key, ns), caches[1].match_prefix(key, ns)
            assert s0.tolist() == s1.tolist()
            if rng.random() < 0.5 and n0.parent is not None:
                caches[0].inc_lock_ref(n0), caches[1].inc_lock_ref(n1)
                locked.append((n0, n1))
        elif op < 0.8 and locked:  # a request finishes: unlock
            n0, n1 = locked.pop(rng.randrange(len(locked)))
            caches[0].dec_lock_ref(n0), caches[1].dec_lock_ref(n1)
        elif op < 0.97:
            n = rng.randrange(1, 40)
            assert caches[0].evict(n) == caches[1].evict(n)
        elif not locked:  # no request uses the adapter: unload it
            assert caches[0].drop_namespace("lora-a") == caches[1].drop_namespace("lora-a")
        for c in caches:
            assert set(map(id, c._leaf_set)) == set(map(id, _walk_leaves(c)))
        assert caches[0].evictable_size == caches[1].evictable_size
        assert caches[0].protected_size == caches[1].protected_size
    assert logs[0] == logs[1]
    return len(logs[0])


def test_evict_equals_naive_lru_reference():
    """Random operation sequences: the same freed slots, in the same order, as the naive reference."""
    evicted = [_run(seed) for seed in range(8)]
    assert sum(evicted) > 200  # the sequences did evict plenty


def test_evict_takes_the_oldest_unlocked_leaf_first():
    """Hand-checked: of three leaves, a locked old one stays, the older unlocked one goes first, and a
    leaf touched by a match counts as recent."""
    freed = []
    c = RadixCache(lambda v: freed.append(v.tolist()))
    c.insert([1, 2], torch.tensor([10, 11]))
    c.insert([3, 4], torch.tensor([20, 21]))
    c.insert([5, 6], torch.tensor([30, 31]))
    _, node = c.match_prefix([1, 2])
    c.inc_lock_ref(node)  # [1, 2] in use
    c.match_prefix([3, 4])  # [3, 4] touched: now newer than [5, 6]
    assert c.evict(1) == 2 and freed == [[30, 31]]
    assert c.evict(1) == 2 and freed[-1] == [20, 21]
    assert c.evict(1) == 0  # only the locked one is left
    c.dec_lock_ref(node)
    assert c.evict(5) == 2 and freed[-1] == [10, 11]
