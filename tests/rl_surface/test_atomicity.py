"""Weight updates are all or nothing on every route, including failures during the write itself.

Oracles: fresh engines on checkpoints A and B (their parameters and outputs), the safetensors files
read with `safetensors`, and hand-made tensors. Every refused update is checked three ways: (False,
reason naming the tensor or file), parameters torch.equal to the snapshot before the call, and
weight_version unchanged (plus outputs bit-identical where it matters).
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import runner.weights.loader as weight_loader
from runner.weights.checkpoint import CheckpointIndex
from tests.rl_surface.conftest import assert_same_tensors, make_engine, read_state_dict, run, snapshot
from weight_sync.disk import save_hf_checkpoint

Q = "model.layers.0.self_attn.q_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"
NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def _last(sd: dict, name: str, tensor) -> list:
    """`sd`'s pairs with `name` moved to the end and replaced by `tensor`: good tensors go first."""
    return [(n, t) for n, t in sd.items() if n != name] + [(name, tensor)]


def _refused(engine, before, ok_msg, *fragments, version="default"):
    ok, msg = ok_msg[:2]  # update_weights_from_disk adds num_paused_requests
    assert not ok, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    assert engine.weight_version == version
    assert_same_tensors(before, engine)


@pytest.fixture(scope="module")
def pair(ckpt_factory):
    """(A dir, B dir, B's state dict, A's outputs, B's outputs) for llama, from fresh engines."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    with make_engine(a) as ea, make_engine(b) as eb:
        return a, b, read_state_dict(b), run(ea), run(eb)


# ---- item 2: a checkpoint rewritten while it is being loaded --------------------------------------
def test_disk_load_during_atomic_rewrites_is_one_checkpoint_or_nothing(ckpt_pair, tmp_path):
    """While a thread rewrites the directory A, B, A, ... with the atomic saver (several shards), every
    ok load holds exactly A's or B's weights and every refused one leaves the previous weights."""
    a, b = ckpt_pair("llama")
    sd = {"A": read_state_dict(a), "B": read_state_dict(b)}
    live = tmp_path / "live"
    save = lambda which: save_hf_checkpoint(sd[which], live, config=a / "config.json", max_shard_bytes=48 << 10)  # noqa: E731
    save("A")
    assert len(list(live.glob("*.safetensors"))) >= 4
    with make_engine(a) as ea, make_engine(b) as eb:
        oracle = {"A": snapshot(ea), "B": snapshot(eb)}

    def which(engine) -> str | None:
        now = snapshot(engine)
        hits = [k for k, snap in oracle.items() if all(torch.equal(now[n], t) for n, t in snap.items())]
        return hits[0] if hits else None

    stop, saves = threading.Event(), [0]

    def writer():
        while not stop.is_set():
            save("B" if saves[0] % 2 == 0 else "A")
            saves[0] += 1

    outcomes = {"ok": set(), "failed": 0}
    with make_engine(a) as engine:
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        try:
            current, deadline = "A", time.monotonic() + 8.0
            while time.monotonic() < deadline and (len(outcomes["ok"]) < 2 or outcomes["failed"] < 1
                                                   or time.monotonic() < deadline - 5.0):
                ok, msg, _ = engine.update_weights_from_disk(str(live))
                got = which(engine)
                if ok:
                    assert got in ("A", "B"), f"ok=True but the weights are a mix: {msg}"
                    outcomes["ok"].add(got)
                    current = got
                else:
                    assert got == current, f"ok=False changed the weights: {msg}"
                    outcomes["failed"] += 1
        finally:
            stop.set()
            thread.join(timeout=30)
    assert saves[0] >= 4, "the writer barely ran: the test proved nothing"
    assert outcomes["ok"], "no load succeeded"


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_index_pointing_outside_the_directory_is_refused(pair, tmp_path, ckpt_factory, where):
    """An index whose shard path is absolute or climbs out with '..' is refused, naming it; even though
    the file it points at exists and is valid, nothing is read and the weights stay."""
    a, _, _, _, _ = pair
    src = ckpt_factory("llama", seed=1, shard=True)
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    shutil.copytree(src, ckpt)
    outside.mkdir()
    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    shutil.move(ckpt / shard, outside / shard)
    pointer = f"../outside/{shard}" if where == "parent" else str(outside / shard)
    index["weight_map"] = {n: (pointer if f == shard else f) for n, f in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    with make_engine(a) as engine:
        before = snapshot(engine)
        _refused(engine, before, engine.update_weights_from_disk(str(ckpt)), pointer, "outside the checkpoint")


# ---- item 3: a failure during the write ----------------------------------------------------------
def test_sparse_tensor_after_plain_ones_is_densified(pair):
    """A sparse tensor (after plain ones) is densified and loads: outputs == a fresh engine on B."""
    a, _, sd_b, _, out_b = pair
    with make_engine(a) as engine:
        ok, msg = engine.update_weights_from_tensor(_last(sd_b, UP, sd_b[UP].to_sparse()))
        assert ok, msg
        assert run(engine) == out_b


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo default group (in-process, no port) and its device mesh, torn down after."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensors_after_plain_tensors_are_gathered(pair, one_rank_mesh):
    """DTensors (an FSDP2 state_dict's, sharded on dim 0) after plain tensors load via full_tensor():
    outputs == a fresh engine on B."""
    from torch.distributed.tensor import Shard, distribute_tensor

    a, _, sd_b, _, out_b = pair
    names = [DOWN, NORM, Q]
    named = [(n, t) for n, t in sd_b.items() if n not in names]
    named += [(n, distribute_tensor(sd_b[n], one_rank_mesh, [Shard(0)])) for n in names]
    with make_engine(a) as engine:
        ok, msg = engine.update_weights_from_tensor(named)
        assert ok, msg
        assert run(engine) == out_b


def _failing_loader(param, loaded, shard_id=None):
    """Writes part of the tensor, then fails: the worst case, a failure after bytes were written."""
    weight_loader.shard_view(param, shard_id).view(-1)[:7].copy_(loaded.reshape(-1)[:7])
    raise RuntimeError("device lost mid-copy")


def test_write_that_fails_half_way_restores_everything(pair, monkeypatch):
    """A copy that fails after the checks passed and after earlier tensors (and part of itself) were
    written -> (False, reason); every parameter equals its old value; outputs == before; version kept."""
    a, _, sd_b, out_a, _ = pair
    with make_engine(a) as engine:
        before = snapshot(engine)
        monkeypatch.setattr(engine.runner.name_map.resolve(NORM).param, "weight_loader", _failing_loader, raising=False)
        result = engine.update_weights_from_tensor(_last(sd_b, NORM, sd_b[NORM]))
        _refused(engine, before, result, NORM, "device lost mid-copy", "restored")
        assert run(engine) == out_a


def test_disk_second_pass_read_failure_restores_everything(pair, monkeypatch):
    """A read that fails in the disk loader's writing pass (after earlier tensors were written) ->
    (False, reason), old weights everywhere, outputs == before."""
    a, b, _, out_a, _ = pair
    real_read, reads = CheckpointIndex.read, {}

    def read(self, name):
        reads[name] = reads.get(name, 0) + 1
        if name == DOWN and reads[name] == 2:  # pass 2: sorted late, so others are written already
            raise OSError("EIO reading shard")
        return real_read(self, name)

    with make_engine(a) as engine:
        before = snapshot(engine)
        monkeypatch.setattr(CheckpointIndex, "read", read)
        _refused(engine, before, engine.update_weights_from_disk(str(b)), "EIO", "restored")
        assert run(engine) == out_a


def test_unrestorable_failure_marks_weights_invalid_until_a_full_update(pair, monkeypatch):
    """If the old values cannot be put back either, the update says so and generate refuses (never a
    mix served); a full update afterwards makes it serve exactly B."""
    a, _, sd_b, _, out_b = pair
    with make_engine(a) as engine:
        param = engine.runner.name_map.resolve(NORM).param
        monkeypatch.setattr(param, "weight_loader", _failing_loader, raising=False)

        def restore(target, old):
            raise RuntimeError("restore failed too")

        monkeypatch.setattr(weight_loader, "restore", restore)
        ok, msg = engine.update_weights_from_tensor(_last(sd_b, NORM, sd_b[NORM]))
        assert not ok and "restore failed too" in msg and "mix" in msg, msg
        assert engine.weight_version == "default"
        with pytest.raises(RuntimeError, match="weights are invalid"):
            engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
        with pytest.raises(ValueError, match="invalid"):
            engine.get_weights_by_name(NORM)
        monkeypatch.undo()
        ok, msg = engine.update_weights_from_tensor(list(sd_b.items()))
        assert ok, msg
        assert run(engine) == out_b


# ---- item 5: finiteness after the cast ------------------------------------------------------------
def test_float64_overflowing_fp32_is_refused(pair):
    """A float64 1e300 (finite in float64, inf in the engine's fp32) is refused, last in the list."""
    a, _, sd_b, out_a, _ = pair
    big = sd_b[UP].double().index_fill_(0, torch.tensor([2]), 1e300)
    with make_engine(a) as engine:
        before = snapshot(engine)
        _refused(engine, before, engine.update_weights_from_tensor(_last(sd_b, UP, big)), UP, "inf", "float64")
        assert run(engine) == out_a


def test_fp32_overflowing_fp16_engine_is_refused(pair):
    """An fp32 1e5 (above float16's 65504) into a float16 engine is refused; nothing is written."""
    a, _, sd_b, _, _ = pair
    with make_engine(a, dtype="float16") as engine:
        before = snapshot(engine)
        big = sd_b[DOWN].clone().index_fill_(1, torch.tensor([0]), 1e5)
        _refused(engine, before, engine.update_weights_from_tensor(_last(sd_b, DOWN, big)), DOWN, "inf")


def test_float64_checkpoint_overflowing_fp32_is_refused(pair, tmp_path):
    """A float64 checkpoint file holding 1e300 is refused by update_weights_from_disk, naming it."""
    a, b, sd_b, out_a, _ = pair
    ckpt = tmp_path / "f64"
    ckpt.mkdir()
    shutil.copy(b / "config.json", ckpt / "config.json")
    sd64 = {n: t.double() for n, t in sd_b.items()}
    sd64[DOWN][3, 3] = 1e300
    save_file(sd64, ckpt / "model.safetensors")
    with make_engine(a) as engine:
        before = snapshot(engine)
        _refused(engine, before, engine.update_weights_from_disk(str(ckpt)), DOWN, "inf", "model.safetensors")
        assert run(engine) == out_a


def test_disk_second_pass_checks_what_it_writes(pair, monkeypatch):
    """If the bytes read in the writing pass differ from the checked ones (inf), the load is refused
    and undone: the check runs where the write happens, not only in the first pass."""
    a, b, _, out_a, _ = pair
    real_read, reads = CheckpointIndex.read, {}

    def read(self, name):
        reads[name] = reads.get(name, 0) + 1
        t = real_read(self, name)
        return t.clone().fill_(float("inf")) if name == DOWN and reads[name] == 2 else t

    with make_engine(a) as engine:
        before = snapshot(engine)
        monkeypatch.setattr(CheckpointIndex, "read", read)
        _refused(engine, before, engine.update_weights_from_disk(str(b)), DOWN, "inf")
        assert run(engine) == out_a


# ---- item 9: a tied LM head ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tied(ckpt_factory):
    a = ckpt_factory("qwen2", seed=0, tie_word_embeddings=True)
    b = ckpt_factory("qwen2", seed=1, tie_word_embeddings=True)
    with make_engine(a) as ea, make_engine(b) as eb:
        return a, b, read_state_dict(a), read_state_dict(b), run(ea), run(eb)


def test_tied_lm_head_reads_as_the_embedding(tied):
    """get_weights_by_name('lm_head.weight') on a tied model is the embedding's rows (from the file)."""
    a, _, sd_a, _, _, _ = tied
    assert LM_HEAD not in sd_a
    with make_engine(a) as engine:
        got = torch.tensor(engine.get_weights_by_name(LM_HEAD, truncate_size=4))
        assert torch.equal(got, sd_a[EMBED][:4])


def test_tied_lm_head_equal_to_the_embedding_is_accepted(tied):
    """A trainer state_dict carrying lm_head.weight == embed_tokens.weight loads (== fresh B); an
    lm_head alone equal to the current embedding is accepted and changes nothing."""
    a, _, sd_a, sd_b, out_a, out_b = tied
    with make_engine(a) as engine:
        before = snapshot(engine)
        ok, msg = engine.update_weights_from_tensor([(LM_HEAD, sd_a[EMBED].clone())])
        assert ok, msg
        assert_same_tensors(before, engine)
        assert run(engine) == out_a
        ok, msg = engine.update_weights_from_tensor([*sd_b.items(), (LM_HEAD, sd_b[EMBED].clone())])
        assert ok, msg
        assert run(engine) == out_b


@pytest.mark.parametrize("case", ["alone", "with the new embedding"])
def test_tied_lm_head_different_from_the_embedding_is_refused(tied, case):
    """lm_head.weight that differs from the embedding it is tied to (the current one, or the one in the
    same update) -> (False, reason naming both); nothing changes."""
    a, _, _, sd_b, out_a, _ = tied
    named = [(LM_HEAD, sd_b[EMBED])] if case == "alone" else [*sd_b.items(), (LM_HEAD, sd_b[EMBED] * 2)]
    with make_engine(a) as engine:
        before = snapshot(engine)
        _refused(engine, before, engine.update_weights_from_tensor(named), LM_HEAD, EMBED, "differs")
        assert run(engine) == out_a


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tied, tmp_path):
    """A tied checkpoint on disk whose lm_head.weight differs from its embedding is refused by name."""
    a, b, _, sd_b, out_a, _ = tied
    ckpt = tmp_path / "tied"
    ckpt.mkdir()
    shutil.copy(b / "config.json", ckpt / "config.json")
    save_file({**sd_b, LM_HEAD: sd_b[EMBED] + 1}, ckpt / "model.safetensors")
    with make_engine(a) as engine:
        before = snapshot(engine)
        _refused(engine, before, engine.update_weights_from_disk(str(ckpt)), LM_HEAD, "differs")
        assert run(engine) == out_a
