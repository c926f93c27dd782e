"""Bad input (issue 2 item 5, issue 3 item 5): each raises a clear ValueError/TypeError naming the
field, nothing of the bad call is queued, and the engine then answers a valid request exactly as HF
greedy generation does; a bad request arriving mid-run does not disturb the running ones."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tests.checkpoints import VOCAB_SIZE
from tests.rollout.oracle import hf_generate, random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}
PROMPT = random_prompts([11], seed=41)[0]


@pytest.fixture(scope="module")
def env(tiny_llama, module_engines, hf_models):
    engine = module_engines(tiny_llama, context_length=128)
    ref_ids, _ = hf_generate(hf_models(tiny_llama), PROMPT, GREEDY["max_new_tokens"])
    return engine, ref_ids


def _sp(**kw) -> dict:
    return {**GREEDY, **kw}


BAD_CALLS = {
    "unknown sampling key": (dict(input_ids=PROMPT, sampling_params=_sp(temprature=0.5)), ValueError, "temprature"),
    "negative temperature": (dict(input_ids=PROMPT, sampling_params=_sp(temperature=-0.1)), ValueError, "temperature"),
    "temperature not a number": (dict(input_ids=PROMPT, sampling_params=_sp(temperature="hot")), ValueError,
                                 "temperature"),
    "top_p zero": (dict(input_ids=PROMPT, sampling_params=_sp(top_p=0.0)), ValueError, "top_p"),
    "top_p above one": (dict(input_ids=PROMPT, sampling_params=_sp(top_p=1.5)), ValueError, "top_p"),
    "top_k zero": (dict(input_ids=PROMPT, sampling_params=_sp(top_k=0)), ValueError, "top_k"),
    "min_p above one": (dict(input_ids=PROMPT, sampling_params=_sp(min_p=2.0)), ValueError, "min_p"),
    "negative max_new_tokens": (dict(input_ids=PROMPT, sampling_params=_sp(max_new_tokens=-1)), ValueError,
                                "max_new_tokens"),
    "fractional max_new_tokens": (dict(input_ids=PROMPT, sampling_params=_sp(max_new_tokens=4.5)), ValueError,
                                  "max_new_tokens"),
    "logit_bias banning the whole vocabulary": (dict(input_ids=PROMPT, sampling_params=_sp(
        temperature=1.0, logit_bias={str(t): -1e300 for t in range(VOCAB_SIZE)})), ValueError, "bans all"),
    # min_new_tokens holds back the stop ids: with every id a stop id, nothing could be sampled (a NaN logprob)
    "min_new_tokens with every id a stop id": (dict(input_ids=PROMPT, return_logprob=True, sampling_params=_sp(
        min_new_tokens=5, stop_token_ids=list(range(VOCAB_SIZE)))), ValueError, "min_new_tokens=5 holds back"),
    "min_new_tokens with the stop ids and logit_bias covering the vocabulary": (dict(input_ids=PROMPT, sampling_params=_sp(
        temperature=1.0, min_new_tokens=3, stop_token_ids=[7],
        logit_bias={str(t): -1e300 for t in range(VOCAB_SIZE) if t != 7})), ValueError, "no token could be sampled"),
    "fractional n": (dict(input_ids=PROMPT, sampling_params=_sp(n=1.5)), ValueError, "sampling param n"),
    "numpy bool n": (dict(input_ids=PROMPT, sampling_params=_sp(n=np.bool_(True))), ValueError, "sampling param n"),
    "infinite top_k": (dict(input_ids=PROMPT, sampling_params=_sp(top_k=float("inf"))), ValueError, "top_k"),
    "n zero": (dict(input_ids=PROMPT, sampling_params=_sp(n=0)), ValueError, "sampling param n"),
    # one Req per sequence would be built first: 10**9 of them exhausted the host's memory
    "n of a billion": (dict(input_ids=PROMPT, sampling_params=_sp(n=10**9)), ValueError, "at most 1048576"),
    "prompts x n over the bound": (dict(input_ids=[PROMPT] * 2, sampling_params=_sp(n=2**19 + 1)), ValueError,
                                   "asks for 1048578 sequences"),
    "min_new_tokens above max_new_tokens": (dict(input_ids=PROMPT, sampling_params=_sp(min_new_tokens=9)),
                                            ValueError, "min_new_tokens=9"),
    # An array has no truth value: these failed with numpy's / torch's "ambiguous" error, naming no field
    "stop_token_ids as a numpy array": (dict(input_ids=PROMPT, sampling_params=_sp(stop_token_ids=np.array([7, 9]))),
                                        ValueError, r"stop_token_ids must be .*\.tolist\(\)"),
    "stop_token_ids as a tensor": (dict(input_ids=PROMPT, sampling_params=_sp(stop_token_ids=torch.tensor([7, 9]))),
                                   ValueError, r"stop_token_ids must be .*\.tolist\(\)"),
    "stop not strings": (dict(input_ids=PROMPT, sampling_params=_sp(stop=[1, 2])), ValueError, "stop"),
    "stop empty string": (dict(input_ids=PROMPT, sampling_params=_sp(stop=[""])), ValueError, "stop"),
    "sampling_params not a dict": (dict(input_ids=PROMPT, sampling_params=[("temperature", 0)]), ValueError,
                                   "sampling_params"),
    "sampling_params list too short": (dict(input_ids=[PROMPT, PROMPT], sampling_params=[GREEDY]), ValueError,
                                       "sampling_params"),
    "token id above vocab": (dict(input_ids=PROMPT + [VOCAB_SIZE]), ValueError, "vocabulary"),
    "negative token id": (dict(input_ids=[-1] + PROMPT), ValueError, "vocabulary"),
    "token id not an int": (dict(input_ids=[1.0, 2.0]), ValueError, "input_ids"),
    "bool token id": (dict(input_ids=[True, 5]), ValueError, "input_ids"),
    "input_ids as a float tensor": (dict(input_ids=torch.tensor(PROMPT, dtype=torch.float32)), ValueError,
                                    "input_ids must be .* got Tensor"),
    "input_ids as numpy bools": (dict(input_ids=list(np.array([True, False]))), ValueError, "input_ids must be"),
    "prompt with a lone surrogate": (dict(prompt="ok \ud800"), ValueError, r"lone surrogate U\+D800 at character 3"),
    "empty prompt": (dict(input_ids=[[]]), ValueError, "empty"),
    "empty batch": (dict(input_ids=[]), ValueError, "input_ids is an empty list"),
    "prompt longer than the context": (dict(input_ids=[5] * 128), ValueError, "context"),
    "neither prompt nor input_ids": (dict(), ValueError, "prompt"),
    "prompt not a string": (dict(prompt=[1, 2, 3]), ValueError, "prompt"),
    "unknown generate argument": (dict(input_ids=PROMPT, sampling_param=GREEDY), TypeError, "sampling_param"),
    "negative top_logprobs_num": (dict(input_ids=PROMPT, top_logprobs_num=-1), ValueError, "top_logprobs_num"),
    "stream not a bool": (dict(input_ids=PROMPT, stream="yes"), ValueError, "stream"),
    "temperature nan": (dict(input_ids=PROMPT, sampling_params=_sp(temperature=float("nan"))), ValueError,
                        "temperature"),
    "temperature inf": (dict(input_ids=PROMPT, sampling_params=_sp(temperature=float("inf"))), ValueError,
                        "temperature"),
    "top_p nan": (dict(input_ids=PROMPT, sampling_params=_sp(top_p=float("nan"))), ValueError, "top_p"),
    "ignore_eos not a bool": (dict(input_ids=PROMPT, sampling_params=_sp(ignore_eos="no")), ValueError, "ignore_eos"),
    "skip_special_tokens not a bool": (dict(input_ids=PROMPT, sampling_params=_sp(skip_special_tokens=3, stop=["x"])),
                                       ValueError, "skip_special_tokens"),
    "no_stop_trim not a bool": (dict(input_ids=PROMPT, sampling_params=_sp(no_stop_trim="false")), ValueError,
                                "no_stop_trim"),
    "top_logprobs_num above vocab": (dict(input_ids=PROMPT, return_logprob=True, top_logprobs_num=VOCAB_SIZE + 1),
                                     ValueError, "top_logprobs_num"),
    "top_logprobs_num list too short": (dict(input_ids=[PROMPT, PROMPT], top_logprobs_num=[1]), ValueError,
                                        "top_logprobs_num"),
    "return_logprob not a bool": (dict(input_ids=PROMPT, return_logprob="yes"), ValueError, "return_logprob"),
    "rid not a string": (dict(input_ids=[PROMPT, PROMPT], rid=[1, 2]), ValueError, "rid"),
    "duplicate rids": (dict(input_ids=[PROMPT, PROMPT], rid=["same", "same"]), ValueError, "id"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_request_is_a_clear_error_and_engine_keeps_serving(case, env):
    """The bad call raises naming the field, queues nothing, and the next valid request equals HF greedy."""
    engine, ref_ids = env
    kwargs, exc, field = BAD_CALLS[case]
    before = engine.get_server_info()["num_prompt_tokens"]
    with pytest.raises(exc, match=field):
        out = engine.generate(**kwargs)
        if kwargs.get("stream"):
            next(out)
    info = engine.get_server_info()
    assert info["num_in_flight"] == 0 and info["num_prompt_tokens"] == before
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == ref_ids


def test_min_new_tokens_with_one_token_left_possible_is_served(env):
    """The same bans leaving one token outside the stop ids: served, every logprob finite, that token sampled
    until min_new_tokens, then the stop id may end it."""
    engine, _ = env
    bias = {str(t): -1e300 for t in range(VOCAB_SIZE) if t not in (7, 9)}
    out = engine.generate(input_ids=PROMPT, return_logprob=True, sampling_params=dict(
        temperature=1.0, seed=3, max_new_tokens=6, min_new_tokens=3, stop_token_ids=[7], logit_bias=bias))
    assert out["output_ids"][:3] == [9, 9, 9] and set(out["output_ids"]) <= {7, 9}
    assert all(np.isfinite(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"])


def test_integral_floats_and_numpy_scalars_read_as_their_values(env):
    """max_new_tokens=8.0, n and top_k as numpy ints, temperature as a numpy float (what JSON clients and
    config arithmetic produce; SGLang takes them) behave exactly as the plain ints: HF greedy's 8 tokens."""
    engine, ref_ids = env
    params = {"temperature": np.float32(0.0), "ignore_eos": True, "max_new_tokens": 8.0, "n": np.int64(1),
              "top_k": np.int32(-1), "seed": 3.0, "stop_token_ids": [np.int64(VOCAB_SIZE - 1)]}
    if VOCAB_SIZE - 1 in ref_ids:
        params["stop_token_ids"] = []
    out = engine.generate(input_ids=PROMPT, sampling_params=params)
    assert out["output_ids"] == ref_ids
    assert out["meta_info"]["completion_tokens"] == 8


def test_numpy_logit_bias_reads_as_the_plain_dict(env):
    """A logit_bias keyed by numpy integers with numpy float values (a dict built from arrays) biases exactly
    as the plain {int: float} dict does; it was refused as "key '5' must be a token id"."""
    engine, ref_ids = env
    plain = {ref_ids[0]: -100.0, 9: 50.0}
    arrays = dict(zip(np.array(list(plain), dtype=np.int64), np.array(list(plain.values()), dtype=np.float32)))
    outs = [engine.generate(input_ids=PROMPT, sampling_params=_sp(temperature=0, max_new_tokens=4, logit_bias=b),
                            return_logprob=True) for b in (plain, arrays)]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == [9, 9, 9, 9]
    assert outs[0]["meta_info"]["output_token_logprobs"] == outs[1]["meta_info"]["output_token_logprobs"]


def test_numpy_integer_logprob_options_read_as_plain_ints(env):
    """top_logprobs_num and logprob_start_len as numpy integers (numbers read off arrays) give exactly the output of
    the same call with plain ints; a numpy bool or a float there is still refused by name."""
    engine, _ = env
    kw = dict(input_ids=PROMPT, sampling_params=_sp(temperature=0, max_new_tokens=3), return_logprob=True)
    plain = engine.generate(**kw, top_logprobs_num=2, logprob_start_len=1)
    numpy = engine.generate(**kw, top_logprobs_num=np.int64(2), logprob_start_len=np.int32(1))
    assert numpy["output_ids"] == plain["output_ids"]
    keys = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs")
    for key in keys:
        assert numpy["meta_info"][key] == plain["meta_info"][key], key
    batch = dict(input_ids=[PROMPT, PROMPT], sampling_params=_sp(temperature=0, max_new_tokens=3), return_logprob=True)
    plains = engine.generate(**batch, top_logprobs_num=[2, 0], logprob_start_len=[1, -1])
    numpys = engine.generate(**batch, top_logprobs_num=[np.int64(2), 0], logprob_start_len=[np.int64(1), -1])
    assert [[o["meta_info"].get(k) for k in keys] for o in numpys] == [[o["meta_info"].get(k) for k in keys]
                                                                     for o in plains]
    for bad in (dict(top_logprobs_num=np.bool_(True)), dict(top_logprobs_num=2.0), dict(logprob_start_len=1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            engine.generate(**kw, **bad)


def test_numpy_and_torch_integer_input_ids_read_as_plain_ints(env):
    """input_ids given as numpy / torch integers (verl's list(np.ndarray) of np.int64, lists of arrays, a 2-D
    array, a 1-D tensor) generate exactly what the same prompts as plain int lists do."""
    engine, _ = env
    sp = _sp(temperature=0, max_new_tokens=3)
    other = [t + 1 for t in PROMPT]
    single = engine.generate(input_ids=PROMPT, sampling_params=sp)["output_ids"]
    pair = [o["output_ids"] for o in engine.generate(input_ids=[PROMPT, other], sampling_params=sp)]
    for given in (list(np.array(PROMPT)), torch.tensor(PROMPT), np.array(PROMPT, dtype=np.int32)):
        assert engine.generate(input_ids=given, sampling_params=sp)["output_ids"] == single, type(given)
    for given in ([np.array(PROMPT), np.array(other)], np.array([PROMPT, other]), [list(np.array(PROMPT)), other],
                  [torch.tensor(PROMPT), torch.tensor(other)]):
        assert [o["output_ids"] for o in engine.generate(input_ids=given, sampling_params=sp)] == pair


def test_null_sampling_params_take_their_defaults(env):
    """None for a field SGLang reads as its default (what /generate's null and a client copying OpenAI fields
    send) is that default: the same tokens and logprobs as leaving the fields out (each was refused)."""
    engine, _ = env
    sp = dict(max_new_tokens=6, seed=11)
    nulls = dict(temperature=None, top_p=None, top_k=None, min_p=None, frequency_penalty=None,
                 presence_penalty=None, repetition_penalty=None, min_new_tokens=None, n=None, ignore_eos=None,
                 skip_special_tokens=None, spaces_between_special_tokens=None, no_stop_trim=None)
    a, b = (engine.generate(input_ids=PROMPT, sampling_params=p, return_logprob=True) for p in (sp, {**sp, **nulls}))
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    with pytest.raises(ValueError, match="max_new_tokens"):  # None there means the context, and "x" is neither
        engine.generate(input_ids=PROMPT, sampling_params=dict(sp, max_new_tokens="x"))


def test_prompt_filling_the_context_gets_one_token(env):
    """A prompt of context_length-1 tokens is accepted and stops after one token (finish length)."""
    engine, _ = env
    out = engine.generate(input_ids=[5] * 127, sampling_params=GREEDY)
    assert out["meta_info"]["completion_tokens"] == 1
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_unknown_id_is_a_no_op(env):
    """abort_request of an id that is not in flight aborts nothing (SGLang: a no-op); a non-string id is a
    TypeError naming rid; the engine keeps serving."""
    engine, ref_ids = env
    assert engine.abort_request("no-such-request") == 0
    with pytest.raises(TypeError, match="rid"):
        engine.abort_request(123)
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == ref_ids


def test_bad_sampling_param_in_one_prompt_rejects_the_whole_call(env):
    """One bad entry in a batch rejects the call before anything is queued (all or nothing)."""
    engine, ref_ids = env
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=[GREEDY, _sp(top_p=0)])
    assert engine.get_server_info()["num_in_flight"] == 0
    outs = engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=[GREEDY, GREEDY])
    assert [o["output_ids"] for o in outs] == [ref_ids, ref_ids]


def test_bad_requests_while_others_run_do_not_disturb_them(env):
    """Bad requests submitted from another thread while a batch runs are refused; the batch is unchanged."""
    engine, _ = env
    prompts = random_prompts([6, 12, 18, 24], seed=42)
    params = [{"temperature": 0.8, "top_k": 30, "max_new_tokens": 40, "ignore_eos": True, "seed": i} for i in range(4)]
    ref = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    result: list = []
    engine.pause_generation(mode="in_place")  # the batch is certainly in flight when the bad requests arrive
    try:
        t = threading.Thread(target=lambda: result.append(
            engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)))
        t.start()
        while engine.get_server_info()["num_in_flight"] < 4:
            time.sleep(0.005)
        for kwargs, exc, field in list(BAD_CALLS.values())[::3]:
            with pytest.raises(exc, match=field):
                engine.generate(**kwargs)
        assert engine.abort_request("nope") == 0
    finally:
        engine.continue_generation()
    t.join(timeout=60)
    for out, r in zip(result[0], ref):
        assert out["output_ids"] == r["output_ids"]
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]], abs=1e-5)


def test_request_larger_than_kv_pool_aborts_with_reason(tiny_llama, make_engine, hf_models):
    """A prompt larger than the KV pool finishes as abort naming max_total_tokens; the others finish normally."""
    engine = make_engine(tiny_llama, max_total_tokens=40)
    ref_ids, _ = hf_generate(hf_models(tiny_llama), PROMPT, 8)
    big, ok = engine.generate(input_ids=[[5] * 60, PROMPT], sampling_params=GREEDY)
    assert big["meta_info"]["finish_reason"]["type"] == "abort"
    assert "max_total_tokens" in big["meta_info"]["finish_reason"]["message"]
    assert ok["output_ids"] == ref_ids
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == ref_ids


@pytest.mark.parametrize("overlap", [True, False])
def test_request_whose_output_outgrows_the_pool_ends_as_length(tiny_llama, make_engine, hf_models, overlap):
    """A prompt that fits the KV pool but whose max_new_tokens would not ends as length when prompt + output fill
    the pool (SGLang clips max_new_tokens so), its tokens HF's, not as an abort an RL client would resubmit;
    a request beside it is untouched and the pool is whole afterwards."""
    engine = make_engine(tiny_llama, max_total_tokens=40, disable_overlap_schedule=not overlap)
    prompt = [5, 9, 13, 17, 21] * 6  # 30 tokens: 10 slots left for its output
    want, _ = hf_generate(hf_models(tiny_llama), prompt, 10)
    long = dict(temperature=0.0, max_new_tokens=25, ignore_eos=True)
    out = engine.generate(input_ids=prompt, sampling_params=long)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}  # the tokens it got room for
    assert out["output_ids"] == want
    ref_ids, _ = hf_generate(hf_models(tiny_llama), PROMPT, 8)
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == ref_ids
    engine.flush_cache()
    assert engine.get_load()["num_tokens"] == 0


def test_stop_token_ids_outside_the_vocabulary_never_match(tiny_llama, make_engine, hf_models):
    """stop_token_ids past the vocabulary (or negative) are taken, as SGLang takes them, and never match: the
    output is HF's greedy run, also with min_new_tokens holding the stop ids back; an in-vocabulary id beside
    them still stops."""
    engine = make_engine(tiny_llama)
    want, _ = hf_generate(hf_models(tiny_llama), PROMPT, 8)
    far = [VOCAB_SIZE, VOCAB_SIZE + 10**6, -3]
    for extra in ({}, {"min_new_tokens": 4}):
        out = engine.generate(input_ids=PROMPT, sampling_params=dict(GREEDY, stop_token_ids=far, **extra))
        assert out["output_ids"] == want and out["meta_info"]["finish_reason"]["type"] == "length"
    out = engine.generate(input_ids=PROMPT, sampling_params=dict(GREEDY, ignore_eos=False,
                                                                 stop_token_ids=far + [want[3]]))
    assert out["output_ids"] == want[: want.index(want[3]) + 1]
