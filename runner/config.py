"""The runner's configuration: ModelConfig (from an HF `config.json`) and RunnerConfig (how to run it).

ModelConfig is the subset of an HF `config.json` the runner needs, validated.

Supported: Llama (incl. rope type `llama3`, explicit `head_dim`), Mistral, Qwen2 (q/k/v bias),
Qwen3 (q/k RMSNorm, explicit `head_dim`), and the mixture-of-experts Qwen3-MoE and Mixtral;
tied or untied embeddings. Anything else is a clear error,
never a silent fallback to a look-alike architecture. Reads both the transformers-4 layout
(`rope_theta` + `rope_scaling`) and the transformers-5 layout (`rope_parameters`).

RunnerConfig holds every runner option (device, dtype, memory, load format), validated in
`__post_init__`; EngineArgs is composed from it rather than repeating it. The one table of dtypes a
model can run in and the one list of memory tags live here too. Nothing here touches a tensor.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The dtypes a model (and its KV cache) can run in, by the names the options take.
MODEL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}
# Memory regions that release/resume act on (runner.memory.memory_saver).
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def check_memory_tags(tags: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """None -> every tag; a name or a list of names -> that list, each checked against MEMORY_TAGS."""
    if tags is None:
        return list(MEMORY_TAGS)
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be None, a tag name or a list of tag names from {list(MEMORY_TAGS)}, "
                         f"got {tags!r}")
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; valid tags: {list(MEMORY_TAGS)}")
    return list(tags)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # Mixture-of-experts: the family is the attention's (q/k norm, bias, sliding window); the MoE part of
    # the config is read by runner/models/moe.py.
    "Qwen3MoeForCausalLM": "qwen3",
    "MixtralForCausalLM": "mistral",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only for rope_type != "default"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2; Llama/Qwen3 with attention_bias=true)
    o_proj_bias: bool = False  # o_proj bias (Llama/Qwen3 with attention_bias=true; never Qwen2/Mistral)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    hf_config: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")

    @property
    def model_family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def context_len(self) -> int:
        """Longest sequence (prompt + output) the runner accepts."""
        if self.sliding_window and self.model_family == "mistral":
            # We attend over the full context; past the window that would differ from the model.
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> ModelConfig:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_path!s}")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        raw = _with_hf_defaults(raw)
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # swish is transformers' other name for SiLU
            raise ValueError(f"{arch} with hidden_act={act!r} is not supported: the MLP is SwiGLU (hidden_act 'silu')")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope_theta, rope_scaling = _parse_rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = raw.get("sliding_window")
        if family in ("qwen2", "qwen3") and raw.get("use_sliding_window", False):
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        if raw.get("mlp_bias", False):
            raise ValueError(f"{arch} with mlp_bias=true is not supported")
        # HF: Qwen2 always has q/k/v bias and never o_proj bias; Mistral has none; Llama and Qwen3
        # put `attention_bias` on all four projections.
        bias = family in ("llama", "qwen3") and bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or bias,
            o_proj_bias=bias,
            qk_norm=family == "qwen3",
            sliding_window=sliding if family == "mistral" else None,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            hf_config=raw,
        )

    def shape_signature(self) -> dict:
        """What must match for another checkpoint's weights to be loadable into this model."""
        keys = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                "attention_bias", "o_proj_bias", "qk_norm")
        return {k: getattr(self, k) for k in keys}


# Keys a config.json may leave out, where transformers then uses its config class's own default (which differs
# by architecture: Mixtral's rope_theta 1e6 and rms_norm_eps 1e-5, Mistral's sliding_window 4096, ...) or a value
# it derives (head_dim from hidden_size and heads). Taken from transformers' resolved config, so a hand-written
# config.json runs as HF runs it.
_HF_DEFAULTED = ("rms_norm_eps", "sliding_window", "max_position_embeddings", "hidden_act", "head_dim",
                 "use_sliding_window", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                 "num_experts_per_tok", "tie_word_embeddings")
_ROPE_KEYS = ("rope_theta", "rope_parameters", "rope_scaling")


def _with_hf_defaults(raw: dict) -> dict:
    """`raw` with the keys of _HF_DEFAULTED (and the rope theta) it lacks filled in as transformers resolves
    them for its model_type; `raw` itself when transformers cannot build that config (the checks that follow
    then see what the file says)."""
    missing = [k for k in _HF_DEFAULTED if k not in raw]
    no_rope = all(raw.get(k) is None for k in _ROPE_KEYS)  # transformers 4 writes "rope_scaling": null
    if not (missing or no_rope) or not isinstance(raw.get("model_type"), str):
        return raw
    try:
        from transformers import AutoConfig

        # A deep copy: transformers standardizes nested values (rope_parameters) in place.
        given = copy.deepcopy({k: v for k, v in raw.items() if k != "model_type"})
        resolved = AutoConfig.for_model(raw["model_type"], **given)
    except Exception:  # an unknown model_type or a config transformers refuses: nothing to fill from
        return raw
    out = dict(raw)
    for k in missing:
        if hasattr(resolved, k):
            out[k] = getattr(resolved, k)
    if no_rope:
        params = getattr(resolved, "rope_parameters", None)  # transformers 5; 4.x keeps rope_theta
        theta = params.get("rope_theta") if isinstance(params, dict) else getattr(resolved, "rope_theta", None)
        if theta is not None:
            out["rope_theta"] = theta
    return out


def _parse_rope(raw: dict) -> tuple[float, dict | None]:
    """Return (rope_theta, scaling dict or None) from either config layout."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and "rope_theta" not in params:
        raise ValueError("per-layer-type rope_parameters are not supported")
    scaling = dict(params) if isinstance(params, dict) else dict(raw.get("rope_scaling") or {})
    theta = float(scaling.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if not isinstance(scaling.get(k), int | float) or isinstance(scaling.get(k), bool)]
        if missing:
            raise ValueError(f"llama3 rope scaling needs numbers for {missing}; got {scaling!r}")
    return theta, scaling


MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


def check_tp_size(mc: ModelConfig, tp_size: int) -> None:
    """The model must split evenly over `tp_size` ranks (KV heads may instead be replicated)."""
    if tp_size == 1:
        return
    if mc.architecture in MOE_ARCHITECTURES:
        raise ValueError(f"tp_size={tp_size}: tensor parallelism of mixture-of-experts models ({mc.architecture}) "
                         f"is not supported; use tp_size=1")
    if mc.num_attention_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide num_attention_heads={mc.num_attention_heads}")
    kv = mc.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"tp_size={tp_size}: num_key_value_heads={kv} must be a multiple or a divisor of it")
    if mc.intermediate_size % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide intermediate_size={mc.intermediate_size}")


RL_ON_POLICY_TARGETS = (None, "fsdp")  # SGLang's accepted values


@dataclass
class RunnerConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "auto"  # "auto": bf16 on CUDA, fp32 on CPU
    load_format: str = "auto"  # "auto" | "safetensors" | "dummy"
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    max_running_requests: int = 512
    context_length: int | None = None
    kv_cache_dtype: str = "auto"
    cpu_kv_cache_bytes: int = 1 << 30
    attention_backend: str | None = None
    disable_cuda_graph: bool = False
    # Captured decode sizes (runner/graphs/graph_runner.py): on CUDA [1, 2, 4, 8, 16, 24, ...] up to
    # cuda_graph_max_bs (None: 256, capped at max_running_requests), or exactly `cuda_graph_bs`. On the CPU the
    # compiled decode step is opt-in: only the sizes in `cuda_graph_bs`, compiled at init.
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None
    # Piecewise CUDA graphs for prefill (runner/graphs/piecewise_runner.py; CUDA only, SGLang's names):
    # token-count buckets up to piecewise_cuda_graph_max_tokens (None: 4096), or exactly these.
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int | None = None
    piecewise_cuda_graph_tokens: list[int] | None = None
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    tp_size: int = 1
    # None (SGLang's default): dummy weights and torch's global seed use 0, and the engine draws the seed of
    # its unseeded requests from the OS, so engines started alike (servers behind a router, an EngineGroup)
    # do not give their k-th unseeded requests the same draws.
    random_seed: int | None = None
    cpu_prepack: bool = True  # CPU fp32: oneDNN-prepacked linear weights (runner/layers/prepack.py)
    # The engine's CPU kernels (runner/cpu_kernels.py: paged attention, fused RMSNorm, rotary), built at
    # first use: None uses them when they build on an AVX-512 CPU, True requires them, False: torch's ops.
    cpu_kernels: bool | None = None
    # SGLang's enable_fp32_lm_head: the vocabulary projection of a bf16/fp16 model in fp32 (hidden states and
    # head weight upcast each step), so logits and logprobs are not rounded to the model dtype first.
    enable_fp32_lm_head: bool = False
    # SGLang's names (see rollout/engine_args.py): dotted paths of fn(model, named_tensors) that
    # update_weights_from_tensor may name as its load_format; GB of weights kept on the host.
    custom_weight_loader: list[str] | None = None
    cpu_offload_gb: float = 0
    # Batch-invariant ops (runner/batch_invariant.py): a request's ids and logprobs are bitwise equal
    # whatever its batch, chunking, cache hits or retraction. Turns off the prepacked CPU linears and
    # the compiled CPU decode step (both use kernels whose bits depend on the row count).
    enable_deterministic_inference: bool = False
    # LoRA (runner/lora/), SGLang's names. enable_lora None: on iff lora_paths is given. max_lora_rank and
    # lora_target_modules are inferred from the initial adapters when not given; max_loaded_loras (None:
    # max(max_loras_per_batch, len(lora_paths))) adapters stay resident on the device.
    enable_lora: bool | None = None
    max_lora_rank: int | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    lora_target_modules: list[str] | None = None
    lora_paths: list[str] | dict | list[dict] | None = None  # SGLang's three forms; the CLI takes name=path

    # SGLang's true on-policy switch: "fsdp" makes the forward follow transformers' op order and
    # dtypes (runner/hf_numerics.py), so an HF/FSDP trainer's logprobs match the engine's.
    rl_on_policy_target: str | None = None

    def __post_init__(self) -> None:
        if self.random_seed is not None and (not isinstance(self.random_seed, int) or isinstance(self.random_seed, bool)):
            raise ValueError(f"random_seed={self.random_seed!r} must be an int or None (None: drawn at start-up)")
        if self.cpu_kernels not in (None, True, False):
            raise ValueError(f"cpu_kernels={self.cpu_kernels!r}: use None (when they build), True (required) or False")
        if self.rl_on_policy_target not in RL_ON_POLICY_TARGETS:
            raise ValueError(f"rl_on_policy_target={self.rl_on_policy_target!r}: choose one of {RL_ON_POLICY_TARGETS} "
                             f"('fsdp': follow transformers' numerics, as SGLang's option)")
        if self.rl_on_policy_target is not None:
            if self.enable_deterministic_inference:
                raise ValueError("rl_on_policy_target='fsdp' and enable_deterministic_inference=True pick different "
                                 "kernels; choose one")
            if self.tp_size != 1:
                raise ValueError(f"rl_on_policy_target='fsdp' with tp_size={self.tp_size}: the ranks' partial sums "
                                 f"add up in another order than transformers' one forward, so logprobs would not be "
                                 f"bitwise HF's; use tp_size=1")
            if self.attention_backend not in (None, "torch_native", "hf_sdpa"):
                raise ValueError(f"attention_backend={self.attention_backend!r} does not follow transformers' "
                                 f"numerics; rl_on_policy_target='fsdp' uses 'hf_sdpa' (leave it None)")
            self.attention_backend = "hf_sdpa"
            self.cpu_prepack = False  # HF's trainer runs plain F.linear
            self.cpu_kernels = False  # and torch's own norm and attention ops
            self.cuda_graph_bs = None
            self.disable_cuda_graph = True  # captured steps pad the batch and use their own kernels

        from runner.lora.options import validate_lora_options  # reads adapter_config.json files only

        validate_lora_options(self)
        if self.enable_deterministic_inference:
            if self.attention_backend not in (None, "torch_native"):
                raise ValueError(f"attention_backend={self.attention_backend!r} is not batch-invariant; "
                                 f"enable_deterministic_inference needs 'torch_native' (or None)")
            self.attention_backend = "torch_native"
            self.cpu_prepack = False
            self.cpu_kernels = False  # trainers/deterministic.py recomputes logprobs with torch's ops, bit for bit
            self.cuda_graph_bs = None
            self.disable_cuda_graph = True  # captured steps pad the batch and use their own kernels
            self.enable_piecewise_cuda_graph = False
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size!r} must be an integer >= 1")
        if self.tp_size > 1 and self.cuda_graph_bs and str(self.device).startswith("cpu"):
            raise ValueError(f"tp_size={self.tp_size} with cuda_graph_bs={self.cuda_graph_bs}: compiled CPU decode "
                             f"steps are not supported under tensor parallelism; drop cuda_graph_bs")
        if self.dtype not in ("auto", *MODEL_DTYPES):
            raise ValueError(f"dtype={self.dtype!r}: choose 'auto', {', '.join(map(repr, MODEL_DTYPES))}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format={self.load_format!r}: choose 'auto', 'safetensors' or 'dummy'")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens={self.max_total_tokens} must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs={self.cuda_graph_max_bs} must be >= 1")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1):
            raise ValueError(f"cuda_graph_bs={self.cuda_graph_bs} must be a non-empty list of sizes >= 1")
        if self.enable_piecewise_cuda_graph and not str(self.device).startswith("cuda"):
            raise ValueError(f"enable_piecewise_cuda_graph needs a CUDA device, got device={self.device!r}; "
                             f"drop it on the CPU")
        if self.piecewise_cuda_graph_max_tokens is not None and self.piecewise_cuda_graph_max_tokens < 1:
            raise ValueError(f"piecewise_cuda_graph_max_tokens={self.piecewise_cuda_graph_max_tokens} must be >= 1")
        if self.piecewise_cuda_graph_tokens is not None and (not self.piecewise_cuda_graph_tokens
                                                             or min(self.piecewise_cuda_graph_tokens) < 1):
            raise ValueError(f"piecewise_cuda_graph_tokens={self.piecewise_cuda_graph_tokens} must be a non-empty "
                             f"list of token counts >= 1")
        if self.kv_cache_dtype not in ("auto", *MODEL_DTYPES):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose 'auto' or {', '.join(MODEL_DTYPES)}")
        if isinstance(self.custom_weight_loader, str):
            self.custom_weight_loader = [self.custom_weight_loader]
        if self.custom_weight_loader is not None and not all(
                isinstance(p, str) and "." in p for p in self.custom_weight_loader):
            raise ValueError(f"custom_weight_loader={self.custom_weight_loader!r}: give a list of dotted paths "
                             f"'package.module.function' of functions fn(model, named_tensors)")
        if self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb={self.cpu_offload_gb} must be >= 0")
        if self.cpu_offload_gb and not str(self.device).startswith("cpu"):
            raise ValueError(f"cpu_offload_gb={self.cpu_offload_gb}: streaming weights from the host into "
                             f"{self.device} is not supported; the supported value there is 0. To give the "
                             f"device back between rollouts use enable_memory_saver=True (with "
                             f"enable_weights_cpu_backup=True to keep the weights on the host meanwhile), or "
                             f"lower mem_fraction_static to leave room")
