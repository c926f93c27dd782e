"""SGLang API parity (issue 16): each test calls the Engine the way SGLang's own RL tests and the RL
frameworks (verl, slime) call `sglang.Engine`, with the same argument names and return shapes, and
checks the behaviour against an oracle the engine did not compute: a fresh engine loaded from the
expected checkpoint, the checkpoint read with safetensors, or a plain engine built without the option.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from rollout import Engine
from rollout.engine_args import SERVER_ONLY_OPTIONS, SGLANG_OPTIONS, EngineArgs
from rollout.tokenizer import _TOKENIZER_FILES
from runner.layers.linear import shard_view
from tests.rl_surface.conftest import (
    assert_same_tensors,
    at_step,
    make_engine,
    read_state_dict,
    run,
    snapshot,
)

DIRECT_LOADER = "runner.weights.loader.load_weights_direct"  # SGLang: ..._model_load_weights_direct
K0 = "model.layers.0.self_attn.k_proj.weight"
QKV0 = "model.layers.0.self_attn.qkv_proj.weight"


@pytest.fixture(scope="module")
def ckpt_pair(ckpt_factory):
    """`ckpt_pair(arch) -> (A, B)`: one config, two random weight sets (the rl_surface checkpoints)."""
    return lambda arch="llama": (ckpt_factory(arch, seed=0), ckpt_factory(arch, seed=1))


@pytest.fixture(scope="module")
def reference_outputs():
    """`reference_outputs(path)`: run() of a fresh engine on `path`, built with no option of the test."""
    cache: dict = {}

    def get(path):
        if path not in cache:
            with make_engine(path) as fresh:
                cache[path] = run(fresh)
        return cache[path]

    return get


# ---- loaders named by custom_weight_loader in these tests ------------------------------------------
def half_then_raise(model, named_tensors):
    """Writes the first tensor, then fails: the engine must put the first one back."""
    params = dict(model.named_parameters())
    name, tensor = named_tensors[0]
    params[name].data.copy_(tensor)
    raise RuntimeError("loader broke half-way")


def write_nan(model, named_tensors):
    """Completes, but leaves a NaN in the model: the engine must refuse and restore."""
    next(iter(model.parameters())).data.view(-1)[0] = float("nan")


# ---- 1. constructor -----------------------------------------------------------------------------
# What verl's SGLang rollout/server, slime's sglang_engine and SGLang's RL tests pass (CPU values).
FRAMEWORK_KWARGS = dict(
    trust_remote_code=True, skip_server_warmup=True, log_level="error", disable_piecewise_cuda_graph=True,
    dp_size=1, pp_size=1, ep_size=1, nnodes=1, node_rank=0, base_gpu_id=0, gpu_id_step=1,
    dist_init_addr=None, nccl_port=None, quantization=None, json_model_override_args="{}",
    mm_attention_backend="fa3", enable_draft_weights_cpu_backup=True, enable_metrics=False,
    enable_dp_attention=True, schedule_policy="fcfs",
    port=30000, host="127.0.0.1", max_running_requests=None, dtype=None, load_format="auto",
    random_seed=42, enable_memory_saver=True, mem_fraction_static=0.6, enable_weights_cpu_backup=False,
    # verl's AsyncEngine(**args) always passes dist_timeout; the rest at SGLang's defaults (ServerArgs fields)
    dist_timeout=1800, watchdog_timeout=300, enable_torch_compile=True, speculative_algorithm=None,
    disaggregation_mode="null", is_embedding=False, allow_auto_truncate=False, tokenizer_path=None,
)


def test_framework_constructor_names_are_accepted_and_change_nothing(ckpt_pair, reference_outputs):
    """Engine(model_path=..., **what verl/slime/SGLang's tests pass) builds, and generates exactly what an
    engine built without those names does (the no-ops are no-ops)."""
    a, _ = ckpt_pair("llama")
    with Engine(model_path=str(a), device="cpu", max_total_tokens=2048, show_progress=False,
                **FRAMEWORK_KWARGS) as engine:
        assert engine.args.trust_remote_code and engine.args.dp_size == 1
        assert engine.runner.config.max_running_requests == 512  # None = SGLang's "choose for me"
        assert run(engine) == reference_outputs(a)


def test_tokenizer_path_loads_the_tokenizer_from_elsewhere(tiny_llama, tmp_path):
    """tokenizer_path (SGLang's): a checkpoint without tokenizer files takes text prompts with the tokenizer
    found there, and generates what the engine on the full checkpoint does."""
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for f in tiny_llama.iterdir():
        if f.name not in _TOKENIZER_FILES and f.is_file():
            shutil.copy(f, weights_only / f.name)
    greedy = dict(temperature=0, max_new_tokens=6, ignore_eos=True)
    with Engine(str(tiny_llama), show_progress=False) as full:
        want = full.generate(prompt="hello there", sampling_params=greedy)
    with Engine(str(weights_only), tokenizer_path=str(tiny_llama), show_progress=False) as engine:
        got = engine.generate(prompt="hello there", sampling_params=greedy)
    assert (got["output_ids"], got["text"]) == (want["output_ids"], want["text"])
    with Engine(str(weights_only), show_progress=False) as engine, pytest.raises(ValueError, match="tokenizer"):
        engine.generate(prompt="hello there", sampling_params=greedy)


def test_every_name_in_the_table_is_an_option():
    """SGLANG_OPTIONS (the table in engine_args.py) and EngineArgs agree: every listed name is accepted."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(SGLANG_OPTIONS) - names == set(SERVER_ONLY_OPTIONS)
    assert not names & set(SERVER_ONLY_OPTIONS)  # or `rollout.launch_server` would declare them twice


@pytest.mark.parametrize("name, value, supported", [
    ("dp_size", 2, "supported: 1"), ("pp_size", 2, "supported: 1"), ("ep_size", 8, "supported: 1"),
    ("nnodes", 2, "supported: 1"), ("node_rank", 1, "supported: 0"), ("quantization", "fp8", "supported: None"),
    ("json_model_override_args", '{"rope_theta": 1}', "supported: None, '' or '{}'"),
    ("gpu_id_step", 0, "an int >= 1"), ("base_gpu_id", -1, "an int >= 0"),
    ("load_format", "remote_instance", "'auto', 'safetensors' or 'dummy'"),
    ("cpu_offload_gb", -1, ">= 0"),
    ("speculative_algorithm", "EAGLE", "supported: None"), ("disaggregation_mode", "prefill", "supported: 'null'"),
    ("is_embedding", True, "supported: False"), ("allow_auto_truncate", True, "supported: False"),
    ("dist_timeout", 0, "seconds > 0"), ("watchdog_timeout", "5", "seconds > 0"),
])
def test_unsupported_values_are_refused_naming_option_and_supported_values(tiny_llama, name, value, supported):
    """A value that would mean something this engine does not do is refused before anything is built,
    naming the option, the value and what is supported."""
    with pytest.raises(ValueError) as err:
        Engine(str(tiny_llama), **{name: value})
    assert f"{name}={value!r}" in str(err.value) and supported in str(err.value), str(err.value)


def test_cpu_offload_on_cuda_is_refused_with_what_to_use_instead(tiny_llama):
    """cpu_offload_gb > 0 on CUDA (streaming weights in) is refused before CUDA is touched, naming
    enable_memory_saver / enable_weights_cpu_backup as the way to free the device."""
    with pytest.raises(ValueError, match=r"cpu_offload_gb=4.*supported value there is 0.*enable_weights_cpu_backup"):
        EngineArgs.from_kwargs(str(tiny_llama), device="cuda", cpu_offload_gb=4)


def test_sglang_attention_backend_names_are_refused(tiny_llama):
    """attention_backend='fa3' (verl's default) is refused naming the backends that exist here."""
    with pytest.raises(ValueError, match=r"attention_backend 'fa3'.*torch_native"):
        Engine(str(tiny_llama), attention_backend="fa3", show_progress=False)


def test_launch_server_takes_sglangs_flags(tiny_llama):
    """`python -m rollout.launch_server` parses SGLang's spelling of these options (list options take one
    or more values, as SGLang's nargs="+"), and the result builds valid EngineArgs."""
    from rollout.server.args import parse_args

    server, kw = parse_args(["--model-path", str(tiny_llama), "--trust-remote-code", "--skip-server-warmup",
                             "--dp-size", "1", "--base-gpu-id", "0", "--port", "31000",
                             "--custom-weight-loader", DIRECT_LOADER, "--weight-version", "v0",
                             "--enable-dp-attention", "--schedule-policy", "fcfs"])  # SGLang's RL tests pass these
    args = EngineArgs.from_kwargs(**kw)
    assert server.port == 31000 and args.trust_remote_code and args.skip_server_warmup
    assert args.enable_dp_attention and args.schedule_policy == "fcfs"
    assert args.custom_weight_loader == [DIRECT_LOADER] and args.weight_version == "v0"


def test_unknown_names_are_still_refused(tiny_llama):
    """A name neither SGLang's table nor this engine knows is a TypeError naming it."""
    with pytest.raises(TypeError, match="no_such_option"):
        Engine(str(tiny_llama), no_such_option=1)


def test_base_gpu_id_selects_the_cuda_device(tiny_llama):
    """base_gpu_id=N with device='cuda' runs on cuda:N (SGLang's meaning); a contradiction is refused."""
    assert EngineArgs.from_kwargs(str(tiny_llama), device="cuda", base_gpu_id=3).runner_config().device == "cuda:3"
    assert EngineArgs.from_kwargs(str(tiny_llama), device="cuda:3", base_gpu_id=3).runner_config().device == "cuda:3"
    assert EngineArgs.from_kwargs(str(tiny_llama), base_gpu_id=3).runner_config().device == "cpu"
    with pytest.raises(ValueError, match="base_gpu_id=1 contradicts device='cuda:0'"):
        EngineArgs.from_kwargs(str(tiny_llama), device="cuda:0", base_gpu_id=1)
    with pytest.raises(ValueError, match="base_gpu_id=2, gpu_id_step=1 with tp_size=2.*supported: base_gpu_id=0"):
        EngineArgs.from_kwargs(str(tiny_llama), device="cuda", base_gpu_id=2, tp_size=2)


def test_cpu_offload_on_cpu_keeps_weights_on_the_host(ckpt_pair, reference_outputs):
    """On the CPU every weight is on the host already: cpu_offload_gb > 0 is accepted and changes nothing."""
    a, _ = ckpt_pair("llama")
    with make_engine(a, cpu_offload_gb=2) as engine:
        assert all(p.device.type == "cpu" for p in engine.runner.model.parameters())
        assert run(engine) == reference_outputs(a)


# ---- 2. tensor updates: load_format="direct" and custom_weight_loader --------------------------------
def test_update_weights_from_tensor_load_format_direct(ckpt_pair, reference_outputs):
    """As SGLang's test: qkv_proj written whole with load_format="direct" reads back through k_proj; the
    whole model sent in the runner's layout gives exactly a fresh engine on B."""
    a, b = ckpt_pair("llama")
    with make_engine(a) as engine:
        assert engine.get_weights_by_name(K0)[0][:5] != [1.5] * 5
        qkv = engine.runner.name_map.params[QKV0]
        ok, msg = engine.update_weights_from_tensor([(QKV0, torch.full(qkv.shape, 1.5))], load_format="direct")
        assert ok, msg
        assert engine.get_weights_by_name(K0)[0][:5] == [1.5] * 5
        # The runner name reads back whole too (SGLang reads it from params_dict), every row written.
        fused = engine.get_weights_by_name(QKV0, truncate_size=10**9)
        assert len(fused) == qkv.shape[0] and all(v == 1.5 for row in fused for v in row)
        merged = _runner_layout(engine, read_state_dict(b))
        ok, msg = engine.update_weights_from_tensor(list(merged.items()), load_format="direct")
        assert ok, msg
        assert run(engine) == reference_outputs(b)


def test_direct_refuses_hf_names_and_bad_shapes_changing_nothing(ckpt_pair):
    """load_format="direct" takes runner names: an HF name, or a fused tensor of the wrong shape, is
    (False, message naming it) and no weight changes, even the good tensors sent before it."""
    a, _ = ckpt_pair("llama")
    with make_engine(a) as engine:
        before, outputs = snapshot(engine), run(engine)
        qkv = engine.runner.name_map.params[QKV0]
        good = (QKV0, torch.zeros(qkv.shape))
        for bad, fragment in [(("model.layers.0.self_attn.q_proj.weight", torch.zeros(4)), "load_format='direct'"),
                              (("model.layers.1.self_attn.qkv_proj.weight", torch.zeros(3, 3)), "shape (3, 3)")]:
            ok, msg = engine.update_weights_from_tensor([good, bad], load_format="direct")
            assert not ok and bad[0] in msg and fragment in msg, msg
            assert_same_tensors(before, engine)
        assert engine.weight_version == "default" and run(engine) == outputs


def test_update_weights_from_tensor_load_format_custom(ckpt_pair, reference_outputs):
    """As SGLang's test: a loader allowed by custom_weight_loader at construction is called as
    fn(model, named_tensors) when named as load_format; the result is a fresh engine on B."""
    a, b = ckpt_pair("llama")
    with make_engine(a, custom_weight_loader=[DIRECT_LOADER]) as engine:
        qkv = engine.runner.name_map.params[QKV0]
        ok, msg = engine.update_weights_from_tensor([(QKV0, torch.full(qkv.shape, 1.5))], load_format=DIRECT_LOADER)
        assert ok, msg
        assert engine.get_weights_by_name(K0)[0][:5] == [1.5] * 5
        # The runner name reads back whole too (SGLang reads it from params_dict), every row written.
        fused = engine.get_weights_by_name(QKV0, truncate_size=10**9)
        assert len(fused) == qkv.shape[0] and all(v == 1.5 for row in fused for v in row)
        merged = _runner_layout(engine, read_state_dict(b))
        ok, msg = engine.update_weights_from_tensor(list(merged.items()), load_format=DIRECT_LOADER,
                                                    weight_version="b")
        assert ok, msg
        assert run(engine) == reference_outputs(b) and engine.weight_version == "b"


@pytest.mark.parametrize("loader, fragment", [
    (f"{__name__}.half_then_raise", "loader broke half-way"),
    (f"{__name__}.write_nan", "NaN"),
])
def test_failing_custom_loader_changes_nothing(ckpt_pair, loader, fragment):
    """A custom loader that raises after writing, or leaves a NaN, is (False, reason) and every weight is
    back to its old value; the outputs are unchanged."""
    a, b = ckpt_pair("llama")
    with make_engine(a, custom_weight_loader=[loader]) as engine:
        before, outputs = snapshot(engine), run(engine)
        merged = _runner_layout(engine, read_state_dict(b))
        ok, msg = engine.update_weights_from_tensor(list(merged.items()), load_format=loader)
        assert not ok and fragment in msg and "restored" in msg, msg
        assert_same_tensors(before, engine)
        assert engine.weight_version == "default" and run(engine) == outputs


def test_custom_loader_must_be_allowed_at_construction(ckpt_pair, tiny_llama):
    """A dotted path not given as custom_weight_loader is refused as a load_format (naming the allowed
    ones); one that cannot be imported is refused when the engine is created."""
    a, _ = ckpt_pair("llama")
    with make_engine(a) as engine:
        before = snapshot(engine)
        ok, msg = engine.update_weights_from_tensor([(QKV0, torch.zeros(1))], load_format=DIRECT_LOADER)
        assert not ok and DIRECT_LOADER in msg and "custom_weight_loader []" in msg, msg
        assert_same_tensors(before, engine)
    with pytest.raises(ValueError, match="custom_weight_loader 'no.such.loader' cannot be imported"):
        Engine(str(tiny_llama), custom_weight_loader=["no.such.loader"], show_progress=False)


# ---- 3. disk updates: (success, message, num_paused_requests) and flush_cache ------------------------
def test_update_weights_from_disk_returns_sglang_shape(ckpt_pair, reference_outputs):
    """update_weights_from_disk -> (True, message, 0) with nothing paused, and a fresh engine on B's outputs;
    a bad path is (False, message naming it, 0)."""
    a, b = ckpt_pair("llama")
    with make_engine(a) as engine:
        res = engine.update_weights_from_disk(str(b))
        assert len(res) == 3 and res[0] is True and isinstance(res[1], str) and res[2] == 0, res
        assert run(engine) == reference_outputs(b)
        ok, msg, num_paused = engine.update_weights_from_disk("/no/such/dir")
        assert not ok and "/no/such/dir" in msg and num_paused == 0
        assert run(engine) == reference_outputs(b)


def test_update_weights_from_disk_counts_paused_requests(ckpt_pair):
    """Two requests paused in place mid-decode: the update reports num_paused_requests == 2, and both
    finish after continue_generation, under the new version."""
    a, b = ckpt_pair("llama")
    sp = dict(temperature=0, max_new_tokens=30, ignore_eos=True)
    with make_engine(a) as engine:
        def pause():
            engine.pause_generation(mode="in_place")
            return len(engine._reqs)

        state = at_step(engine, 4, pause)
        stream = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=sp, stream=True)
        assert state["done"].wait(30) and state["result"] == 2
        ok, msg, num_paused = engine.update_weights_from_disk(str(b), weight_version="b")
        assert ok and num_paused == 2, msg
        engine.continue_generation()
        finals = {}
        for chunk in stream:
            finals[chunk["index"]] = chunk
        assert [len(finals[i]["output_ids"]) for i in (0, 1)] == [30, 30]
        assert {finals[i]["meta_info"]["weight_version"] for i in (0, 1)} == {"b"}


def test_update_weights_from_disk_flush_cache_argument(ckpt_pair):
    """flush_cache=False keeps the prefix cache (the next identical prompt hits it); the default flushes it."""
    a, _ = ckpt_pair("llama")
    prompt, sp = list(range(5, 45)), dict(temperature=0, max_new_tokens=4)
    with make_engine(a) as engine:
        first = engine.generate(input_ids=prompt, sampling_params=sp)
        assert engine.update_weights_from_disk(str(a), flush_cache=False)[0]
        kept = engine.generate(input_ids=prompt, sampling_params=sp)
        assert kept["meta_info"]["cached_tokens"] > 0 and kept["output_ids"] == first["output_ids"]
        assert engine.update_weights_from_disk(str(a))[0]
        assert engine.generate(input_ids=prompt, sampling_params=sp)["meta_info"]["cached_tokens"] == 0


# ---- 4. release / resume state -------------------------------------------------------------------
def test_multi_stage_release_and_resume(ckpt_pair, reference_outputs):
    """SGLang's test_multi_stage_release_and_resume on the CPU: release kv_cache, weights, cuda_graph one by
    one (each frees its bytes), resume cuda_graph, weights, update to B, resume kv_cache -> a fresh
    engine on B. A second release of any of them raises RuntimeError naming it."""
    a, b = ckpt_pair("llama")
    with make_engine(a, enable_memory_saver=True, random_seed=42) as engine:
        saver = engine.runner.memory_saver
        run(engine)
        for tag in ("kv_cache", "weights", "cuda_graph"):
            engine.release_memory_occupation(tags=[tag])
            assert saver.bytes_held(tag) == 0
            with pytest.raises(RuntimeError, match=rf"\['{tag}'\] already released"):
                engine.release_memory_occupation(tags=[tag])
        engine.resume_memory_occupation(tags=["cuda_graph"])
        engine.resume_memory_occupation(tags=["weights"])
        assert engine.update_weights_from_tensor(list(read_state_dict(b).items()))[0]
        engine.resume_memory_occupation(tags=["kv_cache"])
        with pytest.raises(RuntimeError, match=r"not currently released"):
            engine.resume_memory_occupation(tags=["kv_cache"])
        assert run(engine) == reference_outputs(b)


def _runner_layout(engine: Engine, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors placed into the runner's own parameter layout (fused qkv_proj, gate_up_proj), as SGLang's
    test merges HF params before load_format="direct". Each HF tensor goes where the engine's name map
    says its shard lives; the oracle the result is compared with is a fresh engine loaded from disk."""
    name_map = engine.runner.name_map
    out = {pname: torch.full_like(p, float("nan")) for pname, p in name_map.params.items()}
    for target in name_map.targets.values():
        holder = torch.nn.Parameter(out[target.param_name], requires_grad=False)
        holder.__dict__.update({k: v for k, v in target.param.__dict__.items() if k != "weight_loader"})
        shard_view(holder, target.shard_id).copy_(hf_state[target.hf_name])
    assert all(torch.isfinite(t).all() for t in out.values())  # every slot filled exactly by HF tensors
    return out


# ---- 8. get_server_info --------------------------------------------------------------------------
def test_get_server_info_has_sglangs_keys(ckpt_pair):
    """get_server_info() as slime reads it: every option passed comes back under its name, the scheduler
    info and internal_states are there with values from the checkpoint (weight bytes) and the options
    (token capacity), weight_version follows updates and the initial `weight_version` option, and
    version is the installed package's."""
    import importlib.metadata

    a, b = ckpt_pair("llama")
    passed = dict(max_total_tokens=2048, max_running_requests=16, chunked_prefill_size=256, random_seed=7,
                  trust_remote_code=True, skip_server_warmup=True, weight_version="v0")
    with make_engine(a, **passed) as engine:
        info = engine.get_server_info()
        for name, value in passed.items():
            assert info[name] == value, name
        assert info["model_path"] == str(a) and info["tp_size"] == 1 and info["dp_size"] == 1
        assert info["max_total_num_tokens"] == 2048
        assert info["max_req_input_len"] == min(engine.runner.context_len, 2048) - 1
        state = info["internal_states"][0]
        weight_bytes = sum(t.numel() * t.element_size() for t in read_state_dict(a).values())
        assert state["memory_usage"]["weight"] == pytest.approx(weight_bytes / 2**30)
        assert state["memory_usage"]["token_capacity"] == 2048
        assert info["version"] == importlib.metadata.version("rollout-engine")
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=dict(max_new_tokens=2))
        assert out["meta_info"]["weight_version"] == "v0" and info["weight_version"] == "v0"
        assert engine.update_weights_from_disk(str(b), weight_version="v1")[0]
        info = engine.get_server_info()
        assert info["weight_version"] == info["internal_states"][0]["weight_version"] == "v1"
        assert info["internal_states"][0]["num_prompt_tokens"] == 3
