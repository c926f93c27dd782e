"""EngineArgs: every Engine option with its SGLang name, validated before anything is built.

The options are not declared here: EngineArgs is composed from the fields of RunnerConfig
(runner/config.py), SchedulerConfig (rollout/scheduler.py), FrontendConfig and SGLangCompatConfig
(below), in that order,
so a new runner or scheduler option is an Engine option (and a server flag) with no edit here. A name
both parts declare (`max_running_requests`) is one option, passed to both, with the first part's
default. `runner_config()` and `scheduler_config()` split the flat options back into their parts; each
part validates itself in its own `__post_init__`.

SGLang parity: `SGLANG_OPTIONS` below is the one table of the `sglang.Engine` / ServerArgs names that
RL frameworks pass (verl's SGLang rollout and server, slime's sglang_engine, SGLang's own RL tests),
with the values accepted here and what each means. Names that mean nothing in one in-process engine
are accepted as no-ops only at values that really mean nothing (`dp_size=1`, `quantization=None`); any
other value is refused naming the option and the supported values. Unknown names are refused.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, make_dataclass

from rollout.scheduler import SchedulerConfig
from runner.config import RunnerConfig
from runner.expert_distribution import MODES as EXPERT_RECORDER_MODES

# Which logprobs generate() reports (runner/sampler.py): None = SGLang's, log_softmax(logits /
# temperature) over the whole vocabulary after penalties and bias, before top-k/top-p/min-p; the others
# are vLLM's `logprobs_mode` names for the same choices there.
LOGPROBS_MODES = (None, "processed_logprobs", "raw_logprobs")


@dataclass
class FrontendConfig:
    """Options of the Engine itself, beside the runner's and the scheduler's."""

    skip_tokenizer_init: bool = False
    show_progress: bool = True
    log_level: str = "warning"
    expert_distribution_recorder_mode: str = "stat"
    logprobs_mode: str | None = None
    # SGLang's --stream-interval: a streaming request's chunks every N tokens (the first at once, the final
    # always); a request's sampling param stream_interval overrides it. Fewer, larger chunks cost the
    # consumer (an HTTP server's socket writes, its clients' reads) less per token.
    stream_interval: int = 1
    # SGLang's --stream-output: a streamed request's chunks carry only the output_ids new since its previous chunk
    # (disjoint segments that join up to the whole output); text, logprobs and meta_info stay cumulative, as there.
    stream_output: bool = False
    # SGLang's --tokenizer-path: the tokenizer's files somewhere else than the checkpoint (None: model_path).
    tokenizer_path: str | None = None

    def __post_init__(self) -> None:
        if self.tokenizer_path is not None and not isinstance(self.tokenizer_path, str):
            raise ValueError(f"tokenizer_path={self.tokenizer_path!r} must be a path (str) or None")
        if not isinstance(self.stream_output, bool):
            raise ValueError(f"stream_output={self.stream_output!r} must be a bool")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval!r} must be an int >= 1 (1: every token is "
                             f"streamed)")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: choose one of {LOGPROBS_MODES} (None: SGLang's "
                             f"log_softmax(logits / temperature) before top-k/top-p; 'processed_logprobs': the "
                             f"truncated, renormalised distribution sampled from; 'raw_logprobs': the raw logits' "
                             f"log_softmax). vLLM's 'raw_logits'/'processed_logits' (logits, not logprobs) are "
                             f"not offered")
        if self.expert_distribution_recorder_mode not in EXPERT_RECORDER_MODES:
            raise ValueError(f"expert_distribution_recorder_mode={self.expert_distribution_recorder_mode!r}: choose "
                             f"one of {EXPERT_RECORDER_MODES}")
        levels = ("debug", "info", "warning", "error", "critical")
        if str(self.log_level).lower() not in levels:
            raise ValueError(f"log_level={self.log_level!r}: choose one of {levels}")


# name -> (accepted values, meaning here). Every SGLang name RL code passes to sglang.Engine(...) /
# ServerArgs(...) that this engine knows; all are Engine options (the ones the HTTP server owns are
# its flags and no-ops in-process). Checked by SGLangCompatConfig and the parts named.
SGLANG_OPTIONS: dict[str, tuple[str, str]] = {
    # ---- implemented --------------------------------------------------------------------------
    "model_path": ("HF checkpoint dir", "the model"),
    "dtype": ("'auto', 'float32', 'bfloat16', 'float16' (None = 'auto')", "weights and compute dtype"),
    "load_format": ("'auto', 'safetensors', 'dummy' (None = 'auto')", "initial load; 'dummy' = random"),
    "mem_fraction_static": ("(0, 1)", "share of free GPU memory for weights + KV cache"),
    "max_total_tokens": ("None or >= 1", "KV cache size in tokens"),
    "max_running_requests": ("None (= 512) or >= 1", "requests decoded together"),
    "context_length": ("None or <= the model's", "longest prompt + output"),
    "kv_cache_dtype": ("'auto' or a model dtype", "KV cache dtype"),
    "chunked_prefill_size": (">= 1, or -1", "prefill tokens per step; -1 (SGLang's no chunking): max_prefill_tokens"),
    "disable_radix_cache": ("bool", "no prefix cache"),
    "enable_fp32_lm_head": ("bool", "the LM head of a bf16/fp16 model projects in fp32 (hidden states and head "
                                    "weight upcast each step): logits and logprobs not rounded to the model dtype"),
    "enable_prefill_weight_versions": ("bool", "meta_info['prefill_weight_versions']: the weight version each "
                                       "prompt position's KV was computed under (prefix-cache hits included)"),
    "enable_weight_version_kv_isolation": ("bool", "the prefix cache is keyed by the weight version a request was "
                                           "admitted under: KV of one version is never reused under another, "
                                           "even after an update with flush_cache=False"),
    "disable_overlap_schedule": ("bool or None", "True: no overlap schedule, each decode step is built only after "
                                 "the previous one finished (rollout.overlap); False: overlap on; None (default): on "
                                 "for CUDA, off on the CPU (where the plain schedule's decode blocks measured "
                                 "faster); outputs are the same either way"),
    "num_continuous_decode_steps": ("an int >= 1 or None", "the plain schedule runs up to N decode steps of a batch "
                                    "back to back (one batch built, the steps chained on the device, their tokens "
                                    "processed and streamed together) while nothing waits to be admitted or to act; "
                                    "an arrival stops a block after its current step; None (default): 8 on the "
                                    "CPU, 1 on CUDA; outputs are the same either way"),
    "attention_backend": ("None, 'torch_native', 'flashinfer' (SGLang's 'fa3', 'triton' ... are refused)",
                          "attention kernels, chosen once"),
    "disable_cuda_graph": ("bool", "no captured decode step"),
    "cuda_graph_max_bs": ("None or >= 1", "largest captured decode batch"),
    "cuda_graph_bs": ("None or list of sizes", "exact captured decode batches"),
    "enable_piecewise_cuda_graph": ("bool (CUDA only)", "prefill captured per token bucket, attention eager "
                                    "between the pieces (runner/graphs/piecewise_runner.py)"),
    "piecewise_cuda_graph_max_tokens": ("None (= 4096) or >= 1", "largest captured prefill token count"),
    "piecewise_cuda_graph_tokens": ("None or list of token counts", "exact captured prefill token buckets"),
    "enable_memory_saver": ("bool", "release/resume_memory_occupation work"),
    "enable_weights_cpu_backup": ("bool", "released weights kept on the host and restored on resume"),
    "tp_size": (">= 1", "tensor parallelism: one process per rank (runner/tp), gloo on CPU, NCCL on CUDA"),
    "random_seed": ("int or None", "unseeded sampling (None: a seed drawn from the OS at start-up, as SGLang), "
                                   "dummy weights (None: 0)"),
    "skip_tokenizer_init": ("bool", "token ids in, token ids out"),
    "log_level": ("'debug', 'info', 'warning', 'error', 'critical'", "level of the `rollout` loggers"),
    "stream_interval": ("an int >= 1", "a streaming request's chunks every N tokens: the first token at once, "
                                       "then tokens N+1, 2N+1, ..., and the final output"),
    "stream_output": ("bool", "a streamed request's chunks carry only the output_ids new since its previous "
                      "chunk (text and logprobs stay cumulative)"),
    "tokenizer_path": ("None or a directory", "where the tokenizer's files are (None: model_path)"),
    "base_gpu_id": ("int >= 0; 0 when tp_size > 1 on CUDA", "device='cuda' runs on cuda:{base_gpu_id}; "
                    "no-op on the CPU"),
    "weight_version": ("str", "weight_version before the first update"),
    "custom_weight_loader": ("None or list of dotted paths", "functions fn(model, named_tensors) that "
                             "update_weights_from_tensor(load_format=<path>) may call"),
    "enable_return_routed_experts": ("bool", "generate(return_routed_experts=True) works (MoE): every forward's "
                                     "routing is kept per KV slot on the host; captured decode steps yield to "
                                     "eager ones"),
    "expert_distribution_recorder_mode": ("'stat', 'per_pass'", "what dump_expert_distribution_record returns"),
    "rl_on_policy_target": ("None, 'fsdp'", "'fsdp': the forward follows transformers' op order and dtypes "
                            "(per-request SDPA in the model dtype, no prepacked or captured kernels), so an HF/FSDP "
                            "trainer's bf16 logprobs match (runner/hf_numerics.py)"),
    "cpu_offload_gb": (">= 0 on the CPU (weights are on the host already); 0 on CUDA (streaming weights in "
                       "is not supported: use enable_memory_saver + enable_weights_cpu_backup)", "host-resident weights"),
    # ---- accepted, no-ops here ------------------------------------------------------------------
    "trust_remote_code": ("bool", "no-op: only built-in architectures load, no checkpoint code ever runs"),
    "skip_server_warmup": ("bool", "no-op: there is no warmup request"),
    "disable_piecewise_cuda_graph": ("bool", "no-op: piecewise (prefill) graphs are off unless "
                                     "enable_piecewise_cuda_graph=True"),
    "enable_draft_weights_cpu_backup": ("bool", "no-op: no draft model (no speculative decoding)"),
    "mm_attention_backend": ("None or str", "no-op: no multimodal models"),
    "dp_size": ("1", "one Engine is one data-parallel rank; rollout.ray.launch_engines runs several"),
    "pp_size": ("1", "no pipeline parallelism"),
    "ep_size": ("1", "all experts of a MoE model on one device"),
    "nnodes": ("1", "one node"),
    "node_rank": ("0", "one node"),
    "gpu_id_step": ("int >= 1; 1 when tp_size > 1 on CUDA", "no-op at tp_size=1 (TP rank i runs on cuda:i)"),
    "dist_init_addr": ("None or str", "no-op: one node; TP ranks (and weight-update groups) rendezvous on "
                       "their own addresses"),
    "nccl_port": ("None or int", "no-op: TP ranks rendezvous on a free loopback port"),
    "quantization": ("None", "no quantized kernels"),
    "enable_dp_attention": ("bool; True only with dp_size=1", "no-op: with one data-parallel rank, DP attention "
                            "is plain attention"),
    "json_model_override_args": ("None, '', '{}'", "config.json is used as it is"),
    "enable_metrics": ("bool", "no-op: the HTTP server always serves /metrics"),
    "decode_log_interval": ("int >= 1", "no-op: no periodic decode-throughput log line (/metrics has the figures)"),
    "log_requests": ("bool", "no-op: requests are not logged (the access log is the server's --access-log)"),
    "sampling_backend": ("None, 'pytorch', 'flashinfer'", "no-op: one sampler, chosen per device"),
    "dist_timeout": ("None or a number of seconds > 0", "no-op: tensor-parallel ranks rendezvous with their own "
                     "bounded wait"),
    "watchdog_timeout": ("a number of seconds > 0", "no-op: no watchdog kills a slow step (a step that fails "
                         "fails its requests only)"),
    "enable_torch_compile": ("bool", "no-op: the captured decode step is cuda_graph_bs (compiled on the CPU, "
                             "a CUDA graph on CUDA)"),
    "speculative_algorithm": ("None", "no speculative decoding"),
    "disaggregation_mode": ("'null'", "no prefill/decode disaggregation"),
    "is_embedding": ("False", "generation models only"),
    "allow_auto_truncate": ("False", "a prompt is never cut: one that leaves no room for a new token is refused "
                            "by name, and an output is already cut at the context"),
    "max_prefill_tokens": ("int >= 1", "the prefill tokens of a step when chunked_prefill_size=-1; otherwise "
                           "chunked_prefill_size bounds them"),
    # The HTTP server's own flags (rollout.launch_server); an in-process Engine drops them.
    **{name: ("any", "no-op in-process: a flag of rollout.launch_server")
       for name in ("host", "port", "api_key", "served_model_name", "chat_template")},
}
# Names the HTTP server declares itself (rollout/server/args.py): not EngineArgs fields, or its
# command line would have them twice.
SERVER_ONLY_OPTIONS = ("host", "port", "api_key", "served_model_name", "chat_template")
# SGLang's None means "choose for me" for these; here that is the option's default.
NONE_MEANS_DEFAULT = ("dtype", "load_format", "max_running_requests", "kv_cache_dtype",
                      "mem_fraction_static", "chunked_prefill_size")


def _refuse(name: str, value, supported: str, why: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not supported here ({why}); supported: {supported}")


@dataclass
class SGLangCompatConfig:
    """SGLang ServerArgs names that mean nothing (or only one thing) in one in-process engine."""

    trust_remote_code: bool = False
    skip_server_warmup: bool = False
    disable_piecewise_cuda_graph: bool = False
    enable_draft_weights_cpu_backup: bool = False
    enable_metrics: bool = False
    mm_attention_backend: str | None = None
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    dist_init_addr: str | None = None
    nccl_port: int | None = None
    quantization: str | None = None
    enable_dp_attention: bool = False
    json_model_override_args: str | None = "{}"
    weight_version: str = "default"
    decode_log_interval: int = 40
    log_requests: bool = False
    sampling_backend: str | None = None
    max_prefill_tokens: int = 16384
    dist_timeout: int | float | None = None
    watchdog_timeout: int | float = 300
    enable_torch_compile: bool = False
    speculative_algorithm: str | None = None
    disaggregation_mode: str = "null"
    is_embedding: bool = False
    allow_auto_truncate: bool = False

    def __post_init__(self) -> None:
        for name in ("trust_remote_code", "skip_server_warmup", "disable_piecewise_cuda_graph",
                     "enable_draft_weights_cpu_backup", "enable_metrics", "enable_dp_attention",
                     "enable_torch_compile", "is_embedding", "allow_auto_truncate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        for name, why in (("dp_size", "one Engine is one data-parallel rank; start several with "
                                      "rollout.ray.launch_engines"),
                          ("pp_size", "no pipeline parallelism"), ("ep_size", "no expert parallelism"),
                          ("nnodes", "one engine runs on one node")):
            if getattr(self, name) != 1:
                raise _refuse(name, getattr(self, name), "1", why)
        if self.node_rank != 0:
            raise _refuse("node_rank", self.node_rank, "0", "one engine runs on one node")
        if not isinstance(self.base_gpu_id, int) or self.base_gpu_id < 0:
            raise _refuse("base_gpu_id", self.base_gpu_id, "an int >= 0", "a CUDA device index")
        if not isinstance(self.gpu_id_step, int) or self.gpu_id_step < 1:
            raise _refuse("gpu_id_step", self.gpu_id_step, "an int >= 1", "a device index stride")
        if self.quantization is not None:
            raise _refuse("quantization", self.quantization, "None", "no quantized kernels; load a bf16/fp16/fp32 "
                          "checkpoint")
        if self.json_model_override_args not in (None, "", "{}"):
            raise _refuse("json_model_override_args", self.json_model_override_args, "None, '' or '{}'",
                          "config.json is used as it is; edit the checkpoint's config.json instead")
        if not isinstance(self.weight_version, str):
            raise ValueError(f"weight_version={self.weight_version!r} must be a str")
        if not isinstance(self.log_requests, bool):
            raise ValueError(f"log_requests={self.log_requests!r} must be a bool")
        for name in ("decode_log_interval", "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        for name, value in (("dist_timeout", self.dist_timeout), ("watchdog_timeout", self.watchdog_timeout)):
            if value is None and name == "dist_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number of seconds > 0")
        if self.speculative_algorithm is not None:
            raise _refuse("speculative_algorithm", self.speculative_algorithm, "None", "no speculative decoding")
        if self.disaggregation_mode != "null":
            raise _refuse("disaggregation_mode", self.disaggregation_mode, "'null'",
                          "no prefill/decode disaggregation")
        if self.is_embedding:
            raise _refuse("is_embedding", True, "False", "generation models only")
        if self.allow_auto_truncate:
            raise _refuse("allow_auto_truncate", True, "False", "a prompt is never cut: one that leaves no room for "
                          "a new token is refused by name; an output is cut at the context already")
        if self.sampling_backend not in (None, "pytorch", "flashinfer"):
            raise _refuse("sampling_backend", self.sampling_backend, "None, 'pytorch' or 'flashinfer'",
                          "SGLang's two sampling backends; one sampler runs here either way")


_PARTS = (RunnerConfig, SchedulerConfig, FrontendConfig, SGLangCompatConfig)


class _EngineArgsMethods:
    def __post_init__(self) -> None:
        self._parts = {part: self._build(part) for part in _PARTS}  # builds validate: bad options fail here

    def _build(self, part):
        values = {f.name: getattr(self, f.name) for f in fields(part)}
        if part is RunnerConfig:
            values["device"] = self._device()
        return part(**values)

    def _device(self) -> str:
        """SGLang's base_gpu_id picks the CUDA device: device='cuda' runs on cuda:{base_gpu_id}."""
        device, gpu = str(self.device), self.base_gpu_id
        if device.startswith("cuda") and self.tp_size > 1 and (gpu, self.gpu_id_step) != (0, 1):
            raise ValueError(f"base_gpu_id={gpu}, gpu_id_step={self.gpu_id_step} with tp_size={self.tp_size} is not "
                             f"supported here (tensor-parallel rank i runs on cuda:i); supported: base_gpu_id=0, "
                             f"gpu_id_step=1 (or CUDA_VISIBLE_DEVICES to choose the GPUs)")
        if not device.startswith("cuda") or not isinstance(gpu, int) or gpu == 0:
            return device
        if device == "cuda":
            return f"cuda:{gpu}"
        if device != f"cuda:{gpu}":
            raise ValueError(f"base_gpu_id={gpu} contradicts device={device!r}; pass one of them")
        return device

    def runner_config(self) -> RunnerConfig:
        return self._parts[RunnerConfig]

    def scheduler_config(self) -> SchedulerConfig:
        return self._parts[SchedulerConfig]

    @classmethod
    def from_kwargs(cls, model_path: str | None, **kwargs):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known - set(SERVER_ONLY_OPTIONS))
        if unknown:
            raise TypeError(f"Engine got unknown argument(s) {unknown}; known: {sorted(known - {'model_path'})} "
                            f"(SGLang's names and what they mean here: rollout.engine_args.SGLANG_OPTIONS)")
        for name in SERVER_ONLY_OPTIONS:  # the HTTP server's; they mean nothing to an in-process engine
            kwargs.pop(name, None)
        defaults = {f.name: f.default for f in fields(cls)}
        for name in NONE_MEANS_DEFAULT:
            if name in kwargs and kwargs[name] is None:
                kwargs[name] = defaults[name]
        if kwargs.get("chunked_prefill_size") == -1:  # SGLang's "no chunking": a step takes whole prompts up to
            kwargs["chunked_prefill_size"] = kwargs.get("max_prefill_tokens", defaults["max_prefill_tokens"])
        if model_path is None:
            model_path = kwargs.pop("model_path", None)
        else:
            kwargs.pop("model_path", None)
        if not model_path:
            raise ValueError("Engine needs model_path (an HF checkpoint directory)")
        return cls(model_path=str(model_path), **kwargs)


def _composed_fields() -> list[tuple]:
    out, seen = [], set()
    for part in _PARTS:
        for f in fields(part):
            if f.name in seen:
                continue
            seen.add(f.name)
            if f.default is not MISSING:
                spec = field(default=f.default)
            elif f.default_factory is not MISSING:
                spec = field(default_factory=f.default_factory)
            else:
                spec = field()
            out.append((f.name, f.type, spec))
    return out


EngineArgs = make_dataclass("EngineArgs", _composed_fields(), bases=(_EngineArgsMethods,))
EngineArgs.__module__ = __name__  # string annotations resolve against this module
EngineArgs.__doc__ = ("Every Engine option: the fields of RunnerConfig, SchedulerConfig, FrontendConfig and "
                      "SGLangCompatConfig, flat.")
