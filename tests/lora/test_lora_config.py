"""LoRA options and PEFT configs: SGLang's three lora_paths forms, inference of max_lora_rank and
lora_target_modules, and the refusals (by name) of what this engine does not implement."""

from __future__ import annotations

import pytest

from rollout import Engine
from runner.lora.config import AdapterConfig, parse_lora_paths


def test_lora_paths_forms_agree():
    """A dict, "name=path" strings and {"lora_name", "lora_path", "pinned"} dicts give the same sources."""
    want = parse_lora_paths({"a": "/p/a", "b": "/p/b"})
    assert parse_lora_paths(["a=/p/a", "b=/p/b"]) == want
    assert parse_lora_paths([{"lora_name": "a", "lora_path": "/p/a"}, '{"lora_name": "b", "lora_path": "/p/b"}']) == want
    assert parse_lora_paths(["/p/a"])[0].lora_name == "/p/a"
    assert parse_lora_paths([{"lora_name": "a", "lora_path": "/p", "pinned": True}])[0].pinned
    with pytest.raises(ValueError, match="more than once"):
        parse_lora_paths(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="lora_paths entry"):
        parse_lora_paths([{"name": "a"}])


def test_scaling_and_refusals():
    """scaling is alpha/r (alpha/sqrt(r) with rsLoRA); DoRA, LoRA biases, modules_to_save are refused by name."""
    assert AdapterConfig.from_dict({"r": 4, "lora_alpha": 8}).scaling == 2.0
    assert AdapterConfig.from_dict({"r": 4, "lora_alpha": 8, "use_rslora": True}).scaling == 4.0
    for bad, name in (({"use_dora": True}, "use_dora"), ({"bias": "all"}, "bias"),
                      ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"r": 0}, "r="),
                      ({"target_modules": ["embed_tokens"]}, "embed_tokens"), ({"peft_type": "IA3"}, "peft_type"),
                      ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
                      ({"layer_replication": [[0, 2]]}, "layer_replication")):
        with pytest.raises(ValueError, match=name):
            AdapterConfig.from_dict({"r": 4, "lora_alpha": 8, **bad})


def test_a_moe_expert_adapter_is_refused_naming_the_experts():
    """peft's config for LoRA on fused MoE experts (target_parameters, with the rank_pattern peft fills for
    them) is refused naming target_parameters and what MoE models take instead, not the rank_pattern the user
    never set."""
    d = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "target_parameters": ["down_proj", "gate_up_proj"],
         "rank_pattern": {".*\\.gate_up_proj": 8}}
    with pytest.raises(ValueError, match=r"target_parameters.*attention projections"):
        AdapterConfig.from_dict(d)


def test_peft_written_alora_config_is_refused_by_name():
    """An aLoRA adapter (peft's LoraConfig with alora_invocation_tokens: it acts only after those tokens) adds no
    tensors of its own, so only its config tells it apart: refused by name, where serving it as plain LoRA gave
    other tokens than PeftModel; the same config without the key is taken."""
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[5, 6])
    d = config.to_dict()
    with pytest.raises(ValueError, match="alora_invocation_tokens"):
        AdapterConfig.from_dict(d)
    assert AdapterConfig.from_dict({**d, "alora_invocation_tokens": None}).r == 4


def test_adapters_whose_init_rewrites_the_base_are_refused_by_name(tiny_llama, make_engine, tmp_path):
    """PiSSA / OLoRA adapters (peft re-runs their init on load, which rewrites the base weights to a residual)
    are refused naming init_lora_weights, where serving them over the unchanged base gave other tokens than
    PeftModel; an adapter peft wrote with init_lora_weights="olora" is refused at load and the engine keeps
    serving; plain inits (True, False, "gaussian") are taken."""
    from peft import LoraConfig, get_peft_model

    from tests.checkpoints import load_hf_model

    for init in ("pissa", "pissa_niter_4", "olora", "loftq", "corda", "lora_ga"):
        d = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]).to_dict()
        with pytest.raises(ValueError, match="init_lora_weights"):
            AdapterConfig.from_dict({**d, "init_lora_weights": init})
    for init in (True, False, "gaussian"):
        assert AdapterConfig.from_dict({"r": 4, "lora_alpha": 8, "init_lora_weights": init}).r == 4
    peft_model = get_peft_model(load_hf_model(tiny_llama), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                                      init_lora_weights="olora"))
    peft_model.save_pretrained(tmp_path / "olora")
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"])
    res = engine.load_lora_adapter("olora", str(tmp_path / "olora"))
    assert not res.success and "init_lora_weights" in res.error_message
    base = engine.generate(input_ids=[5, 6, 7], sampling_params=dict(temperature=0, max_new_tokens=3))
    assert len(base["output_ids"]) == 3


def test_engine_options_are_inferred_and_checked(tiny_llama, adapter_factory):
    """max_lora_rank / lora_target_modules come from lora_paths when not given; without lora_paths they are
    required; LoRA with deterministic inference and max_loaded_loras < max_loras_per_batch are refused."""
    adapter = adapter_factory(tiny_llama, r=4, targets=["q_proj", "v_proj"])
    with Engine(str(tiny_llama), show_progress=False, max_total_tokens=512, lora_paths=[f"a={adapter}"]) as e:
        cfg = e.runner.config
        assert (cfg.enable_lora, cfg.max_lora_rank, cfg.lora_target_modules) == (True, 4, ["q_proj", "v_proj"])
        assert e.runner.lora_adapters()["a"]["r"] == 4
    for kwargs, needle in ((dict(enable_lora=True), "max_lora_rank"),
                           (dict(enable_lora=True, max_lora_rank=8), "lora_target_modules"),
                           (dict(lora_paths=[f"a={adapter}"], enable_deterministic_inference=True), "deterministic"),
                           (dict(lora_paths=[f"a={adapter}"], max_loaded_loras=2), "max_loaded_loras"),
                           (dict(lora_paths=[f"a={adapter}"], max_lora_rank=2), "max_lora_rank")):
        with pytest.raises(ValueError, match=needle):
            Engine(str(tiny_llama), show_progress=False, max_total_tokens=512, **kwargs)
