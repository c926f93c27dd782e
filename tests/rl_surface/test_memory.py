"""Memory really goes back: the saver holds zero bytes after a release, the process RSS drops by the
released bytes, and many release/resume/update cycles neither leak nor drift."""

from __future__ import annotations

import pytest

from tests.rl_surface.conftest import make_engine, read_state_dict, rss_bytes, run

TAGS = ("weights", "kv_cache", "cuda_graph")
MiB = 1 << 20


@pytest.fixture(scope="module")
def big_ckpt(ckpt_factory):
    """~75 MiB of fp32 weights (hidden 1024, 2 layers); with a 384 MiB KV pool (48K tokens), ~460 MiB."""
    return ckpt_factory("qwen2", hidden_size=1024, num_hidden_layers=2, with_tokenizer=False)


def test_release_returns_memory_to_the_os(big_ckpt):
    """After release_memory_occupation() the saver holds 0 bytes per tag and RSS drops by >= 90% of the
    released bytes; resume restores the byte counts, and weights written by an update are resident."""
    a = big_ckpt
    with make_engine(a, enable_memory_saver=True, max_total_tokens=48 * 1024) as engine:
        saver = engine.runner.memory_saver
        outputs = run(engine)
        held = {t: saver.bytes_held(t) for t in TAGS}
        assert held["weights"] > 70 * MiB and held["kv_cache"] > 180 * MiB
        released = sum(held.values())

        before = rss_bytes()
        engine.release_memory_occupation()
        after = rss_bytes()
        assert {t: saver.bytes_held(t) for t in TAGS} == dict.fromkeys(TAGS, 0)
        drop = before - after
        print(
            f"\nRSS {before / MiB:.0f} -> {after / MiB:.0f} MiB: dropped {drop / MiB:.1f} MiB of "
            f"{released / MiB:.1f} MiB released ({drop / released:.1%})"
        )
        assert drop >= 0.9 * released

        engine.resume_memory_occupation()
        assert {t: saver.bytes_held(t) for t in TAGS} == held
        # Without backup the weights come back as fresh pages; the update that refills them makes them
        # resident again (KV pages become resident as requests write them).
        assert engine.update_weights_from_tensor(list(read_state_dict(a).items()))[0]
        regained = rss_bytes() - after
        print(f"resume + update: RSS +{regained / MiB:.1f} MiB (weights {held['weights'] / MiB:.1f} MiB)")
        assert regained >= 0.9 * held["weights"]
        assert run(engine) == outputs


def test_release_with_backup_frees_the_kv_and_keeps_one_host_copy(big_ckpt):
    """With CPU backup on the CPU the weights move into the persistent host buffer (same RAM), so RSS
    drops by the KV bytes; later cycles allocate no second copy (released RSS stays put)."""
    a = big_ckpt
    with make_engine(
        a, enable_memory_saver=True, enable_weights_cpu_backup=True, max_total_tokens=48 * 1024
    ) as engine:
        saver = engine.runner.memory_saver
        outputs = run(engine)
        kv, weights = saver.bytes_held("kv_cache"), saver.bytes_held("weights")
        before = rss_bytes()
        engine.release_memory_occupation()
        released_rss = [rss_bytes()]
        assert before - released_rss[0] >= 0.9 * kv - 0.1 * weights
        for _ in range(3):
            engine.resume_memory_occupation()
            assert run(engine) == outputs
            engine.release_memory_occupation()
            released_rss.append(rss_bytes())
        assert max(released_rss) - released_rss[0] < 0.1 * weights
        engine.resume_memory_occupation()
        assert run(engine) == outputs


def test_hundred_cycles_do_not_leak_or_drift(ckpt_pair, reference_outputs):
    """100 x (release -> resume -> update A or B -> generate): every output equals the fresh engine on that
    checkpoint, and RSS after the last cycle is within a few percent of RSS after the tenth."""
    a, b = ckpt_pair("llama")
    states = {a: list(read_state_dict(a).items()), b: list(read_state_dict(b).items())}
    expected = {a: reference_outputs(a), b: reference_outputs(b)}
    with make_engine(a, enable_memory_saver=True) as engine:
        for cycle in range(100):
            ckpt = (a, b)[cycle % 2]
            engine.release_memory_occupation()
            assert engine.runner.memory_saver.bytes_held("weights") == 0
            engine.resume_memory_occupation()
            assert engine.update_weights_from_tensor(states[ckpt], weight_version=str(cycle))[0]
            assert run(engine) == expected[ckpt], f"cycle {cycle}"
            if cycle == 9:
                rss_10 = rss_bytes()
        rss_100 = rss_bytes()
    print(f"\nRSS after cycle 10: {rss_10 / MiB:.1f} MiB, after cycle 100: {rss_100 / MiB:.1f} MiB")
    assert rss_100 <= 1.03 * rss_10


@pytest.mark.parametrize("saver", ["memory_saver_with_backup", "no_memory_saver"])
def test_shutdown_frees_every_tensor_while_the_engine_is_referenced(big_ckpt, saver):
    """shutdown() with the Engine (and its runner and model) still referenced: RSS drops by >= 90% of the
    weights + KV cache (+ the host backup) bytes, every parameter's storage is empty, nothing is held."""
    kw = dict(enable_memory_saver=True, enable_weights_cpu_backup=True) if saver == "memory_saver_with_backup" else {}
    engine = make_engine(big_ckpt, max_total_tokens=48 * 1024, **kw)
    model = engine.runner.model  # a caller's reference must not keep the memory alive
    run(engine)
    saver_obj = engine.runner.memory_saver
    if kw:  # one cycle allocates the host backup, which shutdown must free too
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        kv = engine.runner.token_to_kv_pool  # resumed pages count in RSS only once written
        kv.k_buffer.zero_()
        kv.v_buffer.zero_()
    held = sum(saver_obj.bytes_held(t) for t in TAGS)
    backup = saver_obj.regions["weights"].backup
    held += 0 if backup is None else backup.numel()
    assert held > (460 if kw else 380) * MiB
    before = rss_bytes()
    engine.shutdown()
    after = rss_bytes()
    drop = before - after
    print(f"\n{saver}: RSS {before / MiB:.0f} -> {after / MiB:.0f} MiB at shutdown: dropped {drop / MiB:.1f} MiB "
          f"of {held / MiB:.1f} MiB held ({drop / held:.1%})")
    assert drop >= 0.9 * held
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert {t: saver_obj.bytes_held(t) for t in TAGS} == dict.fromkeys(TAGS, 0)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=dict(max_new_tokens=2))
    # control calls on freed memory say so (resume had failed inside torch; release and flush claimed work)
    for call in (engine.release_memory_occupation, engine.resume_memory_occupation):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    assert not engine.flush_cache().success
    engine.shutdown()  # idempotent
