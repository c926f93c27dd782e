"""ServerArgs and the command line of `python -m rollout.launch_server`.

Engine flags are generated from `EngineArgs`' dataclass fields under SGLang's spelling
(`max_total_tokens` -> `--max-total-tokens`), so a new engine option becomes a flag with no edit here.
Booleans that default to False are plain switches (`--enable-memory-saver`); those that default to True
get a `--no-` twin. The server's own options (host, port, API key, served model name, chat template,
the cap on `n`, the access log) live in `ServerArgs`. Every flag has one line of `--help`: from a
field's `metadata["help"]`, else `ARG_HELP`, else the meaning in `SGLANG_OPTIONS`. `--log-level`
defaults to "info" here (SGLang's server default).

This module parses and validates; it does not build the engine or the app.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, dataclass, fields

from rollout.engine_args import EngineArgs

API_KEY_ENV = "SGLANG_API_KEY"  # also read by SGLang's client tooling


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"  # loopback unless asked: an RL rollout server is not a public service
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the model path
    chat_template: str | None = None  # a Jinja file, a built-in name or an inline template; default: the tokenizer's own
    max_n: int = 256  # refuse a request asking for more sequences (prompts x n) than this
    enable_cache_report: bool = False  # OpenAI usage carries prompt_tokens_details.cached_tokens (SGLang's flag)
    # Security (rollout/server/security.py): None = the defaults described there; '*' = any.
    allowed_hosts: list[str] | None = None
    allowed_origins: list[str] | None = None
    allowed_disk_roots: list[str] | None = None  # update_weights_from_disk only under these; None = anywhere
    # Limits (rollout/server/limits.py)
    max_request_bytes: int = 32 * 2**20
    max_weights_request_bytes: int = 8 * 2**30  # /update_weights_from_tensor carries the tensors' bytes
    max_response_entries: int = 2**21  # new tokens + logprob entries one request may ask for
    max_concurrent_weight_group_joins: int = 2  # more concurrent /init_weights_update_group calls get 503
    weight_group_join_timeout_s: float = 60.0  # default join timeout (a request's timeout_s overrides)
    # ---- operator options (logging) --------------------------------------------------------
    access_log: bool = True  # uvicorn's access log, one line per request at --log-level info; --no-access-log
    # ---- process layout (rollout/launch_server.py) -----------------------------------------
    engine_in_process: bool = False  # default: the engine runs in a child process (engine_process.py)
    engine_start_timeout_s: float = 600.0  # bound on building the engine in its process

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65536), got {self.port}")
        for name in ("max_n", "max_request_bytes", "max_weights_request_bytes", "max_response_entries",
                     "max_concurrent_weight_group_joins"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.weight_group_join_timeout_s > 0:
            raise ValueError(f"--weight-group-join-timeout-s must be > 0, got {self.weight_group_join_timeout_s}")
        if not self.engine_start_timeout_s > 0:
            raise ValueError(f"--engine-start-timeout-s must be > 0, got {self.engine_start_timeout_s}")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty (omit it to disable authentication)")


# ---- one line of --help per flag ----------------------------------------------------------------
# Server flags and the Engine options SGLANG_OPTIONS does not describe; every other Engine flag takes its
# line from SGLANG_OPTIONS (rollout/engine_args.py), so a description lives in one place.
ARG_HELP: dict[str, str] = {
    "model_path": "HF checkpoint directory (config.json, safetensors, tokenizer)",
    "host": "address to bind; loopback by default (bind beyond it only with --api-key)",
    "port": "TCP port to listen on",
    "api_key": "require 'Authorization: Bearer KEY' on every route but /health",
    "served_model_name": "model name in /v1/models and OpenAI responses (default: the model path)",
    "chat_template": "chat template for /v1/chat/completions: a Jinja file, a built-in name (plain, chatml) or an "
                     "inline template (default: the tokenizer's own; without one chat completions are refused)",
    "max_n": "refuse a request asking for more sequences (prompts x n) than this",
    "enable_cache_report": "OpenAI responses' usage carries prompt_tokens_details.cached_tokens (prompt tokens "
                           "served from the prefix cache)",
    "access_log": "uvicorn's access log (one line per request, at --log-level info or lower)",
    "engine_in_process": "run the engine (scheduler and model) in the HTTP server's own process, sharing its GIL "
                         "(the old layout; default: a child process, so HTTP and the model use two cores)",
    "engine_start_timeout_s": "seconds the server waits for the engine process to build the engine before it "
                              "gives up and exits",
    "device": "'cpu' or 'cuda' ('cuda:N' picks a device)",
    "cpu_kv_cache_bytes": "KV cache bytes on the CPU when --max-total-tokens is not given",
    "cpu_prepack": "oneDNN-prepacked linear weights on the CPU (faster decode)",
    "cpu_kernels": "the engine's CPU kernels (paged attention, fused RMSNorm, rotary), compiled at first use "
                   "(default: when they build on an AVX-512 CPU; true: required; false: torch's ops)",
    "enable_deterministic_inference": "batch-invariant kernels: a request's ids and logprobs are bitwise the same "
                                      "in any batch (dense and MoE; CPU torch_native attention)",
    "cpu_pin_overlap_threads": "with the overlap schedule on the CPU (a model stepping on one intra-op thread): "
                               "pin its two threads to distinct CPUs (rollout/thread_pinning.py)",
    "schedule_policy": "the order waiting requests are admitted in: fcfs (arrival), lpm (longest cached prefix "
                       "first), lof (longest max_new_tokens first), random (seeded by --random-seed)",
    "enable_mixed_chunk": "a step that admits prompts also decodes the running requests (one forward), instead of "
                          "a prefill step they wait through (plain schedule only)",
    "in_batch_prefix_threshold": "shared prompt tokens that make a request wait a step to reuse another's KV",
    "show_progress": "progress bars in Engine.generate (in-process)",
    "enable_lora": "serve LoRA adapters (on by default when --lora-paths is given)",
    "max_lora_rank": "largest adapter rank accepted (default: the largest initial adapter's)",
    "max_loras_per_batch": "adapters one batch may mix; requests on further adapters wait",
    "max_loaded_loras": "adapters resident at once (default: max(--max-loras-per-batch, initial adapters))",
    "lora_target_modules": "projections adapters may target (q_proj ... down_proj; default: the initial adapters')",
    "lora_paths": "adapters to load at start-up, as name=path (PEFT directories)",
    "allowed_hosts": "Host header names served besides loopback and the bound address ('*': any; DNS-rebinding guard)",
    "allowed_origins": "browser Origins allowed besides the server's own ('*': any; cross-site request guard)",
    "allowed_disk_roots": "update_weights_from_disk reads only checkpoints under these directories (default: any)",
    "max_request_bytes": "refuse request bodies larger than this with 413 (weight routes: --max-weights-request-bytes)",
    "max_weights_request_bytes": "body limit of /update_weights_from_tensor, which carries the tensors' bytes",
    "max_response_entries": "refuse a request whose output could exceed this many tokens + logprob entries",
    "max_concurrent_weight_group_joins": "concurrent /init_weights_update_group joins; more get 503",
    "weight_group_join_timeout_s": "default deadline of a weight-group join (a request's timeout_s overrides it)",
    "logprobs_mode": "None: SGLang's logprobs (log_softmax(logits/T) before top-k/p); processed_logprobs: the "
                     "truncated distribution sampled from; raw_logprobs: log_softmax of the raw logits",
}


def _help(name: str, default) -> str:
    from rollout.engine_args import SGLANG_OPTIONS

    line = ARG_HELP.get(name)
    if line is None and name in SGLANG_OPTIONS:
        accepted, meaning = SGLANG_OPTIONS[name]
        line = meaning if accepted in ("bool", "any") else f"{meaning}; accepted: {accepted}"
    line = line or "(undocumented)"
    return line if default is None or isinstance(default, bool) else f"{line} (default: {default})"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp) -> type:
    """`int | None` -> int; `str` -> str."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _add_dataclass_flags(parser: argparse._ArgumentGroup, cls, skip: set[str]) -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        default = None if f.default is MISSING else f.default
        tp = _base_type(hints[f.name])
        help_ = f.metadata.get("help") or _help(f.name, default)
        if tp is bool:
            # True or None (decided by the engine) defaults also get --no-<flag>: a user can pick either side.
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            parser.add_argument(_flag(f.name), dest=f.name, action=action, default=default, help=help_)
        elif typing.get_origin(tp) is list:  # list[str] / list[int]: one or more values, as SGLang's nargs="+"
            parser.add_argument(_flag(f.name), dest=f.name, nargs="+", type=typing.get_args(tp)[0],
                                default=default, help=help_)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, type=tp, default=default, help=help_)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.launch_server",
        description="Serve an HF checkpoint over SGLang's native HTTP API and the OpenAI API.")
    parser.add_argument("--model-path", dest="model_path", required=True, help=ARG_HELP["model_path"])
    _add_dataclass_flags(parser.add_argument_group("server"), ServerArgs, skip=set())
    _add_dataclass_flags(parser.add_argument_group("engine (SGLang flag names)"), EngineArgs, skip={"model_path"})
    parser.set_defaults(log_level="info")  # SGLang's server default; an in-process Engine stays at "warning"
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[ServerArgs, dict]:
    """-> (ServerArgs, Engine kwargs including model_path). Without --api-key the key comes from the
    SGLANG_API_KEY environment variable when it is set (a command line is visible to every local user)."""
    ns = vars(build_parser().parse_args(argv))
    if ns.get("api_key") is None and os.environ.get(API_KEY_ENV):
        ns["api_key"] = os.environ[API_KEY_ENV]
    server_names = {f.name for f in fields(ServerArgs)}
    server = ServerArgs(**{k: v for k, v in ns.items() if k in server_names})
    engine_kwargs = {k: v for k, v in ns.items() if k not in server_names}
    return server, engine_kwargs
