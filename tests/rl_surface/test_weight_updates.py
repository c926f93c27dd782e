"""Hot weight swaps: after an update the engine generates exactly what a fresh engine on the new
checkpoint generates (tokens and logprobs, bit for bit), whatever path the weights took."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.rl_surface.conftest import (
    assert_same_tensors,
    at_step,
    make_engine,
    params,
    read_state_dict,
    run,
    snapshot,
    versions,
)
from weight_sync import iter_buckets

# (arch, tied): every architecture, tied and untied embeddings between them; all fuse q/k/v and gate/up.
VARIANTS = [
    ("llama", False),
    ("llama", True),
    ("mistral", False),
    ("qwen2", True),
    ("qwen2", False),
    ("qwen3", True),
]


@pytest.mark.parametrize("arch,tied", VARIANTS)
def test_update_from_tensor_equals_fresh_engine(ckpt_pair, reference_outputs, arch, tied):
    """update_weights_from_tensor(B's state dict) -> outputs == a fresh engine on B; version bumps."""
    a, b = ckpt_pair(arch, tie_word_embeddings=tied)
    with make_engine(a) as engine:
        assert run(engine) == reference_outputs(a)
        assert run(engine) != reference_outputs(b)  # the test can fail
        ok, msg = engine.update_weights_from_tensor(list(read_state_dict(b).items()), weight_version="v-b")
        assert ok, msg
        assert run(engine) == reference_outputs(b)
        assert versions(engine) == {"v-b"}


def test_name_sent_twice_takes_its_last_value(ckpt_pair, reference_outputs):
    """A name repeated in one update_weights_from_tensor call loads its last value, as SGLang's in-order load
    does (A's value first, B's last: outputs == a fresh engine on B), in both load formats; the rollback
    snapshot is of the weights before the call, so a later refusal still restores A exactly."""
    a, b = ckpt_pair("llama")
    sd_a, sd_b = read_state_dict(a), read_state_dict(b)
    k = "model.layers.0.self_attn.k_proj.weight"
    with make_engine(a) as engine:
        before = snapshot(engine)
        ok, msg = engine.update_weights_from_tensor([(k, sd_b[k]), (k, sd_a[k] * 0)] + [(k, sd_a[k])] + [
            (k, sd_a[k] + 1), ("model.norm.weight", sd_a["model.norm.weight"][:-1])])
        assert not ok and "model.norm.weight" in msg
        assert_same_tensors(before, engine)
        ok, msg = engine.update_weights_from_tensor([(n, sd_a[n]) for n in sd_a] + list(sd_b.items()))
        assert ok, msg
        assert run(engine) == reference_outputs(b)
        direct = "model.norm.weight"
        ok, msg = engine.update_weights_from_tensor([(direct, sd_a[direct] * 2), (direct, sd_a[direct])],
                                                    load_format="direct")
        assert ok, msg
        assert torch.equal(params(engine)[direct], sd_a[direct])


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_update_from_disk_equals_fresh_engine(ckpt_pair, reference_outputs, arch, tied):
    """update_weights_from_disk(B) -> outputs == a fresh engine on B, and back to A again."""
    a, b = ckpt_pair(arch, tie_word_embeddings=tied)
    with make_engine(a) as engine:
        ok, msg, _ = engine.update_weights_from_disk(str(b))
        assert ok, msg
        assert run(engine) == reference_outputs(b)
        assert versions(engine) == {"1"}
        assert engine.update_weights_from_disk(str(a))[0]
        assert run(engine) == reference_outputs(a)
        assert versions(engine) == {"2"}


def test_update_from_sharded_disk_checkpoint(ckpt_factory, reference_outputs):
    """A sharded checkpoint (index + several files) loads through update_weights_from_disk too."""
    a, b = ckpt_factory("qwen3", seed=0), ckpt_factory("qwen3", seed=1, shard=True)
    assert (b / "model.safetensors.index.json").is_file()
    with make_engine(a) as engine:
        assert engine.update_weights_from_disk(str(b))[0]
        assert run(engine) == reference_outputs(b)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_update_from_one_flattened_bucket(ckpt_pair, reference_outputs, arch, tied):
    """load_format="flattened_bucket" with one bucket holding the whole model == fresh engine on B."""
    a, b = ckpt_pair(arch, tie_word_embeddings=tied)
    (bucket,) = list(iter_buckets(read_state_dict(b), bucket_bytes=1 << 30))
    with make_engine(a) as engine:
        ok, msg = engine.update_weights_from_tensor(bucket.to_dict(), load_format="flattened_bucket")
        assert ok, msg
        assert run(engine) == reference_outputs(b)


def test_update_from_serialized_buckets_one_per_rank(ckpt_pair, reference_outputs):
    """SGLang's Engine shape for load_format="flattened_bucket": a list of serialized buckets (one per TP
    rank, the same) == fresh engine on B; copies that differ are (False, reason) and change nothing."""
    from weight_sync.wire import encode_bucket

    a, b = ckpt_pair("llama")
    buckets = list(iter_buckets(read_state_dict(b), bucket_bytes=1 << 30))
    other = list(iter_buckets(read_state_dict(a), bucket_bytes=1 << 30))
    with make_engine(a) as engine:
        before = snapshot(engine)
        ok, msg = engine.update_weights_from_tensor([encode_bucket(buckets[0]), encode_bucket(other[0])],
                                                    load_format="flattened_bucket")
        assert not ok and "differ" in msg, msg
        assert_same_tensors(before, engine)
        ok, msg = engine.update_weights_from_tensor(named_tensors=[encode_bucket(buckets[0])] * 2,
                                                    load_format="flattened_bucket")
        assert ok, msg
        assert run(engine) == reference_outputs(b)


def test_update_split_in_many_buckets(ckpt_pair, reference_outputs):
    """Small buckets sent one call each (flush only on the last), or all in one call, == fresh engine."""
    a, b = ckpt_pair("llama")
    buckets = [bk.to_dict() for bk in iter_buckets(read_state_dict(b), bucket_bytes=64 << 10)]
    assert len(buckets) >= 4
    with make_engine(a) as engine:
        for i, bucket in enumerate(buckets):
            ok, msg = engine.update_weights_from_tensor(
                bucket, load_format="flattened_bucket", flush_cache=i == len(buckets) - 1
            )
            assert ok, msg
        assert run(engine) == reference_outputs(b)
        assert versions(engine) == {str(len(buckets))}
    with make_engine(a) as engine:
        assert engine.update_weights_from_tensor(buckets, load_format="flattened_bucket")[0]
        assert run(engine) == reference_outputs(b)


def test_a_bucket_of_only_the_tied_lm_head_loads(ckpt_pair, reference_outputs):
    """A tied model's state_dict split so its last bucket holds only lm_head.weight (the embedding's alias):
    every bucket loads (the alias is checked against the embedding, not refused as an empty update), and
    the engine then equals a fresh one on the trainer's checkpoint."""
    a, b = ckpt_pair("qwen2", tie_word_embeddings=True)
    sd = read_state_dict(b)
    sd.pop("lm_head.weight", None)  # a tied checkpoint may not store it: the trainer's state_dict does
    head = sd["model.embed_tokens.weight"].clone()
    with make_engine(a) as engine:
        assert engine.update_weights_from_tensor(list(sd.items()))[0]
        ok, msg = engine.update_weights_from_tensor([("lm_head.weight", head)])
        assert ok, msg
        assert run(engine) == reference_outputs(b)
        ok, msg = engine.update_weights_from_tensor([])
        assert not ok and "no tensors to load" in msg


def test_mixed_dtype_buckets_and_bf16_tensors(ckpt_factory, reference_outputs):
    """bf16 tensors (several single-dtype buckets) load into an fp32 engine as a fresh load of the bf16
    checkpoint does: the same rounding, so the same outputs."""
    a, b16 = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1, dtype=torch.bfloat16)
    sd = read_state_dict(b16)
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    sd = {n: (t.float() if "norm" in n else t) for n, t in sd.items()}  # exact: bf16 -> fp32 loses nothing
    buckets = [bk.to_dict() for bk in iter_buckets(sd, bucket_bytes=64 << 10)]
    # One dtype per bucket (uint8 bytes on the wire, SGLang's layout), both dtypes among the buckets.
    assert {bk["flattened_tensor"].dtype for bk in buckets} == {torch.uint8}
    assert {frozenset(m["dtype"] for m in bk["metadata"]) for bk in buckets} == {frozenset({"bfloat16"}),
                                                                                 frozenset({"float32"})}
    with make_engine(a) as engine:
        assert engine.update_weights_from_tensor(buckets, load_format="flattened_bucket")[0]
        assert run(engine) == reference_outputs(b16)


@pytest.mark.parametrize("tied", [False, True])
def test_subset_update_touches_only_named_tensors(ckpt_pair, reference_outputs, tmp_path, tied):
    """Updating a few tensors (one shard of each fused param among them) writes exactly those slices;
    every other parameter is bit-identical, and outputs == a fresh engine on the spliced checkpoint."""
    a, b = ckpt_pair("qwen2", tie_word_embeddings=tied)
    sd_a, sd_b = read_state_dict(a), read_state_dict(b)
    subset = [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
        "model.embed_tokens.weight",
    ]
    # The oracle: A's files with the subset taken from B, loaded by a fresh engine.
    spliced = tmp_path / "spliced"
    shutil.copytree(a, spliced)
    for f in spliced.glob("*.safetensors"):
        f.unlink()
    save_file({**sd_a, **{n: sd_b[n] for n in subset}}, spliced / "model.safetensors")
    with make_engine(a) as engine:
        before = snapshot(engine)
        ok, msg = engine.update_weights_from_tensor([(n, sd_b[n]) for n in subset])
        assert ok and "loaded 5 tensors" in msg, msg
        assert run(engine) == reference_outputs(spliced)
        p = params(engine)
        kv = engine.runner.model.model.layers[0].self_attn
        q, k, v = kv.q_size, kv.kv_size, kv.kv_size
        qkv_w, qkv_b = (
            p["model.layers.0.self_attn.qkv_proj.weight"],
            p["model.layers.0.self_attn.qkv_proj.bias"],
        )
        assert torch.equal(qkv_w[q : q + k], sd_b["model.layers.0.self_attn.k_proj.weight"])
        assert torch.equal(qkv_b[q : q + k], sd_b["model.layers.0.self_attn.k_proj.bias"])
        old_w, old_b = (
            before["model.layers.0.self_attn.qkv_proj.weight"],
            before["model.layers.0.self_attn.qkv_proj.bias"],
        )
        assert torch.equal(qkv_w[:q], old_w[:q]) and torch.equal(qkv_w[q + k : q + k + v], old_w[q + k :])
        assert torch.equal(qkv_b[:q], old_b[:q]) and torch.equal(qkv_b[q + k :], old_b[q + k :])
        inter = sd_a["model.layers.1.mlp.up_proj.weight"].shape[0]
        gate_up = p["model.layers.1.mlp.gate_up_proj.weight"]
        assert torch.equal(gate_up[:inter], sd_a["model.layers.1.mlp.gate_proj.weight"])
        assert torch.equal(gate_up[inter:], sd_b["model.layers.1.mlp.up_proj.weight"])
        assert torch.equal(p["model.norm.weight"], sd_b["model.norm.weight"])
        assert torch.equal(p["model.embed_tokens.weight"], sd_b["model.embed_tokens.weight"])
        if tied:  # the LM head is the embedding
            assert engine.runner.model.lm_head.weight is p["model.embed_tokens.weight"]
        touched = {
            "model.layers.0.self_attn.qkv_proj.weight",
            "model.layers.0.self_attn.qkv_proj.bias",
            "model.layers.1.mlp.gate_up_proj.weight",
            "model.norm.weight",
            "model.embed_tokens.weight",
        }
        for name, t in p.items():
            if name not in touched:
                assert torch.equal(t, before[name]), name


def test_get_weights_by_name_reads_hf_names(ckpt_pair):
    """get_weights_by_name(HF name) returns the loaded values, fused shards included, and follows updates."""
    a, b = ckpt_pair("qwen2")
    sd_a, sd_b = read_state_dict(a), read_state_dict(b)
    with make_engine(a) as engine:
        for name in (
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.1.mlp.gate_proj.weight",
            "model.norm.weight",
            "lm_head.weight",
        ):
            got = torch.tensor(engine.get_weights_by_name(name, truncate_size=3))
            assert torch.equal(got, sd_a[name][:3]), name
        with pytest.raises(ValueError, match="unknown weight name"):
            engine.get_weights_by_name("model.layers.9.mlp.gate_proj.weight")
        assert engine.update_weights_from_tensor(
            [("model.layers.0.self_attn.v_proj.weight", sd_b["model.layers.0.self_attn.v_proj.weight"])]
        )[0]
        got = torch.tensor(engine.get_weights_by_name("model.layers.0.self_attn.v_proj.weight", 2))
        assert torch.equal(got, sd_b["model.layers.0.self_attn.v_proj.weight"][:2])


def test_update_flushes_prefix_cache(ckpt_pair, reference_outputs):
    """After an update no request reuses KV computed under the old weights (cached_tokens 0)."""
    a, b = ckpt_pair("llama")
    prompt = list(range(5, 45))
    sp = dict(temperature=0, max_new_tokens=4)
    with make_engine(a) as engine:
        engine.generate(input_ids=prompt, sampling_params=sp)
        assert engine.generate(input_ids=prompt, sampling_params=sp)["meta_info"]["cached_tokens"] > 0
        assert engine.update_weights_from_disk(str(b))[0]
        assert engine.generate(input_ids=prompt, sampling_params=sp)["meta_info"]["cached_tokens"] == 0
        assert run(engine) == reference_outputs(b)


def test_update_refused_while_requests_run_unless_paused(ckpt_pair):
    """An update with a request in flight and generation not paused is (False, reason); nothing changes."""
    a, b = ckpt_pair("llama")
    sp = dict(temperature=0, max_new_tokens=40, ignore_eos=True)
    with make_engine(a) as engine:
        before = snapshot(engine)
        reference = engine.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"]
        state = at_step(engine, 5, lambda: engine.update_weights_from_disk(str(b)))  # mid-request
        final = engine.generate(input_ids=[5, 6, 7], sampling_params=sp)
        ok, msg, num_paused = state["result"]
        assert num_paused == 0  # refused: nothing was paused
        assert not ok and "in flight" in msg and "pause_generation" in msg, msg
        # The options it offers exist (online here, force over HTTP's tensor route), and it names itself once.
        assert "online=True" in msg and "`force`" in msg and msg.count("update_weights_from_disk") == 2, msg
        assert final["output_ids"] == reference
        assert final["meta_info"]["weight_version"] == engine.weight_version == "default"
        assert_same_tensors(before, engine)


@pytest.mark.parametrize("route", ["disk", "tensor"])
def test_online_update_retracts_running_requests_which_go_on_under_new_weights(ckpt_pair, route):
    """online=True mid-request (not paused): the update lands, the request is retracted, its first k tokens
    are A's greedy ones and the rest a fresh engine on B's greedy continuation of prompt + those k tokens."""
    a, b = ckpt_pair("llama")
    prompt, n = [5, 6, 7], 24
    sp = dict(temperature=0, max_new_tokens=n, ignore_eos=True)
    with make_engine(b) as fresh_b:
        with make_engine(a) as engine:
            reference_a = engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
            update = (lambda: engine.update_weights_from_disk(str(b), online=True)) if route == "disk" else \
                (lambda: (*engine.update_weights_from_tensor(list(read_state_dict(b).items()), online=True), None))
            state = at_step(engine, 5, update)  # mid-request
            out = engine.generate(input_ids=prompt, sampling_params=sp)
            assert state["done"].is_set() and "error" not in state, state
            ok, msg, num_paused = state["result"]
            assert ok, msg
            assert num_paused in (1, None)  # the disk route reports it (SGLang's shape); the tensor one does not
            spans = out["meta_info"]["weight_versions"]
            assert [s["version"] for s in spans] == ["default", engine.weight_version] and spans[0]["start"] == 0
            k = spans[0]["end"]
            assert 0 < k < n and out["meta_info"]["finish_reason"]["type"] == "length"
            assert out["meta_info"]["num_retractions"] == 1
            assert out["output_ids"][:k] == reference_a[:k]
        rest = fresh_b.generate(input_ids=prompt + out["output_ids"][:k],
                                sampling_params={**sp, "max_new_tokens": n - k})["output_ids"]
        assert out["output_ids"][k:] == rest


def test_update_from_disk_accepts_config_fields_that_keep_shapes(ckpt_pair, reference_outputs, tmp_path):
    """A config that differs only in fields that do not change shapes (dtype, extra keys) is accepted."""
    a, b = ckpt_pair("llama")
    other = tmp_path / "b"
    shutil.copytree(b, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    cfg["some_trainer_note"] = 1
    (other / "config.json").write_text(json.dumps(cfg))
    with make_engine(a) as engine:
        assert engine.update_weights_from_disk(str(other))[0]
        assert run(engine) == reference_outputs(b)


def test_abort_all_requests_aborts_what_was_in_flight_not_what_arrives_during_the_update(ckpt_pair, reference_outputs):
    """update_weights_from_disk(abort_all_requests=True) with a slow load: the request paused in flight when the
    update was asked for ends as abort; one submitted while the load runs goes on under the new weights."""
    import threading
    import time

    a, b = ckpt_pair("llama")
    with make_engine(a) as engine:
        runner = engine.runner
        real = type(runner).update_weights_from_disk
        loading = threading.Event()

        def slow(self, source):
            loading.set()
            time.sleep(0.5)  # a big checkpoint
            return real(self, source)

        engine.pause_generation(mode="in_place")
        first = engine.generate(input_ids=[5, 6, 7], sampling_params=dict(max_new_tokens=8, ignore_eos=True),
                                stream=True)
        outs = {}
        type(runner).update_weights_from_disk = slow
        try:
            updater = threading.Thread(target=lambda: outs.setdefault("update", engine.update_weights_from_disk(
                str(b), abort_all_requests=True)))
            updater.start()
            assert loading.wait(30)
            late = threading.Thread(target=lambda: outs.setdefault("late", engine.generate(
                input_ids=[5, 6, 7, 8], sampling_params=dict(temperature=0, max_new_tokens=4, ignore_eos=True))))
            late.start()
            updater.join(60)
        finally:
            type(runner).update_weights_from_disk = real
        assert outs["update"][0], outs["update"]
        engine.continue_generation()
        late.join(60)
        assert list(first)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert outs["late"]["meta_info"]["finish_reason"]["type"] == "length"
        with make_engine(b) as fresh:
            want = fresh.generate(input_ids=[5, 6, 7, 8], sampling_params=dict(temperature=0, max_new_tokens=4,
                                                                               ignore_eos=True))
        assert outs["late"]["output_ids"] == want["output_ids"]
