"""SGLang's sampling and logprob semantics on the Engine, each against an independent reference.

Penalties against HF's RepetitionPenaltyLogitsProcessor (HF generate on the same checkpoint) and a
hand-written OpenAI frequency/presence reference on HF's logits; logit_bias; stop_regex; prompt logprobs
(logprob_start_len, top logprobs, token_ids_logprob) against HF's log_softmax over one full-prompt
forward, with chunked prefill and with a prefix-cache hit; max_new_tokens=0 and None; the original vs
the tempered logprob distribution; update_weight_version and get_weights_checksum.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig

from tests.rollout.oracle import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def env(tiny_llama, module_engines, hf_models):
    return module_engines(tiny_llama), hf_models(tiny_llama)


@torch.no_grad()
def hf_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), vocab] log_softmax(logits / temperature) of one full forward: row p predicts ids[p + 1]."""
    logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits / temperature, dim=-1)


@torch.no_grad()
def hf_greedy_with(model, prompt: list[int], max_new_tokens: int, **processors) -> list[int]:
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=2, **processors)
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_matches_hf_generate(env):
    """Greedy generation with repetition_penalty equals HF generate with RepetitionPenaltyLogitsProcessor, and
    the penalty changes the tokens (so the comparison can fail)."""
    engine, hf = env
    for prompt in random_prompts([7, 12], seed=3):
        for penalty in (1.3, 0.7):
            got = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=16,
                                                                         repetition_penalty=penalty))
            assert got["output_ids"] == hf_greedy_with(hf, prompt, 16, repetition_penalty=penalty)
        plain = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=16))["output_ids"]
        assert plain != hf_greedy_with(hf, prompt, 16, repetition_penalty=1.3) or plain != hf_greedy_with(
            hf, prompt, 16, repetition_penalty=0.7)


def _reference_freq_presence(hf, prompt, num, freq, pres):
    """Hand-written OpenAI definition on HF's logits: logit -= freq * count + pres * (count > 0), over output."""
    out: list[int] = []
    for _ in range(num):
        logits = hf_logprobs(hf, prompt + out)[-1]  # log_softmax shifts a row uniformly: same argmax
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).double()
        out.append(int((logits - freq * counts - pres * (counts > 0).double()).argmax()))
    return out


@pytest.mark.parametrize("freq,pres", [(2.0, 0.0), (0.0, 2.0), (0.5, -1.5)])
def test_frequency_presence_penalties_match_reference(env, freq, pres):
    """Greedy tokens with frequency/presence penalties equal the OpenAI-definition reference on HF's logits (and
    differ from unpenalised greedy), in a batch mixed with an unpenalised row (which keeps its plain tokens)."""
    engine, hf = env
    prompts = random_prompts([6, 9], seed=2)  # its greedy output repeats a token, so the penalties bite
    sps = [dict(GREEDY, max_new_tokens=12, frequency_penalty=freq, presence_penalty=pres),
           dict(GREEDY, max_new_tokens=12)]
    got = engine.generate(input_ids=prompts, sampling_params=sps)
    assert got[0]["output_ids"] == _reference_freq_presence(hf, prompts[0], 12, freq, pres)
    assert got[1]["output_ids"] == _reference_freq_presence(hf, prompts[1], 12, 0.0, 0.0)
    assert got[0]["output_ids"] != _reference_freq_presence(hf, prompts[0], 12, 0.0, 0.0)  # the penalty matters


def test_logit_bias_forces_and_bans_tokens(env):
    """A large logit_bias (JSON string keys accepted) forces its token at every step, sampled or greedy; a -inf
    bias never lets the greedy token out."""
    engine, _ = env
    prompt = random_prompts([5], seed=8)[0]
    forced = engine.generate(input_ids=prompt, sampling_params=dict(temperature=1.0, seed=1, max_new_tokens=6,
                                                                    ignore_eos=True, logit_bias={"77": 100.0}))
    assert forced["output_ids"] == [77] * 6
    plain = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=6))["output_ids"]
    banned = engine.generate(input_ids=prompt, sampling_params=dict(
        GREEDY, max_new_tokens=6, logit_bias={plain[0]: float("-inf")}))["output_ids"]
    assert banned[0] != plain[0] and plain[0] not in banned


def test_stop_regex_stops_and_trims(env):
    """stop_regex stops at the first output whose text matches; the finish reason names the pattern and the text
    is cut where it matches (no_stop_trim keeps it)."""
    engine, _ = env
    prompt = "Once upon a time"
    free = engine.generate(prompt, dict(GREEDY, max_new_tokens=24))
    text = free["text"]
    target = text[3:5]  # two characters the model generates after a few tokens
    pattern = "".join(f"[{c}]" if c.isalnum() else "\\" + c for c in target)
    out = engine.generate(prompt, dict(GREEDY, max_new_tokens=24, stop_regex=pattern))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert len(out["output_ids"]) < 24 and out["text"] == text[: text.find(target)]
    kept = engine.generate(prompt, dict(GREEDY, max_new_tokens=24, stop_regex=[pattern], no_stop_trim=True))
    assert target in kept["text"]
    with pytest.raises(ValueError, match="stop_regex"):
        engine.generate(prompt, dict(max_new_tokens=2, stop_regex="(unclosed"))


def test_bad_new_params_are_refused_naming_them(env):
    """Out-of-range penalties, bad logit_bias keys or ids, unknown keys: ValueError naming the field."""
    engine, _ = env
    for sp, needle in [(dict(repetition_penalty=0), "repetition_penalty"),
                       (dict(repetition_penalty=2.5), r"repetition_penalty must be in \[1e-06, 2\]"),  # SGLang's top
                       (dict(repetition_penalty=1e-40), "repetition_penalty"),  # overflows a float32 logit
                       (dict(temperature=1e39), "temperature"), (dict(temperature=2e6), "temperature"),
                       (dict(frequency_penalty=3), "frequency"),
                       (dict(presence_penalty=float("nan")), "presence_penalty"),
                       (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias={99999: 1.0}), "logit_bias"),
                       (dict(logit_bias={5: float("inf")}), "logit_bias"), (dict(penalty=1.0), "penalty")]:
        with pytest.raises(ValueError, match=needle):
            engine.generate(input_ids=[5, 6], sampling_params=sp)
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(input_ids=[5, 6], return_logprob=True, logprob_start_len=2)
    with pytest.raises(ValueError, match="token_ids_logprob"):
        engine.generate(input_ids=[5, 6], return_logprob=True, token_ids_logprob=[99999])


def test_logprob_start_len_out_of_range_without_return_logprob_is_ignored(env):
    """Without return_logprob, SGLang ignores logprob_start_len: an out-of-range one is not an error, and the
    output equals leaving it out; a prompt of a batch that asks for logprobs still has its range checked."""
    engine, _ = env
    sp = dict(GREEDY, max_new_tokens=4)
    want = engine.generate(input_ids=[5, 6, 7], sampling_params=sp)
    got = engine.generate(input_ids=[5, 6, 7], sampling_params=sp, logprob_start_len=50)
    assert got["output_ids"] == want["output_ids"] and "input_token_logprobs" not in got["meta_info"]
    with pytest.raises(ValueError, match="logprob_start_len must be .* for prompt 1 of 2 tokens, got 5"):
        engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=sp, return_logprob=[False, True],
                        logprob_start_len=5)
    with pytest.raises(ValueError, match="logprob_start_len"):  # the type is checked either way
        engine.generate(input_ids=[5, 6, 7], sampling_params=sp, logprob_start_len="1")


def test_empty_token_ids_logprob_asks_for_nothing(env):
    """token_ids_logprob=[] (for every prompt, or one prompt's entry) is SGLang's None: no *_token_ids_logprobs
    keys, and the same output and logprobs as leaving it out (which had given empty lists under those keys)."""
    engine, _ = env
    kw = dict(input_ids=[5, 6, 7], sampling_params=dict(GREEDY, max_new_tokens=3), return_logprob=True)
    plain = engine.generate(**kw)
    for ids in ([], [[]]):
        got = engine.generate(**kw, token_ids_logprob=ids)
        assert not {"input_token_ids_logprobs", "output_token_ids_logprobs"} & set(got["meta_info"]), got["meta_info"]
        assert got["output_ids"] == plain["output_ids"]
        # within float rounding: the prompt's prefix is a cache hit now, which takes another kernel path
        assert [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [lp for lp, _, _ in plain["meta_info"]["output_token_logprobs"]], abs=1e-5)


def test_extreme_temperature_and_penalty_within_bounds_keep_logprobs_finite(env):
    """At the bounds the refusals above draw (the largest temperature, the smallest repetition penalty accepted),
    with a banned token (a bias under -1e6 is a ban: -inf), every logprob is finite and the banned token never
    comes out, over many seeds (a float32-inf temperature had made the ban NaN and sampling fall back to
    greedy). At temperature 1e6 the draw is near uniform: several distinct tokens come out."""
    engine, _ = env
    for extra in (dict(temperature=1e6), dict(temperature=0.7, repetition_penalty=1e-6)):
        seen = set()
        for seed in range(12):
            out = engine.generate(input_ids=[5, 6, 7, 5, 6], return_logprob=True, sampling_params=dict(
                max_new_tokens=4, ignore_eos=True, seed=seed, logit_bias={"9": -2e6}, **extra))
            lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert len(lps) == 4 and all(math.isfinite(lp) for lp in lps), (extra, lps)
            assert 9 not in out["output_ids"]
            seen.update(out["output_ids"])
        if extra["temperature"] == 1e6:
            assert len(seen) > 20, seen


def test_max_new_tokens_none_runs_to_the_context(tiny_llama, make_engine):
    """max_new_tokens=None generates until the context is full: finish_reason length, with SGLang's "length" the
    tokens generated (its max_new_tokens clipped to the room), not the context length."""
    engine = make_engine(tiny_llama, context_length=40)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=dict(GREEDY, max_new_tokens=None))
    assert len(out["output_ids"]) == 37
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 37}
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=dict(GREEDY, max_new_tokens=100))
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 37}


def _check_prompt_logprobs(meta, prompt, start, ref, top_k=0, ids=None):
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == prompt[start:]
    assert entries[0][0] is None
    for p in range(start + 1, len(prompt)):
        assert math.isclose(entries[p - start][0], ref[p - 1, prompt[p]].item(), abs_tol=2e-5)
    if top_k:
        tops = meta["input_top_logprobs"]
        assert tops[0] is None and len(tops) == len(prompt) - start
        for p in range(start + 1, len(prompt)):
            want_v, want_i = ref[p - 1].topk(top_k)
            assert [t for _, t, _ in tops[p - start]] == want_i.tolist()
            torch.testing.assert_close(torch.tensor([v for v, _, _ in tops[p - start]], dtype=torch.float64), want_v,
                                       atol=2e-5, rtol=0)
    if ids is not None:
        got = meta["input_token_ids_logprobs"]
        assert got[0] is None
        for p in range(start + 1, len(prompt)):
            assert [t for _, t, _ in got[p - start]] == ids
            torch.testing.assert_close(torch.tensor([v for v, _, _ in got[p - start]], dtype=torch.float64),
                                       ref[p - 1, ids], atol=2e-5, rtol=0)


@pytest.mark.parametrize("start", [0, 9])
def test_prompt_logprobs_match_hf_full_forward(env, start):
    """input_token_logprobs / input_top_logprobs / input_token_ids_logprobs from logprob_start_len equal HF's
    log_softmax over the full prompt forward; max_new_tokens=0 returns them and no tokens."""
    engine, hf = env
    prompt = random_prompts([23], seed=11)[0]
    ids = [3, 50, 200]
    out = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=0), return_logprob=True,
                          logprob_start_len=start, top_logprobs_num=3, token_ids_logprob=ids)
    assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    _check_prompt_logprobs(out["meta_info"], prompt, start, hf_logprobs(hf, prompt), top_k=3, ids=ids)


def test_default_logprob_start_is_the_last_prompt_token(env):
    """Without logprob_start_len, input_token_logprobs is SGLang's one entry: the last prompt token, logprob None."""
    engine, _ = env
    prompt = random_prompts([6], seed=2)[0]
    out = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=2), return_logprob=True)
    assert [(lp, t) for lp, t, _ in out["meta_info"]["input_token_logprobs"]] == [(None, prompt[-1])]


def test_prompt_logprobs_with_chunked_prefill_and_prefix_cache_hit(tiny_llama, make_engine, hf_models):
    """With chunks of 8 tokens and after the prompt's prefix is cached by another request, prompt logprobs still
    equal HF's (the positions they need are recomputed, not taken from the cache), and output logprobs too."""
    engine = make_engine(tiny_llama, chunked_prefill_size=8)
    hf = hf_models(tiny_llama)
    prompt = random_prompts([30], seed=4)[0]
    engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=1))  # caches the prefix
    out = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=4), return_logprob=True,
                          logprob_start_len=2, token_ids_logprob=[7])
    assert out["meta_info"]["cached_tokens"] == 2  # the cache served what the logprobs did not need
    full = prompt + out["output_ids"]
    ref = hf_logprobs(hf, full)
    _check_prompt_logprobs(out["meta_info"], prompt, 2, ref, ids=[7])
    for k, (lp, t, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert math.isclose(lp, ref[len(prompt) - 1 + k, t].item(), abs_tol=2e-5)
    steps = out["meta_info"]["output_token_ids_logprobs"]
    assert [[t for _, t, _ in s] for s in steps] == [[7]] * 4
    for k, step in enumerate(steps):
        assert math.isclose(step[0][0], ref[len(prompt) - 1 + k, 7].item(), abs_tol=2e-5)
    # A request without prompt logprobs takes the whole cached prefix.
    again = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=1))
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1


@pytest.mark.parametrize("mode", ["default", "processed_logprobs", "original"])
def test_original_vs_tempered_logprobs(env, tiny_llama, module_engines, mode):
    """At temperature 0.7 (top_k 5), output logprobs are log_softmax(logits/0.7) over the whole vocabulary by
    default (SGLang), renormalised over the top 5 with logprobs_mode="processed_logprobs", or with
    return_original_logprob the log_softmax of the raw logits; prompt logprobs are tempered (no truncation)
    or raw likewise."""
    engine, hf = env
    if mode == "processed_logprobs":
        engine = module_engines(tiny_llama, logprobs_mode="processed_logprobs")
    prompt = random_prompts([9], seed=6)[0]
    out = engine.generate(input_ids=prompt, sampling_params=dict(temperature=0.7, top_k=5, seed=3, max_new_tokens=5,
                                                                 ignore_eos=True),
                          return_logprob=True, logprob_start_len=0, return_original_logprob=mode == "original")
    full = prompt + out["output_ids"]
    raw = hf_logprobs(hf, full)
    tempered = hf_logprobs(hf, full, 0.7)
    for k, (lp, t, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        row = len(prompt) - 1 + k
        if mode == "original":
            want = raw[row, t]
        elif mode == "processed_logprobs":
            kept = tempered[row].topk(5).values
            want = tempered[row, t] - torch.logsumexp(kept, dim=0)
        else:
            want = tempered[row, t]
        assert math.isclose(lp, want.item(), abs_tol=2e-5)
    _check_prompt_logprobs(out["meta_info"], prompt, 0, raw if mode == "original" else tempered)


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.5), dict(top_k=8, top_p=0.7, min_p=0.05)],
                         ids=["top_k", "top_p", "combined"])
def test_default_logprobs_are_sglangs_full_vocab_tempered(env, filters):
    """With top_k/top_p set, the sampled token's logprob and every returned top-logprob rank (past top_k too)
    equal log_softmax(logits / T) of an HF forward within 1e-5, so ranks past the truncation are finite."""
    engine, hf = env
    temperature, k = 0.8, 10
    prompts = random_prompts([7, 11], seed=12)
    outs = engine.generate(input_ids=prompts, sampling_params=dict(temperature=temperature, seed=5, max_new_tokens=6,
                                                                   ignore_eos=True, **filters),
                           return_logprob=True, top_logprobs_num=k)
    for prompt, out in zip(prompts, outs):
        ref = hf_logprobs(hf, prompt + out["output_ids"], temperature)
        meta = out["meta_info"]
        for step, ((lp, t, _), tops) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
            row = ref[len(prompt) - 1 + step]
            assert abs(lp - row[t].item()) <= 1e-5
            want_v, want_i = row.topk(k)
            assert [i for _, i, _ in tops] == want_i.tolist()
            got_v = torch.tensor([v for v, _, _ in tops], dtype=torch.float64)
            assert got_v.isfinite().all() and (got_v - want_v).abs().max() <= 1e-5


@pytest.mark.parametrize("mode", ["default", "original", "raw_logprobs"])
def test_which_logits_each_logprob_mode_reports(env, tiny_llama, module_engines, mode):
    """With a repetition penalty, a logit bias and a min_new_tokens ban at temperature 0.7, the sampled token's
    logprob is (recomputed by hand on HF's logits): by default log_softmax(processed / 0.7); with
    return_original_logprob SGLang's log_softmax(processed), the penalties, bias and ban applied and the
    temperature not; with logprobs_mode="raw_logprobs" (vLLM's) log_softmax(raw logits). The tokens are the same."""
    engine, hf = env
    if mode == "raw_logprobs":
        engine = module_engines(tiny_llama, logprobs_mode="raw_logprobs")
    prompt = random_prompts([8], seed=9)[0]
    eos, bias = 1, {5: 3.0, 9: -2.0}
    sp = dict(temperature=0.7, seed=4, max_new_tokens=4, min_new_tokens=2, repetition_penalty=1.5, logit_bias=bias)
    out = engine.generate(input_ids=prompt, sampling_params=sp, return_logprob=True,
                          return_original_logprob=mode == "original")
    ref = env[0].generate(input_ids=prompt, sampling_params=sp)
    assert out["output_ids"] == ref["output_ids"]
    for k, t in enumerate(out["output_ids"]):
        seq = prompt + out["output_ids"][:k]
        logits = hf(torch.tensor([seq])).logits[0, -1].double().detach()
        seen = torch.tensor(sorted(set(seq)))
        pen = logits.clone()
        pen[seen] = torch.where(logits[seen] < 0, logits[seen] * 1.5, logits[seen] / 1.5)
        for tok, b in bias.items():
            pen[tok] += b
        if k < 2:
            pen[eos] = -math.inf
        want = {"default": torch.log_softmax(pen / 0.7, 0), "original": torch.log_softmax(pen, 0),
                "raw_logprobs": torch.log_softmax(logits, 0)}[mode]
        assert math.isclose(out["meta_info"]["output_token_logprobs"][k][0], want[t].item(), abs_tol=2e-5), (mode, k)


def test_update_weight_version_and_checksum(tiny_llama, make_engine):
    """update_weight_version changes the reported version, aborting in-flight requests unless told not to
    (SGLang's default); get_weights_checksum is equal for equal weights and changes when one weight changes."""
    engine = make_engine(tiny_llama)
    a = engine.get_weights_checksum()
    assert a == engine.get_weights_checksum() | {"weight_version": a["weight_version"]}
    engine.update_weight_version("v7")
    assert engine.weight_version == "v7"
    assert engine.generate(input_ids=[5, 6], sampling_params=dict(max_new_tokens=1))["meta_info"][
        "weight_version"] == "v7"
    assert engine.get_weights_checksum()["checksum"] == a["checksum"]
    name = "model.layers.0.mlp.down_proj.weight"
    w = engine.get_weights_by_name(name, truncate_size=10**9)
    ok, msg = engine.update_weights_from_tensor([(name, torch.as_tensor(w) + 1e-3)])
    assert ok, msg
    assert engine.get_weights_checksum()["checksum"] != a["checksum"]
    stream = engine.generate(input_ids=[5, 6], sampling_params=dict(max_new_tokens=None, ignore_eos=True),
                             stream=True)
    next(stream)
    engine.update_weight_version("v8")  # abort_all_requests=True by default
    chunks = list(stream)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.weight_version == "v8"
    stream = engine.generate(input_ids=[5, 6], sampling_params=dict(max_new_tokens=6, ignore_eos=True), stream=True)
    next(stream)
    engine.update_weight_version("v9", abort_all_requests=False)
    last = list(stream)[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "length" and engine.weight_version == "v9"


def test_checksum_of_freed_weights_is_refused_by_name(tiny_llama, make_engine):
    """get_weights_checksum never reads freed storages: released weights and a shut-down engine raise the same
    WeightUpdateError get_weights_by_name does (it used to crash the process), and after resume the checksum is
    the one taken before the release."""
    from runner.weights.loader import WeightUpdateError

    engine = make_engine(tiny_llama, enable_memory_saver=True, enable_weights_cpu_backup=True)
    before = engine.get_weights_checksum()["checksum"]
    engine.release_memory_occupation(["weights"])
    with pytest.raises(WeightUpdateError, match="weights are released"):
        engine.get_weights_checksum()
    engine.resume_memory_occupation(["weights"])
    assert engine.get_weights_checksum()["checksum"] == before
    engine.shutdown()
    with pytest.raises(WeightUpdateError, match="shut down"):
        engine.get_weights_checksum()


def test_batch_without_penalties_builds_no_processor_tensors():
    """A batch where no request uses penalties, logit_bias, original logprobs or token_ids builds none of their
    [bs, vocab] tensors (the sampler skips them); one penalised request builds them for the batch."""
    from rollout.batch import sampling_info
    from rollout.request import Req
    from rollout.sampling_params import SamplingParams

    plain = [Req(str(i), [5, 6, 7], SamplingParams.from_dict({}), seed=i, return_logprob=True) for i in range(3)]
    info = sampling_info(plain, 384, [1], "cpu")
    assert all(getattr(info, f) is None for f in ("seen_mask", "output_counts", "logit_bias", "original_rows",
                                                   "token_ids"))
    pen = Req("p", [5, 6, 5], SamplingParams.from_dict({"frequency_penalty": 1.0, "repetition_penalty": 1.2}), seed=0)
    pen.output_ids = [9, 9, 4]
    info = sampling_info(plain + [pen], 384, [1], "cpu")
    assert info.output_counts[3, 9] == 2 and info.output_counts[3, 4] == 1 and info.output_counts[:3].sum() == 0
    assert info.seen_mask[3].nonzero().flatten().tolist() == [4, 5, 6, 9] and not info.seen_mask[:3].any()


def test_logprobs_of_one_request_in_a_batch_that_mostly_skips_them(env):
    """In one greedy batch, the request asking for logprobs gets HF's log_softmax at its tokens, while the
    requests that did not ask get none; every row's tokens equal HF greedy, also after the logprob request
    finished and the batch runs on without logprobs (the sampler then skips them)."""
    engine, hf = env
    prompts = random_prompts([9, 6, 11], seed=21)
    outs = engine.generate(input_ids=prompts, return_logprob=[False, True, False],
                           sampling_params=[dict(GREEDY, max_new_tokens=n) for n in (14, 5, 14)])
    for prompt, out, n in zip(prompts, outs, (14, 5, 14)):
        assert out["output_ids"] == hf_greedy_with(hf, prompt, n)
    assert "output_token_logprobs" not in outs[0]["meta_info"]
    assert "output_token_logprobs" not in outs[2]["meta_info"]
    ref = hf_logprobs(hf, prompts[1] + outs[1]["output_ids"])
    lps = outs[1]["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == outs[1]["output_ids"]
    for k, (lp, t, _) in enumerate(lps):
        assert math.isclose(lp, ref[len(prompts[1]) - 1 + k, t].item(), abs_tol=2e-5)
