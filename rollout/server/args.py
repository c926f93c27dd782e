"""ServerArgs and the command line of `python -m rollout.launch_server`.

Engine flags are generated from `EngineArgs`' dataclass fields under SGLang's spelling
(`max_total_tokens` -> `--max-total-tokens`), so a new engine option becomes a flag with no edit here.
Booleans that default to False are plain switches (`--enable-memory-saver`); those that default to True
get a `--no-` twin. The server's own options (host, port, API key, served model name, chat template,
the cap on `n`) live in `ServerArgs`.

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
    chat_template: str | None = None  # a Jinja file or inline template; default: the tokenizer's own
    max_n: int = 256  # refuse a request asking for more sequences (prompts x n) than this
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

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65536), got {self.port}")
        for name in ("max_n", "max_request_bytes", "max_weights_request_bytes", "max_response_entries",
                     "max_concurrent_weight_group_joins"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.weight_group_join_timeout_s > 0:
            raise ValueError(f"--weight-group-join-timeout-s must be > 0, got {self.weight_group_join_timeout_s}")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty (omit it to disable authentication)")


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
        if tp is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(_flag(f.name), dest=f.name, action=action, default=default)
        elif typing.get_origin(tp) is list:  # list[str] / list[int]: one or more values, as SGLang's nargs="+"
            parser.add_argument(_flag(f.name), dest=f.name, nargs="+", type=typing.get_args(tp)[0],
                                default=default, help=f"(default: {default})")
        else:
            parser.add_argument(_flag(f.name), dest=f.name, type=tp, default=default,
                                help=f"(default: {default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.launch_server",
        description="Serve an HF checkpoint over SGLang's native HTTP API and the OpenAI API.")
    parser.add_argument("--model-path", dest="model_path", required=True, help="HF checkpoint directory")
    _add_dataclass_flags(parser.add_argument_group("server"), ServerArgs, skip=set())
    _add_dataclass_flags(parser.add_argument_group("engine (SGLang flag names)"), EngineArgs, skip={"model_path"})
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
