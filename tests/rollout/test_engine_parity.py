"""Engine.generate against transformers: greedy tokens and logprobs per architecture, the tokenizer
round trip, engines without a tokenizer, the output dict, and the stop conditions (eos,
stop_token_ids, max_new_tokens=0)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from rollout import SamplingParams
from tests.rollout.oracle import hf_generate, random_prompts

PROMPT_LENS = [1, 3, 6, 9, 14, 20, 27, 35]
MAX_NEW = 16
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": MAX_NEW}
TEXTS = ["Hello, world! How are you today?", "What is 7 * 8? The answer is"]


@pytest.fixture(scope="module")
def arch_env(tiny_ckpt, module_engines, hf_models):
    """(checkpoint, engine, HF model, HF greedy reference for the 8 prompts), per architecture."""
    engine = module_engines(tiny_ckpt)
    model = hf_models(tiny_ckpt)
    prompts = random_prompts(PROMPT_LENS, seed=1)
    refs = [hf_generate(model, p, MAX_NEW) for p in prompts]
    return tiny_ckpt, engine, model, prompts, refs


def test_greedy_tokens_and_logprobs_match_hf_generate(arch_env):
    """Greedy batch generate equals HF generate (per prompt, unpadded) token for token; logprobs to 1e-4."""
    _, engine, _, prompts, refs = arch_env
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert len(outs) == len(prompts)
    for prompt, out, (ref_ids, ref_lps) in zip(prompts, outs, refs):
        assert out["output_ids"] == ref_ids
        lps = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == ref_ids
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in lps]), torch.tensor(ref_lps), atol=1e-4, rtol=0)
        meta = out["meta_info"]
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), MAX_NEW)
        assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}


def test_text_prompts_go_through_the_tokenizer(arch_env):
    """A string prompt is encoded by the checkpoint's tokenizer; `text` is the tokenizer's decode of output_ids."""
    ckpt, engine, model, _, _ = arch_env
    tok = AutoTokenizer.from_pretrained(ckpt)
    outs = engine.generate(prompt=TEXTS, sampling_params=GREEDY, return_logprob=True)
    for text, out in zip(TEXTS, outs):
        ids = tok(text).input_ids
        ref_ids, _ = hf_generate(model, ids, MAX_NEW)
        assert out["output_ids"] == ref_ids
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["text"] == tok.decode(ref_ids, skip_special_tokens=True)
        assert [s for _, _, s in out["meta_info"]["output_token_logprobs"]] == [tok.decode([t]) for t in ref_ids]
    single = engine.generate(prompt=TEXTS[0], sampling_params=GREEDY)
    assert isinstance(single, dict) and single["output_ids"] == outs[0]["output_ids"]


def test_output_dict_shape(tiny_llama, module_engines):
    """The output dict has SGLang's keys and types; logprobs are (float, int, str) tuples."""
    engine = module_engines(tiny_llama)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "ignore_eos": True, "seed": 3},
                          return_logprob=True)
    assert isinstance(out, dict)
    assert {"text", "output_ids", "meta_info"} <= set(out)
    meta = out["meta_info"]
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "weight_version",
            "output_token_logprobs"} <= set(meta)
    assert isinstance(out["text"], str) and isinstance(meta["id"], str) and meta["id"]
    assert isinstance(meta["weight_version"], str)
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
    assert meta["finish_reason"] == {"type": "length", "length": 4}  # SGLang's FINISH_LENGTH
    assert meta["e2e_latency"] > 0
    assert len(out["output_ids"]) == 4 and all(isinstance(t, int) for t in out["output_ids"])
    for (lp, t, s), tid in zip(meta["output_token_logprobs"], out["output_ids"]):
        assert isinstance(lp, float) and lp <= 0 and t == tid and isinstance(s, str)
    assert "output_token_logprobs" not in engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1})[
        "meta_info"]


@pytest.mark.parametrize("how", ["no_tokenizer_files", "skip_tokenizer_init"])
def test_engine_without_tokenizer(how, ckpt_factory, make_engine, hf_models):
    """Without a tokenizer, input_ids work (same tokens as HF), outputs have no "text" key (SGLang's token-ids
    outputs), and a string prompt is a clear error."""
    if how == "no_tokenizer_files":
        engine = make_engine(ckpt_factory("llama", with_tokenizer=False))
    else:
        engine = make_engine(ckpt_factory("llama"), skip_tokenizer_init=True)
    prompt = random_prompts([7], seed=2)[0]
    ref_ids, _ = hf_generate(hf_models(ckpt_factory("llama")), prompt, 8)
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 8}, return_logprob=True)
    assert out["output_ids"] == ref_ids
    assert "text" not in out and set(out) == {"output_ids", "meta_info", "index"}
    assert all(s is None for _, _, s in out["meta_info"]["output_token_logprobs"])
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(prompt="hello", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="stop"):  # stop strings could never match without a tokenizer
        engine.generate(input_ids=prompt, sampling_params={**GREEDY, "stop": ["a"]})
    assert engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 8})["output_ids"] == ref_ids


def _first_new_token(tokens: list[int], start: int) -> int:
    """Index >= start of a token that does not occur earlier in `tokens` (and is not the eos id 1)."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i] and tokens[i] != 1:
            return i
    raise AssertionError(f"no fresh token in {tokens}")


def test_eos_stops_unless_ignore_eos(ckpt_factory, make_engine, hf_models):
    """An eos id ends generation as HF's generate does (finish stop, matched = it); ignore_eos runs to the limit."""
    base = ckpt_factory("llama")
    prompt = random_prompts([9], seed=3)[0]
    ref_ids, _ = hf_generate(hf_models(base), prompt, MAX_NEW)
    k = _first_new_token(ref_ids, 3)
    eos = ref_ids[k]
    ckpt = ckpt_factory("llama", eos_token_id=eos)  # same weights, another eos id
    hf_ids, _ = hf_generate(hf_models(ckpt), prompt, MAX_NEW, eos_token_id=[eos, 1])
    assert hf_ids == ref_ids[: k + 1]
    engine = make_engine(ckpt)
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
    assert out["output_ids"] == hf_ids
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["meta_info"]["completion_tokens"] == k + 1
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == ref_ids
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}


def test_min_new_tokens_bans_eos_like_hf(ckpt_factory, make_engine, hf_models):
    """min_new_tokens masks eos until reached, exactly as HF's MinNewTokensLengthLogitsProcessor does."""
    base = ckpt_factory("llama")
    prompt = random_prompts([9], seed=3)[0]
    ref_ids, _ = hf_generate(hf_models(base), prompt, MAX_NEW)
    eos = ref_ids[_first_new_token(ref_ids, 3)]
    ckpt = ckpt_factory("llama", eos_token_id=eos)
    hf_ids, _ = hf_generate(hf_models(ckpt), prompt, MAX_NEW, eos_token_id=[eos, 1], min_new_tokens=10)
    engine = make_engine(ckpt)
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW,
                                                             "min_new_tokens": 10})
    assert out["output_ids"] == hf_ids
    assert len(out["output_ids"]) >= 10


def test_stop_token_ids(arch_env):
    """stop_token_ids end generation at the first such token: output is the greedy run up to and including it;
    with ignore_eos they are ignored too (SGLang's rule), and the run is the whole greedy one."""
    _, engine, _, prompts, refs = arch_env
    ref_ids = refs[4][0]
    k = _first_new_token(ref_ids, 2)
    out = engine.generate(input_ids=prompts[4], sampling_params={**GREEDY, "stop_token_ids": [ref_ids[k]],
                                                                 "ignore_eos": False})  # else ignored, as SGLang
    assert out["output_ids"] == ref_ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref_ids[k]}
    ignored = engine.generate(input_ids=prompts[4], sampling_params={**GREEDY, "stop_token_ids": [ref_ids[k]]})
    assert ignored["output_ids"] == ref_ids and ignored["meta_info"]["finish_reason"]["type"] == "length"


def test_max_new_tokens_zero(arch_env):
    """max_new_tokens=0 returns no tokens (finish length) and leaves the engine serving normally."""
    _, engine, _, prompts, refs = arch_env
    out = engine.generate(input_ids=prompts[3], sampling_params={**GREEDY, "max_new_tokens": 0}, return_logprob=True)
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["output_token_logprobs"] == []
    assert engine.generate(input_ids=prompts[3], sampling_params=GREEDY)["output_ids"] == refs[3][0]


def test_default_and_object_sampling_params(tiny_llama, module_engines):
    """sampling_params omitted uses the defaults (max_new_tokens 128); a SamplingParams object equals its dict."""
    engine = module_engines(tiny_llama)
    prompt = random_prompts([5], seed=4)[0]
    out = engine.generate(input_ids=prompt)
    assert 1 <= out["meta_info"]["completion_tokens"] <= 128
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, stop_token_ids=[], stop=None)
    by_object = engine.generate(input_ids=prompt, sampling_params=sp)
    assert by_object["output_ids"] == engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 8})[
        "output_ids"]
    assert sp.stop is None  # the caller's object is not modified
