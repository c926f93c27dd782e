"""Streaming, async_generate, abort, pause/continue, min_new_tokens, stop strings and n > 1: each
checked against the same requests run plainly (same seeds) or against hand-computed expectations."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from tests.rollout.oracle import pause_mid_stream, random_prompts

N_NEW = 12


def _sp(seed: int, **kw) -> dict:
    return {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": N_NEW, "ignore_eos": True, "seed": seed, **kw}


def _assert_same(outs: list[dict], refs: list[dict]) -> None:
    """Same tokens, text and finish reason; logprobs (if asked) within 1e-5."""
    assert len(outs) == len(refs)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert (out["output_ids"], out["text"]) == (ref["output_ids"], ref["text"]), f"request {i}"
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], f"request {i}"
        lps, ref_lps = (o["meta_info"].get("output_token_logprobs") for o in (out, ref))
        assert (lps is None) == (ref_lps is None)
        if lps is not None:
            assert [t for _, t, _ in lps] == [t for _, t, _ in ref_lps]
            torch.testing.assert_close(torch.tensor([lp for lp, _, _ in lps]),
                                       torch.tensor([lp for lp, _, _ in ref_lps]), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def engine(tiny_llama, module_engines):
    return module_engines(tiny_llama)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _wait_until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _grows(chunks: list[dict], single_steps: bool) -> None:
    """Each chunk extends the one before, ending at N_NEW tokens: one token per chunk with single steps (SGLang's
    granularity), a decode block's tokens at once with blocks (a chunk per step boundary)."""
    lengths = [len(c["output_ids"]) for c in chunks]
    if single_steps:
        assert lengths == list(range(1, N_NEW + 1))
    else:
        assert lengths[0] == 1 and lengths[-1] == N_NEW and all(a < b for a, b in zip(lengths, lengths[1:]))
        assert len(lengths) < N_NEW, lengths  # some block carried several tokens


@pytest.fixture(scope="module")
def single_step_engine(tiny_llama, module_engines):
    return module_engines(tiny_llama, num_continuous_decode_steps=1)


@pytest.mark.parametrize("single_steps", [True, False])
def test_stream_chunks_grow_and_final_equals_non_stream(engine, single_step_engine, single_steps):
    """stream=True yields a chunk per step boundary, each extending the last (one per new token with single steps,
    a block's tokens together with decode blocks); the final equals the non-stream result."""
    engine = single_step_engine if single_steps else engine
    prompt = random_prompts([10], seed=31)[0]
    ref = engine.generate(input_ids=prompt, sampling_params=_sp(1), return_logprob=True)
    chunks = list(engine.generate(input_ids=prompt, sampling_params=_sp(1), return_logprob=True, stream=True))
    _grows(chunks, single_steps)
    for c in chunks[:-1]:
        assert c["output_ids"] == ref["output_ids"][: len(c["output_ids"])]
        assert c["meta_info"]["finish_reason"] is None
        assert c["meta_info"]["completion_tokens"] == len(c["output_ids"]) == len(c["meta_info"]["output_token_logprobs"])
    _assert_same(chunks[-1:], [ref])


@pytest.mark.parametrize("single_steps", [True, False])
def test_stream_chunks_are_snapshots_when_read_late(engine, single_step_engine, single_steps):
    """A chunk read after the request finished still shows the tokens of its own step (or block), not later ones."""
    engine = single_step_engine if single_steps else engine
    prompt = random_prompts([10], seed=32)[0]
    stream = engine.generate(input_ids=prompt, sampling_params=_sp(2), stream=True)
    _wait_until(lambda: engine.get_server_info()["num_in_flight"] == 0)
    chunks = list(stream)
    _grows(chunks, single_steps)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_async_generate_concurrent_equals_solo(engine):
    """asyncio.gather of 8 async_generate coroutines (and one async stream): each equals its solo generate."""
    prompts = random_prompts([3, 7, 11, 15, 19, 23, 27, 31], seed=33)
    solo = [engine.generate(input_ids=p, sampling_params=_sp(10 + i), return_logprob=True)
            for i, p in enumerate(prompts)]

    async def stream_final(p, sp):
        agen = await engine.async_generate(input_ids=p, sampling_params=sp, return_logprob=True, stream=True)
        chunks = [c async for c in agen]
        _grows(chunks, single_steps=False)
        return chunks[-1]

    async def main():
        plain = [engine.async_generate(input_ids=p, sampling_params=_sp(10 + i), return_logprob=True)
                 for i, p in enumerate(prompts)]
        return await asyncio.gather(*plain, stream_final(prompts[0], _sp(10)))

    outs = asyncio.run(main())
    _assert_same(outs, solo + solo[:1])


def test_abort_mid_stream_leaves_others_unchanged(engine):
    """Aborting one streaming request ends it with finish_reason abort; a batch running beside it is unchanged."""
    others = random_prompts([6, 13, 20, 27, 34, 41], seed=34)
    params = [_sp(20 + i) for i in range(len(others))]
    ref = engine.generate(input_ids=others, sampling_params=params, return_logprob=True)
    victim = random_prompts([16], seed=35)[0]
    for _ in range(3):
        stream = engine.generate(input_ids=victim, sampling_params=_sp(3, max_new_tokens=400), stream=True,
                                 rid="victim")
        result: list = []
        t = threading.Thread(target=lambda result=result: result.append(
            engine.generate(input_ids=others, sampling_params=params, return_logprob=True)))
        t.start()
        next(stream), next(stream)
        # False when the engine does not wait for readers and a starved one saw chunk 2 after the end.
        aborted = engine.abort_request("victim")
        *_, final = stream
        t.join(timeout=60)
        _assert_same(result[0], ref)
        if aborted:
            break
    else:
        pytest.fail("the victim always finished before the abort landed")
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 2 <= len(final["output_ids"]) < 400
    assert engine.abort_request("victim") == 0  # already finished: a no-op, as SGLang
    assert engine.abort_request("never-sent") == 0  # never submitted: a no-op too


def test_abort_from_another_thread_inside_a_batch(engine):
    """Aborting one request of a blocking batch call (from another thread) returns it as abort; others unchanged."""
    prompts = random_prompts([8, 12, 16, 20], seed=36)
    params = [_sp(30 + i) for i in range(len(prompts))]
    ref = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    rids = [f"batch-{i}" for i in range(len(prompts))]
    result: list = []
    engine.pause_generation(mode="in_place")  # so the aborted request is certainly still in flight
    try:
        t = threading.Thread(target=lambda: result.append(
            engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, rid=rids)))
        t.start()
        _wait_until(lambda: engine.get_server_info()["num_in_flight"] == len(prompts))
        engine.abort_request("batch-2")
    finally:
        engine.continue_generation()
    t.join(timeout=60)
    outs = result[0]
    assert outs[2]["meta_info"]["finish_reason"]["type"] == "abort" and outs[2]["output_ids"] == []
    assert [o["meta_info"]["id"] for o in outs] == rids
    _assert_same(outs[:2] + outs[3:], ref[:2] + ref[3:])


def test_pause_holds_progress_and_continue_resumes(engine):
    """Paused: no new chunks and no new request finishes; after continue both equal an unpaused run."""
    prompt, other = random_prompts([9, 14], seed=37)
    long_sp = _sp(4, max_new_tokens=200)
    ref = engine.generate(input_ids=prompt, sampling_params=long_sp, return_logprob=True)
    ref_other = engine.generate(input_ids=other, sampling_params=_sp(5), return_logprob=True)
    stream, chunks = pause_mid_stream(engine, input_ids=prompt, sampling_params=long_sp, return_logprob=True)
    consumer = threading.Thread(target=lambda: chunks.extend(stream))
    consumer.start()
    other_out: list[dict] = []
    late = threading.Thread(target=lambda: other_out.append(
        engine.generate(input_ids=other, sampling_params=_sp(5), return_logprob=True)))
    try:
        late.start()
        _wait_until(lambda: engine.get_server_info()["num_in_flight"] == 2)
        held = -1
        while held != len(chunks):  # chunks made before the pause are delivered (slowly under load)
            held = len(chunks)
            time.sleep(0.3)
        time.sleep(0.3)
        assert len(chunks) == held and chunks[-1]["meta_info"]["finish_reason"] is None and not other_out
    finally:
        engine.continue_generation()
    consumer.join(timeout=60)
    late.join(timeout=60)
    assert not engine.get_server_info()["paused"]
    _assert_same([chunks[-1], other_out[0]], [ref, ref_other])


def test_min_new_tokens_bans_stop_tokens(engine):
    """Before min_new_tokens, neither stop_token_ids nor eos can be sampled; after it they stop generation."""
    prompt = random_prompts([10], seed=38)[0]
    base = engine.generate(input_ids=prompt, sampling_params=_sp(6, max_new_tokens=20))["output_ids"]
    stop = base[2]
    out = engine.generate(input_ids=prompt, sampling_params=_sp(6, max_new_tokens=20, stop_token_ids=[stop],
                                                                ignore_eos=False))  # ignore_eos ignores them too
    assert out["output_ids"] == base[: base.index(stop) + 1]
    out = engine.generate(input_ids=prompt, sampling_params=_sp(6, max_new_tokens=20, stop_token_ids=[stop],
                                                                min_new_tokens=8, ignore_eos=False))
    ids = out["output_ids"]
    assert len(ids) >= 8 and stop not in ids[:8] and 1 not in ids[:8]
    assert out["meta_info"]["finish_reason"]["type"] == "length" or ids[-1] in (stop, 1)


def _straddling_stop(tok, base: list[int]) -> tuple[str, int] | None:
    """A 2-character stop string made of the end of token k-1's text and the start of token k's, new at k."""
    for k in range(2, len(base)):
        prev, cur = tok.decode(base[:k]), tok.decode(base[: k + 1])
        if not cur.startswith(prev) or len(cur) == len(prev) or not prev:
            continue
        s = prev[-1] + cur[len(prev)]
        if s.isascii() and s.isprintable() and s not in prev:
            return s, k
    return None


def test_stop_strings_are_matched_on_text_and_trimmed(engine, tok):
    """A stop string (even spanning two tokens) ends at the token completing it; text stops before it; matched = it."""
    texts = ["Hello, world! How are you today?", "The quick brown fox", "What is 2 + 3? The answer",
             "Once upon a time there was", "Numbers like 0, 1, 10"]
    found = 0
    for text in texts:
        greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        base = engine.generate(prompt=text, sampling_params=greedy)["output_ids"]
        pick = _straddling_stop(tok, base)
        if pick is None:
            continue
        s, _ = pick
        j = next(j for j in range(len(base)) if s in tok.decode(base[: j + 1]))  # the oracle: first completing token
        out = engine.generate(prompt=text, sampling_params={**greedy, "stop": ["\x00never", s]})
        assert out["output_ids"] == base[: j + 1]
        full = tok.decode(base[: j + 1])
        assert out["text"] == full[: full.index(s)]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": s}
        found += 1
    assert found >= 2, "too few printable outputs to test stop strings"


def test_n_returns_n_samples_per_prompt(engine):
    """n=4 gives 4 distinct, reproducible samples per prompt in prompt order; greedy n=3 gives 3 equal ones."""
    prompts = random_prompts([7, 12], seed=39)
    outs = engine.generate(input_ids=prompts, sampling_params=_sp(7, n=4), return_logprob=True)
    assert len(outs) == 8
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [7] * 4 + [12] * 4
    for group in (outs[:4], outs[4:]):
        assert len({tuple(o["output_ids"]) for o in group}) == 4
    again = engine.generate(input_ids=prompts, sampling_params=_sp(7, n=4), return_logprob=True)
    _assert_same(again, outs)
    greedy = engine.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "n": 3, "max_new_tokens": 6})
    assert len(greedy) == 3 and greedy[0]["output_ids"] == greedy[1]["output_ids"] == greedy[2]["output_ids"]
    named = engine.generate(input_ids=prompts[0], sampling_params=_sp(7, n=2), rid="grp")
    assert [o["meta_info"]["id"] for o in named] == ["grp_0", "grp_1"]  # SGLang: f"{rid}_{i}"


def test_closed_stream_and_cancelled_coroutine_abort_their_requests(tiny_llama):
    """A stream the caller closes, or an async_generate that is cancelled, stops generating: its
    request leaves the engine, which keeps serving; aborting a finished id is a no-op (0 aborted)."""
    import asyncio

    from rollout import Engine

    with Engine(str(tiny_llama), show_progress=False) as engine:
        it = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 400, "ignore_eos": True},
                             stream=True, rid="s1")
        next(it)
        it.close()
        assert engine.get_server_info()["num_in_flight"] == 0
        assert engine.abort_request("s1") == 0

        async def cancel_one():
            task = asyncio.ensure_future(engine.async_generate(
                input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 400, "ignore_eos": True}, rid="a1"))
            await asyncio.sleep(0.05)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

        asyncio.run(cancel_one())
        assert engine.get_server_info()["num_in_flight"] == 0
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 4


def test_control_calls_in_a_tight_loop_do_not_stop_generation(engine):
    """A thread calling a cheap control method (get_weights_by_name) back to back, with no pause between
    calls, while a request generates: the request still finishes, with the tokens it gives alone (each
    control call that leaves while the scheduler waits owes it a step; it used to make no progress at all)."""
    sp = dict(temperature=0, max_new_tokens=40, ignore_eos=True)
    want = engine.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"]
    stop, calls = threading.Event(), [0]

    def poll():
        while not stop.is_set():
            engine.get_weights_by_name("model.norm.weight", truncate_size=2)
            calls[0] += 1

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        got: dict = {}
        worker = threading.Thread(target=lambda: got.update(engine.generate(input_ids=[5, 6, 7], sampling_params=sp)),
                                  daemon=True)
        worker.start()
        worker.join(60)
        assert got.get("output_ids") == want, "the request made no progress beside the control calls"
        assert calls[0] > 0
    finally:
        stop.set()
        poller.join(10)
