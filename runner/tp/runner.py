"""TPModelRunner: the ModelRunner surface over N tensor-parallel ranks, rank 0 in this process.

Rank 0 is a TPRankRunner here; ranks 1..N-1 are spawned daemon processes (runner/tp/worker.py). Every
call that touches the model goes to the workers first, then runs locally, so the collectives inside the
model line up; then each worker's reply is collected (bounded by the group timeout, and watching the
process). Sampling, KV bookkeeping and the weight-update group registry stay on rank 0: a forward
carries the req_to_token rows it reads (and its LoRA uids), a distributed update is received here and
forwarded as tensors. A weight update, a LoRA load and a LoRA unload commit on every rank or on none
(two-phase vote); adapters keep rank 0's uids on every rank; a sparse delta goes to every rank whole, each
applies its own slice, after rank 0 checked the summed partial checksums. A rank that dies makes
every later call fail at once with "tensor-parallel rank N died ..."; the runner then reports its
weights as unusable so the scheduler fails the batch instead of retrying it.

Everything not overridden here (pools, configs, sample, memory saver, group registry) is rank 0's.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import socket
import threading
import time

import torch

from runner import omp_env
from runner.config import RunnerConfig
from runner.forward_batch import LogitsOutput
from runner.lora.manager import new_uid
from runner.tp import channel
from runner.tp.group import TPGroup
from runner.tp.rank_runner import TPRankRunner, encode_batch
from runner.tp.worker import worker_main
from runner.weights import delta
from runner.weights.loader import WeightUpdateError
from runner.weights.routes import truncated_values, unpack_named_tensors
from weight_sync.delta_codec import combine

DEFAULT_TIMEOUT_S = 60.0  # a collective or a reply that takes longer means a rank is stuck


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPModelRunner:
    def __init__(self, config: RunnerConfig, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.config, self.tp_size, self.timeout_s = config, config.tp_size, timeout_s
        self.dead_message = ""
        self.is_shut_down = False
        backend = "nccl" if str(config.device).startswith("cuda") else "gloo"
        port = _free_port()
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, self.tp_size):
            worker_cfg = dataclasses.replace(config, device=_rank_device(config.device, rank))
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"rollout-tp-rank{rank}", daemon=True,
                               args=(json.dumps(dataclasses.asdict(worker_cfg)), rank, port, backend, timeout_s,
                                     child_end))
            with omp_env.for_children():  # libgomp's spin before it sleeps, read as the worker loads torch
                proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        try:
            self.tp = self._join_group(port, backend, timeout_s)
            self.local = TPRankRunner(config, self.tp)
            for rank, reply in self._replies("start"):
                if reply["max_total_num_tokens"] < self.local.max_total_num_tokens:
                    raise RuntimeError(f"tensor-parallel rank {rank} has room for {reply['max_total_num_tokens']} "
                                       f"KV tokens, rank 0 for {self.local.max_total_num_tokens}")
            for src in (config.lora_paths or []) if config.enable_lora else []:
                self.load_lora_adapter(src["lora_name"], src["lora_path"], pinned=src["pinned"])
        except BaseException:
            self._kill_workers()
            raise

    def _join_group(self, port: int, backend: str, timeout_s: float) -> TPGroup:
        """Rank 0's TPGroup, built on a thread while this one watches the workers: a worker that dies before it
        joins (a failed import, an OOM kill) is named within a fraction of a second, not after the store's
        timeout with "1/2 clients joined". The abandoned join then ends by itself at that timeout."""
        built: dict = {}

        def build() -> None:
            try:
                built["tp"] = TPGroup(0, self.tp_size, port, backend, timeout_s)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                built["error"] = e

        joiner = threading.Thread(target=build, name="rollout-tp-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.1)
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive() and joiner.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {proc.exitcode}) before it "
                                       f"joined the group (see its log above)")
        if "error" in built:
            raise built["error"]
        return built["tp"]

    # ---- everything else is rank 0's --------------------------------------------------------
    def __getattr__(self, name: str):
        if name == "local":  # not yet built: no recursion
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def weights_valid(self) -> bool:
        return not self.dead_message and self.local.weights_valid

    def invalid_weights_message(self) -> str:
        return self.dead_message or self.local.invalid_weights_message()

    def fatal_problem(self) -> str:
        """Why this runner can never run the model again (a rank died or stopped answering), else "". Cheap and
        lock-free (a process-liveness check per rank), for health checks between steps and while idle."""
        if not self.dead_message:
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    self._mark_dead(rank, proc)
                    break
        return self.dead_message

    # ---- the channel ------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.fatal_problem():
            raise RuntimeError(self.dead_message)

    def _mark_dead(self, rank: int, proc) -> None:
        self.dead_message = (f"tensor-parallel rank {rank} died (exit code {proc.exitcode}); the engine cannot "
                             f"run the model any more: shut it down and create a new one")

    def _send(self, header: dict, tensors: list[torch.Tensor] = ()) -> None:
        self._check_alive()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                channel.send(conn, header, tensors)
            except OSError:
                self._fail(rank)

    def _recv(self, rank: int, timeout_s: float | None = None) -> tuple[dict, list[torch.Tensor]]:
        proc = self.procs[rank - 1]
        try:
            return channel.recv(self.conns[rank - 1], timeout_s or self.timeout_s, proc.is_alive,
                                f"tensor-parallel rank {rank}")
        except channel.ChannelClosed as e:
            self._fail(rank, str(e))

    def _fail(self, rank: int, why: str = "") -> None:
        proc = self.procs[rank - 1]
        proc.join(timeout=2.0)  # a crash shows as an exit code within moments
        if not proc.is_alive():
            self._mark_dead(rank, proc)
        else:
            self.dead_message = f"tensor-parallel rank {rank} stopped answering ({why}); shut the engine down"
        raise RuntimeError(self.dead_message)

    def _replies(self, what: str) -> list[tuple[int, dict]]:
        out = []
        for rank in range(1, self.tp_size):
            reply, _ = self._recv(rank)
            if not reply["ok"]:
                raise RuntimeError(f"tensor-parallel rank {rank} failed in {what}: {reply['error']}")
            out.append((rank, reply))
        return out

    def _after_local_error(self, e: Exception) -> None:
        """A local failure during a collective is usually a peer that died: say so."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and all(p.is_alive() for p in self.procs):
            time.sleep(0.05)
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                self._mark_dead(rank, proc)
                raise RuntimeError(self.dead_message) from e

    # ---- the hot path -----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, fb) -> LogitsOutput | None:
        if fb.forward_mode.is_idle():
            return None
        header, tensors = encode_batch(fb, self.local.req_to_token_pool.req_to_token)
        self._send({"cmd": "forward", "batch": header}, tensors)
        try:
            out = self.local.forward(fb)
        except Exception as e:
            self._after_local_error(e)
            for rank in range(1, self.tp_size):  # same refusal on every rank (e.g. weights invalid)
                self._recv(rank)
            raise
        self._replies("forward")
        return out

    # ---- memory -----------------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._memory("release", self.local.check_memory_transition(tags, release=True))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._memory("resume", self.local.check_memory_transition(tags, release=False))

    def _memory(self, cmd: str, tags: list[str]) -> None:
        self._send({"cmd": cmd, "tags": tags})
        local_error = None
        try:
            getattr(self.local, f"{cmd}_memory_occupation")(tags)
        except Exception as e:
            local_error = e
        self._replies(f"{cmd}_memory_occupation")
        if local_error is not None:
            raise local_error

    # ---- weights ----------------------------------------------------------------------------
    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None) -> int:
        if load_format == "delta":
            return self._update_delta(named_tensors)
        if load_format == "direct" or load_format in self.local.custom_loaders:
            raise WeightUpdateError(f"load_format={load_format!r} is not supported with tp_size={self.tp_size}: "
                                    f"send Hugging Face names (load_format=None or 'flattened_bucket')")
        self.local._require_weights_resident()
        named = unpack_named_tensors(named_tensors, load_format, list(self.local.custom_loaders))
        for name, tensor in named:
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                raise WeightUpdateError(f"weight {name!r}: expected (str, torch.Tensor with data), got "
                                        f"({type(name).__name__}, {type(tensor).__name__})")
        named = [(n, _plain(t)) for n, t in named]
        return self._update({"cmd": "update_tensor", "names": [n for n, _ in named]}, [t for _, t in named],
                            lambda: self.local.update_weights_from_tensor(named))

    def _update_delta(self, blob) -> int:
        """A sparse delta: every rank reports its slices' partial checksums (base, and the result its
        changes give); their sums must be the delta's, else nothing is written anywhere. Then every rank
        applies its slice in the usual two-phase update."""
        self.local._require_weights_resident()
        update = delta.parse(blob)
        wire = update.to_tensor()
        self._send({"cmd": "delta_partials"}, [wire])
        try:
            mine = delta.partial_hashes(self.local, update)
        except Exception:
            for rank in range(1, self.tp_size):
                self._recv(rank)
            raise
        parts = [mine] + [reply["partials"] for _, reply in self._replies("the delta check")]
        entries = [e for e in update.entries if not self.local.name_map.is_ignored(e["name"])]
        delta.check_sums(entries, _sum_partials(parts, "base"), None)
        errors = [f"tensor-parallel rank {r}: {p['error']}" for r, p in enumerate(parts) if p["error"]]
        if errors:
            raise WeightUpdateError(errors[0])
        delta.check_sums(entries, [e["base"] for e in entries], _sum_partials(parts, "result"))
        self._update({"cmd": "update_delta"}, [wire], lambda: self.local.update_weights_from_tensor(update, "delta"))
        # The tensors the delta changes, whichever ranks hold the changed elements (rank 0's own count misses
        # a change that lies only in another rank's slice); a tied alias counts once, as unsharded.
        aliases = self.local.name_map.aliases
        return sum(1 for e in entries if e["count"] and e["name"] not in aliases)

    def update_weights_from_disk(self, model_path) -> int:
        self.local._require_weights_resident()
        return self._update({"cmd": "update_disk", "path": str(model_path)}, [],
                            lambda: self.local.update_weights_from_disk(model_path))

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None, load=None) -> int:
        # Received on rank 0 only; forwarded to the other ranks as a tensor update.
        return self.local.update_weights_from_distributed(names, dtypes, shapes, group_name, load_format,
                                                          load=load or self.update_weights_from_tensor)

    def _update(self, header: dict, tensors: list[torch.Tensor], local_call, what: str = "the update"):
        """Two-phase: every rank checks and writes, votes; all commit or all restore."""
        self._send(header, tensors)
        decided = False

        def vote() -> str | None:
            nonlocal decided
            refusals = self._collect_votes(what)
            self._decide(not refusals)
            decided = True
            return refusals[0] if refusals else None

        self.local.vote_fn = vote
        try:
            num = local_call()
        except Exception:
            if not decided:
                self._collect_votes(what)
                self._decide(False)
            for rank in range(1, self.tp_size):
                self._recv(rank)
            raise
        finally:
            self.local.vote_fn = None
        self._replies(what)
        return num

    def _collect_votes(self, what: str) -> list[str]:
        refusals = []
        for rank in range(1, self.tp_size):
            v, _ = self._recv(rank)
            if v["vote"] != "ok":
                refusals.append(f"tensor-parallel rank {rank} refused {what} ({v['error']}); every rank "
                                f"kept its weights and adapters as they were")
        return refusals

    def _decide(self, commit: bool) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                channel.send(conn, {"commit": commit})
            except OSError:
                self._fail(rank)

    # ---- LoRA adapters: checked on rank 0, then checked, voted and committed on every rank ----------
    def load_lora_adapter(self, lora_name: str, lora_path: str | None = None, tensors=None,
                          config_dict: dict | None = None, load_format: str | None = None,
                          pinned: bool = False) -> int:
        """ModelRunner's, on every rank: rank 0 checks first (a refusal sends nothing), then sends the adapter's
        tensors (read once, here) and its uid; each rank re-checks and stages its own A/B slices, and all
        commit or none does."""
        staged = self.local.stage_lora_adapter(lora_name, lora_path, tensors, config_dict, load_format, pinned)
        return self._load_staged_lora(staged, new_uid(), list(staged.tensors.items()))

    def _load_staged_lora(self, staged, uid: int, named: list[tuple[str, torch.Tensor]]) -> int:
        header = {"cmd": "lora_load", "name": staged.name, "path": staged.path, "pinned": staged.pinned, "uid": uid,
                  "config": dataclasses.asdict(staged.config), "names": [n for n, _ in named]}
        return self._update(header, [_plain(t) for _, t in named], lambda: self.local.commit_lora_adapter(staged, uid),
                            f"the load of LoRA adapter {staged.name!r}")

    def unload_lora_adapter(self, lora_name: str) -> None:
        self.local._require_lora().check_unload(lora_name)
        self._update({"cmd": "lora_unload", "name": lora_name}, [], lambda: self.local.unload_lora_adapter(lora_name),
                     f"the unload of LoRA adapter {lora_name!r}")

    def rank_lora_adapters(self) -> list[dict[str, dict]]:
        """Every rank's `lora_adapters()`, rank order (they agree unless something is broken)."""
        self._send({"cmd": "lora_adapters"})
        return [self.local.lora_adapters()] + [reply["adapters"] for _, reply in self._replies("lora_adapters")]

    def rank_checksums(self) -> list[tuple[str, int]]:
        """Every rank's (parameter digest, parameter count), rank order (runner/weights/checker.py)."""
        from runner.weights.checker import parameters_sha256

        self._send({"cmd": "checksum"})
        own = parameters_sha256(self.local.model)
        return [own] + [(reply["checksum"], reply["num_tensors"]) for _, reply in self._replies("checksum")]

    def get_weights_by_name(self, name: str, truncate_size: int = 100, max_values: int | None = None) -> list:
        """The full HF tensor, assembled from every rank's slice, truncated as ModelRunner does."""
        try:
            shard, spec = self.local.weight_shard(name)
        except WeightUpdateError:
            if name in self.local.name_map.params:  # a fused runner parameter (qkv_proj, gate_up_proj)
                raise WeightUpdateError(
                    f"{name!r} is a fused parameter, and under tensor parallelism each rank holds its own slices of "
                    f"its parts in that layout: read the HF tensors it fuses (q_proj/k_proj/v_proj, "
                    f"gate_proj/up_proj) instead, which come back whole") from None
            raise
        if spec is None:
            return self.local.get_weights_by_name(name, truncate_size, max_values)
        self.local.get_weights_by_name(name, 1)  # its checks (invalid weights) first
        self._send({"cmd": "get_shard", "name": name})
        parts = [(spec, shard)]
        for rank in range(1, self.tp_size):
            reply, tensors = self._recv(rank)
            if not reply["ok"]:
                raise WeightUpdateError(f"tensor-parallel rank {rank}: {reply['error']}")
            parts.append((reply["spec"], tensors[0]))
        dim, _, _, full = spec
        shape = list(shard.shape)
        shape[dim] = full
        whole = torch.zeros(shape, dtype=shard.dtype)
        for (d, start, size, _), part in parts:
            whole.narrow(d, start, size).copy_(part.narrow(d, 0, size).to("cpu"))
        return truncated_values(whole, truncate_size, max_values, name)

    # ---- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.is_shut_down:
            return
        self.is_shut_down = True
        if not self.dead_message:
            try:
                self._send({"cmd": "shutdown"})
                for rank in range(1, self.tp_size):
                    self._recv(rank, timeout_s=10.0)
            except RuntimeError:
                pass  # a dead rank has nothing to free
        self.local.shutdown()
        self._kill_workers()
        self.tp.close()

    def _kill_workers(self) -> None:
        for proc in self.procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()


def _rank_device(device: str, rank: int) -> str:
    """cuda -> cuda:rank (one GPU per rank); cpu stays cpu."""
    if str(device).startswith("cuda"):
        return f"cuda:{rank}"
    return device


def _sum_partials(per_rank: list[dict], key: str) -> list[int]:
    """Per-entry checksums of whole tensors from each rank's partial sums (runner/weights/delta.py
    partial_hashes); a span held by several ranks (replicated) is counted once."""
    out = []
    for i in range(len(per_rank[0][key])):
        h, seen = 0, set()
        for p in per_rank:
            span = tuple(p["span"][i])
            if span in seen:
                continue
            seen.add(span)
            v = p[key][i]
            h = combine(h, (v >> 31, v & ((1 << 31) - 1)))
        out.append(h)
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A dense, local tensor the pipe can carry (DTensors gathered, sparse densified)."""
    full = getattr(t, "full_tensor", None)
    if callable(full):
        t = full()
    return t.to_dense() if t.layout != torch.strided else t
