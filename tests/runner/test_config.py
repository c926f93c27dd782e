"""ModelConfig parsing against the HF configs tests/checkpoints.py writes and hand-written variants:
head_dim, biases, q/k norm, both rope layouts, llama3 frequencies equal HF's, tied embeddings, the
sliding-window context cap."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from runner.config import ModelConfig, RunnerConfig
from runner.layers.rotary import RotaryEmbedding, rope_inv_freq
from tests.checkpoints import load_hf_model

# arch -> (head_dim, head_dim given explicitly in config.json, attention_bias, qk_norm, rope_theta)
EXPECTED = {
    "llama": (32, True, False, False, 500000.0),
    "mistral": (16, True, False, False, 1e6),
    "qwen2": (16, False, True, False, 1e6),
    "qwen3": (32, True, False, True, 1e6),
}
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _raw(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_parses_each_architecture(tiny_ckpt):
    """Shapes, head_dim (explicit or hidden/heads), biases, q/k norm, rope theta and special ids are
    read as HF reads them."""
    raw = _raw(tiny_ckpt)
    mc = ModelConfig.from_pretrained(tiny_ckpt)
    head_dim, explicit, bias, qk_norm, theta = EXPECTED[mc.model_family]
    assert ("head_dim" in raw) == explicit
    assert (mc.head_dim, mc.attention_bias, mc.qk_norm, mc.rope_theta) == (head_dim, bias, qk_norm, theta)
    assert not mc.o_proj_bias
    assert (mc.vocab_size, mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers) == (384, 64, 128, 2)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.max_position_embeddings) == (4, 2, 512)
    assert (mc.eos_token_ids, mc.bos_token_id, mc.pad_token_id, mc.tie_word_embeddings) == ([1], 0, 2, False)
    assert mc.rope_scaling == (LLAMA31_ROPE | {"original_max_position_embeddings": 64}
                               if mc.model_family == "llama" else None)
    # The HF model agrees on every shape the runner derives.
    attn = load_hf_model(tiny_ckpt).model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (mc.num_attention_heads * mc.head_dim, mc.hidden_size)
    assert attn.k_proj.weight.shape == (mc.num_key_value_heads * mc.head_dim, mc.hidden_size)
    assert (attn.q_proj.bias is not None) == mc.attention_bias
    assert (attn.o_proj.bias is not None) == mc.o_proj_bias
    assert hasattr(attn, "q_norm") == mc.qk_norm


def test_head_dim_derived_when_absent(tiny_llama):
    """Without head_dim (or with null) it is hidden_size // num_attention_heads."""
    raw = _raw(tiny_llama)
    for value in ("absent", None):
        cfg = dict(raw)
        if value == "absent":
            del cfg["head_dim"]
        else:
            cfg["head_dim"] = None
        assert ModelConfig.from_dict(cfg).head_dim == 64 // 4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_flag(tiny_llama, tiny_qwen3, arch):
    """attention_bias=true gives Llama/Qwen3 q/k/v and o_proj biases (as HF), Mistral none."""
    cfg = dict(_raw(tiny_llama if arch == "llama" else tiny_qwen3), attention_bias=True)
    mc = ModelConfig.from_dict(cfg)
    assert mc.attention_bias and mc.o_proj_bias
    mistral = ModelConfig.from_dict(dict(cfg, architectures=["MistralForCausalLM"]))
    assert not mistral.attention_bias and not mistral.o_proj_bias


def test_tied_embeddings(ckpt_factory):
    """tie_word_embeddings is read from config.json."""
    assert ModelConfig.from_pretrained(ckpt_factory("qwen2", tie_word_embeddings=True)).tie_word_embeddings


def _rope_layouts(raw: dict) -> dict[str, dict]:
    """The same llama3 rope in transformers-5 and both transformers-4 spellings."""
    base = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    scaling = {k: v for k, v in LLAMA31_ROPE.items() if k != "rope_type"}
    return {
        "v5_rope_parameters": dict(base, rope_parameters={**LLAMA31_ROPE, "rope_theta": 500000.0}),
        "v4_rope_type": dict(base, rope_theta=500000.0, rope_scaling={**scaling, "rope_type": "llama3"}),
        "v4_type": dict(base, rope_theta=500000.0, rope_scaling={**scaling, "type": "llama3"}),
    }


@pytest.mark.parametrize("layout", ["v5_rope_parameters", "v4_rope_type", "v4_type"])
def test_llama3_rope_layouts(tiny_llama, layout):
    """Every config layout yields theta 5e5 and the llama3 scaling dict (rope_type normalised)."""
    mc = ModelConfig.from_dict(_rope_layouts(_raw(tiny_llama))[layout])
    assert mc.rope_theta == 500000.0
    assert mc.rope_scaling == LLAMA31_ROPE


def test_default_rope_layouts(tiny_qwen2):
    """Default rope: theta from rope_parameters, or from top-level rope_theta with null or
    'default' rope_scaling; missing everywhere means HF's 10000."""
    raw = {k: v for k, v in _raw(tiny_qwen2).items() if k != "rope_parameters"}
    assert ModelConfig.from_pretrained(tiny_qwen2).rope_theta == 1e6
    for scaling in (None, {"type": "default"}, {"rope_type": "default"}):
        mc = ModelConfig.from_dict(dict(raw, rope_theta=123.0, rope_scaling=scaling))
        assert (mc.rope_theta, mc.rope_scaling) == (123.0, None)
    assert ModelConfig.from_dict(raw).rope_theta == 10000.0


@pytest.mark.parametrize("original", [8192, 64])
def test_llama3_inv_freq_equals_hf(original):
    """rope_inv_freq for llama3 equals transformers' llama3 init (Llama 3.1 geometry, and a short
    original context that puts frequencies in all three bands)."""
    rope = dict(LLAMA31_ROPE, original_max_position_embeddings=original)
    hf_config = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128,
                            rope_parameters={**rope, "rope_theta": 500000.0})
    want, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    assert attention_scaling == 1.0
    mc = ModelConfig.from_dict(dict(hf_config.to_dict(), architectures=["LlamaForCausalLM"]))
    got = rope_inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    default = rope_inv_freq(128, 500000.0, None)
    assert (got < default * 0.99).any() and (got == default).any()  # scaling did something, not everything


def test_rotary_tables_equal_hf(tiny_ckpt):
    """The runner's cos/sin tables equal HF's rotary embedding at positions 0..511."""
    mc = ModelConfig.from_pretrained(tiny_ckpt)
    rotary = RotaryEmbedding(mc.head_dim, mc.max_position_embeddings, mc.rope_theta, mc.rope_scaling)
    positions = torch.arange(mc.max_position_embeddings)
    x = torch.zeros(1, 1, mc.head_dim)
    cos, sin = load_hf_model(tiny_ckpt).model.rotary_emb(x, positions.unsqueeze(0))
    torch.testing.assert_close(rotary.cos_cached[positions], cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotary.sin_cached[positions], sin[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, context", [(128, 128), (4096, 512), (None, 512)])
def test_mistral_sliding_window_caps_context(tiny_mistral, window, context):
    """Mistral's context is min(max_position_embeddings, sliding_window): attention is full-context,
    which equals sliding-window attention only inside the window."""
    mc = ModelConfig.from_dict(dict(_raw(tiny_mistral), sliding_window=window))
    assert (mc.sliding_window, mc.context_len) == (window, context)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_sliding_window(tiny_qwen2, tiny_qwen3, arch):
    """Qwen's sliding_window is ignored unless use_sliding_window, which is refused (not silently
    run with full attention)."""
    raw = _raw(tiny_qwen2 if arch == "qwen2" else tiny_qwen3)
    mc = ModelConfig.from_dict(dict(raw, sliding_window=64, use_sliding_window=False))
    assert (mc.sliding_window, mc.context_len) == (None, 512)
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_dict(dict(raw, sliding_window=64, use_sliding_window=True, max_window_layers=0))


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"architectures": []}, "exactly one architecture"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}}, "low_freq_factor"),  # was a bare KeyError  # the MLP is SwiGLU: run as SiLU it gave other tokens than HF
])
def test_unsupported_configs_are_refused(tiny_llama, change, message):
    """Configs the runner cannot run exactly fail with a message naming the culprit."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(dict(_raw(tiny_llama), **change))


def test_cpu_kernels_setting_must_be_none_or_a_bool(tiny_llama):
    """cpu_kernels takes None, True or False; anything else is refused by name."""
    with pytest.raises(ValueError, match=r"cpu_kernels='yes'"):
        RunnerConfig(str(tiny_llama), cpu_kernels="yes")


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_keys_left_out_of_config_json_take_transformers_defaults(ckpt_factory, arch):
    """A config.json without rope_theta, rms_norm_eps, sliding_window, head_dim resolves them as transformers does
    for its model_type (Mistral's window is 4096, Qwen3's head_dim 128; the engine had used Llama's defaults and
    hidden_size // heads), and hidden_act "swish" (transformers' other name for SiLU) is taken."""
    from transformers import AutoConfig

    raw = _raw(ckpt_factory(arch))
    cut = {k: v for k, v in raw.items()
           if k not in ("rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps", "sliding_window", "head_dim")}
    hf = AutoConfig.for_model(cut["model_type"], **{k: v for k, v in cut.items() if k != "model_type"})
    mc = ModelConfig.from_dict(cut)
    assert mc.rope_theta == hf.rope_parameters["rope_theta"] and mc.rms_norm_eps == hf.rms_norm_eps
    assert mc.head_dim == hf.head_dim
    assert mc.sliding_window == (hf.sliding_window if arch == "mistral" else None)
    assert ModelConfig.from_dict(dict(raw, hidden_act="swish")).head_dim == ModelConfig.from_dict(raw).head_dim
