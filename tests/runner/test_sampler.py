"""Sampler against naive references: greedy is argmax, top-k/top-p/min-p never emit a masked token,
reported logprobs are SGLang's log_softmax(logits / T) over the whole vocabulary by default and those
of the renormalised truncated distribution with `processed_rows`, draws follow the target
distribution (chi-square), a request's draw depends only on its own (seed, step), banned tokens
never appear."""

from __future__ import annotations

import math

import pytest
import torch

from runner.sampler import Sampler, SamplingBatchInfo

VOCAB = 50
sampler = Sampler()


def _info(rows: list[dict], vocab: int = VOCAB, **kwargs) -> SamplingBatchInfo:
    """rows: dicts with any of temperature, top_p, top_k, min_p, seed, step."""
    get = lambda key, default: [r.get(key, default) for r in rows]  # noqa: E731
    return SamplingBatchInfo.from_lists(
        temperatures=get("temperature", 1.0), top_ps=get("top_p", 1.0), top_ks=get("top_k", -1),
        min_ps=get("min_p", 0.0), seeds=get("seed", 0), steps=get("step", 0), vocab_size=vocab,
        device="cpu", **kwargs,
    )


def _logits(num_rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def naive_distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                       min_p: float = 0.0) -> torch.Tensor:
    """The distribution one row samples from, computed token by token in float64.

    As SGLang: every filter is judged on the temperature-scaled full distribution and a token must
    pass all of them; top-p keeps the smallest top prefix whose mass reaches top_p; the most likely
    token always stays. Refuses inputs that sit within 1e-4 of a filter boundary (fp32 rounding
    could then legitimately go either way)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = p.argsort(descending=True).tolist()
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass_before, p_max = 0.0, p[order[0]].item()
    for rank, tok in enumerate(order):
        pt = p[tok].item()
        if top_p < 1.0:
            assert abs(mass_before - top_p) > 1e-4, "test logits sit on a top-p boundary"
        if min_p > 0.0:
            assert abs(pt - min_p * p_max) > 1e-4 * p_max, "test logits sit on a min-p boundary"
        kept = (top_k < 0 or rank < top_k) and mass_before < top_p and pt >= min_p * p_max
        keep[tok] = kept or rank == 0
        mass_before += pt
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


FILTERS = [
    pytest.param({"temperature": 0.8, "top_k": 5}, id="top_k"),
    pytest.param({"temperature": 1.0, "top_p": 0.7}, id="top_p"),
    pytest.param({"temperature": 1.2, "min_p": 0.1}, id="min_p"),
    pytest.param({"temperature": 0.9, "top_k": 12, "top_p": 0.8, "min_p": 0.05}, id="combined"),
    pytest.param({"temperature": 0.5}, id="temperature_only"),
]


@pytest.mark.parametrize("params", FILTERS)
def test_filters_never_emit_masked_tokens_and_report_truncated_logprobs(params):
    """Over 4000 draws on 4 logit rows: every token is in the naive keep set, every kept token with
    p >= 1% shows up; each default logprob is log_softmax(logits / T) of the full vocabulary (SGLang),
    each processed one (same draws) the log of the renormalised truncated probability."""
    base = _logits(4, seed=1)
    num_draws = 4000
    logits = base.repeat(num_draws // 4, 1)  # row i uses base[i % 4]
    rows = [dict(params, seed=1000 + i // 7, step=i % 7) for i in range(num_draws)]
    out = sampler(logits, _info(rows))
    info = _info(rows)
    info.processed_rows = torch.ones(num_draws, dtype=torch.bool)
    processed = sampler(logits, info)
    assert torch.equal(processed.next_token_ids, out.next_token_ids)  # the mode changes reports, not draws
    for b in range(4):
        q = naive_distribution(base[b], **params)
        full = torch.log_softmax(base[b].double() / params["temperature"], dim=-1)
        ids = out.next_token_ids[b::4]
        assert q[ids].min() > 0, f"a masked token was sampled for row {b}"
        common = set((q >= 0.01).nonzero().flatten().tolist())
        assert common <= set(ids.tolist()), "a kept token never came up: over-masking"
        torch.testing.assert_close(out.logprobs[b::4].double(), full[ids], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(processed.logprobs[b::4].double(), q[ids].log(), atol=1e-5, rtol=1e-5)


def test_greedy_is_argmax_with_raw_logprob():
    """temperature=0 picks argmax and reports log_softmax(raw logits), alone and in a mixed batch;
    top_k/top_p on a greedy row change nothing."""
    logits = _logits(6, seed=2)
    raw = torch.log_softmax(logits.double(), dim=-1)
    all_greedy = sampler(logits, _info([{"temperature": 0.0, "seed": i} for i in range(6)],
                                       return_raw_logprob=True))
    mixed_rows = [{"temperature": 0.0, "top_k": 2, "top_p": 0.1} if i % 2 == 0 else
                  {"temperature": 1.5, "seed": i} for i in range(6)]
    mixed = sampler(logits, _info(mixed_rows))
    argmax = logits.argmax(-1)
    assert torch.equal(all_greedy.next_token_ids, argmax)
    assert torch.equal(mixed.next_token_ids[::2], argmax[::2])
    want = raw.gather(1, argmax[:, None]).squeeze(1)
    torch.testing.assert_close(all_greedy.logprobs.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(all_greedy.raw_logprobs.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed.logprobs[::2].double(), want[::2], atol=1e-6, rtol=0)


def test_logprobs_skipped_when_nobody_reads_them():
    """need_logprobs=False: greedy and mixed batches pick the same tokens as with logprobs (greedy = argmax)
    and report logprobs None; any top-logprobs request brings them back."""
    logits = _logits(6, seed=3)
    for rows in ([{"temperature": 0.0}] * 6, [{"temperature": 0.0} if i % 2 else {"temperature": 1.2, "seed": i}
                                              for i in range(6)]):
        full = sampler(logits, _info(rows))
        lean_info = _info(rows)
        lean_info.need_logprobs = False
        lean = sampler(logits, lean_info)
        assert lean.logprobs is None
        assert torch.equal(lean.next_token_ids, full.next_token_ids)
        assert torch.equal(lean.next_token_ids[1::2], logits.argmax(-1)[1::2])
    top_info = _info([{"temperature": 0.0}] * 6, top_logprobs_num=2)
    top_info.need_logprobs = False
    want = torch.log_softmax(logits.double(), -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(sampler(logits, top_info).logprobs.double(), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("target", [
    pytest.param({"temperature": 0.9}, id="temperature"),
    pytest.param({"temperature": 1.1, "top_k": 20, "top_p": 0.9}, id="filtered"),
])
def test_draw_depends_only_on_seed_and_step(target):
    """A row's token and logprob are the same alone (bs=1) and at row 2 of a 5-row batch whose other
    rows are greedy / top-k / top-p / min-p with other seeds."""
    others = [{"temperature": 0.0}, {"temperature": 0.7, "top_k": 3, "seed": 5},
              {"temperature": 1.3, "top_p": 0.5, "seed": 6}, {"temperature": 1.0, "min_p": 0.2, "seed": 7}]
    tokens = set()
    for trial in range(40):
        seed, step = 12345 + 977 * trial, trial % 5
        row = dict(target, seed=seed, step=step)
        logits = _logits(5, seed=trial)
        alone = sampler(logits[2:3], _info([row]))
        batch = sampler(logits, _info(others[:2] + [row] + others[2:]))
        assert batch.next_token_ids[2] == alone.next_token_ids[0], f"trial {trial}"
        assert batch.logprobs[2] == alone.logprobs[0]
        tokens.add((trial, alone.next_token_ids[0].item()))
        # The same (seed, step) again is the same token: no hidden RNG state.
        assert sampler(logits[2:3], _info([row])).next_token_ids[0] == alone.next_token_ids[0]
    # Seeds matter: the same logits with 64 different seeds do not all give one token.
    logits = _logits(1, seed=0).repeat(64, 1)
    ids = sampler(logits, _info([dict(target, seed=s) for s in range(64)])).next_token_ids
    assert len(set(ids.tolist())) > 1


def _chi_square_ok(observed: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float]:
    """Goodness of fit at significance 1e-3 (fixed seeds, so the outcome is deterministic)."""
    stat = ((observed - expected) ** 2 / expected).sum().item()
    dof = observed.numel() - 1
    try:
        from scipy.stats import chi2

        return chi2.sf(stat, dof) > 1e-3, stat
    except ImportError:
        # chi-square critical values at alpha = 0.001 for dof 1..12 (standard tables)
        critical = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588,
                    31.264, 32.909]
        return stat < critical[dof - 1], stat


@pytest.mark.parametrize("params", [
    pytest.param({"temperature": 0.7}, id="temperature"),
    pytest.param({"temperature": 1.4, "top_k": 7}, id="top_k"),
    pytest.param({"temperature": 1.0, "top_p": 0.85}, id="top_p"),
])
@pytest.mark.parametrize("vary", ["seed", "step"])
def test_draws_follow_the_target_distribution(params, vary):
    """20k draws of a 10-token distribution pass a chi-square goodness-of-fit test against the
    naive temperature-scaled, truncated, renormalised distribution (varying seed or step)."""
    vocab, n = 10, 20000
    base = torch.tensor([2.0, 1.6, 1.3, 1.0, 0.6, 0.3, 0.0, -0.4, -0.9, -1.5])[torch.randperm(
        vocab, generator=torch.Generator().manual_seed(0))]
    rows = [dict(params, seed=i if vary == "seed" else 99, step=i if vary == "step" else 3) for i in range(n)]
    ids = sampler(base.repeat(n, 1), _info(rows, vocab=vocab)).next_token_ids
    q = naive_distribution(base, **params)
    observed = torch.bincount(ids, minlength=vocab).double()
    assert observed[q == 0].sum() == 0
    kept = q > 0
    expected = q[kept] * n
    assert expected.min() >= 5, "chi-square needs expected counts >= 5"
    ok, stat = _chi_square_ok(observed[kept], expected)
    assert ok, f"chi2={stat:.1f} (dof {int(kept.sum()) - 1}): observed {observed.tolist()} vs {expected.tolist()}"
    if params == {"temperature": 0.7}:  # the test has power: sampling at temperature 1 would fail it
        assert not _chi_square_ok(observed, naive_distribution(base) * n)[0]


@pytest.mark.parametrize("processed", [False, True], ids=["default", "processed"])
def test_top_logprobs_are_the_k_largest_of_the_reported_distribution(processed):
    """top_logprobs/ids are the k largest log-probabilities of the reported distribution: by default
    log_softmax(logits / T) of the whole vocabulary (finite past top_k), with processed_rows the one
    sampled from (truncated, -inf past the kept set); the raw distribution's for greedy rows."""
    logits = _logits(3, seed=3)
    rows = [{"temperature": 0.8, "top_k": 3, "seed": 1}, {"temperature": 1.1, "top_p": 0.35, "seed": 2},
            {"temperature": 0.0}]
    k = 5
    info = _info(rows, top_logprobs_num=k)
    if processed:
        info.processed_rows = torch.ones(3, dtype=torch.bool)
    out = sampler(logits, info)
    for b, row in enumerate(rows):
        if row["temperature"] == 0:
            logq = torch.log_softmax(logits[b].double(), dim=-1)
        elif processed:
            logq = naive_distribution(logits[b], **{key: v for key, v in row.items() if key != "seed"}).log()
        else:
            logq = torch.log_softmax(logits[b].double() / row["temperature"], dim=-1)
        want_vals, want_ids = logq.topk(k)
        finite = want_vals.isfinite()
        assert (finite.sum() < k) == (processed and row["temperature"] != 0)  # truncation shows as -inf
        assert torch.equal(out.top_logprob_ids[b][finite], want_ids[finite])
        torch.testing.assert_close(out.top_logprobs[b].double(), want_vals, atol=1e-5, rtol=1e-5)


def test_banned_tokens_are_never_sampled():
    """Tokens set in banned_mask never come out, greedy or sampled, even when they are the most
    likely; greedy then takes the best allowed token."""
    n = 2000
    base = _logits(1, seed=4)[0]
    banned_ids = base.topk(3).indices.tolist() + [0, 7]
    rows = [{"temperature": 0.0}] + [{"temperature": 1.5, "seed": i, "step": i % 3} for i in range(1, n)]
    info = _info(rows)
    info.banned_mask = torch.zeros(n, VOCAB, dtype=torch.bool)
    info.banned_mask[:, banned_ids] = True
    out = sampler(base.repeat(n, 1), info)
    assert not set(out.next_token_ids.tolist()) & set(banned_ids)
    allowed = base.clone()
    allowed[banned_ids] = -math.inf
    assert out.next_token_ids[0] == allowed.argmax()
    # Without the mask the banned top tokens are drawn often: the mask is what keeps them out.
    unmasked = sampler(base.repeat(n, 1), _info(rows)).next_token_ids
    assert set(unmasked.tolist()) & set(banned_ids)


@pytest.mark.parametrize("vocab", [50, 128, 300, 4096])
def test_inverse_cdf_matches_the_naive_running_sum(vocab):
    """The two-level draw returns the float64 running-sum inverse-CDF token (ties to rounding aside),
    never a zero-probability token, and a row's token is the same alone as inside a batch."""
    from runner.sampler import inverse_cdf

    gen = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(64, vocab, generator=gen) * 3, dim=-1)
    probs[:, ::7] = 0.0  # zero-probability tokens scattered through every chunk
    u = torch.rand(64, generator=gen)
    ids = inverse_cdf(probs, u)
    cdf = probs.double().cumsum(dim=-1)
    target = u.double() * cdf[:, -1]
    naive = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    for row in range(64):
        if ids[row] != naive[row]:  # allowed only when the target sits on a boundary to fp32 rounding
            edge = cdf[row, min(int(ids[row]), int(naive[row]))]
            assert abs(edge - target[row]) < 1e-5, (row, int(ids[row]), int(naive[row]))
        assert probs[row, ids[row]] > 0
        assert inverse_cdf(probs[row:row + 1].contiguous(), u[row:row + 1]).item() == ids[row].item()


@pytest.mark.parametrize("vocab", [1, 50, 128, 300, 1000])
def test_plain_cpu_op_is_bitwise_the_python_path(cpu_direct, vocab):
    """runner/csrc/sampler.cpp on plain batches (no processors, no truncation): the same ids and logprobs,
    bit for bit, as the Python path, for greedy, sampled and mixed rows, any temperature, with and without
    logprobs, -inf and NaN logits, and a seed mix the batch info already holds."""
    fast = Sampler()
    fast.cpu_ops = cpu_direct
    g = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        bs = int(torch.randint(1, 17, (1,), generator=g))
        logits = _logits(bs, vocab, seed=trial, scale=float(torch.rand(1, generator=g)) * 20)
        if trial % 5 == 0:
            logits[:, ::3] = float("-inf")
        if trial % 7 == 0:
            logits[0, -1] = float("nan")
        kind = trial % 4  # all sampled at T=1, all greedy, mixed with temperatures, sampled with temperatures
        temps = [[1.0] * bs, [0.0] * bs, [0.0 if i % 2 else 0.7 for i in range(bs)],
                 [0.3 + i / bs for i in range(bs)]][kind]
        rows = [{"temperature": t, "seed": trial * 100 + i, "step": i + trial} for i, t in enumerate(temps)]
        a, b = _info(rows, vocab), _info(rows, vocab)
        a.need_logprobs = b.need_logprobs = trial % 3 != 0
        if trial % 6 == 1:
            b.seed_mix = a.seed_mix = torch.tensor([r["seed"] * 7 for r in rows], dtype=torch.int64)
        got, ref = fast(logits, a), sampler(logits, b)
        assert torch.equal(got.next_token_ids, ref.next_token_ids), trial
        if ref.logprobs is None:
            assert got.logprobs is None
        else:
            assert torch.equal(got.logprobs.nan_to_num(7.0), ref.logprobs.nan_to_num(7.0)), trial
            assert torch.equal(got.logprobs.isnan(), ref.logprobs.isnan())


def test_plain_cpu_op_in_row_blocks_is_bitwise_the_whole_batch_python_path(cpu_direct):
    """A batch whose fp32 temporaries exceed the op's block budget (40 rows x 151,936, Qwen2.5's vocabulary:
    sampled in blocks of 13 rows) gives bit for bit the Python path's ids and logprobs over the whole batch,
    for every kind of row mix, with a seed mix, from fp32 logits and from bf16 ones (widened a block at a time);
    a seed mix of the wrong size is refused, naming it."""
    fast = Sampler()
    fast.cpu_ops = cpu_direct
    bs, vocab = 40, 151936
    for kind in range(4):
        logits = _logits(bs, vocab, seed=kind, scale=8.0)
        if kind == 1:
            logits[:, ::5] = float("-inf")
        temps = [[1.0] * bs, [0.0] * bs, [0.0 if i % 3 else 0.8 for i in range(bs)],
                 [0.3 + i / bs for i in range(bs)]][kind]
        rows = [{"temperature": t, "seed": 1000 * kind + i, "step": 3 * i} for i, t in enumerate(temps)]
        a, b = _info(rows, vocab), _info(rows, vocab)
        a.need_logprobs = b.need_logprobs = True
        if kind == 3:
            b.seed_mix = a.seed_mix = torch.tensor([r["seed"] * 11 for r in rows], dtype=torch.int64)
        got, ref = fast(logits, a), sampler(logits, b)
        assert torch.equal(got.next_token_ids, ref.next_token_ids), kind
        assert torch.equal(got.logprobs, ref.logprobs), kind
        # bf16 logits (what the one-call decode step hands over): widened block by block, exactly as a whole
        half = logits.to(torch.bfloat16)
        c = _info(rows, vocab)
        c.need_logprobs = True
        c.seed_mix = a.seed_mix
        ids_h, lps_h = cpu_direct.sample_plain(half, c.temperatures, c.seeds, c.seed_mix, c.steps, c.is_all_greedy,
                                               c.has_greedy, c.need_temperature, True)
        d = _info(rows, vocab)
        d.need_logprobs = True
        d.seed_mix = a.seed_mix
        ref_h = sampler(half.float(), d)
        assert torch.equal(ids_h, ref_h.next_token_ids) and torch.equal(lps_h, ref_h.logprobs), kind
    info = _info(rows, vocab)
    with pytest.raises(RuntimeError, match="seed_mix"):
        cpu_direct.sample_plain(logits, info.temperatures, info.seeds, torch.zeros(bs + 1, dtype=torch.int64),
                                info.steps, False, False, True, True)


@pytest.mark.parametrize("extra", ["top_k", "logit_bias", "top_logprobs", "raw", "fp64_temperatures"])
def test_batches_beyond_the_plain_path_keep_the_python_sampler(cpu_direct, monkeypatch, extra):
    """Truncation, a logit processor, top logprobs, raw logprobs or per-row tensors of another dtype than the
    op takes: the op is not called, and the result is the Python path's."""
    fast = Sampler()
    fast.cpu_ops = cpu_direct
    rows = [{"temperature": 1.0, "seed": 3, "top_k": 5 if extra == "top_k" else -1}]
    info = _info(rows, top_logprobs_num=2 if extra == "top_logprobs" else 0, return_raw_logprob=extra == "raw")
    if extra == "logit_bias":
        info.logit_bias = torch.zeros(1, VOCAB)
    if extra == "fp64_temperatures":
        info.temperatures = info.temperatures.double()
    calls = []
    monkeypatch.setattr(fast, "cpu_ops", type("Ops", (), {"sample_plain": lambda *a: calls.append(a)})())
    got = fast(_logits(1), info)
    assert calls == []
    assert torch.equal(got.next_token_ids, sampler(_logits(1), info).next_token_ids)


TOP_DRAW_SEED = 14790804  # splitmix64(splitmix64(seed) ^ 0) has its top 24 bits all set: the largest uniform


@pytest.mark.parametrize("path", ["python", "plain_op"])
def test_the_largest_uniform_draws_by_probability_not_the_last_id(path, request):
    """The (seed, step) whose uniform is the largest, 1 - 2^-25 (1.0 once rounded to float32), draws the token the
    float64 inverse CDF gives at the largest float32 under 1, never the last vocabulary id for being last (here
    it has probability ~1e-18: it used to be taken once in 2^24 draws)."""
    from runner.sampler import seeded_uniform

    u = seeded_uniform(torch.tensor([TOP_DRAW_SEED]), torch.tensor([0]))
    assert u.item() == 1 - 2**-25 and u.float().item() == 1.0  # the case itself
    vocab = 64
    logits = _logits(1, vocab, seed=5)
    logits[0, -1] = -40.0
    p = torch.softmax(logits[0].double(), dim=-1)
    cdf = p.cumsum(dim=-1)
    want = int(torch.searchsorted(cdf, torch.tensor([(1 - 2**-24) * cdf[-1].item()], dtype=torch.float64),
                                  right=True))
    assert want != vocab - 1
    fast = Sampler()
    if path == "plain_op":
        fast.cpu_ops = request.getfixturevalue("cpu_direct")
    info = _info([{"temperature": 1.0, "seed": TOP_DRAW_SEED, "step": 0}], vocab)
    info.need_logprobs = True
    out = fast(logits, info)
    assert out.next_token_ids.tolist() == [want]
    # Every other draw is unchanged: the clamp touches only values that round to 1.0.
    from runner.sampler import below_one
    draws = seeded_uniform(torch.arange(1000), torch.arange(1000)).float()
    assert torch.equal(below_one(draws.clone()), draws)
