"""DeltaSync into an in-process Engine: exact after every step, and every bad delta changes nothing.

Oracle: a second engine given a plain full update of the trainer's bf16 cast (tests/weight_sync/
delta_helpers.py): equal `get_weights_checksum` (SHA-256 of every parameter) and equal greedy outputs.
"""

from __future__ import annotations

import pytest
import torch

from rollout import Engine
from runner.weights import loader
from tests.weight_sync.delta_helpers import ENGINE_KW, Trainer, assert_equals_full_update, checksum, greedy
from weight_sync import DeltaSync
from weight_sync import delta_codec as dc


@pytest.fixture(scope="module")
def engines(tiny_llama):
    with Engine(str(tiny_llama), **ENGINE_KW) as e, Engine(str(tiny_llama), **ENGINE_KW) as ref:
        yield e, ref


@pytest.mark.parametrize("lr", [1e-6, 1e-3])
def test_adam_steps_equal_a_full_update(engines, tiny_llama, lr):
    """After each Adam step the delta-synced engine holds bit for bit the full update of the same cast."""
    engine, ref = engines
    trainer = Trainer(tiny_llama, lr)
    ds = DeltaSync(engine)
    ok, msg = ds.sync(trainer.model)
    assert ok and ds.last["mode"] == "full", msg
    version = engine.weight_version
    for step in range(3):
        trainer.step()
        ok, msg = ds.sync(trainer.model)
        assert ok, msg
        last = ds.last
        assert last["mode"] == "delta" and last["elements_changed"] > 0
        assert last["bytes_full"] == sum(p.numel() * 2 for p in trainer.model.parameters())
        if lr == 1e-6:  # few bf16 elements move at this rate: the delta is a small fraction of a full sync
            assert last["bytes_sent"] * 5 < last["bytes_full"], last
        assert engine.weight_version != version
        version = engine.weight_version
        assert_equals_full_update(engine, ref, trainer, outputs=step == 2)


def test_a_tied_state_dict_split_in_parts_stays_a_delta(ckpt_factory):
    """A tied model's state_dict (embedding and LM head one tensor under two names) whose delta is split in
    several parts: the tied pair travels in one part, so every sync is a delta (it had been refused as a
    stale base, every step falling back to a full sync) and the engine equals a full update of the cast."""
    ckpt = ckpt_factory("qwen2", tie_word_embeddings=True)
    with Engine(str(ckpt), **ENGINE_KW) as engine, Engine(str(ckpt), **ENGINE_KW) as ref:
        trainer = Trainer(ckpt, 1e-3)
        ds = DeltaSync(engine, bucket_bytes=1 << 14)
        assert ds.sync(trainer.model.state_dict())[0]
        for _ in range(2):
            trainer.step()
            ok, msg = ds.sync(trainer.model.state_dict(), fallback=True)
            assert ok and ds.last["mode"] == "delta" and ds.last["num_updates"] > 1, (msg, ds.last)
            assert "fallback" not in ds.last
            assert_equals_full_update(engine, ref, trainer)


def test_a_tied_pair_in_separate_storages_stays_one_part(ckpt_factory):
    """A tied model's embedding and LM head given as equal tensors in two storages (a state dict gathered
    from FSDP2: each full_tensor() is its own copy), split in several parts: the pair still travels in one
    part, so every sync is a delta the engine takes (the second part had been refused as a stale base)."""
    ckpt = ckpt_factory("qwen2", tie_word_embeddings=True)
    with Engine(str(ckpt), **ENGINE_KW) as engine, Engine(str(ckpt), **ENGINE_KW) as ref:
        trainer = Trainer(ckpt, 1e-3)
        ds = DeltaSync(engine, bucket_bytes=1 << 14)

        def copies():
            sd = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            assert sd["lm_head.weight"].data_ptr() != sd["model.embed_tokens.weight"].data_ptr()
            return sd

        assert ds.sync(copies())[0]
        for _ in range(2):
            trainer.step()
            version = engine.weight_version
            ok, msg = ds.sync(copies())
            assert ok and ds.last["mode"] == "delta" and ds.last["num_updates"] > 1, (msg, ds.last)
            assert engine.weight_version != version
            assert_equals_full_update(engine, ref, trainer)


def test_stale_base_is_refused_then_fallback_sends_full(engines, tiny_llama):
    """A delta against weights the engine no longer holds is refused untouched; fallback=True syncs in full."""
    engine, ref = engines
    trainer, other = Trainer(tiny_llama, 1e-3, seed=1), Trainer(tiny_llama, 1e-2, seed=2)
    ds = DeltaSync(engine)
    assert ds.sync(trainer.model)[0]
    other.step()
    assert engine.update_weights_from_tensor(other.cast())[0]  # another trainer writes in between
    before, version = checksum(engine), engine.weight_version
    trainer.step()
    ok, msg = ds.sync(trainer.model)
    assert not ok and dc.STALE_BASE in msg and "full sync" in msg, msg
    assert checksum(engine) == before and engine.weight_version == version
    assert greedy(engine)  # still serving
    ds2 = DeltaSync(engine)
    assert ds2.sync(trainer.model)[0]
    assert engine.update_weights_from_tensor(other.cast())[0]
    trainer.step()
    ok, msg = ds2.sync(trainer.model, fallback=True)
    assert ok and "fell back to a full sync" in msg and ds2.last["mode"] == "full" and ds2.last["fallback"], msg
    assert_equals_full_update(engine, ref, trainer)
    trainer.step()  # and deltas resume from the new baseline
    assert ds2.sync(trainer.model)[0] and ds2.last["mode"] == "delta"
    assert_equals_full_update(engine, ref, trainer, outputs=True)


def _current(engine, name: str) -> torch.Tensor:
    return engine.runner.name_map.resolve(name).view().detach().clone()


def _gap_entry(name, base, positions, values_bits, base_hash, result=0, val_kind="raw"):
    gaps = torch.diff(torch.tensor(positions, dtype=torch.int64), prepend=torch.tensor([-1]))
    vals = dc.from_bits(torch.tensor(values_bits, dtype=torch.int64), base.dtype).view(torch.uint8) \
        if val_kind == "raw" else dc.varint_encode(dc.zigzag(torch.tensor(values_bits, dtype=torch.int64)))
    return dc.EncodedTensor({"name": name, "dtype": dc.DTYPE_NAMES[base.dtype], "shape": list(base.shape),
                             "pos": "gaps", "val": val_kind, "count": len(positions), "base": base_hash,
                             "result": result}, dc.varint_encode(gaps), vals, len(positions))


def test_bad_deltas_are_refused_and_change_nothing(engines, monkeypatch):
    """Out-of-range and duplicate positions, NaN, truncated payloads, a wrong result checksum, a cast dtype,
    a failing write: each refused by name; checksum, version and outputs stay; the engine serves."""
    engine, _ = engines
    name, other = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"
    w, w2 = _current(engine, name), _current(engine, other)
    h, h2 = dc.tensor_hash(w), dc.tensor_hash(w2)
    before, version, outs = checksum(engine), engine.weight_version, greedy(engine)
    numel = w.numel()
    one = dc.to_bits(torch.ones(1, dtype=w.dtype)).tolist()[0]
    nan = dc.to_bits(torch.full((1,), float("nan"), dtype=w.dtype)).tolist()[0]
    good = w.clone()
    good.view(-1)[[3, 17]] = 0.25
    good_enc = dc.encode_tensor(name, w, good, h)
    cases = {
        "out of range": dc.DeltaUpdate.pack([_gap_entry(name, w, [3, numel], [one, one], h)]),
        "duplicate": dc.DeltaUpdate.pack([_gap_entry(name, w, [3, 3], [one, one], h)]),
        "NaN or inf": dc.DeltaUpdate.pack([_gap_entry(name, w, [3], [nan], h)]),
        "announces": dc.DeltaUpdate.pack([_gap_entry(name, w, [3], [one], h, result=h)]),  # corrupted
    }
    short = dc.DeltaUpdate.pack([good_enc])
    short.entries[0]["val_bytes"][1] -= 1
    cases["truncated"] = short
    cases["never cast"] = dc.DeltaUpdate.pack([dc.encode_tensor(name, w.float(), good.float(), dc.tensor_hash(w.float()))])
    for words, update in cases.items():
        ok, msg = engine.update_weights_from_tensor(update, load_format="delta")
        assert not ok and words in msg, (words, msg)
    blob = dc.DeltaUpdate.pack([good_enc]).to_bytes()
    for cut in (len(blob) - 1, len(blob) // 2, 4):
        ok, msg = engine.update_weights_from_tensor(blob[:cut], load_format="delta")
        assert not ok and ("truncated" in msg or "shorter" in msg), msg
    # a write that fails on the second tensor: the first one's elements are put back
    two = dc.DeltaUpdate.pack([good_enc, dc.encode_tensor(other, w2, w2 + 1, h2)])
    calls = []
    real = loader.WeightWriter.write_elements

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(loader.WeightWriter, "write_elements", flaky)
    ok, msg = engine.update_weights_from_tensor(two, load_format="delta")
    monkeypatch.undo()
    assert not ok and "restored" in msg and len(calls) == 2, msg
    assert checksum(engine) == before and engine.weight_version == version
    assert greedy(engine) == outs
    # the good delta still applies afterwards (the cached checksums were not disturbed)
    ok, msg = engine.update_weights_from_tensor(dc.DeltaUpdate.pack([good_enc]), load_format="delta")
    assert ok, msg
    assert torch.equal(_current(engine, name), good)


def test_a_later_part_refused_says_the_earlier_ones_landed(engines, tiny_llama):
    """When part 1 of a several-part delta is refused, the message says part 0 was applied (the engine's own
    "nothing was changed" is about that part alone), and the next sync is a full one that restores agreement."""
    engine, ref = engines
    trainer = Trainer(tiny_llama, 1e-3, seed=5)

    class RefusesPartOne:
        def __init__(self):
            self.parts = 0

        def update_weights_from_tensor(self, *args, **kwargs):
            self.parts += kwargs.get("load_format") == "delta"
            if self.parts == 2 and kwargs.get("load_format") == "delta":
                return False, "refused for the test; nothing was changed"
            return engine.update_weights_from_tensor(*args, **kwargs)

    target = RefusesPartOne()
    ds = DeltaSync(target, dtype=torch.bfloat16, bucket_bytes=1 << 12)
    assert ds.sync(trainer.model)[0] and ds.last["mode"] == "full"
    trainer.step()
    ok, msg = ds.sync(trainer.model, weight_version="d2")
    assert not ok and "delta part 1 of" in msg and "parts 0-0 were applied" in msg, msg
    assert engine.weight_version == "d2-partial-0"  # part 0 landed; "d2" itself was never reached
    ok, msg = ds.sync(trainer.model, weight_version="d3")
    assert ok and ds.last["mode"] == "full", msg
    assert engine.weight_version == "d3"
    assert_equals_full_update(engine, ref, trainer)


def test_an_engine_that_raises_mid_delta_drops_the_baseline_and_a_dead_one_is_named(engines, tiny_llama):
    """A list target whose second engine raises (a dead RemoteEngine) after the first applied the delta: the
    exception propagates and the next sync is a full one (the docstring's "any other failure drops the
    baseline"; it stayed, and the next delta was refused as a stale base); a dtype probe of a dead engine names
    its error, not only "pass dtype="."""
    engine, ref = engines
    trainer = Trainer(tiny_llama, 1e-3, seed=6)

    class Dead:
        def __init__(self):
            self.alive = True

        def update_weights_from_tensor(self, *args, **kwargs):
            if not self.alive:
                raise RuntimeError("remote engine: engine process exited (exit code -9)")
            return True, "ok"

        def get_server_info(self):
            raise RuntimeError("remote engine: engine process exited (exit code -9)")

    dead = Dead()
    ds = DeltaSync([engine, dead], dtype=torch.bfloat16)
    assert ds.sync(trainer.model)[0] and ds.last["mode"] == "full"
    trainer.step()
    dead.alive = False
    with pytest.raises(RuntimeError, match="engine process exited"):
        ds.sync(trainer.model)
    ds.target = engine  # the caller drops the dead engine and syncs the live one again
    ok, msg = ds.sync(trainer.model)
    assert ok and ds.last["mode"] == "full", msg
    assert_equals_full_update(engine, ref, trainer)
    with pytest.raises(ValueError, match="get_server_info.*RuntimeError: remote engine: engine process exited"):
        DeltaSync(Dead()).sync(trainer.model)
