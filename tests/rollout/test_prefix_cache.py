"""Prefix cache: the samples of a prompt prefill it once (cached_tokens and the prefill-token counter
show it), eviction under pressure keeps outputs equal to cache-less runs, flush_cache, and RadixCache
itself against a naive dict-of-prefixes reference."""

from __future__ import annotations

import random

import pytest
import torch

from rollout.radix_cache import RadixCache
from tests.rollout.oracle import pause_mid_stream, random_prompts

PROMPT_LENS = [6, 9, 12, 15, 18, 21, 24, 27]
N = 8
SAMPLED = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}


def _ids_and_lps(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _assert_same(outs: list[dict], refs: list[dict]) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs)):
        ids, lps = _ids_and_lps(out)
        ref_ids, ref_lps = _ids_and_lps(ref)
        assert ids == ref_ids, f"request {i}"
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def no_cache_engine(tiny_llama, module_engines):
    return module_engines(tiny_llama, disable_radix_cache=True)


def _check_prefilled_once(outs: list[dict], prompts: list[list[int]], info: dict) -> None:
    for i, p in enumerate(prompts):
        cached = sorted(o["meta_info"]["cached_tokens"] for o in outs[i * N : (i + 1) * N])
        assert cached == [0] + [len(p) - 1] * (N - 1), f"prompt {i}"
        assert all(o["meta_info"]["prompt_tokens"] == len(p) for o in outs[i * N : (i + 1) * N])
    total = sum(map(len, prompts))
    # each prompt computed once, plus its last token once more per extra sample (it yields the first logits)
    assert info["num_prefill_tokens"] == total + len(prompts) * (N - 1)
    assert info["num_cached_tokens"] == sum(len(p) - 1 for p in prompts) * (N - 1)
    assert info["num_prompt_tokens"] == total * N


def test_n_samples_prefill_prompt_once(tiny_llama, make_engine, no_cache_engine):
    """8 prompts x n=8 prefill each prompt once (7 of 8 report len-1 cached) and equal a cache-less engine."""
    engine = make_engine(tiny_llama)
    prompts = random_prompts(PROMPT_LENS, seed=21)
    sp = {**SAMPLED, "n": N, "seed": 5}
    outs = engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    assert len(outs) == len(prompts) * N
    _check_prefilled_once(outs, prompts, engine.get_server_info())
    for i in range(len(prompts)):  # n samples of a prompt differ from each other
        assert len({tuple(o["output_ids"]) for o in outs[i * N : (i + 1) * N]}) > 1
    _assert_same(outs, no_cache_engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True))


def test_same_prompt_sent_n_times_prefills_once(tiny_llama, make_engine, no_cache_engine):
    """The same prompt sent 8 times as separate prompts is prefilled once, like n=8."""
    engine = make_engine(tiny_llama)
    prompts = random_prompts(PROMPT_LENS, seed=22)
    batch = [p for p in prompts for _ in range(N)]
    params = [{**SAMPLED, "seed": 1000 + i} for i in range(len(batch))]
    outs = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True)
    _check_prefilled_once(outs, prompts, engine.get_server_info())
    _assert_same(outs, no_cache_engine.generate(input_ids=batch, sampling_params=params, return_logprob=True))


def test_cache_hit_across_calls(tiny_llama, make_engine):
    """A prompt seen in an earlier call is served from the cache (all but its last token)."""
    engine = make_engine(tiny_llama)
    prompt = random_prompts([20], seed=23)[0]
    first = engine.generate(input_ids=prompt, sampling_params={**SAMPLED, "seed": 1})
    again = engine.generate(input_ids=prompt, sampling_params={**SAMPLED, "seed": 1})
    longer = engine.generate(input_ids=prompt + first["output_ids"] + [5], sampling_params={**SAMPLED, "seed": 1})
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == 19 and again["output_ids"] == first["output_ids"]
    # the first call's generated tokens were cached too (all but the last, whose KV was never computed)
    assert longer["meta_info"]["cached_tokens"] == 20 + len(first["output_ids"]) - 1


def test_eviction_under_pressure_keeps_results(tiny_llama, make_engine, no_cache_engine):
    """Under LRU eviction (pool << prompts) outputs equal a cache-less engine, repeats still hit, nothing leaks."""
    engine = make_engine(tiny_llama, max_total_tokens=120, chunked_prefill_size=32)
    prefix = random_prompts([16], seed=24)[0]
    distinct = random_prompts([10 + (3 * i) % 25 for i in range(24)], seed=25)
    prompts = [prefix + p if i % 3 == 0 else p for i, p in enumerate(distinct)]
    for call in range(3):  # call 1 and 2 revisit prompts seen (and partly evicted) before
        batch = prompts[call * 4 : call * 4 + 12]
        params = [{**SAMPLED, "seed": 7 * i, "max_new_tokens": 5} for i in range(len(batch))]
        outs = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True)
        _assert_same(outs, no_cache_engine.generate(input_ids=batch, sampling_params=params, return_logprob=True))
    info = engine.get_server_info()
    assert info["num_evicted_tokens"] > 0
    assert info["num_cached_tokens"] > 0
    tree = engine.scheduler.tree
    assert tree.protected_size == 0  # nothing running: nothing locked
    assert tree.evictable_size + engine.scheduler.kv_pool.available_size() == 120


def test_flush_cache_empties_and_is_refused_while_running(tiny_llama, make_engine):
    """flush_cache() empties the cache, returns False (flushing nothing) while a request runs, and that request
    finishes unchanged."""
    engine = make_engine(tiny_llama)
    prompt = random_prompts([20], seed=26)[0]
    sp = {**SAMPLED, "seed": 3, "max_new_tokens": 200}
    ref = engine.generate(input_ids=prompt, sampling_params=sp)
    assert engine.flush_cache()
    assert engine.scheduler.tree.total_size() == 0
    assert engine.scheduler.kv_pool.available_size() == 4096
    assert engine.generate(input_ids=prompt, sampling_params=sp)["meta_info"]["cached_tokens"] == 0

    stream, _ = pause_mid_stream(engine, input_ids=prompt, sampling_params=sp)
    try:
        size_before = engine.scheduler.tree.total_size()
        assert engine.flush_cache().success is False
        assert engine.scheduler.tree.total_size() == size_before > 0
    finally:
        engine.continue_generation()
    *_, final = stream
    assert final["output_ids"] == ref["output_ids"]
    assert final["meta_info"]["cached_tokens"] == 19


# ---- RadixCache unit tests ---------------------------------------------------------------------


class NaiveCache:
    """Reference: every cached prefix (a tuple) -> the KV slot of its last token."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, ...], int] = {}

    def match(self, key: list[int]) -> list[int]:
        out = []
        for i in range(1, len(key) + 1):
            if tuple(key[:i]) not in self.slots:
                break
            out.append(self.slots[tuple(key[:i])])
        return out

    def insert(self, key: list[int], value: list[int]) -> int:
        already = len(self.match(key))
        for i in range(already, len(key)):
            self.slots[tuple(key[: i + 1])] = value[i]
        return already


class SlotSource:
    """Hands out fresh slot ids and records what the cache frees (each slot at most once)."""

    def __init__(self) -> None:
        self.next = 1
        self.freed: list[int] = []

    def take(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n)
        self.next += n
        return out

    def free(self, slots: torch.Tensor) -> None:
        self.freed.extend(slots.tolist())


def _sizes_consistent(cache: RadixCache, ref: NaiveCache, locked: list[list[int]]) -> None:
    protected = {tuple(k[:i]) for k in locked for i in range(1, len(k) + 1)}
    assert cache.total_size() == len(ref.slots)
    assert cache.protected_size == len(protected)
    assert cache.evictable_size == len(ref.slots) - len(protected)


def test_radix_match_insert_split():
    """insert returns the already-cached length; match returns the longest prefix's slots, splitting edges."""
    src = SlotSource()
    cache = RadixCache(src.free)
    a = [1, 2, 3, 4, 5]
    assert cache.insert(a, src.take(5)) == 0
    slots, node = cache.match_prefix([1, 2, 3, 9])  # splits the [1..5] edge after 3
    assert slots.tolist() == [1, 2, 3] and node.key == [1, 2, 3] and list(node.children) == [4]
    assert cache.insert([1, 2, 3, 7, 8], src.take(5)) == 3  # caller frees its own slots 6, 7, 8
    assert cache.match_prefix([1, 2, 3, 7, 8, 9])[0].tolist() == [1, 2, 3, 9, 10]
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == [1, 2, 3, 4, 5]
    assert cache.match_prefix([2, 1])[0].tolist() == []
    assert cache.insert([1, 2], src.take(2)) == 2  # a prefix of a cached key: nothing new
    assert cache.total_size() == 7 and cache.evictable_size == 7 and src.freed == []


def test_radix_lru_eviction_and_locks():
    """Eviction frees unlocked nodes (parents once their children are gone) but never a locked path."""
    src = SlotSource()
    cache = RadixCache(src.free)
    keys = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9], "d": [1, 2, 10, 11]}
    for k in keys.values():
        cache.insert(k, src.take(len(k)))
    _, node_c = cache.match_prefix(keys["c"])
    cache.inc_lock_ref(node_c)
    assert cache.protected_size == 3 and cache.evictable_size == 8  # a, b, d's tail [10, 11]
    assert cache.evict(2) >= 2
    before = set(src.freed)
    cache.evict(100)  # everything unlocked goes
    assert cache.match_prefix(keys["c"])[0].tolist() == [7, 8, 9]
    assert cache.match_prefix(keys["b"])[0].tolist() == []
    assert cache.evictable_size == 0 and cache.protected_size == 3
    assert len(src.freed) == len(set(src.freed)) == 8 and before <= set(src.freed)
    assert not set(src.freed) & {7, 8, 9}
    cache.dec_lock_ref(node_c)
    assert cache.evictable_size == 3 and cache.protected_size == 0
    assert cache.evict(3) == 3 and cache.total_size() == 0


def test_radix_lru_order():
    """Of two unlocked leaves, the one touched longer ago is evicted first."""
    src = SlotSource()
    cache = RadixCache(src.free)
    cache.insert([1, 2], src.take(2))  # slots 1, 2
    cache.insert([3, 4], src.take(2))  # slots 3, 4
    cache.insert([5, 6], src.take(2))  # slots 5, 6
    cache.match_prefix([1, 2])  # order of use now: [3,4], [5,6], [1,2]
    cache.evict(2)
    assert sorted(src.freed) == [3, 4]
    cache.evict(1)
    assert sorted(src.freed) == [3, 4, 5, 6]
    assert cache.match_prefix([1, 2])[0].tolist() == [1, 2]


def test_radix_random_ops_match_naive_reference():
    """Random insert/match/lock/evict: RadixCache equals a dict of prefixes; sizes consistent; locked never evicted."""
    rng = random.Random(0)
    src = SlotSource()
    cache = RadixCache(src.free)
    ref = NaiveCache()
    locks: list[tuple[list[int], object]] = []
    for _ in range(600):
        op = rng.random()
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        if op < 0.4:
            value = src.take(len(key))
            already = cache.insert(key, value)
            assert already == ref.insert(key, value.tolist())
            src.free(value[:already])  # the caller's duplicates, as the scheduler does
        elif op < 0.6:
            slots, node = cache.match_prefix(key)
            assert slots.tolist() == ref.match(key)
            if len(slots) and rng.random() < 0.5:
                cache.inc_lock_ref(node)
                locks.append((key[: len(slots)], node))
        elif op < 0.75 and locks:
            _, node = locks.pop(rng.randrange(len(locks)))
            cache.dec_lock_ref(node)
        elif op < 0.9:
            want = rng.randrange(1, 12)
            evictable = cache.evictable_size
            n_before = len(src.freed)
            freed = cache.evict(want)
            newly = set(src.freed[n_before:])
            assert freed == len(newly) >= min(want, evictable)
            ref.slots = {k: v for k, v in ref.slots.items() if v not in newly}
            for k in ref.slots:  # still prefix-closed: only leaves went
                assert all(k[:i] in ref.slots for i in range(1, len(k)))
            for k, _ in locks:
                assert len(ref.match(k)) == len(k), "a locked prefix was evicted"
        _sizes_consistent(cache, ref, [k for k, _ in locks])
        for k in list(ref.slots)[:20]:
            assert cache.match_prefix(list(k))[0].tolist() == ref.match(list(k))
    assert len(src.freed) == len(set(src.freed))

