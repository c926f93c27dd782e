"""Adapter lifecycle on the Engine: load, unload, load from tensors (pairs and flattened buckets) and
replacing under the same name each equal a fresh engine with that adapter; every bad adapter is refused
by name and changes nothing; requests naming an unknown adapter are refused; an unload waits for the
requests using it; release/resume keeps adapters with a CPU backup (and drops them without one)."""

from __future__ import annotations

import json
import math
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file

from tests.rollout.oracle import random_prompts
from weight_sync.bucket import FlattenedTensorBucket

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
PROMPTS = random_prompts([4, 9], seed=5)
Q = "base_model.model.model.layers.0.self_attn.q_proj"


def _files(adapter):
    return load_file(str(adapter / "adapter_model.safetensors")), json.loads((adapter / "adapter_config.json").read_text())


def _gen(engine, name):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, lora_path=name)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _same(got, want):
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want):
        assert ids == ref_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def env(ckpt_factory, adapter_factory, module_engines):
    """(checkpoint, adapters a and b, reference outputs of fresh engines with a / b / none)."""
    ckpt = ckpt_factory("llama")
    a, b = adapter_factory(ckpt, r=8, seed=11), adapter_factory(ckpt, r=4, seed=12)
    refs = {"a": _gen(module_engines(ckpt, lora_paths={"a": str(a)}), "a"),
            "b": _gen(module_engines(ckpt, lora_paths={"b": str(b)}), "b")}
    refs[None] = _gen(module_engines(ckpt), None)
    assert refs["a"] != refs[None] and refs["b"] != refs[None]
    return ckpt, a, b, refs


def _lora_engine(make_engine, ckpt, **kw):
    return make_engine(ckpt, enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], **kw)


def test_load_unload_from_tensors_and_replace_equal_fresh_engines(env, make_engine):
    """Every way an adapter arrives gives a fresh engine's outputs, and replacing under a name never reuses
    the old adapter's prefix cache."""
    ckpt, a, b, refs = env
    engine = _lora_engine(make_engine, ckpt)
    res = engine.load_lora_adapter("x", str(a))
    assert res.success and res.loaded_adapters == {"x": str(a)}
    _same(_gen(engine, "x"), refs["a"])
    _same(_gen(engine, None), refs[None])
    assert engine.unload_lora_adapter("x").loaded_adapters == {}
    tensors, config = _files(b)
    assert engine.load_lora_adapter_from_tensors("x", tensors, config).loaded_adapters == {"x": "__tensor__"}
    _same(_gen(engine, "x"), refs["b"])  # same name, same prompts: b's outputs, not a's cached KV
    tensors, config = _files(a)
    bucket = FlattenedTensorBucket(named_tensors=list(tensors.items()))
    assert engine.load_lora_adapter_from_tensors("y", bucket.to_dict(), config, load_format="flattened_bucket").success
    _same(_gen(engine, "y"), refs["a"])
    _same(_gen(engine, "x"), refs["b"])


def _bad_cases(a):
    tensors, config = _files(a)
    cases = {
        "rank": (tensors, {**config, "r": 16}, "max_lora_rank"),
        "dora": (tensors, {**config, "use_dora": True}, "use_dora"),
        "shape": ({**tensors, f"{Q}.lora_A.weight": torch.zeros(8, 65)}, config, "shape"),
        "nan": ({**tensors, f"{Q}.lora_B.weight": torch.full_like(tensors[f"{Q}.lora_B.weight"], float("nan"))},
                config, "non-finite"),
        "overflow": ({**tensors, f"{Q}.lora_B.weight": tensors[f"{Q}.lora_B.weight"].double() * 1e300}, config,
                     "non-finite"),
        "missing_b": ({k: v for k, v in tensors.items() if k != f"{Q}.lora_B.weight"}, config, "lora_B"),
        "unknown": ({**tensors, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 4)}, config,
                    "not a PEFT LoRA weight"),
        "layer": ({**tensors, Q.replace("layers.0", "layers.9") + ".lora_A.weight": tensors[f"{Q}.lora_A.weight"],
                   Q.replace("layers.0", "layers.9") + ".lora_B.weight": tensors[f"{Q}.lora_B.weight"]}, config,
                  "layer 9"),
        "int": ({**tensors, f"{Q}.lora_A.weight": tensors[f"{Q}.lora_A.weight"].int()}, config, "floating-point"),
        "experts": ({"base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(8, 64)},
                    config, "experts"),
        # PEFT would skip tensors of a module its config does not target; serving them is another model
        "off_config": (tensors, {**config, "target_modules": ["k_proj"]}, "adapter's own target_modules"),
        # a finite alpha whose scaling is inf in float32, and one whose scaled B overflows
        "alpha_inf": (tensors, {**config, "lora_alpha": 1e300}, "overflows torch.float32"),
        "alpha_b": ({**tensors, f"{Q}.lora_B.weight": tensors[f"{Q}.lora_B.weight"] * 1e6},
                    {**config, "lora_alpha": 3e38}, "times the scaling"),
        # one weight under PEFT's name and the bare one, other values: which is meant? (the later had won)
        "two_spellings": ({**tensors, f"{Q}.lora_A.weight".removeprefix("base_model.model."):
                           torch.zeros_like(tensors[f"{Q}.lora_A.weight"])}, config, "are the same weight"),
    }
    return cases


def test_bad_adapters_are_refused_and_change_nothing(env, make_engine, tmp_path):
    """Each bad adapter is refused naming its problem; loaded adapters and every output stay the same."""
    ckpt, a, b, refs = env
    engine = _lora_engine(make_engine, ckpt)
    assert engine.load_lora_adapter("b", str(b)).success
    for broken, write in (("adapter_config.json", lambda d: b"{not json"), ("adapter_model.safetensors",
                                                                            lambda d: d[: len(d) // 2])):
        bad = shutil.copytree(a, tmp_path / broken)
        (bad / broken).write_bytes(write((bad / broken).read_bytes()))
        res = engine.load_lora_adapter("new", str(bad))
        assert not res.success and f"{bad / broken} is not a valid" in res.error_message, res.error_message
        assert res.loaded_adapters == {"b": str(b)}
    for case, (tensors, config, needle) in _bad_cases(a).items():
        res = engine.load_lora_adapter_from_tensors("new", tensors, config)
        assert not res.success and needle in res.error_message, (case, res.error_message)
        assert res.loaded_adapters == {"b": str(b)}, case
    dup = engine.load_lora_adapter("b", str(a))
    assert not dup.success and "already loaded" in dup.error_message
    for name in ("h\x00", "two\nlines", "x" * 257):  # a NUL or newline in a listing, a 10k-char id
        res = engine.load_lora_adapter(name, str(a))
        assert not res.success and "printable characters" in res.error_message, (name[:10], res.error_message)
        assert res.loaded_adapters == {"b": str(b)}
    assert engine.load_lora_adapter("x" * 256, str(a)).success and engine.unload_lora_adapter("x" * 256).success
    qv = make_engine(ckpt, enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"])
    res = qv.load_lora_adapter("a", str(a))
    assert not res.success and "lora_target_modules" in res.error_message
    _same(_gen(engine, "b"), refs["b"])
    _same(_gen(engine, None), refs[None])


def test_a_load_into_full_slots_is_refused_in_sglangs_words(env, make_engine):
    """With max_loaded_loras adapters loaded, a load is refused as SGLang refuses it ("Maximum number of loaded LoRA
    adapters is N ... unload some"), changing nothing: no adapter is evicted, each still serves its own outputs;
    after an unload the load succeeds. The default limit (max_loras_per_batch) refuses the same way."""
    ckpt, a, b, refs = env
    tensors, config = _files(a)
    engine = _lora_engine(make_engine, ckpt, max_loras_per_batch=2, max_loaded_loras=3)
    for i in range(3):
        res = engine.load_lora_adapter_from_tensors(f"a{i}", tensors, config)
        assert res.success, res.error_message
    for res in (engine.load_lora_adapter_from_tensors("a3", tensors, config), engine.load_lora_adapter("b", str(b))):
        assert not res.success and "Maximum number of loaded LoRA adapters is 3" in res.error_message, res
        assert "Please unload some LoRA adapters before loading new ones" in res.error_message
        assert list(res.loaded_adapters) == ["a0", "a1", "a2"]
    assert f"at path {b}" in res.error_message
    _same(_gen(engine, "a0"), refs["a"])
    assert engine.unload_lora_adapter("a1").success
    res = engine.load_lora_adapter("b", str(b))
    assert res.success and list(res.loaded_adapters) == ["a0", "a2", "b"], res
    _same(_gen(engine, "b"), refs["b"])
    default = _lora_engine(make_engine, ckpt, max_loras_per_batch=1)
    assert default.load_lora_adapter("x", str(a)).success
    res = default.load_lora_adapter("y", str(b))
    assert not res.success and "Maximum number of loaded LoRA adapters is 1" in res.error_message
    assert res.loaded_adapters == {"x": str(a)}


@pytest.mark.parametrize("segmented", [True, False])
def test_an_adapter_that_overflows_its_own_rows_leaves_other_rows_alone(env, make_engine, segmented):
    """An adapter loaded with a huge but representable lora_alpha turns its own rows' activations inf/NaN;
    the base-model and other-adapter rows of the same steps still give their fresh engines' outputs (padding
    and masked rows are zeroed with a select, not a product that keeps NaN)."""
    ckpt, a, b, refs = env
    engine = _lora_engine(make_engine, ckpt, lora_paths={"b": str(b)})
    engine.runner.lora_manager.segmented = segmented
    tensors, config = _files(a)
    assert engine.load_lora_adapter_from_tensors("huge", tensors, {**config, "lora_alpha": 1e30}).success
    names = ["huge", None, "b", None]
    outs = engine.generate(input_ids=[PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1]], sampling_params=GREEDY,
                           return_logprob=True, lora_path=names)
    got = [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]
    assert not all(lp is not None and math.isfinite(lp) for lp in got[0][1])  # the case under test: it overflowed
    _same([got[1], got[3]], refs[None])
    _same([got[2]], refs["b"][:1])


def test_unknown_adapter_requests_are_refused(env, make_engine):
    """A request naming an adapter that is not loaded fails by name; LoRA off refuses lora_path."""
    ckpt, a, _, refs = env
    engine = _lora_engine(make_engine, ckpt, lora_paths={"a": str(a)})
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=["a", "nope"])
    assert not engine.unload_lora_adapter("nope").success
    _same(_gen(engine, "a"), refs["a"])
    with pytest.raises(ValueError, match="enable_lora"):
        make_engine(ckpt).generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path="a")


def test_unload_waits_for_requests_in_flight(env, make_engine):
    """Unloading an adapter that a running request uses waits for it to finish (its output is the
    adapter's); new requests on it are refused meanwhile; while paused the unload is refused instead."""
    ckpt, a, _, refs = env
    engine = _lora_engine(make_engine, ckpt, lora_paths={"a": str(a)})
    long = {**GREEDY, "max_new_tokens": 200}
    stream = engine.generate(input_ids=PROMPTS[0], sampling_params=long, lora_path="a", stream=True)
    first = next(iter(stream))
    assert first["output_ids"]
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("res", engine.unload_lora_adapter("a")))
    t.start()
    chunks = [first, *stream]
    t.join(timeout=60)
    assert done["res"].success and done["res"].loaded_adapters == {}
    assert chunks[-1]["output_ids"][:6] == refs["a"][0][0]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.load_lora_adapter("a", str(a)).success
    engine.pause_generation(mode="in_place")
    try:
        stream = engine.generate(input_ids=PROMPTS[0], sampling_params=long, lora_path="a", stream=True)
        res = engine.unload_lora_adapter("a")
        assert not res.success and "paused" in res.error_message and res.loaded_adapters == {"a": str(a)}
    finally:
        engine.continue_generation()
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("backup", [True, False])
def test_release_resume_keeps_adapters_with_backup(env, make_engine, backup):
    """Adapters live in the weights region: with a CPU backup they survive release/resume (outputs
    unchanged, bytes freed); without one they are dropped and requests naming them are refused."""
    ckpt, a, b, refs = env
    engine = _lora_engine(make_engine, ckpt, lora_paths={"a": str(a), "b": str(b)}, enable_memory_saver=True,
                          enable_weights_cpu_backup=backup)
    saver = engine.runner.memory_saver
    held = saver.bytes_held("weights")
    engine.release_memory_occupation(["weights"])
    assert saver.bytes_held("weights") == 0 or not saver.is_resident("weights")
    engine.resume_memory_occupation(["weights"])
    assert saver.bytes_held("weights") == held
    if backup:
        _same(_gen(engine, "a"), refs["a"])
        _same(_gen(engine, "b"), refs["b"])
        _same(_gen(engine, None), refs[None])
    else:
        assert engine.runner.lora_adapters() == {}
        assert engine.update_weights_from_disk(str(ckpt))[0]  # the base model's weights come back
        with pytest.raises(ValueError, match="not loaded"):
            engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path="a")
        assert engine.load_lora_adapter("a", str(a)).success
        _same(_gen(engine, "a"), refs["a"])


def test_a_paused_request_on_an_adapter_dropped_by_a_release_is_told_which_and_why(env, make_engine):
    """Paused in flight on adapter "a", a request whose adapter a release without CPU backup dropped ends as an
    abort naming "a" and the release (it said "uid 1 is not loaded"), also after "a" is loaded again (a new
    adapter, not the one it ran under); a base-model request paused beside it finishes."""
    ckpt, a, _, _ = env
    engine = _lora_engine(make_engine, ckpt, lora_paths={"a": str(a)}, enable_memory_saver=True,
                          enable_weights_cpu_backup=False)
    long = dict(GREEDY, max_new_tokens=200)
    on_a = engine.generate(input_ids=PROMPTS[0], sampling_params=long, lora_path="a", stream=True)
    on_base = engine.generate(input_ids=PROMPTS[1], sampling_params=long, stream=True)
    next(on_a), next(on_base)
    engine.pause_generation(mode="in_place")
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert engine.update_weights_from_disk(str(ckpt))[0]
    assert engine.load_lora_adapter("a", str(a)).success
    engine.continue_generation()
    end_a, end_base = list(on_a)[-1]["meta_info"]["finish_reason"], list(on_base)[-1]["meta_info"]["finish_reason"]
    assert end_a["type"] == "abort" and "'a'" in end_a["message"] and "released" in end_a["message"], end_a
    assert end_base == {"type": "length", "length": 200}
