"""sglang.Engine.generate's arguments this engine does not implement: neutral values port unchanged,
others are refused by name and cost nothing.

Oracles: the same engine's plain call (greedy, so outputs must be equal token for token) and the
parameter list of SGLang's Engine.generate, written down here from its source.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from rollout import Engine
from rollout.sglang_generate_args import IGNORED, UNIMPLEMENTED

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
GREEDY = dict(temperature=0, max_new_tokens=6, ignore_eos=True)

# sglang/srt/entrypoints/engine.py, Engine.generate's parameters (SGLang 0.5.x).
SGLANG_GENERATE = (
    "prompt", "sampling_params", "input_ids", "image_data", "audio_data", "video_data", "mm_hashes",
    "mm_content_hashes", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "lora_path", "custom_logit_processor", "require_reasoning", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "stream", "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
    "disagg_prefill_dp_rank", "data_parallel_rank", "external_trace_header", "rid", "session_params", "priority",
    "session_id", "cache_salt", "kv_router_hint",  # the last one: async_generate's
)
# What verl's and other wrappers pass when they forward every argument at its default.
NEUTRAL_CALL = dict(image_data=None, audio_data=None, video_data=None, mm_hashes=None, mm_content_hashes=None,
                    custom_logit_processor=None, require_reasoning=False, return_hidden_states=False,
                    routed_experts_start_len=0, bootstrap_host=None, bootstrap_port=None, bootstrap_room=None,
                    routed_dp_rank=None, disagg_prefill_dp_rank=None, data_parallel_rank=0,
                    external_trace_header={"traceparent": "00-abc-def-01"}, session_params=None, priority=None,
                    session_id=None, cache_salt=None)
REFUSED = [
    ("image_data", ["img.png", None], "multimodal"),
    ("custom_logit_processor", '{"callable": "x"}', "custom logit processors"),
    ("return_hidden_states", True, "hidden states"),
    ("routed_dp_rank", 1, r"out of range \[0, 1\)"),
    ("data_parallel_rank", 3, "dp_size=1"),
    ("session_params", {"id": "s"}, "sessions"),
    ("priority", 5, "priority scheduling"),
    ("bootstrap_host", "10.0.0.1", "disaggregation"),
    ("cache_salt", "tenant-a", "salt"),
    ("extra_key", "tenant-a", "namespaces"),
    ("routed_experts_start_len", 4, "first prompt position"),
]


@pytest.fixture(scope="module")
def engine(module_engines, tiny_llama):
    return module_engines(tiny_llama)


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_every_sglang_generate_parameter_is_accepted_by_name():
    """Each parameter of SGLang's Engine.generate is a parameter of ours or a checked SGLang argument."""
    ours = set(inspect.signature(Engine.generate).parameters) | set(UNIMPLEMENTED) | set(IGNORED)
    assert [p for p in SGLANG_GENERATE if p not in ours] == []


def test_neutral_values_give_the_plain_calls_outputs(engine):
    """A call passing every unimplemented argument at its neutral value (None per prompt included)
    generates exactly what the plain call does, sync and async."""
    want = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, **NEUTRAL_CALL)
    assert _ids(got) == _ids(want)
    per_prompt = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, image_data=[None, None],
                                 return_hidden_states=[False, False])
    assert _ids(per_prompt) == _ids(want)
    got_async = asyncio.run(engine.async_generate(input_ids=PROMPTS, sampling_params=GREEDY, **NEUTRAL_CALL))
    assert _ids(got_async) == _ids(want)


@pytest.mark.parametrize("name, value, why", REFUSED)
def test_other_values_are_refused_by_name_and_the_engine_keeps_serving(engine, name, value, why):
    """A value asking for an unimplemented feature is a ValueError naming the argument and the reason;
    nothing was submitted, and the next call generates what it did before."""
    want = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    with pytest.raises(ValueError, match=rf"{name}=.*refused: .*{why}"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, **{name: value})
    with pytest.raises(ValueError, match=rf"async_generate: {name}="):
        asyncio.run(engine.async_generate(input_ids=PROMPTS[0], sampling_params=GREEDY, **{name: value}))
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"] == want


SGLANG_SP_UNIMPLEMENTED = ("json_schema", "regex", "ebnf", "structural_tag")


def test_unimplemented_sglang_sampling_params_at_none_are_neutral_else_refused(engine):
    """SGLang's sampling params this engine lacks: None (a full SamplingParams dump) generates what the plain call
    does; a value is a ValueError naming the param and the feature, and nothing is submitted."""
    want = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    neutral = {**GREEDY, **dict.fromkeys(SGLANG_SP_UNIMPLEMENTED)}
    assert _ids(engine.generate(input_ids=PROMPTS, sampling_params=neutral)) == _ids(want)
    for name, value, why in (("regex", "a+", "constrained decoding"), ("json_schema", "{}", "constrained decoding")):
        with pytest.raises(ValueError, match=rf"sampling param {name}=.* is refused: .*{why}"):
            engine.generate(input_ids=PROMPTS, sampling_params={**GREEDY, name: value})
    assert engine.get_server_info()["num_in_flight"] == 0
    assert _ids(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == _ids(want)


def test_custom_params_without_a_processor_change_nothing(engine):
    """custom_params reach only a custom logit processor in SGLang (refused here), so a dict (slime's
    {"return_top_p_token_ids": True} with top-p) generates what the plain call does; a non-dict is refused."""
    seeded = dict(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=6, ignore_eos=True)
    want = engine.generate(input_ids=PROMPTS, sampling_params=seeded)
    got = engine.generate(input_ids=PROMPTS, sampling_params={**seeded,
                                                              "custom_params": {"return_top_p_token_ids": True}})
    assert _ids(got) == _ids(want)
    with pytest.raises(ValueError, match="custom_params must be a dict"):
        engine.generate(input_ids=PROMPTS, sampling_params={**seeded, "custom_params": "x"})


def test_sglang_none_defaults_mean_sglang_defaults(engine):
    """SGLang's generate defaults return_logprob and top_logprobs_num to None (meaning False and 0), as a
    whole or per prompt: a wrapper forwarding them gets the plain call's outputs."""
    want = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=None, top_logprobs_num=None,
                          return_routed_experts=None)
    assert _ids(got) == _ids(want) and "output_token_logprobs" not in got[0]["meta_info"]
    mixed = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=[True, None],
                            top_logprobs_num=[2, None])
    assert _ids(mixed) == _ids(want)
    assert len(mixed[0]["meta_info"]["output_top_logprobs"][0]) == 2 and "output_token_logprobs" not in \
        mixed[1]["meta_info"]
    with pytest.raises(ValueError, match="return_logprob must be a bool"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob="yes")


def test_a_name_sglang_does_not_have_is_a_type_error(engine):
    """A keyword neither engine knows is a TypeError naming it, as Python's own would be."""
    with pytest.raises(TypeError, match="imgae_data"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, imgae_data=None)


def test_prompt_and_input_ids_together_take_the_ids(engine):
    """Given both prompt and input_ids, the ids are the prompt and the text is not read (SGLang's tokenizer
    manager takes input_ids first): the output equals the ids-only call's, single or batched; neither is an
    error naming both."""
    want = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    got = engine.generate(prompt=["something else", "entirely"], input_ids=PROMPTS, sampling_params=GREEDY)
    assert _ids(got) == _ids(want)
    one = engine.generate(prompt="x y z", input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert one["output_ids"] == want[0]["output_ids"] and one["meta_info"]["prompt_tokens"] == len(PROMPTS[0])
    with pytest.raises(ValueError, match="prompt or input_ids"):
        engine.generate(sampling_params=GREEDY)
