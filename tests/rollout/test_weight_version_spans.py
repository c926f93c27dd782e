"""meta_info["weight_versions"] (SGLang's spans): which weight version sampled which output tokens.

Oracles: the step count at which the test itself changes the version (at_step runs the change between
two known steps, so the split position is known in advance), and the request's own completion_tokens.
"""

from __future__ import annotations

from tests.rl_surface.conftest import at_step

PROMPT = [5, 6, 7, 8, 9]
SP = dict(temperature=0, max_new_tokens=10, ignore_eos=True)


def _spans(out) -> list[tuple[int, int, str]]:
    return [(s["start"], s["end"], s["version"]) for s in out["meta_info"]["weight_versions"]]


def test_one_span_without_an_update(make_engine, tiny_llama):
    """A request no update touches reports one span over all its tokens, in the served version."""
    engine = make_engine(tiny_llama, weight_version="base-v0")
    out = engine.generate(input_ids=PROMPT, sampling_params=SP)
    assert _spans(out) == [(0, 10, "base-v0")] and out["meta_info"]["weight_version"] == "base-v0"


def test_a_version_change_mid_request_splits_at_the_known_token(make_engine, tiny_llama):
    """update_weight_version after the 3rd step (prefill + 2 decodes: 3 tokens) splits the spans at 3;
    the runs are contiguous, cover completion_tokens, and the last one is meta_info's weight_version."""
    engine = make_engine(tiny_llama, weight_version="a")
    state = at_step(engine, 3, lambda: engine.update_weight_version("b", abort_all_requests=False))
    out = engine.generate(input_ids=PROMPT, sampling_params=SP)
    assert state["done"].is_set() and "error" not in state
    assert _spans(out) == [(0, 3, "a"), (3, 10, "b")]
    assert out["meta_info"]["weight_version"] == "b" and out["meta_info"]["completion_tokens"] == 10


def _update_in_place(engine, path, version):
    """What an RL loop does between two steps of a rollout: pause in place, load weights, continue."""
    engine.pause_generation(mode="in_place")
    ok, msg, _ = engine.update_weights_from_disk(str(path), weight_version=version)
    engine.continue_generation()
    assert ok, msg


def test_two_weight_updates_give_three_spans_and_streams_carry_them(make_engine, ckpt_factory):
    """Two real updates (pause in place, update_weights_from_disk with a weight_version, continue) during
    one streamed request give three spans split where they landed; every stream chunk's spans cover
    exactly the tokens it has, contiguous, one run per version."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    engine = make_engine(a, weight_version="v0")
    second = {}

    def first():
        _update_in_place(engine, b, "v1")
        second.update(at_step(engine, 3, lambda: _update_in_place(engine, a, "v2")))

    state = at_step(engine, 2, first)
    chunks = list(engine.generate(input_ids=PROMPT, sampling_params=SP, stream=True))
    assert state["done"].is_set() and "error" not in state and "error" not in second
    for c in chunks:
        spans = _spans(c)
        assert spans[0][0] == 0 and spans[-1][1] == len(c["output_ids"])
        assert all(p[1] == q[0] and p[2] != q[2] for p, q in zip(spans, spans[1:]))
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    # Each update lands after a known step count (2 steps, then 3 more: each step, the recompute of the
    # retracted request included, samples one token).
    assert _spans(final) == [(0, 2, "v0"), (2, 5, "v1"), (5, 10, "v2")]


def _prefill(out) -> list[tuple[int, int, str]]:
    return [(s["start"], s["end"], s["version"]) for s in out["meta_info"]["prefill_weight_versions"]]


def test_prefill_spans_report_the_version_each_prompt_position_was_computed_under(make_engine, tiny_llama):
    """enable_prefill_weight_versions: a fresh prompt is one span in the served version; a longer prompt
    sharing it after a relabel reads the cached positions (cached_tokens of them, the oracle) as the old
    version and the rest as the new; without the option there is no such key."""
    assert "prefill_weight_versions" not in make_engine(tiny_llama).generate(
        input_ids=PROMPT, sampling_params=SP)["meta_info"]
    engine = make_engine(tiny_llama, enable_prefill_weight_versions=True, weight_version="a")
    long_prompt = PROMPT * 4
    first = engine.generate(input_ids=long_prompt, sampling_params=SP)
    assert _prefill(first) == [(0, len(long_prompt), "a")]
    engine.update_weight_version("b")
    second = engine.generate(input_ids=long_prompt + [11, 12, 13], sampling_params=SP)
    k = second["meta_info"]["cached_tokens"]
    assert k >= len(long_prompt) - 1
    assert _prefill(second) == [(0, k, "a"), (k, len(long_prompt) + 3, "b")]


def test_a_request_retracted_across_an_update_reports_its_recomputed_prompt(make_engine, ckpt_factory):
    """Paused (retract), updated from disk with a new version, continued: the prompt was recomputed, so its
    prefill span is the new version's alone, while the output spans split at the update."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    engine = make_engine(a, enable_prefill_weight_versions=True, weight_version="v0")

    def update():
        engine.pause_generation(mode="retract")
        ok, msg, _ = engine.update_weights_from_disk(str(b), weight_version="v1")
        engine.continue_generation()
        assert ok, msg

    state = at_step(engine, 3, update)
    out = engine.generate(input_ids=PROMPT, sampling_params=SP)
    assert state["done"].is_set() and "error" not in state
    assert _prefill(out) == [(0, len(PROMPT), "v1")]
    assert _spans(out) == [(0, 3, "v0"), (3, 10, "v1")]
    assert out["meta_info"]["num_retractions"] == 1


def test_a_stream_snapshot_keeps_its_spans_when_the_request_grows():
    """Req.snapshot() (what a stream chunk is built from on the caller's thread) copies the span runs:
    tokens the scheduler appends afterwards, in the same version or a new one, do not reach the snapshot."""
    from rollout.request import Req, extend_runs
    from rollout.sampling_params import SamplingParams

    req = Req(rid="r", prompt_ids=PROMPT, sampling_params=SamplingParams(), seed=0, prefill_version_spans=[])
    for pos, version in enumerate(["a", "a", "b"]):
        req.output_ids.append(pos)
        extend_runs(req.output_version_spans, pos, version)
    extend_runs(req.prefill_version_spans, 0, "a")
    snap = req.snapshot()
    for pos, version in [(3, "b"), (4, "c")]:  # the scheduler goes on: the last run grows, then a new one
        req.output_ids.append(pos)
        extend_runs(req.output_version_spans, pos, version)
    extend_runs(req.prefill_version_spans, 1, "a")
    assert snap.output_version_spans == [[0, 2, "a"], [2, 3, "b"]] and len(snap.output_ids) == 3
    assert snap.prefill_version_spans == [[0, 1, "a"]]
    assert req.output_version_spans == [[0, 2, "a"], [2, 4, "b"], [4, 5, "c"]]
