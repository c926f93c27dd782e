"""Releasing and resuming memory: what comes back is what went away (with backup), nothing is served
from freed or invalid memory, and no call with requests in flight mixes weights."""

from __future__ import annotations

import pytest
import torch

from tests.rl_surface.conftest import (
    assert_same_tensors,
    at_step,
    make_engine,
    read_state_dict,
    run,
    snapshot,
    versions,
)

TAGS = ("weights", "kv_cache", "cuda_graph")
SP = dict(temperature=0, max_new_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_release_resume_with_backup_is_bit_exact(ckpt_pair, arch, tied):
    """With enable_weights_cpu_backup every parameter and buffer comes back torch.equal, and so do outputs."""
    a, _ = ckpt_pair(arch, tie_word_embeddings=tied)
    with make_engine(a, enable_memory_saver=True, enable_weights_cpu_backup=True) as engine:
        before, outputs = snapshot(engine), run(engine)
        engine.release_memory_occupation()
        assert all(engine.runner.memory_saver.bytes_held(t) == 0 for t in TAGS)
        engine.resume_memory_occupation()
        assert_same_tensors(before, engine)
        assert run(engine) == outputs
        assert versions(engine) == {"default"}  # a release is not an update


def test_backup_buffer_is_allocated_once(ckpt_pair):
    """The host backup is one persistent buffer reused by every release, not a new one each time."""
    a, b = ckpt_pair("llama")
    sd_b = read_state_dict(b)
    with make_engine(a, enable_memory_saver=True, enable_weights_cpu_backup=True) as engine:
        region = engine.runner.memory_saver.regions["weights"]
        engine.release_memory_occupation(["weights"])
        ptr = region.backup.data_ptr()
        assert region.backup.numel() == sum(region.nbytes)
        for _ in range(3):
            engine.resume_memory_occupation(["weights"])
            assert engine.update_weights_from_tensor(list(sd_b.items()))[0]  # the backup follows updates
            before = snapshot(engine)
            engine.release_memory_occupation(["weights"])
            assert region.backup.data_ptr() == ptr
        engine.resume_memory_occupation(["weights"])
        assert_same_tensors(before, engine)


def test_without_backup_generate_is_refused_until_an_update(ckpt_pair, reference_outputs):
    """Weights released without backup are invalid: generate raises until a full update, then == fresh B."""
    a, b = ckpt_pair("llama")
    sd_b = read_state_dict(b)
    with make_engine(a, enable_memory_saver=True) as engine:
        engine.release_memory_occupation()
        with pytest.raises(RuntimeError, match="resume_memory_occupation"):
            run(engine)
        engine.resume_memory_occupation()
        with pytest.raises(RuntimeError, match="released without CPU backup"):
            run(engine)
        with pytest.raises(ValueError, match="released without CPU backup"):
            engine.get_weights_by_name("model.norm.weight")
        names = sorted(sd_b)
        assert engine.update_weights_from_tensor([(n, sd_b[n]) for n in names[:5]])[
            0
        ]  # a subset is not enough
        with pytest.raises(RuntimeError, match="released without CPU backup"):
            run(engine)
        assert engine.update_weights_from_tensor([(n, sd_b[n]) for n in names[5:]])[0]
        assert run(engine) == reference_outputs(b)


def test_release_twice_and_resume_resident_are_refused_and_change_nothing(ckpt_pair):
    """As SGLang: a second release, or a resume of what is resident, raises RuntimeError naming the tag,
    and leaves every tag's state, the weights and the prefix cache as they were."""
    a, _ = ckpt_pair("llama")
    prompt = list(range(5, 45))
    sp = dict(temperature=0, max_new_tokens=4)
    with make_engine(a, enable_memory_saver=True, enable_weights_cpu_backup=True) as engine:
        saver = engine.runner.memory_saver
        before, outputs = snapshot(engine), run(engine)
        held = {t: saver.bytes_held(t) for t in TAGS}
        assert held["weights"] > 0 and held["kv_cache"] > 0
        with pytest.raises(RuntimeError, match=r"\['weights', 'kv_cache', 'cuda_graph'\] not currently released"):
            engine.resume_memory_occupation()
        engine.release_memory_occupation(["kv_cache"])
        with pytest.raises(RuntimeError, match=r"\['kv_cache'\] already released"):
            engine.release_memory_occupation()  # weights and cuda_graph are resident: still refused whole
        assert [saver.is_resident(t) for t in TAGS] == [True, False, True]
        assert saver.bytes_held("weights") == held["weights"]
        engine.release_memory_occupation(["weights", "cuda_graph"])
        with pytest.raises(RuntimeError, match=r"\['weights'\] already released"):
            engine.release_memory_occupation(["weights"])
        engine.resume_memory_occupation()
        assert {t: saver.bytes_held(t) for t in TAGS} == held
        assert_same_tensors(before, engine)
        engine.generate(input_ids=prompt, sampling_params=sp)
        with pytest.raises(RuntimeError, match=r"\['kv_cache'\] not currently released"):
            engine.resume_memory_occupation(["kv_cache"])
        assert engine.generate(input_ids=prompt, sampling_params=sp)["meta_info"]["cached_tokens"] > 0
        assert_same_tensors(before, engine)
        assert run(engine) == outputs


def test_staged_resume_weights_update_then_kv_cache(ckpt_pair, reference_outputs):
    """resume(["weights"]) -> update -> resume(["kv_cache"]), the RL loop's order, == fresh engine on B."""
    a, b = ckpt_pair("qwen2", tie_word_embeddings=True)
    with make_engine(a, enable_memory_saver=True) as engine:
        engine.release_memory_occupation()
        ok, msg, _ = engine.update_weights_from_disk(str(b))
        assert not ok and "resume_memory_occupation" in msg  # nowhere to write while released
        engine.resume_memory_occupation(["weights"])
        assert engine.runner.memory_saver.bytes_held("kv_cache") == 0
        ok, msg, _ = engine.update_weights_from_disk(str(b), weight_version="step-1")
        assert ok, msg
        with pytest.raises(RuntimeError, match="resume_memory_occupation"):
            run(engine)  # the KV cache is still released
        engine.resume_memory_occupation(["kv_cache"])
        assert run(engine) == reference_outputs(b)
        assert versions(engine) == {"step-1"}


def test_releasing_kv_cache_flushes_prefix_cache(ckpt_pair):
    """After a kv_cache release no request is served from the (freed) prefix cache: cached_tokens 0."""
    a, _ = ckpt_pair("llama")
    prompt = list(range(5, 45))
    sp = dict(temperature=0, max_new_tokens=6, ignore_eos=True)
    with make_engine(a, enable_memory_saver=True) as engine:
        first = engine.generate(input_ids=prompt, sampling_params=sp)
        assert engine.generate(input_ids=prompt, sampling_params=sp)["meta_info"]["cached_tokens"] > 0
        engine.release_memory_occupation(["kv_cache"])
        engine.resume_memory_occupation(["kv_cache"])
        again = engine.generate(input_ids=prompt, sampling_params=sp)
        assert again["meta_info"]["cached_tokens"] == 0
        assert again["output_ids"] == first["output_ids"]


def test_resumed_kv_memory_content_does_not_matter(ckpt_pair):
    """Resumed KV memory is uninitialised; even if it is all NaN, outputs (padded batches) are unchanged."""
    a, _ = ckpt_pair("llama")
    with make_engine(a, enable_memory_saver=True) as engine:
        outputs = run(engine)
        saver = engine.runner.memory_saver
        real_resume = saver.resume

        def resume_into_garbage(tag):
            real_resume(tag)
            for buf in saver.regions[tag].buffers:
                buf.fill_(float("nan"))
            # torch_memory_saver also hands the request->slot table back undefined.
            engine.runner.req_to_token_pool.req_to_token.fill_(1 << 40)

        saver.resume = resume_into_garbage
        engine.release_memory_occupation(["kv_cache"])
        engine.resume_memory_occupation(["kv_cache"])
        assert int(engine.runner.req_to_token_pool.req_to_token.abs().max()) == 0
        assert run(engine) == outputs


def test_rope_buffers_survive_a_weight_release(ckpt_pair, reference_outputs):
    """Rope cos/sin tables are buffers, not weights: a release without backup keeps them resident and
    intact, and after a full update the model equals a fresh one."""
    a, b = ckpt_pair("llama")  # llama3 rope scaling: a table a default one would not reproduce
    with make_engine(a, enable_memory_saver=True) as engine:
        buffers = {n: t.clone() for n, t in engine.runner.model.named_buffers()}
        assert any("cos_cached" in n for n in buffers) and any("sin_cached" in n for n in buffers)
        engine.release_memory_occupation(["weights"])
        for name, t in engine.runner.model.named_buffers():
            assert t.untyped_storage().nbytes() > 0 and torch.equal(t, buffers[name]), name
        assert all(p.untyped_storage().nbytes() == 0 for p in engine.runner.model.parameters())
        engine.resume_memory_occupation(["weights"])
        assert engine.update_weights_from_tensor(list(read_state_dict(b).items()))[0]
        assert run(engine) == reference_outputs(b)


def test_release_without_memory_saver_is_a_clear_error(ckpt_pair):
    """enable_memory_saver=False: release raises naming the flag, and the engine keeps serving unchanged."""
    a, _ = ckpt_pair("llama")
    with make_engine(a) as engine:
        before, outputs = snapshot(engine), run(engine)
        for tags in (None, ["weights"], ["kv_cache"]):
            with pytest.raises(RuntimeError, match="enable_memory_saver=True"):
                engine.release_memory_occupation(tags)
        with pytest.raises(RuntimeError, match="enable_memory_saver=True"):
            engine.resume_memory_occupation()
        assert_same_tensors(before, engine)
        assert run(engine) == outputs


def test_unknown_tag_is_a_clear_error(ckpt_pair):
    """A misspelt tag raises, listing the valid ones, and releases nothing."""
    a, _ = ckpt_pair("llama")
    with make_engine(a, enable_memory_saver=True) as engine:
        with pytest.raises(ValueError, match="kv_cache"):
            engine.release_memory_occupation(["kvcache"])
        assert engine.runner.memory_saver.bytes_held("kv_cache") > 0
        run(engine)


def _pause_at(engine, steps: int) -> dict:
    """Pause right after `steps` scheduler steps from now; the result is each in-flight request's token count."""

    def pause():
        engine.pause_generation(mode="in_place")  # requests stay in flight (the default, "abort", ends them)
        return [len(r.output_ids) for r in engine._reqs.values()]

    return at_step(engine, steps, pause)


def test_release_refused_while_a_request_runs(ckpt_pair):
    """Release with a request in flight and generation not paused raises; the request finishes intact."""
    a, _ = ckpt_pair("llama")
    with make_engine(a, enable_memory_saver=True, enable_weights_cpu_backup=True) as engine:
        reference = engine.generate(input_ids=[5, 6, 7], sampling_params=SP)["output_ids"]

        def try_release():
            assert engine.scheduler.num_in_flight() == 1
            engine.release_memory_occupation()

        state = at_step(engine, 5, try_release)  # between decode steps, mid-request, not paused
        final = engine.generate(input_ids=[5, 6, 7], sampling_params=SP)
        assert state["done"].is_set()
        assert isinstance(state["error"], RuntimeError)
        assert "in flight" in str(state["error"]) and "pause_generation" in str(state["error"])
        assert "online" not in str(state["error"])  # release has no such option: the refusal must not offer it
        assert engine.runner.memory_saver.bytes_held("weights") > 0
        assert final["output_ids"] == reference


def _paused_mid_request(engine):
    """-> (the uninterrupted greedy output, a stream of the same request paused after its 5th step)."""
    reference = engine.generate(input_ids=[5, 6, 7], sampling_params=SP)["output_ids"]
    state = _pause_at(engine, 5)
    stream = engine.generate(input_ids=[5, 6, 7], sampling_params=SP, stream=True)
    assert state["done"].wait(30) and state["result"] == [5]
    return reference, stream


def test_paused_release_resume_continue_recomputes_identically(ckpt_pair):
    """Paused: release all (requests are retracted), resume, continue -> the same tokens as uninterrupted."""
    a, _ = ckpt_pair("llama")
    with make_engine(a, enable_memory_saver=True, enable_weights_cpu_backup=True) as engine:
        reference, stream = _paused_mid_request(engine)
        engine.release_memory_occupation()
        assert engine.runner.memory_saver.bytes_held("kv_cache") == 0
        engine.resume_memory_occupation()
        engine.continue_generation()
        final = list(stream)[-1]
        assert final["output_ids"] == reference
        assert final["meta_info"]["num_retractions"] == 1


def test_paused_update_then_continue_uses_new_weights(ckpt_pair):
    """Paused mid-request: release -> resume(weights) -> update -> resume(kv) -> continue. The tokens before
    the pause are A's, the rest are what a fresh engine on B continues the same prefix with, and the
    output reports the new weight_version."""
    a, b = ckpt_pair("llama")
    prompt = [5, 6, 7]
    with make_engine(a, enable_memory_saver=True) as engine:
        state = _pause_at(engine, 6)  # one prefill + five decode steps: six tokens under A
        stream = engine.generate(input_ids=prompt, sampling_params=SP, stream=True)
        assert state["done"].wait(30) and state["result"] == [6]
        engine.release_memory_occupation()
        engine.resume_memory_occupation(["weights"])
        assert engine.update_weights_from_disk(str(b), weight_version="new")[0]
        engine.resume_memory_occupation(["kv_cache"])
        engine.continue_generation()
        final = list(stream)[-1]
    assert final["meta_info"]["weight_version"] == "new"
    out, n = final["output_ids"], 6
    assert len(out) == SP["max_new_tokens"]
    with make_engine(a) as fresh_a:
        assert out[:n] == fresh_a.generate(input_ids=prompt, sampling_params=SP)["output_ids"][:n]
    with make_engine(b) as fresh_b:
        rest = fresh_b.generate(
            input_ids=prompt + out[:n], sampling_params=SP | dict(max_new_tokens=len(out) - n)
        )
    assert out[n:] == rest["output_ids"]


def test_paused_update_without_release_retracts_and_recomputes(ckpt_pair):
    """Paused with requests in flight, update_weights_from_tensor succeeds (no release needed); after
    continue_generation every one of them finishes under the new weight_version."""
    a, b = ckpt_pair("qwen3")
    with make_engine(a) as engine:
        engine.pause_generation()
        streams = [
            engine.generate(input_ids=[5 + i, 6, 7], sampling_params=SP, stream=True) for i in range(3)
        ]
        state = _pause_at(engine, 3)
        engine.continue_generation()
        assert state["done"].wait(30) and state["result"] == [3, 3, 3]
        ok, msg = engine.update_weights_from_tensor(list(read_state_dict(b).items()), weight_version="v2")
        assert ok, msg
        engine.continue_generation()
        finals = [list(s)[-1] for s in streams]
    for f in finals:
        assert f["meta_info"]["weight_version"] == "v2"
        assert f["meta_info"]["finish_reason"]["type"] == "length"
        assert f["meta_info"]["num_retractions"] == 1


def test_generate_while_released_is_refused_unless_paused_then_it_queues(ckpt_pair):
    """Released and not paused: generate raises naming the fix. Paused: it queues, then equals a normal run."""
    import threading

    a, _ = ckpt_pair("llama")
    ids = [[5, 9, 14, 3], [7, 7, 2]]
    params = dict(temperature=0, max_new_tokens=6)
    with make_engine(a, enable_memory_saver=True, enable_weights_cpu_backup=True) as engine:
        want = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]
        engine.flush_cache()
        engine.release_memory_occupation()
        with pytest.raises(RuntimeError, match="resume_memory_occupation"):
            engine.generate(input_ids=ids, sampling_params=params)
        engine.pause_generation(mode="retract")
        got: list = []
        t = threading.Thread(target=lambda: got.append(engine.generate(input_ids=ids, sampling_params=params)))
        t.start()
        t.join(timeout=1.0)
        assert t.is_alive() and not got  # queued, not run on released memory
        engine.resume_memory_occupation()
        engine.continue_generation()
        t.join(timeout=60)
        assert not t.is_alive()
        assert [o["output_ids"] for o in got[0]] == want


def test_continue_before_resume_ends_the_requests_in_flight_naming_it(ckpt_pair):
    """Paused mid-request, memory released, then continue_generation without a resume: nothing could run the
    request (a new one is refused saying memory is released), so it ends as abort with its partial output and
    a message naming the order to call things in, instead of waiting unseen; after resume the engine serves."""
    a, _ = ckpt_pair("llama")
    with make_engine(a, enable_memory_saver=True, enable_weights_cpu_backup=True) as engine:
        reference, stream = _paused_mid_request(engine)
        engine.release_memory_occupation()
        engine.continue_generation()
        final = list(stream)[-1]
        reason = final["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "resume_memory_occupation" in reason["message"], reason
        assert final["output_ids"] == reference[: len(final["output_ids"])]
        with pytest.raises(RuntimeError, match="memory is released"):
            engine.generate(input_ids=[5, 6, 7], sampling_params=SP)
        engine.resume_memory_occupation()
        assert engine.generate(input_ids=[5, 6, 7], sampling_params=SP)["output_ids"] == reference
