"""Decode blocks (num_continuous_decode_steps, rollout/scheduler.py) change no output: the same tokens, finish
reasons and (to 1e-5) logprobs as single steps, greedy ones equal to HF generate; a block never runs a row past
its length limit, stops after its current step when something arrives, frees the KV of the steps it did not
run and of the tokens a stop dropped, and falls back to a single step (with its failure attribution) when it
raises."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.rl_surface.conftest import assert_kv_clean
from tests.rollout.oracle import assert_same_outputs, hf_generate, random_prompts

PROMPTS = random_prompts([5, 9, 14, 20, 7, 30], seed=31)


def _pair(make_engine, path, **kw):
    """(blocks of 8, single steps), both on the plain schedule."""
    return (make_engine(path, disable_overlap_schedule=True, num_continuous_decode_steps=8, **kw),
            make_engine(path, disable_overlap_schedule=True, num_continuous_decode_steps=1, **kw))


def test_greedy_blocks_with_stops_equal_single_steps_and_hf(tiny_llama, make_engine, hf_models):
    """Greedy requests, odd ones stopped by a stop token at their 7th token (inside a block: the rest of the
    block is dropped), give the same tokens and logprobs as single steps; the unstopped ones equal HF
    generate; blocks really ran; the KV pool ends clean."""
    blocks, single = _pair(make_engine, tiny_llama)
    ref = single.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 24,
                                                              "ignore_eos": True})
    params = [{"temperature": 0, "max_new_tokens": 24, "ignore_eos": not i % 2,
               "stop_token_ids": [r["output_ids"][6]] if i % 2 else []} for i, r in enumerate(ref)]
    outs = blocks.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    assert_same_outputs(outs, single.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True))
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" and len(o["output_ids"]) <= 7 for o in outs)
    assert blocks.scheduler.stats["num_decode_blocks"] > 0 and single.scheduler.stats["num_decode_blocks"] == 0
    hf = hf_models(tiny_llama)
    for prompt, out in zip(PROMPTS[::2], outs[::2]):
        tokens, logprobs = hf_generate(hf, prompt, 24)
        assert out["output_ids"] == tokens
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]),
                                   torch.tensor(logprobs), atol=1e-4, rtol=0)
    assert_kv_clean(blocks)


def test_seeded_groups_top_p_and_stop_strings_equal_single_steps(tiny_llama, make_engine):
    """n=3 seeded groups with top-k/top-p (the per-step Python path of a block), stop strings and stop tokens,
    lengths 1-40 and the prefix cache: same outputs as single steps."""
    prompts = [PROMPTS[0] + [7, 8], PROMPTS[0] + [9], PROMPTS[3], PROMPTS[5]]
    params = [{"n": 3, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 7 + i, "max_new_tokens": 1 + 13 * i,
               "stop": ["ab"], "stop_token_ids": [11, 12]} for i in range(len(prompts))]
    kw = dict(input_ids=prompts, sampling_params=params, return_logprob=True)
    blocks, single = _pair(make_engine, tiny_llama)
    assert_same_outputs(blocks.generate(**kw), single.generate(**kw))
    assert blocks.scheduler.stats["num_decode_blocks"] > 0
    assert_kv_clean(blocks)


def test_top_logprobs_take_single_steps(tiny_llama, make_engine):
    """Top logprobs, token-id logprobs or a stop_regex asked by any row: single steps (their per-token host work is
    the step's cost, and a control call would wait for a block's worth of it), with the same outputs."""
    blocks, single = _pair(make_engine, tiny_llama)
    params = {"temperature": 1.0, "seed": 4, "max_new_tokens": 12, "ignore_eos": True}
    for extra in ({"top_logprobs_num": 3}, {"token_ids_logprob": [5, 6]},
                  {"sampling_params": {**params, "stop_regex": "zz+q"}}):
        kw = {"input_ids": PROMPTS[:3], "sampling_params": params, "return_logprob": True, **extra}
        assert_same_outputs(blocks.generate(**kw), single.generate(**kw))
    assert blocks.scheduler.stats["num_decode_blocks"] == 0
    assert_kv_clean(blocks)


def test_plain_sampling_path_blocks_equal_single_steps(tiny_llama, make_engine):
    """Temperature 0.7/1.0 seeded rows with logprobs (the fused path's one C++ call per block, where the CPU
    kernels build) and mixed lengths: same outputs as single steps."""
    params = [{"temperature": 0.7 if i % 2 else 1.0, "seed": 50 + i, "max_new_tokens": 5 + 7 * i, "ignore_eos": i % 3 != 0}
              for i in range(len(PROMPTS))]
    blocks, single = _pair(make_engine, tiny_llama)
    assert_same_outputs(blocks.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True),
          single.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True))
    assert blocks.scheduler.stats["num_decode_blocks"] > 0
    assert_kv_clean(blocks)


def test_blocks_are_bitwise_single_steps_when_no_row_ends_early(tiny_llama, make_engine):
    """Rows that all run to the same max_new_tokens (so every step of a block has the batch single steps have):
    the tokens and logprobs are bitwise those of single steps, greedy and seeded."""
    blocks, single = _pair(make_engine, tiny_llama)
    for params in ({"temperature": 0, "max_new_tokens": 17, "ignore_eos": True},
                   {"temperature": 1.0, "seed": 9, "max_new_tokens": 17, "ignore_eos": True}):
        got = blocks.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
        want = single.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
        for g, w in zip(got, want):
            assert g["output_ids"] == w["output_ids"]
            assert g["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]
    assert blocks.scheduler.stats["num_decode_blocks"] > 0


def test_a_block_never_passes_a_length_limit(tiny_llama, make_engine):
    """Rows of max_new_tokens 2, 3 and 30 in one batch, and one that runs into the context: every row stops at
    its own limit (finish reason length, that many tokens), however the blocks fall."""
    engine = make_engine(tiny_llama, disable_overlap_schedule=True, num_continuous_decode_steps=16, context_length=48)
    params = [{"max_new_tokens": n, "ignore_eos": True, "temperature": 0} for n in (2, 3, 30)]
    outs = engine.generate(input_ids=PROMPTS[:3], sampling_params=params)
    assert [len(o["output_ids"]) for o in outs] == [2, 3, 30]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    long = engine.generate(input_ids=PROMPTS[5], sampling_params={"max_new_tokens": 100, "ignore_eos": True})
    assert len(PROMPTS[5]) + len(long["output_ids"]) == 48
    assert long["meta_info"]["finish_reason"]["type"] == "length"
    assert_kv_clean(engine)


def test_penalties_and_min_new_tokens_take_single_steps(tiny_llama, make_engine):
    """A penalty (its counts need each step's tokens) or a min_new_tokens ban still in force runs single steps:
    no block, and the same outputs as single steps."""
    blocks, single = _pair(make_engine, tiny_llama)
    for sp in ({"repetition_penalty": 1.3, "max_new_tokens": 12, "temperature": 0},
               {"min_new_tokens": 10, "max_new_tokens": 12, "temperature": 0}):
        before = blocks.scheduler.stats["num_decode_blocks"]
        assert_same_outputs(blocks.generate(input_ids=PROMPTS[:2], sampling_params=sp, return_logprob=True),
              single.generate(input_ids=PROMPTS[:2], sampling_params=sp, return_logprob=True))
        if "repetition_penalty" in sp:
            assert blocks.scheduler.stats["num_decode_blocks"] == before
    assert_kv_clean(blocks)


def test_an_interrupt_ends_a_block_after_its_current_step(tiny_llama, make_engine):
    """interrupt_block() from inside a block's third step (as a submission or a control call from another
    thread does) ends the block there: its unrun steps' KV slots go back, the next block runs the rest, and the
    outputs equal single steps'."""
    blocks, single = _pair(make_engine, tiny_llama, cpu_kernels=False)  # the per-step path: a hook per step
    sched = blocks.scheduler
    real = sched._forward_sample_device
    calls, steps_per_block = [0], []

    def hooked(fb, reqs, prepared=None, fill=None):
        calls[0] += 1
        if fill is not None and calls[0] % 3 == 0:
            sched.interrupt_block()
        return real(fb, reqs, prepared=prepared, fill=fill)

    real_block = sched._run_decode_block

    def counting(reqs, num_steps):
        before = sched.stats["num_decode_steps"]
        out = real_block(reqs, num_steps)
        steps_per_block.append((num_steps, sched.stats["num_decode_steps"] - before))
        return out

    sched._forward_sample_device, sched._run_decode_block = hooked, counting
    params = {"temperature": 0.8, "seed": 3, "max_new_tokens": 20, "ignore_eos": True}
    assert_same_outputs(blocks.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True),
          single.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True))
    assert any(done < planned for planned, done in steps_per_block), steps_per_block
    assert_kv_clean(blocks)


def test_the_fused_call_stops_at_the_flag_after_one_step(tiny_llama, make_engine):
    """ModelRunner.forward_sample_steps with the stop flag already set runs exactly one step (the first always
    runs) and returns its ids, which equal the single step's; without the flag it runs them all."""
    engine = make_engine(tiny_llama, disable_overlap_schedule=True, num_continuous_decode_steps=8)
    if getattr(engine.runner.model, "fused_model", None) is None:
        pytest.skip("the CPU kernels do not build here: no fused forward")  # covered by the per-step tests above
    from rollout.batch import decode_batch

    captured = {}
    real = engine.scheduler._block_forward

    def capture(reqs, locs):
        if "done" not in captured:
            fb = decode_batch(reqs, locs[0], engine.runner.device)
            fb.sampling_info = engine.scheduler._sampling_info(reqs)
            prepared = engine.runner.prepare_forward(fb)
            flag = torch.ones(1, dtype=torch.int32)
            ids, _ = engine.runner.forward_sample_steps(fb, prepared, locs, flag)
            captured["done"], captured["first"] = ids.shape[0], ids[0].tolist()
            all_ids, _ = engine.runner.forward_sample_steps(fb, prepared, locs, torch.zeros(1, dtype=torch.int32))
            captured["all"] = all_ids.shape[0]
        return real(reqs, locs)

    engine.scheduler._block_forward = capture
    out = engine.generate(input_ids=PROMPTS[:2], sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                                  "ignore_eos": True})
    assert captured["done"] == 1 and captured["all"] > 1
    assert captured["first"] == [o["output_ids"][1] for o in out]  # the block after prefill samples token 2
    assert_kv_clean(engine)


def test_a_block_that_raises_falls_back_to_a_single_step(tiny_llama, make_engine):
    """A block whose forward raises frees its slots and the single step runs instead: the same outputs, and a
    clean pool."""
    blocks, single = _pair(make_engine, tiny_llama)

    def broken(reqs, locs):
        raise RuntimeError("block forward broke")

    blocks.scheduler._block_forward = broken
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    assert_same_outputs(blocks.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True),
          single.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True))
    assert blocks.scheduler.stats["num_decode_blocks"] == 0
    assert_kv_clean(blocks)


def test_streamed_chunks_join_up_to_the_final_output(tiny_llama, make_engine):
    """Streaming through blocks: every chunk extends the one before (a block's tokens arrive together), and
    the last equals the non-streamed output."""
    engine = make_engine(tiny_llama, num_continuous_decode_steps=8)
    sp = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    ref = engine.generate(input_ids=PROMPTS[1], sampling_params=sp)
    chunks = [c["output_ids"] for c in engine.generate(input_ids=PROMPTS[1], sampling_params=sp, stream=True)]
    assert chunks[-1] == ref["output_ids"]
    assert all(b[: len(a)] == a and len(b) > len(a) for a, b in zip(chunks, chunks[1:]))
    assert len(chunks) < 20  # tokens of a block come in one chunk


def test_a_control_call_waits_for_one_step_not_the_block(tiny_llama, make_engine):
    """A control call from another thread while 64-step blocks run gets the lock within a step or two of asking
    (the block stops at its next step), not at the block's end (counted on the per-step path, whose forwards
    a hook can count as they run; the fused call's flag check is the test above)."""
    engine = make_engine(tiny_llama, num_continuous_decode_steps=64, context_length=512, cpu_kernels=False)
    sched = engine.scheduler
    real, live = sched._forward_sample_device, [0]

    def counting(*args, **kwargs):
        live[0] += 1
        return real(*args, **kwargs)

    sched._forward_sample_device = counting
    done = threading.Event()
    result = {}

    def run():
        result["outs"] = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 300, "ignore_eos": True})
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    waits = []
    try:
        while len(waits) < 3 and not done.is_set():
            time.sleep(0.01)
            if live[0] < 5:
                continue
            before = live[0]
            with engine._cv:  # what every control call does first
                waits.append(live[0] - before)
    finally:
        thread.join(60)
    assert len(waits) == 3, "the batch ended first: make it longer"
    assert max(waits) <= 2, waits
    assert all(len(o["output_ids"]) == 300 for o in result["outs"])


def test_num_continuous_decode_steps_is_validated_and_a_server_flag(tiny_llama, make_engine):
    """None (the default) is 8 on the CPU; an int >= 1 is taken; anything else is refused by name; the server takes
    --num-continuous-decode-steps."""
    from rollout.server.args import parse_args

    assert make_engine(tiny_llama).scheduler.decode_block_steps == 8
    assert make_engine(tiny_llama, num_continuous_decode_steps=1).scheduler.decode_block_steps == 1
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(ValueError, match="num_continuous_decode_steps"):
            make_engine(tiny_llama, num_continuous_decode_steps=bad)
    assert parse_args(["--model-path", "m", "--num-continuous-decode-steps", "4"])[1]["num_continuous_decode_steps"] == 4
    assert parse_args(["--model-path", "m"])[1]["num_continuous_decode_steps"] is None
