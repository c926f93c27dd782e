"""SGLang's control semantics on Engine (what the HTTP server calls): abort_request(rid, abort_all),
pause_generation's three modes with continue_generation, flush_cache() -> bool; and SGLang's request
and output conventions (per-prompt lists, rid expansion, batch streaming, finish_reason, e2e_latency).
The oracle is always an uninterrupted run of the same requests (same seeds; greedy ones included)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.rl_surface.conftest import at_step as after_step  # tests here take an `at_step` number
from tests.rollout.oracle import random_prompts

N_NEW = 24
PROMPTS = random_prompts([5, 9, 14, 20], seed=70)
PARAMS = [{"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}] + [
    {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": N_NEW, "ignore_eos": True, "seed": 70 + i}
    for i in range(1, 4)
]
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def engine(tiny_llama, module_engines):
    return module_engines(tiny_llama)


@pytest.fixture(scope="module")
def refs(engine):
    return engine.generate(input_ids=PROMPTS, sampling_params=PARAMS, return_logprob=True)


def _wait_until(cond, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _run_batch(engine, control, at_step: int, rids=None) -> tuple[list[dict], dict]:
    """The PROMPTS batch in a thread, with `control()` run right after step `at_step`. Returns the outputs
    (after the call returns, which needs a continue_generation for pausing controls) and the hook state."""
    result: list = []
    state = after_step(engine, at_step, control)
    t = threading.Thread(target=lambda: result.append(engine.generate(
        input_ids=PROMPTS, sampling_params=PARAMS, return_logprob=True, rid=rids)), daemon=True)
    t.start()
    assert state["done"].wait(TIMEOUT), "the control call never ran"
    return result, {"state": state, "thread": t}


def _join(handle, result) -> list[dict]:
    handle["thread"].join(TIMEOUT)
    assert not handle["thread"].is_alive(), "generate never returned"
    return result[0]


def _lps(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def _assert_prefix_of(out: dict, ref: dict, n: int) -> None:
    """A partial rollout: its n tokens and their logprobs are the first n of the uninterrupted run."""
    assert out["output_ids"] == ref["output_ids"][:n] and len(out["output_ids"]) == n
    torch.testing.assert_close(_lps(out), _lps(ref)[:n], atol=1e-5, rtol=0)


def _assert_same(out: dict, ref: dict) -> None:
    assert out["output_ids"] == ref["output_ids"]
    assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    torch.testing.assert_close(_lps(out), _lps(ref), atol=1e-5, rtol=0)


def _kv_rows_held(engine) -> int:
    kv = engine.scheduler.kv
    return kv.req_pool.size - kv.num_free_rows()


# ---- abort_request -----------------------------------------------------------------------------------
def test_abort_all_returns_partial_rollouts(engine, refs):
    """abort_request(abort_all=True) aborts every request in flight and returns the count; each output is
    the uninterrupted run's first tokens (with logprobs) and finish_reason {"type": "abort", ...}."""
    result, h = _run_batch(engine, lambda: engine.abort_request(abort_all=True), at_step=5)
    outs = _join(h, result)
    assert h["state"]["result"] == 4
    for out, ref in zip(outs, refs):
        assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by abort_request (abort_all)"}
        _assert_prefix_of(out, ref, 5)  # one prefill + four decode steps
    assert engine.abort_request(abort_all=True) == 0  # nothing in flight
    assert _kv_rows_held(engine) == 0


def test_abort_all_of_retracted_requests_says_waiting_queue(engine, refs):
    """Requests retracted to the waiting queue (pause "retract" after step 5), then abort_request(abort_all): each
    finishes as SGLang's "Abort in waiting queue" with the 5 tokens it had, the uninterrupted run's first 5."""
    def control():
        engine.pause_generation(mode="retract")
        return engine.abort_request(abort_all=True)

    result, h = _run_batch(engine, control, at_step=5)
    try:
        outs = _join(h, result)
    finally:
        engine.continue_generation()
    assert h["state"]["result"] == 4
    for out, ref in zip(outs, refs):
        assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        _assert_prefix_of(out, ref, 5)
    assert _kv_rows_held(engine) == 0


def test_abort_by_rid_matches_prefix_and_unknown_ids_are_no_ops(engine, refs):
    """As SGLang: an id not in flight aborts nothing (returns 0, no error); an id in flight aborts every
    request whose id starts with it ("job" takes "job_1" and "jobless"); the others are unchanged."""
    rids = ["job", "job_1", "other", "jobless"]

    def control():
        return [engine.abort_request("jo"), engine.abort_request("nope"), engine.abort_request("job"),
                engine.abort_request("job")]

    result, h = _run_batch(engine, control, at_step=3, rids=rids)
    outs = _join(h, result)
    assert h["state"]["result"] == [0, 0, 3, 0]
    assert [o["meta_info"]["id"] for o in outs] == rids
    for i in (0, 1, 3):
        assert outs[i]["meta_info"]["finish_reason"]["type"] == "abort"
        _assert_prefix_of(outs[i], refs[i], 3)
    _assert_same(outs[2], refs[2])
    assert engine.abort_request("other") == 0  # finished: a no-op


# ---- pause / continue ------------------------------------------------------------------------------
def test_pause_default_mode_aborts_in_flight_and_holds_new_requests(engine, refs):
    """pause_generation() (mode "abort", SGLang's default) aborts everything in flight with partial outputs;
    a request submitted while paused waits, then after continue_generation equals its uninterrupted run."""
    result, h = _run_batch(engine, lambda: engine.pause_generation(), at_step=4)
    try:
        outs = _join(h, result)
        for out, ref in zip(outs, refs):
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            _assert_prefix_of(out, ref, 4)
        late: list = []
        t = threading.Thread(target=lambda: late.append(engine.generate(
            input_ids=PROMPTS[1], sampling_params=PARAMS[1], return_logprob=True)), daemon=True)
        t.start()
        _wait_until(lambda: engine.get_server_info()["num_in_flight"] == 1)
        generated = engine.get_server_info()["num_generated_tokens"]
        time.sleep(0.2)
        assert not late and engine.get_server_info()["num_generated_tokens"] == generated
        assert engine.get_server_info()["paused"]
    finally:
        engine.continue_generation()
    t.join(TIMEOUT)
    _assert_same(late[0], refs[1])


def test_pause_retract_frees_kv_and_continue_is_token_exact(engine, refs):
    """mode "retract": requests stay in flight but hold no KV row or cache lock, so flush_cache() succeeds;
    after continue_generation they recompute and finish exactly as an unpaused run (retracted once)."""
    result, h = _run_batch(engine, lambda: engine.pause_generation(mode="retract"), at_step=6)
    try:
        info = engine.get_server_info()
        assert info["num_in_flight"] == 4 and info["paused"]
        assert _kv_rows_held(engine) == 0 and engine.scheduler.tree.protected_size == 0
        assert engine.flush_cache().success is True
        assert engine.scheduler.tree.total_size() == 0
        assert engine.scheduler.kv_pool.available_size() == engine.scheduler.kv_pool.size
    finally:
        engine.continue_generation()
    outs = _join(h, result)
    for out, ref in zip(outs, refs):
        _assert_same(out, ref)
        assert out["meta_info"]["num_retractions"] == 1


def test_pause_in_place_keeps_kv_and_continue_is_token_exact(engine, refs):
    """mode "in_place": requests keep their KV and make no progress; flush_cache() returns False and
    flushes nothing; after continue_generation they finish exactly as an unpaused run, never retracted."""
    result, h = _run_batch(engine, lambda: engine.pause_generation(mode="in_place"), at_step=6)
    try:
        assert _kv_rows_held(engine) == 4
        cached = engine.scheduler.tree.total_size()
        res = engine.flush_cache()
        assert res.success is False and not res  # SGLang's FlushCacheReqOutput, falsy when nothing was flushed
        assert engine.scheduler.tree.total_size() == cached > 0
        generated = engine.get_server_info()["num_generated_tokens"]
        time.sleep(0.2)
        assert engine.get_server_info()["num_generated_tokens"] == generated and not result
    finally:
        engine.continue_generation()
    outs = _join(h, result)
    for out, ref in zip(outs, refs):
        _assert_same(out, ref)
        assert out["meta_info"]["num_retractions"] == 0


def test_pause_with_unknown_mode_is_refused_and_does_not_pause(engine):
    """An unknown pause mode raises a ValueError naming the modes; the engine is not paused."""
    with pytest.raises(ValueError, match="in_place"):
        engine.pause_generation(mode="drain")
    assert not engine.get_server_info()["paused"]
    assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "ignore_eos": True})["meta_info"][
        "completion_tokens"] == 2


# ---- request and output conventions ------------------------------------------------------------------
def test_per_prompt_logprob_lists_and_rid_expansion(engine, refs):
    """return_logprob / top_logprobs_num take one value per prompt; a string rid on a batch expands to
    f"{rid}_{i}"; tokens are those of the plain batch run; finals carry e2e_latency."""
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS, return_logprob=[True, False, True, False],
                           top_logprobs_num=[2, 0, 0, 3], rid="batch")
    assert [o["meta_info"]["id"] for o in outs] == [f"batch_{i}" for i in range(4)]
    for out, ref in zip(outs, refs):
        assert out["output_ids"] == ref["output_ids"]
        assert out["meta_info"]["e2e_latency"] > 0
    assert "output_token_logprobs" in outs[0]["meta_info"] and len(outs[0]["meta_info"]["output_top_logprobs"][0]) == 2
    torch.testing.assert_close(_lps(outs[2]), _lps(refs[2]), atol=1e-5, rtol=0)
    assert "output_top_logprobs" not in outs[2]["meta_info"]
    assert "output_token_logprobs" not in outs[1]["meta_info"] and "output_token_logprobs" not in outs[3]["meta_info"]


def test_rid_list_names_each_prompts_samples_and_needs_one_n(engine):
    """A rid list names prompt i's samples f"{rid[i]}_{j}" (n > 1) or rid[i] (n = 1); different n per prompt
    with a rid list is refused naming n, even where the total divides evenly (n 1 and 3 had named the second
    prompt's first sample after the first prompt)."""
    sp = {"temperature": 0.8, "max_new_tokens": 2, "ignore_eos": True, "seed": 5}
    outs = engine.generate(input_ids=PROMPTS[:2], sampling_params={**sp, "n": 2}, rid=["a", "b"])
    assert [o["meta_info"]["id"] for o in outs] == ["a_0", "a_1", "b_0", "b_1"]
    outs = engine.generate(input_ids=PROMPTS[:2], sampling_params=sp, rid=["a", "b"])
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    for ns in ([1, 3], [2, 1, 1, 2]):
        with pytest.raises(ValueError, match=r"same n for every prompt, got n=\[" + ", ".join(map(str, ns))):
            engine.generate(input_ids=PROMPTS[:len(ns)], sampling_params=[{**sp, "n": n} for n in ns],
                            rid=[f"r{i}" for i in range(len(ns))])
    assert engine.get_server_info()["num_in_flight"] == 0


def test_streaming_a_batch_with_n_gives_indexed_chunks(engine):
    """stream=True on two prompts with n=2: every chunk carries "index"; per index the chunks grow (a decode
    block's tokens at once) and the last equals the non-streamed output of the same call."""
    sp = {"temperature": 0.8, "max_new_tokens": 6, "ignore_eos": True, "seed": 5, "n": 2}
    plain = engine.generate(input_ids=PROMPTS[:2], sampling_params=sp)
    by_index: dict[int, list[dict]] = {}
    for chunk in engine.generate(input_ids=PROMPTS[:2], sampling_params=sp, stream=True):
        by_index.setdefault(chunk["index"], []).append(chunk)
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, chunks in by_index.items():
        lengths = [len(c["output_ids"]) for c in chunks]
        assert lengths[0] == 1 and lengths[-1] == 6 and all(a < b for a, b in zip(lengths, lengths[1:]))
        assert chunks[-1]["output_ids"] == plain[i]["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
