"""enable_weight_version_kv_isolation (SGLang's --enable-weight-version-kv-isolation): KV computed under
one weight version is never reused under another, even after updates with flush_cache=False.

Oracles: the prompt's own length (a full hit caches every prompt token but the last), the same engine
without the option (which does reuse the old KV, as SGLang does by default), and a fresh engine built
on the new checkpoint (what outputs after an update must equal).
"""

from __future__ import annotations

from tests.rl_surface.conftest import at_step

PROMPT = list(range(5, 45))  # 40 tokens: a hit caches 39
GREEDY = dict(temperature=0, max_new_tokens=4, ignore_eos=True)


def _cached(engine, prompt=PROMPT, **sp) -> tuple[int, dict]:
    out = engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, **sp))
    return out["meta_info"]["cached_tokens"], out


def test_a_relabelled_version_misses_the_old_versions_cache(make_engine, tiny_llama):
    """update_weight_version alone (no flush) starts a new namespace: the next request misses, the one
    after hits again; without the option the old entry is reused."""
    iso = make_engine(tiny_llama, enable_weight_version_kv_isolation=True)
    plain = make_engine(tiny_llama)
    for engine in (iso, plain):
        assert _cached(engine)[0] == 0
        assert _cached(engine)[0] == len(PROMPT) - 1
        engine.update_weight_version("v2")
    hit, out = _cached(iso)
    assert hit == 0 and out["meta_info"]["weight_version_start"] == "v2"
    assert _cached(iso)[0] == len(PROMPT) - 1
    assert _cached(plain)[0] == len(PROMPT) - 1  # the default keeps sharing across versions


def test_an_update_without_flush_never_serves_old_kv(make_engine, ckpt_factory):
    """After update_weights_from_disk(flush_cache=False) to another checkpoint, a cached prompt is
    recomputed and the output equals a fresh engine's on that checkpoint; without the option the stale
    KV is reused (the prompt is a cache hit)."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    want = make_engine(b).generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    iso = make_engine(a, enable_weight_version_kv_isolation=True)
    plain = make_engine(a)
    for engine in (iso, plain):
        _cached(engine)
        ok, msg, _ = engine.update_weights_from_disk(str(b), flush_cache=False)
        assert ok, msg
    hit, out = _cached(iso)
    assert hit == 0 and out["output_ids"] == want
    assert _cached(plain)[0] == len(PROMPT) - 1


def test_a_label_used_again_for_other_weights_never_serves_their_kv(make_engine, ckpt_factory):
    """Labels may repeat (a caller sends the same weight_version twice; the update count meets an earlier
    label): the cache is keyed by the weights generation too, so after A -> B -> A all labelled "v" (no
    flush) each cached prompt is recomputed and the outputs equal fresh engines' on that checkpoint."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    want = {p: make_engine(p).generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] for p in (a, b)}
    iso = make_engine(a, enable_weight_version_kv_isolation=True, weight_version="v")
    assert _cached(iso)[1]["output_ids"] == want[a]
    for path in (b, a):
        ok, msg, _ = iso.update_weights_from_disk(str(path), flush_cache=False, weight_version="v")
        assert ok, msg
        hit, out = _cached(iso)
        assert hit == 0 and out["output_ids"] == want[path] and out["meta_info"]["weight_version"] == "v"


def test_an_unlabelled_update_never_takes_the_label_it_replaces(make_engine, ckpt_factory):
    """The update count labels an update that names no version, but never with the label of the weights
    it replaces: started as "1", the first unlabelled update is "2" (count 1 -> 2); after an explicit "4"
    (count 3) the next is "5", not "4"; then the count goes on ("6")."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    engine = make_engine(a, weight_version="1")
    labels = []
    for path, label in ((b, None), (a, "4"), (b, None), (a, None)):
        ok, msg, _ = engine.update_weights_from_disk(str(path), weight_version=label)
        assert ok, msg
        labels.append(engine.weight_version)
    assert labels == ["2", "4", "5", "6"]


def test_a_request_spanning_a_version_change_does_not_seed_the_new_namespace(make_engine, tiny_llama):
    """A request admitted under "a" that finishes after the version becomes "b" reports both versions,
    finishes normally, and its KV (cached when it finishes) is not matched by a request admitted under "b"."""
    engine = make_engine(tiny_llama, enable_weight_version_kv_isolation=True)
    engine.update_weight_version("a")
    state = at_step(engine, 2, lambda: engine.update_weight_version("b", abort_all_requests=False))
    _, spanning = _cached(engine, max_new_tokens=8)
    assert state["done"].is_set() and "error" not in state
    meta = spanning["meta_info"]
    assert (meta["weight_version_start"], meta["weight_version_end"]) == ("a", "b")
    assert meta["finish_reason"]["type"] == "length"
    assert _cached(engine)[0] == 0
    assert _cached(engine)[0] == len(PROMPT) - 1


def test_server_flag_is_sglangs():
    """`--enable-weight-version-kv-isolation` parses into the engine option (SGLang's spelling)."""
    from rollout.server.args import parse_args

    _, kw = parse_args(["--model-path", "m", "--enable-weight-version-kv-isolation"])
    assert kw["enable_weight_version_kv_isolation"] is True
