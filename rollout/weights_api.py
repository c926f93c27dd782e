"""The Engine's RL surface: memory release/resume and atomic weight updates (SGLang's names).

Mixed into Engine; every method takes the engine lock, so it runs between scheduler steps. Rules:
nothing is released or updated under running requests unless generation is paused (paused requests
are retracted and recompute their KV afterwards, under whatever weights are then loaded); a failed
update returns (False, reason) and changes nothing; a successful one flushes the prefix cache and
bumps `weight_version`.
"""

from __future__ import annotations

import logging

import torch

from runner.weight_loader import WeightUpdateError

logger = logging.getLogger(__name__)


class WeightsAPI:
    # ---- guards ------------------------------------------------------------------------------
    def _require_quiescent(self, what: str) -> None:
        """Raise unless no request is in flight or generation is paused (then retract them)."""
        n = self.scheduler.num_in_flight()
        if n and not self._paused:
            raise RuntimeError(f"{what} refused: {n} request(s) in flight; call pause_generation() first "
                               f"(or wait for them to finish)")
        if n:
            self.scheduler.retract_all()

    def _bump_version(self, weight_version: str | None) -> None:
        self._num_updates += 1
        self.weight_version = weight_version if weight_version is not None else str(self._num_updates)

    # ---- memory ------------------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        with self._cv:
            self._require_quiescent("release_memory_occupation")
            try:
                self.runner.release_memory_occupation(tags)
            finally:  # the prefix cache points into the KV pool: flush it iff the pool went
                if not self.runner.memory_saver.is_resident("kv_cache"):
                    self.scheduler.flush_cache()

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        with self._cv:
            # Resuming what is resident is a no-op: the prefix cache (and running requests) stay.
            self.runner.resume_memory_occupation(tags)
            self._cv.notify_all()

    # ---- weights -----------------------------------------------------------------------------
    def _update(self, what: str, fn, flush_cache: bool, weight_version: str | None) -> tuple[bool, str]:
        with self._cv:
            try:
                self._require_quiescent(what)
                n = fn()
            except Exception as e:  # any failure is reported, never raised: the (bool, str) contract
                logger.warning("%s failed: %s", what, e)
                return False, f"{what} failed: {e}"
            # Paused requests were retracted into the prefix cache with KV of the old weights: never
            # keep that cache across an update, whatever flush_cache says.
            if flush_cache or self._paused:
                self.scheduler.flush_cache()
            self._bump_version(weight_version)
            self._cv.notify_all()
            return True, f"{what}: loaded {n} tensors; weight_version={self.weight_version}"

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None) -> tuple[bool, str]:
        """named_tensors: list of (HF name, tensor), or with load_format="flattened_bucket" a bucket dict
        {"flattened_tensor", "metadata"} (or a list of them) from weight_sync.bucket."""
        def load():
            return self.runner.update_weights_from_tensor(_named_tensors(named_tensors, load_format))
        # KV computed from the old weights must not be reused: an update without flush is only
        # safe when nothing is cached, so force it if requests were retracted.
        return self._update("update_weights_from_tensor", load, flush_cache, weight_version)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None) -> tuple[bool, str]:
        if load_format not in (None, "auto", "safetensors"):
            return False, f"update_weights_from_disk failed: load_format={load_format!r} is not supported"
        return self._update("update_weights_from_disk", lambda: self.runner.update_weights_from_disk(model_path),
                            True, weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo", timeout_s: float = 120.0
                                  ) -> tuple[bool, str]:
        """Join the trainer's weight-broadcast group (the trainer is rank 0; this engine is rank_offset)."""
        from weight_sync.distributed import create_weight_update_group

        with self._cv:
            groups = self.__dict__.setdefault("_update_groups", {})
        if group_name in groups:
            return False, f"init_weights_update_group failed: group {group_name!r} already exists"
        try:
            groups[group_name] = create_weight_update_group(master_address, master_port, rank_offset, world_size,
                                                            group_name, backend, timeout_s)
        except Exception as e:  # store/connect errors come in many types; report, keep serving
            return False, f"init_weights_update_group failed: {type(e).__name__}: {e}"
        return True, f"joined weight update group {group_name!r} as rank {rank_offset} of {world_size}"

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool = True,
                                        weight_version: str | None = None) -> tuple[bool, str]:
        """Receive one bucket broadcast by rank 0 of `group_name`, then load it atomically."""
        from weight_sync.distributed import receive_named_tensors

        group = self.__dict__.get("_update_groups", {}).get(group_name)
        if group is None:
            return False, f"update_weights_from_distributed failed: no group {group_name!r}; call " \
                          f"init_weights_update_group first"
        with self._cv:
            try:
                # Receive before any other check so both sides' collectives stay matched; nothing is
                # written until the whole bucket has arrived (a dead trainer -> timeout, old weights).
                named = receive_named_tensors(group, names, dtypes, shapes, self.runner.device)
            except Exception as e:
                return False, f"update_weights_from_distributed failed while receiving: {type(e).__name__}: {e}"
            return self._update("update_weights_from_distributed",
                                lambda: self.runner.update_weights_from_tensor(named), flush_cache, weight_version)

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        with self._cv:
            return self.runner.get_weights_by_name(name, truncate_size)


def _named_tensors(named_tensors, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    if load_format in (None, "auto"):
        if isinstance(named_tensors, dict):
            named_tensors = list(named_tensors.items())
        items = list(named_tensors)
        if not all(isinstance(x, tuple | list) and len(x) == 2 for x in items):
            raise WeightUpdateError("named_tensors must be a list of (name, tensor) pairs or a dict")
        return [(n, t) for n, t in items]
    if load_format == "flattened_bucket":
        from weight_sync.bucket import FlattenedTensorBucket

        buckets = named_tensors if isinstance(named_tensors, list) else [named_tensors]
        out = []
        for b in buckets:
            bucket = b if isinstance(b, FlattenedTensorBucket) else FlattenedTensorBucket.from_dict(b)
            out.extend(bucket.named_tensors())
        return out
    raise WeightUpdateError(f"load_format={load_format!r}: choose None or 'flattened_bucket'")
