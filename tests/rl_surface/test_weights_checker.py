"""Engine.check_weights (SGLang's weights checker, slime's check-weight-update mode) and
post_process_weights: the oracles are fresh engines on the same checkpoint, safetensors reads of it,
and torch.equal on the runner's parameters."""

from __future__ import annotations

import pytest
import torch

from runner.layers import prepack
from tests.rl_surface.conftest import make_engine, params, read_state_dict, run, snapshot


def test_reset_makes_compare_fail_on_every_parameter_and_changes_outputs(ckpt_pair, reference_outputs):
    """After snapshot + reset_tensors every parameter differs (compare names them all) and greedy
    outputs differ from a fresh engine's on the same checkpoint; the prefix cache is empty."""
    a, _ = ckpt_pair()
    with make_engine(a) as engine:
        before = snapshot(engine)
        assert engine.check_weights("snapshot")[0]
        ok, msg = engine.check_weights("compare")
        assert ok and f"all {len(before) - len(dict(engine.runner.model.named_buffers()))} parameters" in msg, msg
        run(engine)  # fills the prefix cache
        old_version = engine.weight_version
        ok, msg = engine.check_weights("reset_tensors")
        assert ok, msg
        assert engine.weight_version != old_version
        assert engine.scheduler.kv.tree.evictable_size == 0
        now = params(engine)
        assert all(not torch.equal(now[n], before[n]) for n in now)
        ok, msg = engine.check_weights("compare")
        assert not ok and f"{len(now)} of {len(now)} parameters differ" in msg
        assert run(engine) != reference_outputs(a)


def test_full_sync_after_reset_passes_compare_and_serves_the_checkpoint(ckpt_pair, reference_outputs):
    """reset_tensors then update_weights_from_disk of the original checkpoint: compare succeeds and
    outputs equal a fresh engine's on that checkpoint, bit for bit."""
    a, _ = ckpt_pair()
    with make_engine(a) as engine:
        assert engine.check_weights("snapshot")[0]
        assert engine.check_weights("reset_tensors")[0]
        assert engine.update_weights_from_disk(str(a))[0]
        ok, msg = engine.check_weights("compare")
        assert ok and "all" in msg, msg
        assert run(engine) == reference_outputs(a)


def test_partial_sync_after_reset_names_exactly_the_missed_parameter(ckpt_pair):
    """A sync that leaves out one tensor is caught: compare fails naming that parameter and only it."""
    a, _ = ckpt_pair()
    missed = "model.norm.weight"
    sd = read_state_dict(a)
    with make_engine(a) as engine:
        assert engine.check_weights("snapshot")[0]
        assert engine.check_weights("reset_tensors")[0]
        assert engine.update_weights_from_tensor([(n, t) for n, t in sd.items() if n != missed])[0]
        ok, msg = engine.check_weights("compare")
        assert not ok
        assert f"1 of {len(params(engine))} parameters differ" in msg and f"{missed} (max_abs_err=" in msg, msg


def test_reset_refreshes_prepacked_shadows(ckpt_factory, monkeypatch):
    """After reset_tensors an engine with prepacked linears serves what an unpacked engine serves when
    given the same parameter values (a stale packed copy would serve the old weights)."""
    monkeypatch.setattr(prepack, "MIN_PACK_NUMEL", 0)  # tiny layers: pack every linear
    path = ckpt_factory("qwen2")
    with make_engine(path) as packed, make_engine(path, cpu_prepack=False) as plain:
        assert all(m.packed is not None for m in prepack.packable_modules(packed.runner.model))
        assert packed.check_weights("reset_tensors")[0]
        assert plain.update_weights_from_tensor(list(params(packed).items()), load_format="direct")[0]
        (ids_a, lps_a), (ids_b, lps_b) = zip(*run(packed)), zip(*run(plain))
        assert ids_a == ids_b
        assert torch.allclose(torch.tensor(lps_a), torch.tensor(lps_b), atol=1e-5)


def test_bad_actions_are_refused_and_change_nothing(ckpt_pair, reference_outputs, monkeypatch):
    """An unknown action, compare without a snapshot, and any action on a tensor-parallel engine answer
    (False, reason naming it); the weights and outputs stay as they were."""
    a, _ = ckpt_pair()
    with make_engine(a) as engine:
        before = snapshot(engine)
        with monkeypatch.context() as m:
            m.setattr(engine.args, "tp_size", 2)  # the refusal reads only the option
            for action in ("snapshot", "reset_tensors", "compare"):
                ok, msg = engine.check_weights(action)
                assert not ok and "tp_size=2" in msg
        ok, msg = engine.check_weights("compare")
        assert not ok and "no snapshot" in msg and "snapshot" in msg
        ok, msg = engine.check_weights("wipe")
        assert not ok and "'wipe'" in msg and all(a_ in msg for a_ in ("snapshot", "reset_tensors", "compare"))
        assert all(torch.equal(t, before[n]) for n, t in params(engine).items())
        assert run(engine) == reference_outputs(a)


def test_reset_refused_while_requests_run(ckpt_pair, reference_outputs):
    """reset_tensors between two steps of a running request is refused (not paused): the request
    finishes with the outputs of the untouched weights."""
    from tests.rl_surface.conftest import PROMPTS, SAMPLING, at_step

    a, _ = ckpt_pair()
    with make_engine(a) as engine:
        state = at_step(engine, 2, lambda: engine.check_weights("reset_tensors"))
        outs = engine.generate(input_ids=PROMPTS, sampling_params=SAMPLING, return_logprob=True)
        assert state["done"].wait(30)
        ok, msg = state["result"]
        assert not ok and "in flight" in msg and "pause_generation" in msg
        got = [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]
        assert [ids for ids, _ in got] == [ids for ids, _ in reference_outputs(a)]


@pytest.mark.parametrize("flags", [dict(), dict(restore_weights_before_load=True, post_process_quantization=True)])
def test_post_process_weights_keeps_serving_the_synced_weights(ckpt_pair, reference_outputs, flags):
    """post_process_weights after a sync succeeds and the engine serves exactly the synced checkpoint
    (equal to a fresh engine on it); a non-bool flag is refused by name."""
    a, b = ckpt_pair()
    with make_engine(a) as engine:
        assert engine.update_weights_from_disk(str(b))[0]
        ok, msg = engine.post_process_weights(**flags)
        assert ok and "nothing to do" in msg, msg
        assert run(engine) == reference_outputs(b)
        ok, msg = engine.post_process_weights(restore_weights_before_load="yes")
        assert not ok and "restore_weights_before_load" in msg
