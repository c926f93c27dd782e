"""Many engines on Ray behave as one engine: same outputs, one weight version, failures named.

Oracle: a plain in-process Engine on the same checkpoint (or on the trainer's weights, written with
HF's `save_pretrained`). A local Ray cluster (`ray.init(num_cpus=2)`) runs two engine actors.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from rollout import Engine
from tests.checkpoints import load_hf_model
from tests.rollout.oracle import random_prompts

ray = pytest.importorskip("ray")

from rollout.ray import EngineGroupError, launch_engines  # noqa: E402
from weight_sync import sync_weights  # noqa: E402

ENGINE_KW = dict(show_progress=False, max_total_tokens=2048, max_running_requests=32)
PROMPTS = random_prompts([5, 9, 3, 7, 4, 11], seed=3)
GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


def greedy(engine_or_group, prompts=PROMPTS):
    outs = engine_or_group.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def assert_same(got, want, atol=1e-5):
    assert len(got) == len(want)
    for (ids, lps), (rids, rlps) in zip(got, want):
        assert ids == rids
        assert torch.allclose(torch.tensor(lps), torch.tensor(rlps), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("llama")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def group(cluster, ckpt):
    g = launch_engines(2, str(ckpt), num_cpus_per_engine=0.5, call_timeout_s=120,
                       enable_memory_saver=True, enable_weights_cpu_backup=True, **ENGINE_KW)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def reference(ckpt):
    with Engine(str(ckpt), **ENGINE_KW) as e:
        return greedy(e)


@pytest.fixture(scope="module")
def trainer(ckpt, tmp_path_factory):
    """A perturbed copy of the checkpoint (the trainer's new weights) and a fresh engine's outputs on it."""
    model = load_hf_model(ckpt)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp_min(0.05))
    path = tmp_path_factory.mktemp("ray-trainer")
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (ckpt / f).exists():
            shutil.copy(ckpt / f, path / f)
    with Engine(str(path), **ENGINE_KW) as fresh:
        return model, path, greedy(fresh)


def test_group_generate_equals_one_engine_in_input_order(group, reference):
    """Spread over two engines, greedy outputs equal one local engine's, prompt for prompt."""
    assert_same(greedy(group), reference)
    infos = group.get_server_info()
    assert all(info["num_prompt_tokens"] > 0 for info in infos), "both engines should have taken prompts"


def test_null_n_routes_as_one_sample(group, reference):
    """sampling_params n=None (SGLang's "the default", what /generate's null sends) is one sample per prompt in
    the group's routing too, as the engines read it (the group raised on int(None))."""
    outs = group.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "n": None})
    assert [o["output_ids"] for o in outs] == [ids for ids, _ in reference]


def test_n_samples_of_one_prompt_stay_on_one_engine(group):
    """The n samples of a prompt go to one engine, so n-1 of them hit its prefix cache."""
    group.flush_cache()
    before = [i["num_cached_tokens"] for i in group.get_server_info()]
    prompt = random_prompts([40], seed=9)[0]
    outs = group.generate(input_ids=[prompt], sampling_params={"n": 4, "temperature": 1.0, "max_new_tokens": 3,
                                                               "seed": 1})
    assert len(outs) == 4 and [o["index"] for o in outs] == [0, 1, 2, 3]
    after = [i["num_cached_tokens"] for i in group.get_server_info()]
    gained = [a - b for a, b in zip(after, before)]
    assert sorted(gained) == [0, 3 * (len(prompt) - 1)], gained


def _close(a, b, atol=1e-5) -> bool:
    """Same nesting, ids and Nones; floats within atol."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], atol) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y, atol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= atol
    return a == b


def test_per_prompt_arguments_are_split_with_their_prompts(group, ckpt):
    """Arguments given one per prompt (return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob) follow
    their prompts to the engines, so the group answers as one Engine does; a list of the wrong length, a malformed
    batch and duplicate rids are refused as one Engine refuses them (each engine got the whole list and raised, or a
    short list was applied to each engine's share)."""
    kw = dict(input_ids=PROMPTS[:4], sampling_params=GREEDY, return_logprob=[True, False, True, True],
              logprob_start_len=[0, None, 2, 1], top_logprobs_num=[0, 0, 2, 1], token_ids_logprob=[[1], None, [2, 3], []])

    def meta(outs):
        keys = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_token_ids_logprobs")
        return [(o["output_ids"], {k: o["meta_info"].get(k) for k in keys}) for o in outs]

    with Engine(str(ckpt), **ENGINE_KW) as one:
        want = meta(one.generate(**kw))
    got = meta(group.generate(**kw))
    assert _close(got, want), (got, want)
    with pytest.raises(ValueError, match="return_logprob has 2 entries for 4 prompts"):
        group.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY, return_logprob=[True, False])
    with pytest.raises(ValueError, match="input_ids must be a list of ints or a list of lists of ints"):
        group.generate(input_ids=[PROMPTS[0], 3], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="given twice"):
        group.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY, rid=["a", "a", "b"])
    with pytest.raises(ValueError, match="same n for every prompt"):
        group.generate(input_ids=PROMPTS[:2], sampling_params=[{**GREEDY, "n": 2}, {**GREEDY, "n": 3}], rid=["a", "b"])
    # a string rid names requests as one Engine names them (it was refused: "must be a list")
    with Engine(str(ckpt), **ENGINE_KW) as one:
        for call in (dict(input_ids=PROMPTS[0], rid="solo"), dict(input_ids=PROMPTS[:3], rid="batch"),
                     dict(input_ids=PROMPTS[0], rid="nsamp", sampling_params={**GREEDY, "n": 3})):
            call = {"sampling_params": GREEDY, **call}
            want, got = one.generate(**call), group.generate(**call)
            ids = [o["meta_info"]["id"] for o in (want if isinstance(want, list) else [want])]
            assert ids == [o["meta_info"]["id"] for o in (got if isinstance(got, list) else [got])], call
    with pytest.raises(ValueError, match="give a list with one id per prompt"):
        group.generate(input_ids=PROMPTS[:2], sampling_params={**GREEDY, "n": 2}, rid="x")


def test_sync_reaches_every_engine(group, trainer, reference):
    """sync_weights into the group: both engines serve exactly a fresh engine on the trainer's weights."""
    model, path, want = trainer
    ok, msg = sync_weights(model, group, bucket_bytes=64 << 10, weight_version="v1")
    assert ok, msg
    assert group.weight_version == "v1"
    assert group.get_weights_checksum()["weight_version"] == "v1"  # raises if the engines' bits differ
    for i in range(len(group)):  # each engine on its own, not just the spread
        got = group._get([group.handles[i].call.remote("generate", (), dict(
            input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True))], "generate")[0]
        assert_same([(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
                     for o in got], want)
    # The same weights again, from the trainer's checkpoint on disk, on both.
    ok, msg, _ = group.update_weights_from_disk(str(path), weight_version="v1-disk")
    assert ok, msg
    assert_same(greedy(group), want)


def test_group_release_and_resume_are_checked_on_every_engine_first(group):
    """A release that one engine would refuse (its weights released already) releases nothing on the others and
    names that engine; so does a resume one engine would refuse; the group then releases and resumes whole and
    generates as before (it used to leave engine 0 released and engine 1 refusing every later call)."""
    before = greedy(group)  # whatever weights earlier tests left: this test must not change them
    ray.get(group.handles[1].call.remote("release_memory_occupation", (["weights"],), {}), timeout=60)
    try:
        with pytest.raises(RuntimeError, match=r"changed nothing on any engine: engine 1: .*already released"):
            group.release_memory_occupation()
        # engine 0 was left resident by the refused release: a resume is refused there, naming it
        with pytest.raises(RuntimeError, match=r"changed nothing on any engine: engine 0: .*not currently released"):
            group.resume_memory_occupation(["weights"])
    finally:
        ray.get(group.handles[1].call.remote("resume_memory_occupation", (["weights"],), {}), timeout=60)
    assert_same(greedy(group), before)  # engine 0 was never released: it still generates
    group.release_memory_occupation()
    group.resume_memory_occupation()
    assert_same(greedy(group), before)


def test_update_refused_by_one_engine_leaves_all_on_old_version(group, ckpt, trainer):
    """One engine cannot take the update (its weights are released): no engine changes; versions and outputs stay old."""
    ok, msg, _ = group.update_weights_from_disk(str(ckpt), weight_version="base")
    assert ok, msg
    base_outputs = greedy(group)
    model, _, want = trainer
    assert [ids for ids, _ in base_outputs] != [ids for ids, _ in want]
    ray.get(group.handles[1].call.remote("release_memory_occupation", (["weights"],), {}), timeout=60)
    try:
        ok, msg = group.update_weights_from_tensor(list(model.state_dict().items()), weight_version="bad")
    finally:
        ray.get(group.handles[1].call.remote("resume_memory_occupation", (["weights"],), {}), timeout=60)
    assert not ok
    assert "engine 1" in msg and "released" in msg, msg
    assert group.weight_version == "base"
    assert_same(greedy(group), base_outputs)


def test_sync_failing_in_a_later_bucket_rolls_every_engine_back(group, ckpt, trainer):
    """A many-bucket sync whose last bucket is refused: every engine is back on the old weights and version."""
    ok, msg, _ = group.update_weights_from_disk(str(ckpt), weight_version="base2")
    assert ok, msg
    base_outputs = greedy(group)
    model, _, _ = trainer
    last = list(model.state_dict())[-1]
    ok, msg = sync_weights(model, group, bucket_bytes=32 << 10, weight_version="half",
                           name_map=lambda n: "model.bogus.weight" if n == last else n)
    assert not ok and "model.bogus.weight" in msg and "rolled back" in msg, msg
    assert group.weight_version == "base2"
    assert_same(greedy(group), base_outputs)


def _busy_engine_1(group, rid: str):
    """Start a request on engine 1 that runs until aborted by `rid` (or, at worst, its context fills); return once
    it runs (its ObjectRef). A penalty keeps it on single decode steps: in decode blocks its ~500 tokens took
    ~0.3 s, less than the updates the tests make while it must still be in flight."""
    long = dict(input_ids=PROMPTS[0], sampling_params=dict(max_new_tokens=100000, ignore_eos=True,
                                                           repetition_penalty=1.05), rid=rid)
    busy = group.handles[1].call.remote("generate", (), long)
    deadline = time.monotonic() + 60
    while ray.get(group.handles[1].call.remote("get_server_info", (), {}), timeout=60)["num_in_flight"] == 0:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.05)
    return busy


def test_a_request_in_flight_on_one_engine_leaves_the_group_consistent(group, ckpt, trainer, monkeypatch):
    """Engine 1 busy, engine 0 idle: engine 0 takes bucket 0, engine 1 refuses; the rollback of engine 0
    cannot be refused by a request arriving meanwhile (it retracts it), the busy engine is left alone, and the
    group stays on one version with equal bits, so the next sync (once idle) goes through."""
    ok, msg, _ = group.update_weights_from_disk(str(ckpt), weight_version="base3")
    assert ok, msg
    base_sum = group.get_weights_checksum()["checksum"]
    # Both requests are sent from inside the sync, around bucket 0: engine 1's long one right before it (sent
    # before the sync's snapshots, it could reach the context limit and end first, so engine 1 took bucket 0),
    # and engine 0's after it (the rollback must retract it, not be refused by it; sent before, it could start
    # first and make engine 0 refuse bucket 0).
    busy, late = [], []
    apply_everywhere = group._apply_everywhere

    def then_a_request_on_engine_0(*args, **kwargs):
        if not busy:
            busy.append(_busy_engine_1(group, "busy"))
        failed = apply_everywhere(*args, **kwargs)
        if not late:
            late.append(group.handles[0].call.remote("generate", (), dict(input_ids=PROMPTS[1], sampling_params=dict(
                max_new_tokens=200, ignore_eos=True))))
            deadline = time.monotonic() + 60
            while ray.get(group.handles[0].call.remote("get_server_info", (), {}), timeout=60)["num_in_flight"] == 0:
                assert time.monotonic() < deadline, "the late request never started"
                time.sleep(0.02)
        return failed

    monkeypatch.setattr(group, "_apply_everywhere", then_a_request_on_engine_0)
    model, _, _ = trainer
    ok, msg = sync_weights(model, group, bucket_bytes=32 << 10, weight_version="mixed?")
    monkeypatch.undo()
    assert not ok and "engine 1" in msg and "in flight" in msg and "inconsistent" not in msg, msg
    assert group.weight_version == "base3"  # raises if the engines disagree
    assert group.get_weights_checksum()["checksum"] == base_sum  # raises if the engines' bits differ
    ray.get(group.handles[1].call.remote("abort_request", (), dict(rid="busy")), timeout=60)
    ray.get([*busy, *late], timeout=120)
    # No version named: each engine labels the update with its update count, which the rollback put back too
    # (left one ahead on engine 0, the group read versions ["3", "1"] and refused every later update).
    ok, msg = sync_weights(model, group, bucket_bytes=32 << 10)
    assert ok, msg
    assert group.weight_version.isdigit()  # raises if the engines disagree
    ok, msg = sync_weights(model, group, bucket_bytes=32 << 10, weight_version="after")
    assert ok, msg
    assert group.weight_version == "after"


def test_rollback_keeps_the_engines_labelling_alike(group, ckpt, trainer):
    """Engine 1 busy refuses an update engine 0 applied and rolled back: the rollback also puts back engine 0's
    update count, which labels an update that names no version, so the next such update commits with one
    version on both (it read ["3", "1"] once, and the group refused every update after it)."""
    ok, msg, _ = group.update_weights_from_disk(str(ckpt), weight_version="base4")
    assert ok, msg
    busy = _busy_engine_1(group, "busy4")
    model, _, want = trainer
    try:
        ok, msg = group.update_weights_from_tensor(list(model.state_dict().items()))
        assert not ok and "engine 1" in msg and "rolled back" in msg, msg
        assert group.weight_version == "base4"
    finally:
        ray.get(group.handles[1].call.remote("abort_request", (), dict(rid="busy4")), timeout=60)
        ray.get(busy, timeout=120)
    for _ in range(2):
        ok, msg = group.update_weights_from_tensor(list(model.state_dict().items()))
        assert ok, msg
        assert group.weight_version.isdigit()  # raises if the engines disagree
    assert_same(greedy(group), want)


def test_a_group_seed_gives_each_engine_its_own_stream(cluster, ckpt):
    """launch_engines(random_seed=s): engine i runs with s + i, so the same unseeded request differs between
    the engines (they had drawn alike: duplicate rollouts for a GRPO group spread over them)."""
    g = launch_engines(2, str(ckpt), num_cpus_per_engine=0.5, call_timeout_s=120, random_seed=7, **ENGINE_KW)
    try:
        assert [info["random_seed"] for info in g.get_server_info()] == [7, 8]
        body = dict(input_ids=[PROMPTS[1]] * 2, sampling_params={"temperature": 1.0, "max_new_tokens": 12,
                                                                 "ignore_eos": True})
        outs = [ray.get(h.call.remote("generate", (), body), timeout=120) for h in g.handles]
        assert [o["output_ids"] for o in outs[0]] != [o["output_ids"] for o in outs[1]]
    finally:
        g.shutdown()


def test_killed_engine_is_named_and_nothing_hangs(cluster, ckpt):
    """An actor killed mid-run: the next call fails within seconds with an error naming that engine."""
    g = launch_engines(2, str(ckpt), num_cpus_per_engine=0.5, call_timeout_s=60, **ENGINE_KW)
    try:
        ray.kill(g.handles[1])
        # Ray learns of the death asynchronously (slowly on a loaded machine): time the group's call once it has.
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.get(g.handles[1].call.remote("get_server_info", (), {}), timeout=5)
            except Exception:  # noqa: BLE001 - RayActorError once the kill landed
                break
            assert time.monotonic() < deadline, "the killed actor still answers after 60 s"
            time.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(EngineGroupError, match="engine 1"):
            g.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert time.monotonic() - t0 < 30
        ok, msg, _ = g.update_weights_from_disk(str(ckpt))
        assert not ok and "engine 1" in msg
    finally:
        g.shutdown()


@pytest.fixture(scope="module")
def group_of_one(cluster, ckpt):
    g = launch_engines(1, str(ckpt), num_cpus_per_engine=0.5, call_timeout_s=120, **ENGINE_KW)
    yield g
    g.shutdown()


def test_actor_exposes_engine_methods_by_name(group_of_one, reference):
    """actor.generate.remote(...) runs Engine.generate (Ray's usual call style); call(...) gives the same."""
    actor = group_of_one.handles[0]
    direct = ray.get(actor.generate.remote(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True), timeout=60)
    via_call = ray.get(actor.call.remote("generate", (), dict(input_ids=PROMPTS, sampling_params=GREEDY,
                                                               return_logprob=True)), timeout=60)
    for outs in (direct, via_call):
        assert_same([(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs],
                    reference)
    assert ray.get(actor.flush_cache.remote(), timeout=60).success is True
    assert "weight_version" in ray.get(actor.get_server_info.remote(), timeout=60)


def test_group_of_one_rolls_a_failed_many_bucket_sync_back(group_of_one, trainer, reference):
    """One engine, a sync whose last bucket is refused: first tensor and version stay as they were."""
    model, _, _ = trainer
    before_version = group_of_one.weight_version
    first = list(model.state_dict())[0]
    before_first = torch.tensor(group_of_one.get_weights_by_name(first, truncate_size=1 << 30))
    last = list(model.state_dict())[-1]
    ok, msg = sync_weights(model, group_of_one, bucket_bytes=32 << 10, weight_version="half",
                           name_map=lambda n: "model.bogus.weight" if n == last else n)
    assert not ok and "model.bogus.weight" in msg and "rolled back" in msg, msg
    assert group_of_one.weight_version == before_version
    after_first = torch.tensor(group_of_one.get_weights_by_name(first, truncate_size=1 << 30))
    assert torch.equal(after_first, before_first)
    assert_same(greedy(group_of_one), reference)


def test_output_index_counts_across_engines_as_one_engine(group):
    """Prompts spread over both engines, n=2 each: `index` runs 0..5 in output order, as one Engine numbers
    them (each engine had numbered its own share from 0)."""
    outs = group.generate(input_ids=random_prompts([5, 6, 7], seed=3),
                          sampling_params={"n": 2, "temperature": 1.0, "max_new_tokens": 2, "seed": 4})
    assert [o["index"] for o in outs] == list(range(6))


def test_group_of_one_rolls_a_failed_multi_part_delta_back(group_of_one, trainer, reference):
    """A delta split in parts (one tensor each), whose last part is refused (a NaN): the one engine keeps
    every tensor and its version, as with two engines."""
    import copy

    from weight_sync import DeltaSync

    model = copy.deepcopy(trainer[0])  # changed below: the fixture's model stays as it is
    sync = DeltaSync(group_of_one, bucket_bytes=64)
    ok, msg = sync.sync(model)
    assert ok, msg
    before = group_of_one.get_weights_checksum()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
        list(model.parameters())[-1].view(-1)[0] = float("nan")
    ok, msg = sync.sync(model)
    assert not ok and "rolled back" in msg, msg
    assert group_of_one.get_weights_checksum() == before
    assert sync_weights(trainer[0], group_of_one)[0]


def test_racing_syncs_leave_one_version_everywhere(group, ckpt, trainer, reference):
    """Two threads syncing different weights into one group at once: each sync commits whole, one after the
    other, so every engine ends on the same version with all of one source's weights."""
    import threading

    model, _, trained = trainer
    base = load_hf_model(ckpt)
    results = {}
    threads = [threading.Thread(target=lambda k=k, m=m: results.setdefault(k, sync_weights(
        m, group, bucket_bytes=16 << 10, weight_version=k))) for k, m in (("base", base), ("trained", model))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results["base"][0] and results["trained"][0], results
    version = group.weight_version
    assert version in ("base", "trained")
    assert_same(greedy(group), reference if version == "base" else trained)
    group.get_weights_checksum()  # raises if the engines hold different bits
    assert sync_weights(base, group, weight_version="base")[0]


def test_a_name_the_engines_ignore_is_accepted_by_the_group(group, trainer):
    """A state_dict carrying a buffer the engine ignores by design (rotary inv_freq): one Engine takes it,
    and so does a group of two (its snapshot had tried to resolve every name)."""
    model, _, trained = trainer
    named = list(model.state_dict().items()) + [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))]
    ok, msg = group.update_weights_from_tensor(named, weight_version="with-ignored")
    assert ok, msg
    assert_same(greedy(group), trained)


def test_group_abort_request_finds_the_engine_that_holds_the_rid(group):
    """abort_request on the group reaches every engine: the one running the rid aborts it (its output ends as
    abort), the others find nothing, and the count is the group's total."""
    busy = _busy_engine_1(group, "group-abort")
    assert group.abort_request("group-abort") == 1
    out = ray.get(busy, timeout=120)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert group.abort_request("group-abort") == 0  # finished: a no-op, as on one engine
    with pytest.raises(TypeError, match="abort_all"):
        group.abort_request("x", abort_all="yes")


def test_abort_all_requests_aborts_only_once_every_engine_committed(group, ckpt, trainer):
    """update_*(abort_all_requests=True) on the group: a request in flight does not refuse the update, and it
    is aborted only after every engine committed; an update the engines refuse aborts nothing."""
    model, _, want = trainer
    ok, msg, _ = group.update_weights_from_disk(str(ckpt), weight_version="base5")
    assert ok, msg
    busy = _busy_engine_1(group, "abort-all")
    try:
        bad = [("model.embed_tokens.weight", torch.zeros(3, 3))]  # refused by every engine: wrong shape
        ok, msg = group.update_weights_from_tensor(bad, abort_all_requests=True)
        assert not ok and "rolled back" in msg, msg
        assert group.weight_version == "base5"
        assert ray.get(group.handles[1].call.remote("get_server_info", (), {}), timeout=60)["num_in_flight"] == 1
        ok, msg = group.update_weights_from_tensor(list(model.state_dict().items()), weight_version="trained5",
                                                   abort_all_requests=True)
        assert ok and "aborted 1 request" in msg, msg
        out = ray.get(busy, timeout=120)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        group.abort_request("abort-all")
    assert group.weight_version == "trained5"
    assert_same(greedy(group), want)
    ok, msg, _ = group.update_weights_from_disk(str(ckpt), abort_all_requests=True)  # nothing in flight
    assert ok and "aborted 0 request" in msg, msg


def test_engine_group_update_methods_take_the_engines_positional_order():
    """EngineGroup's weight-group methods list their parameters in Engine's order (SGLang's: group_name,
    flush_cache, load_format, weight_version), with the same defaults (but the group's explicit gloo backend),
    so a positional call means the same on either."""
    import inspect

    from rollout.ray import EngineGroup

    for method in ("init_weights_update_group", "update_weights_from_distributed", "destroy_weights_update_group"):
        ours = [p for p in inspect.signature(getattr(EngineGroup, method)).parameters.values()
                if p.kind is p.POSITIONAL_OR_KEYWORD]
        engine = list(inspect.signature(getattr(Engine, method)).parameters.values())[: len(ours)]
        assert [(p.name, p.default if p.name != "backend" else None) for p in ours] == \
            [(p.name, p.default) for p in engine], method
