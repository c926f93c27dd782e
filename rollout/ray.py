"""Many engines as Ray actors, driven as one: `launch_engines(n, ...)` -> `EngineGroup`.

Each actor holds one `rollout.Engine` and exposes its methods under their names
(`actor.generate.remote(...)`, as Ray users expect; `actor.call.remote("generate", args, kwargs)` also
works); the group spreads `generate` over them and
sends every weight update, release/resume, flush and shutdown to all of them. What it adds over a list
of engines:

- placement: least-loaded routing that keeps all n samples of one prompt on one engine (one prefill,
  then prefix-cache hits), outputs returned in input order;
- one version on all engines or on none: before a weight update (or a whole `sync_weights` of many
  buckets) every engine snapshots the tensors it touches, in its own process; the update goes
  everywhere, and if any engine refuses any part of it every engine restores its snapshot, and the
  error names the engine and why. The cost is one host copy of the touched weights per engine while
  the update runs;
- failure detection: a dead actor (killed, OOM) surfaces as `EngineGroupError` naming the engine,
  within `call_timeout_s`, never as a hang.

It does not run the trainer or place trainer workers: pass a placement group (`placement_group=`,
bundle i -> engine i) to co-locate engines with trainer workers on the same devices, as verl and
OpenRLHF do, or let Ray place them. Ray is an optional extra (`pip install -e ".[ray]"`) and is
imported only when this module is used.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Engine methods the actor forwards by name; anything else is refused (the actor is not a shell).
FORWARDED = frozenset({
    "generate", "update_weights_from_tensor", "update_weights_from_disk", "release_memory_occupation",
    "resume_memory_occupation", "flush_cache", "get_server_info", "pause_generation", "continue_generation",
    "abort_request", "init_weights_update_group", "update_weights_from_distributed",
    "destroy_weights_update_group", "get_weights_by_name", "start_expert_distribution_record",
    "stop_expert_distribution_record", "dump_expert_distribution_record", "update_weight_version",
    "get_weights_checksum", "load_lora_adapter", "load_lora_adapter_from_tensors", "unload_lora_adapter",
    "check_weights", "weights_checksums", "post_process_weights", "start_profile", "stop_profile",
    "get_model_info", "freeze_gc", "drain",
})


def _num_samples(sp) -> int:
    """A prompt's n from its sampling params; None (SGLang's "the default") is 1, as the engine reads it."""
    n = (sp or {}).get("n")
    return 1 if n is None else int(n)


# Engine.generate arguments that take one value for every prompt or a list with one per prompt.
_PER_PROMPT_ARGS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "lora_path",
                    "return_routed_experts")


def _is_per_prompt(name: str, value) -> bool:
    """Whether `value` of generate argument `name` is the one-per-prompt form (a list; for token_ids_logprob a
    list of lists, a flat list of ids being the ids for every prompt)."""
    if not isinstance(value, list):
        return False
    if name == "token_ids_logprob":
        return not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    return True


def _check_abort_all(abort_all_requests) -> None:
    if not isinstance(abort_all_requests, bool):
        raise TypeError(f"abort_all_requests must be a bool, got {abort_all_requests!r}")


class EngineGroupError(RuntimeError):
    """An operation failed on one or more engines of a group; the message names them."""


class EngineActor:
    """The body of one Ray actor: an Engine and a few group-only helpers. Created by `launch_engines`."""

    def __init__(self, model_path: str, engine_kwargs: dict) -> None:
        from rollout.engine import Engine

        self.engine = Engine(model_path, **engine_kwargs)

    def call(self, method: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        if method not in FORWARDED:
            raise AttributeError(f"EngineActor does not forward {method!r}; allowed: {sorted(FORWARDED)}")
        return getattr(self.engine, method)(*args, **(kwargs or {}))

    def ping(self) -> bool:
        return True

    def memory_transition_problem(self, tags, release: bool) -> str | None:
        """Why release (or resume) of `tags` would be refused on this engine, else None; changes nothing."""
        what = "release_memory_occupation" if release else "resume_memory_occupation"
        try:
            self.engine._require_not_shut_down(what)
            self.engine.runner.check_memory_transition(tags, release=release)
        except (RuntimeError, ValueError) as e:
            return str(e)
        return None

    def weight_version(self) -> str:
        return self.engine.weight_version

    def num_in_flight(self) -> int:
        return self.engine.scheduler.num_in_flight()

    def hf_weight_names(self) -> list[str]:
        return self.engine.runner.name_map.hf_names()

    def snapshot_weights(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """Full copies (host) of the current values of `names` (HF names), taken between scheduler steps."""
        runner = self.engine.runner
        with self.engine._cv:
            if not runner.memory_saver.is_resident("weights"):
                # Released storage cannot be read: refuse the update here (the engine would refuse it too).
                raise RuntimeError("weights are released on this engine; resume_memory_occupation first")
            names = [n for n in names if not runner.name_map.is_ignored(n)]  # what the engine never loads
            if getattr(runner, "config", None) is not None and getattr(runner.config, "tp_size", 1) > 1:
                # Each rank holds a slice: read the reassembled HF tensor through the public API.
                return [(n, torch.tensor(runner.get_weights_by_name(n, truncate_size=1 << 62))) for n in names]
            return [(n, runner.name_map.resolve(n).view().detach().to("cpu", copy=True)) for n in names]

    # A transaction spans several update calls (a sync of many buckets): the snapshot stays here, in the
    # actor's process, so rolling back moves no bytes between processes.
    def begin(self, names: list[str] | None) -> str:
        names = self.hf_weight_names() if names is None else names
        # Weights released without backup and not yet reloaded hold nothing worth keeping (the engine
        # refuses to serve them): rolling back then means marking them invalid again, not restoring.
        snapshot = self.snapshot_weights(names) if self.engine.runner.weights_valid else None
        self._txn = (snapshot, self.engine.weight_version, self.engine._num_updates)
        return self._txn[1]

    def rollback(self) -> tuple[bool, str]:
        snapshot, version, num_updates = self._txn
        self._txn = None
        if self.engine._num_updates == num_updates:  # every call of the transaction refused here: unchanged
            return True, "nothing to roll back (no update of the transaction was applied on this engine)"
        if snapshot is None:
            with self.engine._cv:
                self.engine.runner.invalidate_weights("a group weight sync failed and was rolled back; load a "
                                                      "full set of weights")
                self.engine.weight_version = version
                self.engine._num_updates = num_updates
            return True, "weights marked invalid again (there was nothing valid to restore)"
        # online: requests that arrived since are retracted and go on under the restored weights, instead
        # of the rollback being refused (which would leave this engine on a version no other engine has).
        ok, msg = self.engine.update_weights_from_tensor(snapshot, flush_cache=True, weight_version=version,
                                                         online=True)
        if ok:
            # The update count labels the next update that names no version: put it back too, or this engine
            # would label it one ahead of an engine that refused (versions "3" against "1").
            with self.engine._cv:
                self.engine._num_updates = num_updates
        return ok, msg

    def commit(self) -> None:
        self._txn = None

    def shutdown(self) -> None:
        self.engine.shutdown()


def _forwarder(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.engine, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Engine.{name}, run in this actor (`actor.{name}.remote(...)`)."
    return method


# Ray users call an actor's methods by name (`actor.generate.remote(...)`): every forwarded Engine method
# is one. They are class attributes before `ray.remote(EngineActor)` reads the class. `call` stays.
for _name in FORWARDED:
    setattr(EngineActor, _name, _forwarder(_name))
del _name


def _ray():
    try:
        import ray
    except ImportError as e:  # the extra is optional; say how to get it
        raise ImportError("rollout.ray needs Ray: pip install -e '.[ray]' (or pip install ray)") from e
    return ray


def launch_engines(num_engines: int, model_path: str, *, num_cpus_per_engine: float = 1,
                   num_gpus_per_engine: float = 0, placement_group=None, call_timeout_s: float = 600.0,
                   **engine_kwargs) -> EngineGroup:
    """Start `num_engines` Engine actors (Ray must be initialised) and wait until each serves.

    `placement_group`: a Ray placement group with at least `num_engines` bundles; engine i goes to
    bundle i (share bundles with trainer workers to co-locate, fractional GPUs included).
    `random_seed=s` (the group's): engine i gets s + i, so unseeded requests differ between engines and a rerun
    draws the same; left out, each engine draws its own from the OS.
    """
    if not isinstance(num_engines, int) or num_engines < 1:
        raise ValueError(f"num_engines={num_engines!r} must be an int >= 1")
    ray = _ray()
    if not ray.is_initialized():
        raise RuntimeError("call ray.init(...) before launch_engines (e.g. ray.init(num_cpus=2))")
    actor_cls = ray.remote(EngineActor)
    handles = []
    for i in range(num_engines):
        options: dict = dict(num_cpus=num_cpus_per_engine, num_gpus=num_gpus_per_engine, max_concurrency=64,
                             name=None)
        if placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            if i >= placement_group.bundle_count:
                raise ValueError(f"placement group has {placement_group.bundle_count} bundles for "
                                 f"{num_engines} engines")
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=i)
        kwargs = dict(engine_kwargs)
        if kwargs.get("random_seed") is not None:  # one seed for the group: each engine its own stream of it,
            kwargs["random_seed"] = kwargs["random_seed"] + i  # or their k-th unseeded requests draw alike
        handles.append(actor_cls.options(**options).remote(str(model_path), kwargs))
    group = EngineGroup(handles, call_timeout_s=call_timeout_s)
    group._all("ping")  # surfaces a constructor error (bad path, bad option) with the engine's name
    return group


class EngineGroup:
    """Engines as one: the Engine API over several Ray actors. See the module docstring."""

    def __init__(self, handles: Sequence, call_timeout_s: float = 600.0) -> None:
        if not handles:
            raise ValueError("an EngineGroup needs at least one engine")
        self.handles = list(handles)
        self.call_timeout_s = call_timeout_s
        self._outstanding = [0] * len(self.handles)  # prompts this group has in flight per engine
        self._snapshotted = False  # whether the update in progress took snapshots (set by _begin)
        # One weight transaction at a time: each actor holds one snapshot slot, so two racing syncs would
        # overwrite each other's and could commit a mix of both.
        self._txn_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.handles)

    # ---- plumbing ---------------------------------------------------------------------------
    def _get(self, refs: list, what: str) -> list:
        """Wait for one ref per engine; any failure is reported with the engine's index and cause."""
        ray = _ray()
        results, errors = [None] * len(refs), []
        for i, ref in enumerate(refs):
            if ref is None:
                continue
            try:
                results[i] = ray.get(ref, timeout=self.call_timeout_s)
            except ray.exceptions.GetTimeoutError:
                errors.append(f"engine {i}: {what} did not answer within {self.call_timeout_s:.0f} s")
            except ray.exceptions.RayActorError as e:
                errors.append(f"engine {i}: actor died ({type(e).__name__}: {_last_line(e)})")
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                errors.append(f"engine {i}: {what} raised {type(cause).__name__}: {cause}")
        if errors:
            raise EngineGroupError(f"{what} failed on {len(errors)} of {len(refs)} engine(s): "
                                   + "; ".join(errors))
        return results

    def _all(self, method: str, *args, **kwargs) -> list:
        if method in FORWARDED:
            refs = [h.call.remote(method, args, kwargs) for h in self.handles]
        else:
            refs = [getattr(h, method).remote(*args, **kwargs) for h in self.handles]
        return self._get(refs, method)

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, **kwargs):
        """Like Engine.generate. Each prompt (with all its n samples) goes to the least-loaded engine;
        outputs come back in input order (one dict for a single prompt with n=1, else a list)."""
        from rollout.engine import Engine, prompt_token_ids

        if kwargs.get("stream"):
            raise ValueError("EngineGroup.generate does not stream; call an engine's generate for that")
        if input_ids is None:  # given both, input_ids are the prompt, as Engine.generate takes them
            if prompt is None:
                raise ValueError("pass prompt or input_ids")
            single = isinstance(prompt, str)
            items = [prompt] if single else prompt
            if not isinstance(items, list) or not all(isinstance(p, str) for p in items):
                raise ValueError("prompt must be a string or a list of strings")
            key = "prompt"
        else:  # the Engine's own shape check: a malformed batch was split into prompts it never meant
            items, single = prompt_token_ids(None, None, input_ids)
            key = "input_ids"
        if not items:
            raise ValueError("empty batch: no prompts given (prompt or input_ids is an empty list)")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(items):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(items)} prompts")
            sps = sampling_params
        else:
            sps = [sampling_params] * len(items)
        # Arguments given one per prompt are split with the prompts (each engine gets its prompts' entries).
        per_prompt = {name: kwargs.pop(name) for name in _PER_PROMPT_ARGS if _is_per_prompt(name, kwargs.get(name))}
        for name, values in per_prompt.items():
            if len(values) != len(items):
                raise ValueError(f"{name} has {len(values)} entries for {len(items)} prompts")
        rid = kwargs.pop("rid", None)
        if isinstance(rid, str) and rid:  # the Engine's string rule, as the per-prompt list that gives the same ids
            ns = [_num_samples(sp) for sp in sps]
            if len(items) == 1:
                rid = [rid]  # one prompt: rid itself, or rid_j over its n samples
            elif all(n == 1 for n in ns):
                rid = [f"{rid}_{i}" for i in range(len(items))]
            else:
                raise ValueError("a string rid over several prompts with n > 1 names every sequence rid_i, which an "
                                 "EngineGroup cannot split between engines: give a list with one id per prompt")
        if rid is not None:
            if not (isinstance(rid, list) and len(rid) == len(items)):
                raise ValueError("rid on an EngineGroup must be a string or a list with one id per prompt")
            dups = sorted(repr(r) for r, k in collections.Counter(rid).items() if k > 1)
            if dups:  # one engine refuses them; split over several, two requests would share an id
                raise ValueError(f"request id(s) given twice in this call: {', '.join(dups)}")
            # The Engine's rid rules (one n for every prompt) checked before the prompts are split between engines.
            Engine._expand_rids(rid, [_num_samples(sp) for sp in sps], is_single=False)

        # Least-loaded by samples: a prompt with n=8 weighs 8.
        loads = list(self._outstanding)
        assignment: list[list[int]] = [[] for _ in self.handles]
        for i, sp in enumerate(sps):
            n = _num_samples(sp)
            e = min(range(len(loads)), key=lambda j: loads[j])
            assignment[e].append(i)
            loads[e] += n
        refs: list = [None] * len(self.handles)
        for e, idx in enumerate(assignment):
            if not idx:
                continue
            call_kwargs = dict(kwargs, **{key: [items[i] for i in idx],
                                          "sampling_params": [sps[i] for i in idx]})
            call_kwargs.update({name: [values[i] for i in idx] for name, values in per_prompt.items()})
            if rid is not None:
                call_kwargs["rid"] = [rid[i] for i in idx]
            self._outstanding[e] += len(idx)
            refs[e] = self.handles[e].call.remote("generate", (), call_kwargs)
        try:
            per_engine = self._get(refs, "generate")
        except EngineGroupError as e:  # an engine numbers the prompts it got from 0: say which ones they were
            took = "; ".join(f"engine {j} took prompts [{', '.join(map(str, idx[:8]))}{', ...' if len(idx) > 8 else ''}]"
                             for j, idx in enumerate(assignment) if idx)
            raise EngineGroupError(f"{e} (prompt numbers are each engine's own: {took})") from None
        finally:
            for e, idx in enumerate(assignment):
                self._outstanding[e] -= len(idx)
        # Reassemble in input order; each engine returns n dicts per prompt, prompts in order.
        by_prompt: list[list[dict]] = [[] for _ in items]
        for e, idx in enumerate(assignment):
            if not idx:
                continue
            outs = per_engine[e]
            outs = outs if isinstance(outs, list) else [outs]
            pos = 0
            for i in idx:
                n = _num_samples(sps[i])
                by_prompt[i] = outs[pos: pos + n]
                pos += n
        flat = [o for group in by_prompt for o in group]
        for k, o in enumerate(flat):  # each engine numbered its own outputs: number them as one Engine would
            if isinstance(o, dict) and "index" in o:
                o["index"] = k
        return flat[0] if single and len(flat) == 1 else flat

    # ---- weights: one version everywhere or nowhere -------------------------------------------
    def _begin(self, what: str, names: list[str] | None, many_calls: bool = False) -> str:
        """Every engine snapshots what the update touches (in its own process). Returns the version.

        One engine and one update call need no snapshot (the engine's own update is all-or-none). A
        transaction of many calls (a `sync_weights` of many buckets) does, whatever the group size: with
        one engine and no snapshot, bucket 0 would stay applied when bucket 1 fails."""
        versions = self._all("weight_version")
        if len(set(versions)) != 1:
            raise EngineGroupError(f"engines disagree on the current weight version {versions}; update them "
                                   f"all from one source first")
        self._snapshotted = len(self.handles) > 1 or many_calls
        if self._snapshotted:
            self._get([h.begin.remote(names) for h in self.handles], f"{what}: snapshot")
        return versions[0]

    def _apply_everywhere(self, what: str, args: tuple, kwargs: dict) -> list[tuple[int, str]]:
        """Run one update method on every engine at once; the (engine, reason) pairs that failed."""
        ray = _ray()
        refs = [h.call.remote(what, args, kwargs) for h in self.handles]
        failed = []
        for i, ref in enumerate(refs):
            try:
                res = ray.get(ref, timeout=self.call_timeout_s)
                if not res[0]:
                    failed.append((i, str(res[1])))
            except Exception as e:  # dead actor, timeout, raised: the engine did not commit (or is gone)
                failed.append((i, f"{type(e).__name__}: {_last_line(e)}"))
        return failed

    def _end(self, what: str, failed: list[tuple[int, str]], old_version: str) -> tuple[bool, str]:
        """Commit everywhere, or roll back every engine that applied any call of the transaction (online: a
        request that arrived since is retracted, never a reason to refuse); an engine that refused every
        call is unchanged (each engine's own update is atomic) and is left alone."""
        ray = _ray()
        if not self._snapshotted:  # one engine, one atomic call: nothing to commit or roll back here
            return (True, f"{what}: committed") if not failed else (False, f"{what} failed: engine 0: {failed[0][1]}")
        if not failed:
            self._get([h.commit.remote() for h in self.handles], f"{what}: commit")
            return True, f"{what}: committed on all {len(self.handles)} engine(s)"
        dead = {i for i, msg in failed if "ActorDiedError" in msg or "RayActorError" in msg}
        restore_errors = []
        for i, h in enumerate(self.handles):
            if i in dead:
                continue
            try:
                ok, msg = ray.get(h.rollback.remote(), timeout=self.call_timeout_s)
            except Exception as e:
                ok, msg = False, f"{type(e).__name__}: {_last_line(e)}"
            if not ok:
                restore_errors.append(f"engine {i}: {msg}")
        reason = "; ".join(f"engine {i}: {msg}" for i, msg in failed)
        if restore_errors:
            return False, (f"{what} failed ({reason}) and rolling back failed ({'; '.join(restore_errors)}): "
                           f"the group is inconsistent; reload all engines from one checkpoint")
        return False, (f"{what} failed on {len(failed)} engine(s): {reason}; every engine rolled back "
                       f"to version {old_version!r}")

    def _atomic_update(self, what: str, names: list[str] | None, args: tuple, kwargs: dict) -> tuple[bool, str]:
        with self._txn_lock:
            try:  # a dead engine fails the update before anything is written anywhere
                old_version = self._begin(what, names)
            except EngineGroupError as e:
                return False, f"{what} refused: {e}"
            return self._end(what, self._apply_everywhere(what, args, kwargs), old_version)

    def sync_from(self, source, bucket_bytes: int, name_map=None, weight_version: str | None = None
                  ) -> tuple[bool, str]:
        """`weight_sync.sync_weights(source, group)` lands here: every bucket to every engine, and the whole
        sync commits on all engines or rolls all of them back (not just the failing bucket)."""
        with self._txn_lock:
            return self._sync_from(source, bucket_bytes, name_map, weight_version)

    def _sync_from(self, source, bucket_bytes: int, name_map, weight_version: str | None) -> tuple[bool, str]:
        from weight_sync.bucket import iter_buckets

        try:
            old_version = self._begin("sync_weights", None, many_calls=True)
        except EngineGroupError as e:
            return False, f"sync_weights refused: {e}"
        failed: list[tuple[int, str]] = []
        num_buckets = num_tensors = 0
        try:
            with torch.no_grad():
                for bucket in iter_buckets(source, bucket_bytes=bucket_bytes, name_map=name_map):
                    failed = self._apply_everywhere("update_weights_from_tensor", (bucket.to_dict(),), dict(
                        load_format="flattened_bucket", flush_cache=True, weight_version=weight_version))
                    if failed:
                        failed = [(i, f"bucket {num_buckets}: {msg}") for i, msg in failed]
                        break
                    num_buckets += 1
                    num_tensors += len(bucket)
        except Exception as e:  # the source itself failed (bad name map, duplicate names): roll back
            failed = [(-1, f"reading the source: {type(e).__name__}: {e}")]
        ok, msg = self._end("sync_weights", failed, old_version)
        return ok, (f"synced {num_tensors} tensors in {num_buckets} bucket(s) into {len(self.handles)} engines"
                    if ok else msg)

    def sync_delta(self, updates, weight_version: str | None = None) -> tuple[bool, str, int]:
        """Sparse deltas (weight_sync/delta.py DeltaSync): every part to every engine inside one
        transaction, so all engines take the whole delta or none does. -> (ok, message, parts applied)."""
        with self._txn_lock:
            return self._sync_delta(updates, weight_version)

    def _sync_delta(self, updates, weight_version: str | None) -> tuple[bool, str, int]:
        from weight_sync.delta_codec import DeltaUpdate

        blobs = [DeltaUpdate.from_blob(u).to_tensor() for u in updates]
        names = sorted({n for u in updates for n in DeltaUpdate.from_blob(u).names()})
        try:  # several parts are several calls: a group of one engine needs the snapshot too
            old_version = self._begin("sync_delta", names, many_calls=len(blobs) > 1)
        except EngineGroupError as e:
            return False, f"sync_delta refused: {e}", 0
        failed: list[tuple[int, str]] = []
        for k, blob in enumerate(blobs):
            failed = self._apply_everywhere("update_weights_from_tensor", (blob,), dict(
                load_format="delta", flush_cache=True, weight_version=weight_version))
            if failed:
                failed = [(i, f"delta part {k}: {msg}") for i, msg in failed]
                break
        ok, msg = self._end("sync_delta", failed, old_version)
        return ok, (f"{len(blobs)} delta part(s) into {len(self.handles)} engines" if ok else msg), \
            (len(blobs) if ok else 0)

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None, online: bool = False,
                                   abort_all_requests: bool = False) -> tuple[bool, str]:
        """Engine.update_weights_from_tensor on every engine, committed on all or none. online=True: each
        engine retracts its requests in flight (they go on under the new weights) instead of refusing.
        abort_all_requests=True: see `_abort_after`."""
        _check_abort_all(abort_all_requests)
        names = _update_names(named_tensors, load_format)
        ok, msg = self._atomic_update("update_weights_from_tensor", names, (named_tensors,),
                                      dict(load_format=load_format, flush_cache=flush_cache,
                                           weight_version=weight_version, online=online or abort_all_requests))
        return self._abort_after(abort_all_requests, ok, msg)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None, flush_cache: bool = True, online: bool = False,
                                 abort_all_requests: bool = False) -> tuple[bool, str, int]:
        """SGLang's shape: (success, message, num_paused_requests); the group pauses nothing itself.
        abort_all_requests=True: see `_abort_after`."""
        _check_abort_all(abort_all_requests)
        ok, msg = self._atomic_update("update_weights_from_disk", None, (str(model_path),),
                                      dict(load_format=load_format, weight_version=weight_version,
                                           flush_cache=flush_cache, online=online or abort_all_requests))
        return (*self._abort_after(abort_all_requests, ok, msg), 0)

    def _abort_after(self, abort_all_requests: bool, ok: bool, msg: str) -> tuple[bool, str]:
        """SGLang's abort_all_requests over the group: requests in flight do not refuse the update (each
        engine retracts them, as online=True), and once every engine committed, every request in flight on
        every engine is aborted (also one submitted while the update ran). A group that rolls back aborts
        nothing: an engine's own abort_all_requests would already have aborted its requests when another
        engine's refusal rolled it back, and those would be lost with nothing loaded."""
        if ok and abort_all_requests:  # committed everywhere: a failed abort (an engine died since) undoes nothing
            try:
                aborted = sum(self._all("abort_request", "", True))
                msg = f"{msg}; aborted {aborted} request(s) in flight"
            except EngineGroupError as e:
                msg = f"{msg}; aborting the requests in flight failed: {e}"
        return ok, msg

    def abort_request(self, rid: str = "", abort_all: bool = False, abort_message: str | None = None) -> int:
        """Engine.abort_request on every engine (a rid lives on one of them; the others find nothing).
        Returns how many requests were aborted in all."""
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise TypeError(f"abort_request takes rid: str and abort_all: bool, got {rid!r}, {abort_all!r}")
        return sum(self._all("abort_request", rid, abort_all, abort_message))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "gloo",
                                  **kwargs) -> tuple[bool, str]:
        """Engine i joins as rank `rank_offset + i` (SGLang's convention, tp_size 1 per engine);
        `world_size` counts the trainer's ranks plus every engine. The joins run concurrently because
        the rendezvous needs every rank."""
        refs = [h.call.remote("init_weights_update_group",
                              (master_address, master_port, rank_offset + i, world_size, group_name),
                              dict(backend=backend, **kwargs)) for i, h in enumerate(self.handles)]
        results = self._get(refs, "init_weights_update_group")
        bad = [f"engine {i}: {msg}" for i, (ok, msg) in enumerate(results) if not ok]
        return (not bad), ("; ".join(bad) if bad else f"{len(self.handles)} engines joined {group_name!r}")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str = "weight_update_group",
                                        flush_cache: bool = True, load_format: str | None = None,
                                        weight_version: str | None = None, **kwargs) -> tuple[bool, str]:
        return self._atomic_update("update_weights_from_distributed", list(names),
                                   (names, dtypes, shapes, group_name),
                                   dict(flush_cache=flush_cache, load_format=load_format, weight_version=weight_version,
                                        **kwargs))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"):
        return self._all("destroy_weights_update_group", group_name)

    # ---- LoRA adapters: loaded on every engine or on none --------------------------------------
    def _lora_all_or_none(self, method: str, lora_name: str, *args, **kwargs):
        results = self._all(method, lora_name, *args, **kwargs)
        failed = [(i, r.error_message) for i, r in enumerate(results) if not r.success]
        if not failed:
            return results[0]
        for i, r in enumerate(results):  # take it back where it loaded, so no engine serves it alone
            if r.success:
                self.handles[i].call.remote("unload_lora_adapter", (lora_name,), {})
        first = results[failed[0][0]]
        first.error_message = f"engine {failed[0][0]}: {failed[0][1]} (unloaded from the others)"
        return first

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False):
        """Load on every engine, or (if any refuses) on none; the error names the engine."""
        return self._lora_all_or_none("load_lora_adapter", lora_name, lora_path, pinned)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors, config_dict: dict,
                                       load_format: str | None = None, pinned: bool = False):
        return self._lora_all_or_none("load_lora_adapter_from_tensors", lora_name, tensors, config_dict,
                                      load_format=load_format, pinned=pinned)

    def unload_lora_adapter(self, lora_name: str):
        """Unload from every engine (each waits for its own requests on the adapter)."""
        results = self._all("unload_lora_adapter", lora_name)
        bad = [(i, r.error_message) for i, r in enumerate(results) if not r.success]
        if bad:
            results[0].success, results[0].error_message = False, "; ".join(f"engine {i}: {m}" for i, m in bad)
        return results[0]

    # ---- everything else reaches every engine ------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Release `tags` on every engine; checked on every engine first, so a release one engine would refuse
        (those tags released there already) releases nothing anywhere and names that engine."""
        self._check_memory_transition(tags, release=True)
        self._all("release_memory_occupation", tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Resume `tags` on every engine, checked on every engine first as release is."""
        self._check_memory_transition(tags, release=False)
        self._all("resume_memory_occupation", tags)

    def _check_memory_transition(self, tags, release: bool) -> None:
        problems = self._all("memory_transition_problem", tags, release)
        bad = [f"engine {i}: {p}" for i, p in enumerate(problems) if p]
        if bad:
            raise RuntimeError(f"{'release' if release else 'resume'}_memory_occupation({tags}) changed nothing on "
                               f"any engine: " + "; ".join(bad))

    def flush_cache(self):
        """FlushCacheReqOutput: success iff every engine flushed."""
        from rollout.engine_info_api import FlushCacheReqOutput

        return FlushCacheReqOutput(all(bool(r) for r in self._all("flush_cache")))

    def pause_generation(self, *args, **kwargs) -> None:
        self._all("pause_generation", *args, **kwargs)

    def continue_generation(self) -> None:
        self._all("continue_generation")

    def get_server_info(self) -> list[dict]:
        return self._all("get_server_info")

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        return self._get([self.handles[0].call.remote("get_weights_by_name", (name, truncate_size), {})],
                         "get_weights_by_name")[0]

    def start_expert_distribution_record(self) -> None:
        self._all("start_expert_distribution_record")

    def stop_expert_distribution_record(self) -> None:
        self._all("stop_expert_distribution_record")

    def dump_expert_distribution_record(self, output_dir: str | None = None) -> list:
        """One dump per engine (engine i's counts at index i); each engine writes its own file."""
        return self._all("dump_expert_distribution_record", output_dir)

    def get_weights_checksum(self) -> dict:
        """Engine 0's checksum dict, after checking every engine holds the same bits."""
        sums = self._all("get_weights_checksum")
        if len({s["checksum"] for s in sums}) != 1:
            raise EngineGroupError(f"engines hold different weights: checksums {[s['checksum'] for s in sums]}")
        return sums[0]

    @property
    def weight_version(self) -> str:
        versions = self._all("weight_version")
        if len(set(versions)) != 1:
            raise EngineGroupError(f"engines disagree on the weight version: {versions}")
        return versions[0]

    def shutdown(self) -> None:
        """Shut every engine down and kill the actors (also the dead ones' handles are dropped)."""
        ray = _ray()
        for h in self.handles:
            try:
                ray.get(h.shutdown.remote(), timeout=30)
            except Exception as e:  # already dead: nothing to release
                logger.info("engine shutdown: %s", e)
            try:
                ray.kill(h)
            except Exception:  # noqa: BLE001 - a handle to a gone actor
                pass

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _last_line(e: BaseException) -> str:
    """The informative line of a Ray error (its text is a whole remote traceback)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def _update_names(named_tensors, load_format: str | None) -> list[str] | None:
    """The HF names an update touches, read from the argument without unpacking any tensor; None (the
    transaction then snapshots every weight) where the argument does not say them in HF names: "direct"
    (runner names), SGLang's serialized buckets (one blob per TP rank), a custom loader's format."""
    if load_format == "delta":
        from weight_sync.delta_codec import delta_names

        return delta_names(named_tensors)
    if load_format == "flattened_bucket":
        buckets = named_tensors if isinstance(named_tensors, list) else [named_tensors]
        names = []
        for b in buckets:
            if isinstance(b, dict):
                meta = b.get("metadata")
            elif hasattr(b, "get_metadata"):
                meta = b.get_metadata()
            else:
                return None
            names.extend(m["name"] if isinstance(m, dict) else m.name for m in meta)
        return names
    if load_format is not None:
        return None
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    return [n for n, _ in items]
