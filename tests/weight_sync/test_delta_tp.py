"""DeltaSync into a tp_size=2 engine: each rank applies its own slice, exactly, or nothing changes.

A Qwen2 checkpoint with a tied, vocab-parallel embedding and one KV head (replicated on both ranks), so
sliced, padded and replicated tensors are all covered. Oracles: every HF tensor read back whole from
both ranks equals the trainer's bf16 cast bit for bit, and greedy tokens equal a tp_size=1 engine given
a full update of the same cast.
"""

from __future__ import annotations

import pytest
import torch

from rollout import Engine
from tests.weight_sync.delta_helpers import ENGINE_KW, Trainer, greedy
from weight_sync import DeltaSync
from weight_sync import delta_codec as dc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("delta-tp"), "qwen2", seed=3, tie_word_embeddings=True,
                           num_key_value_heads=1)


def assert_holds_cast(engine, trainer: Trainer) -> None:
    for name, want in trainer.cast():
        got = torch.tensor(engine.get_weights_by_name(name, truncate_size=1 << 40), dtype=torch.float32)
        assert torch.equal(got.reshape(want.shape).to(torch.bfloat16).view(torch.int16),
                           want.view(torch.int16)), name


@pytest.mark.parametrize("lr", [1e-6, 1e-3])
def test_tp2_deltas_equal_a_full_update(ckpt, lr):
    """After each Adam step the tp=2 engine holds the cast bit for bit and decodes like tp=1 given it in full."""
    trainer = Trainer(ckpt, lr, seed=4)
    with Engine(str(ckpt), tp_size=2, **ENGINE_KW) as tp, Engine(str(ckpt), **ENGINE_KW) as ref:
        ds = DeltaSync(tp)
        assert ds.sync(trainer.model)[0]
        for _ in range(2):
            trainer.step()
            ok, msg = ds.sync(trainer.model)
            assert ok and ds.last["mode"] == "delta" and ds.last["elements_changed"] > 0, msg
            assert_holds_cast(tp, trainer)
        assert ref.update_weights_from_tensor(trainer.cast())[0]
        assert greedy(tp) == greedy(ref)
        if lr == 1e-3:  # a stale base is refused on every rank, nothing written
            other = Trainer(ckpt, 1e-2, seed=5)
            other.step()
            assert tp.update_weights_from_tensor(other.cast())[0]
            trainer.step()
            version = tp.weight_version
            ok, msg = ds.sync(trainer.model)
            assert not ok and dc.STALE_BASE in msg, msg
            assert tp.weight_version == version
            assert_holds_cast(tp, other)
            ok, msg = ds.sync(trainer.model, fallback=True)  # the baseline was dropped: a full sync
            assert ok and ds.last["mode"] == "full", msg
            trainer.step()
            assert ds.sync(trainer.model)[0] and ds.last["mode"] == "delta"
            assert_holds_cast(tp, trainer)


def test_tp2_delta_reports_every_tensor_it_changes(ckpt):
    """A delta whose changes lie in rank 0's rows, in replicated tensors, and in rank 1's slice alone (a
    down_proj input column, a q_proj output row): the tp=2 engine says it loaded as many tensors as a tp=1
    engine given the same delta (it reported rank 0's count, missing the rank-1-only tensors)."""
    import re

    from tests.checkpoints import load_hf_model

    counts = []
    for tp_size in (2, 1):
        model = load_hf_model(ckpt).to(torch.bfloat16)
        with Engine(str(ckpt), tp_size=tp_size, **ENGINE_KW) as engine:
            ds = DeltaSync(engine)
            assert ds.sync(model)[0]
            with torch.no_grad():
                p = dict(model.named_parameters())
                p["model.embed_tokens.weight"][0, 0] += 0.25
                p["model.norm.weight"][3] += 0.125
                p["model.layers.1.mlp.down_proj.weight"][:, -1] += 0.25
                p["model.layers.1.self_attn.q_proj.weight"][-1, :] += 0.25
            ok, msg = ds.sync(model)
            assert ok and ds.last["mode"] == "delta", msg
            counts.append(int(re.search(r"(\d+) tensors?", msg).group(1)))
    assert counts[0] == counts[1] == 4, counts
