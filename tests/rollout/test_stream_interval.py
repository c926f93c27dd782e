"""stream_interval (SGLang's engine option and sampling param): a streaming request's chunks come at
tokens 1, N+1, 2N+1, ... and at the end, and the tokens are those of the request streamed every token.

Oracles: the same engine streaming every token (greedy and seeded, so equal token for token), and the
chunk lengths SGLang's rule gives, written out by hand.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
GREEDY = dict(temperature=0, max_new_tokens=10, ignore_eos=True)
SEEDED = dict(temperature=1.0, seed=3, max_new_tokens=10, ignore_eos=True)


# Single decode steps, so that every token is a step boundary and SGLang's rule shows exactly; decode blocks
# (the CPU default) are the last test.
@pytest.fixture(scope="module")
def engine(module_engines, tiny_llama):
    return module_engines(tiny_llama, num_continuous_decode_steps=1)


@pytest.fixture(scope="module")
def engine_every_4(module_engines, tiny_llama):
    return module_engines(tiny_llama, stream_interval=4, num_continuous_decode_steps=1)


def _lengths(chunks) -> list[int]:
    return [len(c["output_ids"]) for c in chunks]


def test_engine_stream_interval_sends_tokens_1_n_plus_1_and_the_final(engine, engine_every_4):
    """stream_interval=4 over 10 tokens streams after tokens 1, 5, 9 and 10; the last chunk equals the
    every-token stream's last chunk (ids, logprobs, finish reason)."""
    for params in (GREEDY, SEEDED):
        want = list(engine.generate(input_ids=PROMPTS[0], sampling_params=params, return_logprob=True, stream=True))
        got = list(engine_every_4.generate(input_ids=PROMPTS[0], sampling_params=params, return_logprob=True,
                                           stream=True))
        assert _lengths(want) == list(range(1, 11))
        assert _lengths(got) == [1, 5, 9, 10]
        assert got[-1]["output_ids"] == want[-1]["output_ids"]
        assert got[-1]["meta_info"]["output_token_logprobs"] == want[-1]["meta_info"]["output_token_logprobs"]
        assert got[-1]["meta_info"]["finish_reason"] == want[-1]["meta_info"]["finish_reason"] == \
            {"type": "length", "length": 10}
        for g in got:  # each chunk is the every-token stream's snapshot at that length
            assert g["output_ids"] == want[len(g["output_ids"]) - 1]["output_ids"]


def test_sampling_param_overrides_the_engine_option(engine, engine_every_4):
    """A request's stream_interval wins over the engine's: 3 on an every-token engine, 1 on an every-4 one."""
    got3 = list(engine.generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "stream_interval": 3}, stream=True))
    assert _lengths(got3) == [1, 4, 7, 10]
    got1 = list(engine_every_4.generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "stream_interval": 1},
                                        stream=True))
    assert _lengths(got1) == list(range(1, 11))
    assert got3[-1]["output_ids"] == got1[-1]["output_ids"]


def test_async_stream_and_batches_follow_the_interval(engine_every_4):
    """async_generate(stream=True) over a batch (n=2 each) keeps the rule per sequence; a stop before the next
    due chunk still ends with the final output."""

    async def run():
        stream = await engine_every_4.async_generate(input_ids=PROMPTS, sampling_params={**SEEDED, "n": 2,
                                                                                         "max_new_tokens": 7},
                                                     stream=True)
        seen: dict[int, list[int]] = {}
        async for chunk in stream:
            seen.setdefault(chunk["index"], []).append(len(chunk["output_ids"]))
        return seen

    seen = asyncio.run(run())
    assert sorted(seen) == [0, 1, 2, 3]
    for lengths in seen.values():
        # A slow reader may get a newer snapshot in place of an older one, never an extra chunk.
        assert lengths[-1] == 7 and set(lengths) <= {1, 5, 7} and lengths == sorted(lengths)


def test_non_streaming_requests_are_unaffected(engine, engine_every_4):
    """Without stream the interval changes nothing: the same outputs."""
    want = engine.generate(input_ids=PROMPTS, sampling_params=SEEDED)
    got = engine_every_4.generate(input_ids=PROMPTS, sampling_params=SEEDED)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True])
def test_bad_sampling_param_is_refused_by_name(engine, value):
    """A stream_interval that is not an int >= 1 is a ValueError naming it, and nothing is queued."""
    with pytest.raises(ValueError, match="stream_interval"):
        engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "stream_interval": value}, stream=True)
    assert engine.get_server_info()["num_in_flight"] == 0


def test_integral_float_is_taken_as_an_int():
    """4.0 (what JSON arithmetic produces) is 4, as the other integer sampling params."""
    assert SamplingParams.from_dict({"stream_interval": 4.0}).stream_interval == 4
    assert SamplingParams.from_dict({"stream_interval": None}).stream_interval is None


@pytest.mark.parametrize("value", [0, -1, 2.0, "2", True])
def test_bad_engine_option_is_refused_by_name(tiny_llama, value):
    """Engine(stream_interval=...) that is not an int >= 1 fails before anything is built, naming it."""
    from rollout import Engine

    with pytest.raises(ValueError, match="stream_interval"):
        Engine(str(tiny_llama), stream_interval=value)


def test_with_decode_blocks_a_chunk_follows_each_block_that_passes_a_due_token(module_engines, tiny_llama, engine):
    """With blocks of 3 and stream_interval=4 over 10 tokens (blocks end after tokens 4, 7, 10), a chunk goes at
    the first boundary at or after each of tokens 1, 5, 9 (token 1 comes from the prefill): after tokens 1, 7
    and 10; each is the every-token stream's snapshot at that length."""
    blocks = module_engines(tiny_llama, stream_interval=4, num_continuous_decode_steps=3)
    want = list(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True))
    got = list(blocks.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True))
    assert _lengths(got) == [1, 7, 10]
    for g in got:
        assert g["output_ids"] == want[len(g["output_ids"]) - 1]["output_ids"]
