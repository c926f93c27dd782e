"""schedule_policy (SGLang's --schedule-policy): the order in which waiting requests are admitted, and nothing else.

With one running slot (max_running_requests=1) requests run one after the other, so the order they finish in is
the order the policy admitted them. Oracles: the orders written out by hand from each policy's rule (fcfs: as
sent; lof: longest max_new_tokens first; lpm: the prompt whose prefix is cached first; random: a fixed
permutation per seed), and the tokens of the fcfs engine, which every policy must reproduce.
"""

from __future__ import annotations

import pytest

from rollout import Engine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]]
LENGTHS = [2, 8, 4, 6]


def _finish_order(engine: Engine, prompts=PROMPTS, lengths=LENGTHS) -> tuple[list[int], list[list[int]]]:
    """(prompt indices in the order they finished, each prompt's output ids) of one batch call."""
    sps = [dict(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    outs = engine.generate(input_ids=prompts, sampling_params=sps)
    order = sorted(range(len(outs)), key=lambda i: outs[i]["meta_info"]["e2e_latency"])
    return order, [o["output_ids"] for o in outs]


def _engine(tiny_llama, **kw) -> Engine:
    return Engine(str(tiny_llama), show_progress=False, max_running_requests=1, disable_overlap_schedule=True, **kw)


def test_each_policy_admits_in_its_order_with_the_same_tokens(tiny_llama):
    """fcfs runs them as sent, lof longest max_new_tokens first, random in a seeded order that differs from
    fcfs and repeats with the seed; every policy gives each request the fcfs engine's tokens."""
    with _engine(tiny_llama) as e:
        order, want = _finish_order(e)
    assert order == [0, 1, 2, 3]
    with _engine(tiny_llama, schedule_policy="lof") as e:
        order, got = _finish_order(e)
    assert order == [1, 3, 2, 0] and got == want
    orders = []
    for seed in (0, 0, 1):
        with _engine(tiny_llama, schedule_policy="random", random_seed=seed) as e:
            order, got = _finish_order(e)
        assert sorted(order) == [0, 1, 2, 3] and got == want
        orders.append(order)
    assert orders[0] == orders[1] and (orders[0] != [0, 1, 2, 3] or orders[2] != [0, 1, 2, 3])


def test_lpm_admits_the_cached_prefix_first(tiny_llama):
    """lpm: of requests waiting together, the one whose prompt the prefix cache holds goes first (fcfs would
    run it last), with the same tokens."""
    shared = list(range(20, 52))  # 32 tokens, cached by a first call
    prompts = [[60, 61, 62, 63, 64], [65, 66, 67, 68, 69], shared + [70, 71]]
    with _engine(tiny_llama, schedule_policy="lpm") as e:
        e.generate(input_ids=shared, sampling_params=dict(max_new_tokens=1))
        order, got = _finish_order(e, prompts, [3, 3, 3])
    with _engine(tiny_llama) as e:
        e.generate(input_ids=shared, sampling_params=dict(max_new_tokens=1))
        fcfs, want = _finish_order(e, prompts, [3, 3, 3])
    assert fcfs == [0, 1, 2] and order[0] == 2 and got == want


def test_unknown_policy_is_refused_naming_the_choices(tiny_llama):
    """SGLang's dfs-weight (not implemented here) and a typo are refused before anything is built."""
    for bad in ("dfs-weight", "fifo"):
        with pytest.raises(ValueError, match=r"schedule_policy=.*'fcfs', 'lpm', 'lof', 'random'"):
            Engine(str(tiny_llama), schedule_policy=bad)
