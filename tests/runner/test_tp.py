"""Tensor parallelism on the CPU: 2 ranks over gloo (rank 0 in this process, rank 1 spawned).

The module's TP engine runs a Qwen2 checkpoint with q/k/v bias, a tied (vocab-parallel) LM head and
one KV head (replicated on both ranks), against tp_size=1 and HF transformers on the same checkpoint.
"""

from __future__ import annotations

import time

import pytest
import torch

from rollout import Engine
from tests.checkpoints import load_hf_model
from tests.rollout.oracle import ENGINE_DEFAULTS, hf_generate
from weight_sync.bucket import FlattenedTensorBucket

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 200, 13, 5, 9, 77]]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
SHAPE = dict(tie_word_embeddings=True, num_key_value_heads=1)


def _engine(path, **kwargs) -> Engine:
    return Engine(str(path), **{**ENGINE_DEFAULTS, "skip_tokenizer_init": True, **kwargs})


def _run(engine: Engine) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _assert_same(got, want, tol: float = 1e-5) -> None:
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) <= tol


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    old = make_checkpoint(tmp_path_factory.mktemp("tp-old"), "qwen2", seed=0, **SHAPE)
    new = make_checkpoint(tmp_path_factory.mktemp("tp-new"), "qwen2", seed=1, **SHAPE)
    return old, new


@pytest.fixture(scope="module")
def tp_engine(ckpts):
    engine = _engine(ckpts[0], tp_size=2, enable_memory_saver=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(ckpts):
    """tp_size=1 outputs on the old and the new weights."""
    out = {}
    for key, path in zip(("old", "new"), ckpts, strict=True):
        with _engine(path) as e:
            out[key] = _run(e)
    return out


def test_tp2_greedy_equals_tp1_and_hf(tp_engine, reference, ckpts):
    """tp_size=2 greedy tokens equal tp_size=1's and HF's; logprobs within 1e-5 of both."""
    got = _run(tp_engine)
    _assert_same(got, reference["old"])
    hf = load_hf_model(ckpts[0])
    _assert_same(got, [hf_generate(hf, p, GREEDY["max_new_tokens"]) for p in PROMPTS])


def test_tp2_get_weights_by_name_is_the_full_tensor(tp_engine, ckpts):
    """Sharded weights read back whole (assembled from both ranks), equal to the checkpoint's."""
    hf = load_hf_model(ckpts[0]).state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.bias"):
        got = torch.tensor(tp_engine.get_weights_by_name(name, truncate_size=1000))
        want = hf[name][:1000] if hf[name].dim() > 1 else hf[name].reshape(-1)[:1000]
        assert torch.equal(got, want.float()), name
    # max_values bounds the assembled slice as at tp_size=1 (the ranks' replies are read either way)
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=f"hold {3 * k.shape[1]} values"):
        tp_engine.get_weights_by_name("model.layers.0.self_attn.k_proj.weight", 3, max_values=2 * k.shape[1])
    got = tp_engine.get_weights_by_name("model.layers.0.self_attn.k_proj.weight", 2, max_values=2 * k.shape[1])
    assert torch.equal(torch.tensor(got), k[:2].float())


def test_tp2_fused_parameter_name_is_refused_naming_the_hf_tensors(tp_engine):
    """A fused runner parameter (qkv_proj), which get_weights_by_name reads whole at tp_size=1, is refused under
    tensor parallelism naming the HF tensors to read instead (it was "unknown weight name"), and a weight read
    after it still works."""
    with pytest.raises(Exception, match="fused parameter.*q_proj/k_proj/v_proj"):
        tp_engine.get_weights_by_name("model.layers.0.self_attn.qkv_proj.weight")
    assert len(tp_engine.get_weights_by_name("model.norm.weight", truncate_size=4)) == 4


def test_tp2_checksum_covers_every_rank(tp_engine, ckpts):
    """A change only rank 1 holds (the last rows of a column-parallel weight) moves get_weights_checksum;
    putting the original back restores it exactly."""
    name = "model.layers.0.self_attn.q_proj.weight"
    full = torch.tensor(tp_engine.get_weights_by_name(name, truncate_size=1 << 30))
    before = tp_engine.get_weights_checksum()
    changed = full.clone()
    changed[-1] += 0.5  # rank 1's slice of the output rows
    try:
        assert tp_engine.update_weights_from_tensor([(name, changed)])[0]
        assert tp_engine.get_weights_checksum()["checksum"] != before["checksum"]
    finally:
        assert tp_engine.update_weights_from_tensor([(name, full)])[0]
    assert tp_engine.get_weights_checksum()["checksum"] == before["checksum"]


def test_tp2_every_update_route_equals_a_fresh_tp_engine(tp_engine, reference, ckpts, tmp_path):
    """Tensor, flattened-bucket and disk updates under TP give what a fresh TP engine on the new weights gives."""
    old_sd, new_sd = (load_hf_model(p).state_dict() for p in ckpts)
    new_pairs = [(n, t) for n, t in new_sd.items() if n != "lm_head.weight"]
    old_pairs = [(n, t) for n, t in old_sd.items() if n != "lm_head.weight"]
    with _engine(ckpts[1], tp_size=2) as fresh:
        fresh_out = _run(fresh)
    _assert_same(fresh_out, reference["new"])
    routes = [
        ("tensor", lambda: tp_engine.update_weights_from_tensor(new_pairs)),
        ("bucket", lambda: tp_engine.update_weights_from_tensor(
            [FlattenedTensorBucket(new_pairs).to_dict()], load_format="flattened_bucket")),
        ("disk", lambda: tp_engine.update_weights_from_disk(str(ckpts[1]))),
    ]
    for route, update in routes:
        ok, msg = update()[:2]  # the disk route also returns the number of tensors (SGLang's triple)
        assert ok, (route, msg)
        _assert_same(_run(tp_engine), fresh_out)
        ok, msg = tp_engine.update_weights_from_tensor(old_pairs)
        assert ok, msg
        _assert_same(_run(tp_engine), reference["old"])


def test_tp2_bad_update_changes_nothing_on_any_rank(tp_engine, reference, ckpts):
    """A refused update (NaN in one tensor, after a good one) leaves every rank's weights as they were."""
    before = _run(tp_engine)
    sd = load_hf_model(ckpts[1]).state_dict()
    bad = sd["model.layers.1.mlp.down_proj.weight"].clone()
    bad[3, -1] = float("nan")  # in the columns rank 1 holds
    ok, msg = tp_engine.update_weights_from_tensor([("model.layers.0.mlp.down_proj.weight",
                                                     sd["model.layers.0.mlp.down_proj.weight"]),
                                                    ("model.layers.1.mlp.down_proj.weight", bad)])
    assert not ok and "NaN" in msg
    _assert_same(_run(tp_engine), before)
    # Integer and bool tensors reach every rank (the command channel carries any plain dtype) and are refused
    # there by name; a dtype the channel could not decode once killed rank 1 and the engine with it.
    name = "model.layers.0.mlp.down_proj.weight"
    for dtype in (torch.int16, torch.bool, torch.int8):
        ok, msg = tp_engine.update_weights_from_tensor([(name, sd[name].to(dtype))])
        assert not ok and "not a floating-point dtype" in msg and str(dtype) in msg, msg
    _assert_same(_run(tp_engine), before)


def test_channel_carries_plain_dtypes_and_refuses_the_rest_before_sending():
    """The rank command channel round-trips every plain dtype bit for bit; a quantized tensor is refused by name
    before any byte goes out (the far side sees no message, so the channel stays in step)."""
    import multiprocessing
    import warnings

    from runner.tp import channel

    a, b = multiprocessing.Pipe()
    for dtype in (torch.int16, torch.bool, torch.uint8, torch.complex64, torch.float8_e4m3fn, torch.bfloat16):
        t = (torch.arange(6).reshape(2, 3) % 3).to(dtype)
        channel.send(a, {"cmd": "x"}, [t])
        header, (got,) = channel.recv(b, 5)
        assert header == {"cmd": "x"} and got.dtype == dtype and got.view(torch.uint8).equal(t.view(torch.uint8))
    with warnings.catch_warnings():  # torch deprecates quantized tensors; one must still be refused cleanly
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(ValueError, match="qint8"):
        channel.send(a, {"cmd": "x"}, [torch.ones(2), q])
    assert not b.poll(0.1)


def test_tp2_release_resume_act_on_every_rank(tp_engine, reference, ckpts):
    """Release/resume of the KV cache keeps outputs; released weights refuse to generate until reloaded."""
    before = _run(tp_engine)
    _assert_same(before, reference["old"])
    tp_engine.release_memory_occupation(["kv_cache"])
    tp_engine.resume_memory_occupation(["kv_cache"])
    _assert_same(_run(tp_engine), before)
    tp_engine.release_memory_occupation()
    tp_engine.resume_memory_occupation(["weights"])
    with pytest.raises(RuntimeError, match="released without CPU backup"):
        tp_engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    sd = load_hf_model(ckpts[0]).state_dict()
    ok, msg = tp_engine.update_weights_from_tensor([(n, t) for n, t in sd.items() if n != "lm_head.weight"])
    assert ok, msg
    tp_engine.resume_memory_occupation(["kv_cache"])
    _assert_same(_run(tp_engine), before)


def test_tp2_killed_rank_fails_with_a_clear_error_within_seconds(ckpts):
    """SIGKILL of rank 1: the next generate ends within seconds with 'tensor-parallel rank 1 died'."""
    with _engine(ckpts[0], tp_size=2) as engine:
        proc = engine.runner.procs[0]
        proc.kill()
        proc.join(timeout=10)
        start = time.monotonic()
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        elapsed = time.monotonic() - start
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "tensor-parallel rank 1 died" in out["meta_info"]["finish_reason"]["message"]
        assert elapsed < 10.0


def test_tp2_rank_dying_before_it_joins_is_named_within_seconds(ckpts, monkeypatch):
    """A worker killed right after it is spawned (as a failed import or an OOM kill would end it): building the
    engine raises 'tensor-parallel rank 1 died' within seconds (it used to wait for the store's 60 s timeout
    and say "1/2 clients joined"), and no worker process is left."""
    import multiprocessing.context
    import os
    import signal

    spawned = []
    real_start = multiprocessing.context.SpawnProcess.start

    def start_and_kill(self):
        real_start(self)
        spawned.append(self)
        os.kill(self.pid, signal.SIGKILL)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start_and_kill)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 died \(exit code -9\) before it joined"):
        _engine(ckpts[0], tp_size=2)
    assert time.monotonic() - t0 < 20
    assert spawned and not any(p.is_alive() for p in spawned)


def test_tp_size_refusals(ckpts, ckpt_factory):
    """tp_size that does not split the heads, or a MoE model, is refused at construction naming the limit."""
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        _engine(ckpts[0], tp_size=3)
    with pytest.raises(ValueError, match="tp_size=0"):
        _engine(ckpts[0], tp_size=0)
