"""stream_output (SGLang's --stream-output): a streamed request's chunks carry only the output_ids new since its
previous chunk, disjoint pieces that join up to the whole output, while text and logprobs stay cumulative.

Oracles: the same engine's non-streamed answer (greedy and seeded: equal token for token) and the chunk
boundaries streaming every token gives.
"""

from __future__ import annotations

import asyncio

import pytest

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
GREEDY = dict(temperature=0, max_new_tokens=10, ignore_eos=True)
SEEDED = dict(temperature=1.0, seed=3, max_new_tokens=10, ignore_eos=True, n=2)


# Single decode steps, so that each token is its own chunk (with decode blocks a piece holds a block's tokens:
# the last test).
@pytest.fixture(scope="module")
def engine(module_engines, tiny_llama):
    return module_engines(tiny_llama, stream_output=True, num_continuous_decode_steps=1)


def _joined(chunks: list[dict]) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for c in chunks:
        ids.setdefault(c["index"], []).extend(c["output_ids"])
    return ids


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded-n2"])
def test_stream_pieces_join_to_the_output(engine, sp):
    """Each chunk holds one new id (streamed every token); per request they join to the non-streamed output_ids,
    and the last chunk's text and logprobs are the whole output's."""
    engine.flush_cache()  # both calls prefill from scratch: a prefix-cache hit may move a logprob by an ulp
    want = engine.generate(input_ids=PROMPTS, sampling_params=sp, return_logprob=True)
    engine.flush_cache()
    chunks = list(engine.generate(input_ids=PROMPTS, sampling_params=sp, return_logprob=True, stream=True))
    assert all(len(c["output_ids"]) == 1 for c in chunks)
    assert _joined(chunks) == {i: w["output_ids"] for i, w in enumerate(want)}
    last = {c["index"]: c for c in chunks}
    for i, w in enumerate(want):
        assert last[i]["text"] == w["text"]
        assert last[i]["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]


def test_async_stream_with_an_interval(engine):
    """async_generate(stream=True) with stream_interval 4: pieces of 1, 4, 4, 1 ids (tokens 1, 5, 9 and the
    final), joining to the output."""
    want = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]

    async def run():
        stream = await engine.async_generate(input_ids=PROMPTS[0], stream=True,
                                             sampling_params={**GREEDY, "stream_interval": 4})
        return [c async for c in stream]

    chunks = asyncio.run(run())
    assert [len(c["output_ids"]) for c in chunks] == [1, 4, 4, 1]
    assert [t for c in chunks for t in c["output_ids"]] == want


def test_off_by_default_and_checked(module_engines, tiny_llama):
    """Without the option chunks are cumulative (SGLang's default); a non-bool is refused naming it."""
    from rollout.engine_args import FrontendConfig

    plain = module_engines(tiny_llama, num_continuous_decode_steps=1)
    chunks = list(plain.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True))
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 11))
    with pytest.raises(ValueError, match="stream_output"):
        FrontendConfig(stream_output="yes")


def test_decode_blocks_send_a_blocks_ids_as_one_piece(module_engines, tiny_llama, engine):
    """With decode blocks of 4 the pieces are the prefill's token and then each block's tokens (1, 4, 4, 1 over 10
    tokens), joining to the output of single steps."""
    blocks = module_engines(tiny_llama, stream_output=True, num_continuous_decode_steps=4)
    want = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    chunks = list(blocks.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True))
    assert [len(c["output_ids"]) for c in chunks] == [1, 4, 4, 1]
    assert [t for c in chunks for t in c["output_ids"]] == want
