"""The Engine's reads and small SGLang controls, mixed into Engine: weight version relabels, checksums,
flush_cache, get_model_info, freeze_gc, drain, the MoE expert-distribution record and get_server_info.

Each call is SGLang's (same names, arguments and return shapes) and runs between steps under the engine's
step lock (`self._cv`), except drain, which must not hold it while it waits. It does not submit requests,
write weights (rollout/weights_api.py) or pause (rollout/engine.py).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import importlib.metadata
import time

import torch

from rollout.weights_api import weight_version_problem
from runner.weights import checker
from runner.weights.routes import require_weights_resident

DRAIN_POLL_S = 0.02  # drain() looks at the requests in flight this often


@dataclasses.dataclass(frozen=True)
class FlushCacheReqOutput:
    """What sglang.Engine.flush_cache returns (its io_struct's name): `success`, and truthy iff it flushed."""

    success: bool

    def __bool__(self) -> bool:
        return self.success


def _version() -> str:
    try:
        return importlib.metadata.version("rollout-engine")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


class EngineInfoAPI:
    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> tuple[bool, str]:
        """SGLang's update_weight_version: relabel the weights being served (no weight changes), after
        aborting every request in flight when `abort_all_requests` (their outputs carry the old version).
        True by default, as SGLang's UpdateWeightVersionReqInput; False relabels under running requests, whose
        outputs then carry both versions (meta_info["weight_versions"])."""
        if not isinstance(new_version, str) or not isinstance(abort_all_requests, bool):
            raise TypeError(f"update_weight_version takes new_version: str and abort_all_requests: bool, "
                            f"got {new_version!r}, {abort_all_requests!r}")
        problem = weight_version_problem(new_version)
        if problem:
            raise ValueError(f"update_weight_version: {problem}")
        self._require_not_shut_down("update_weight_version")  # a label on freed weights would claim a success
        with self._cv:
            if abort_all_requests:
                self._abort_reqs(self._in_flight(), "aborted by update_weight_version(abort_all_requests=True)")
            self._set_weight_version(new_version)
        return True, f"Weight version updated to {new_version}"

    def get_weights_checksum(self) -> dict:
        """SHA-256 over every model parameter (name, dtype, shape, bytes) in name order, taken under the step
        lock so an update is never read half-way: equal checksums mean bitwise-equal weights. Under tensor
        parallelism every rank hashes its own slices and the checksum is the SHA-256 of those digests in
        rank order (num_tensors: summed over ranks). Returns {"checksum", "num_tensors", "weight_version"}."""
        with self._cv:
            # Freed storages (released weights, a shut-down engine) must not be read: the copy would fault.
            # Tensor parallel: rank 0's runner says (the TP runner's shutdown shuts it down too).
            require_weights_resident(getattr(self.runner, "local", self.runner))
            ranks = getattr(self.runner, "rank_checksums", None)
            parts = ranks() if ranks is not None else [checker.parameters_sha256(self.runner.model)]
            version = self.weight_version
        if len(parts) == 1:
            checksum, num = parts[0]
        else:
            checksum = hashlib.sha256("|".join(d for d, _ in parts).encode()).hexdigest()
            num = sum(n for _, n in parts)
        return {"checksum": checksum, "num_tensors": num, "weight_version": version}

    def flush_cache(self) -> FlushCacheReqOutput:
        """Empty the prefix cache. As SGLang: `.success` False (nothing flushed) while requests hold KV
        (running, or paused in place); True otherwise (waiting or retracted requests hold none). The
        result is truthy iff it flushed, so `if engine.flush_cache():` reads as it does with a bool."""
        with self._cv:
            if self.runner.is_shut_down:  # nothing is cached any more; "flushed" would claim work it did not do
                return FlushCacheReqOutput(False)
            return FlushCacheReqOutput(self.scheduler.flush_cache())

    def get_model_info(self) -> dict:
        """What the engine serves now (SGLang's get_model_info): the checkpoint last loaded (the launch path
        until an update_weights_from_disk succeeds) and the current weight version."""
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "load_format": getattr(self.args, "load_format", None), "reasoning_parser": None,
                "tool_call_parser": None}

    def freeze_gc(self) -> None:
        """SGLang's freeze_gc: move every object alive now to the permanent generation (gc.freeze), so
        later collections skip them; call after warm-up. The engine lives in this process."""
        gc.collect()
        gc.freeze()

    def drain(self, timeout: float | None = None) -> dict:
        """SGLang's drain: wait until no request is in flight, or `timeout` seconds (None: no limit).
        It neither pauses nor refuses new requests; one submitted meanwhile is waited for too.
        Returns {"success": nothing left in flight, "remaining_requests": how many are}."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or not timeout >= 0):
            raise ValueError(f"drain timeout must be None or a number of seconds >= 0, got {timeout!r}")
        self._require_not_shut_down("drain")
        deadline = None if timeout is None else time.monotonic() + timeout
        # No step lock: waiting under it would stop the very steps that finish the requests.
        while (remaining := len(self._in_flight())) and self._thread.is_alive():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            time.sleep(DRAIN_POLL_S if left is None else min(left, DRAIN_POLL_S))
        return {"success": remaining == 0, "remaining_requests": remaining}

    # ---- expert distribution (MoE models; SGLang's names) ------------------------------------------
    def _expert_recorder(self, what: str):
        recorder = getattr(getattr(self.runner, "model", None), "expert_recorder", None)
        if recorder is None:
            raise ValueError(f"{what} needs a mixture-of-experts model; "
                             f"{self.runner.model_config.architecture} has no experts")
        return recorder

    def start_expert_distribution_record(self) -> None:
        """Count, per layer and expert, the tokens routed there from now on (a fresh record; mode from
        expert_distribution_recorder_mode). Captured decode steps yield to eager ones while it runs."""
        with self._cv:
            recorder = self._expert_recorder("start_expert_distribution_record")
            recorder.mode = self.args.expert_distribution_recorder_mode
            recorder.start_record()

    def stop_expert_distribution_record(self) -> None:
        with self._cv:
            self._expert_recorder("stop_expert_distribution_record").stop_record()

    def dump_expert_distribution_record(self, output_dir: str | None = None) -> dict:
        """The record so far, JSON-ready: {"logical_count": [num_layers][num_experts], ...} (mode "stat"
        adds num_forward_passes; "per_pass" adds one record per forward pass). Given `output_dir`, also
        torch.save's it there as SGLang does. Resets the record."""
        with self._cv:
            dump = self._expert_recorder("dump_expert_distribution_record").dump_record(output_dir)
        return _json_ready(dump)

    def fatal_problem(self) -> str:
        """Why this engine can never generate again ("" if it can): shut down, its scheduler thread gone, or a
        tensor-parallel rank dead. Takes no lock (a health check must not wait for a step). Released memory or
        paused generation are not fatal: a resume or a continue ends them."""
        if self.runner.is_shut_down:
            return "the engine was shut down"
        if not self._thread.is_alive():
            return "the engine's scheduler thread is not running"
        check = getattr(self.runner, "fatal_problem", None)
        return check() if check is not None else ""

    def get_server_info(self) -> dict:
        """SGLang's keys where they can be computed: every server arg (this engine's options, flat), the
        scheduler info (`max_total_num_tokens`, `max_req_input_len`), `internal_states` (one dict per
        scheduler: counters, cache hit rate, `memory_usage` in GB), `weight_version` and `version`; and,
        flat beside them, this engine's counters (`num_in_flight`, `paused`, `memory_bytes`, ...)."""
        with self._cv:
            s = dict(self.scheduler.stats)
            total = s["num_prompt_tokens"]
            s["cache_hit_rate"] = s["num_cached_tokens"] / total if total else 0.0
            memory = {t: self.runner.memory_saver.bytes_held(t) for t in ("weights", "kv_cache", "cuda_graph")}
            s.update(weight_version=self.weight_version, num_in_flight=self.scheduler.num_in_flight(),
                     max_total_num_tokens=self.runner.max_total_num_tokens, context_length=self.runner.context_len,
                     paused=self._paused, memory_bytes=memory,
                     weights_dtype=str(self.runner.dtype).removeprefix("torch."),  # what a delta must carry
                     memory_usage={"weight": memory["weights"] / 2**30, "kvcache": memory["kv_cache"] / 2**30,
                                   "graph": memory["cuda_graph"] / 2**30,
                                   "token_capacity": self.runner.max_total_num_tokens})
            max_input = min(self.runner.context_len, self.runner.max_total_num_tokens) - 1
            return {**dataclasses.asdict(self.args), **s, "max_req_input_len": max_input,
                    "internal_states": [dict(s)], "version": _version()}


def _json_ready(value):
    """Tensors (any depth of dicts and lists) as nested lists, so the dict crosses JSON (HTTP, RemoteEngine)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    return value
