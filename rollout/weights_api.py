"""The Engine's RL surface: memory release/resume and atomic weight updates (SGLang's names).

Mixed into Engine. It handles the requests around a weight update, never the weights themselves:
the runner owns every route in (tensors, buckets, disk, the distributed groups) and one loader behind
them. Every call takes the engine lock, so it runs between scheduler steps; a distributed update
receives its bytes first, without the lock, so a silent trainer never stalls serving. Rules: nothing
is released or updated under running requests unless generation is paused or the update is `online`
(then the requests in flight are retracted and recompute their KV afterwards, under whatever weights
are then loaded, and go on without a pause); a failed
update returns (False, reason) and changes nothing (or, if it could not be undone, leaves the
weights marked invalid so generate refuses); a successful one flushes the prefix cache and bumps
`weight_version`.

Return shapes are SGLang's: (success, message) from the tensor and distributed routes,
(success, message, num_paused_requests) from update_weights_from_disk. Releasing a released tag or
resuming a resident one raises RuntimeError, as SGLang does.
"""

from __future__ import annotations

import logging
import os
import stat

from rollout.sampling_params import is_integer
from runner.weights.loader import WeightUpdateError

logger = logging.getLogger(__name__)


class WeightsAPI:
    # ---- guards ------------------------------------------------------------------------------
    def _require_quiescent(self, online: bool | None = None) -> int:
        """Raise unless no request is in flight, generation is paused or `online` (then retract them);
        returns how many requests were retracted (SGLang's num_paused_requests). online None: the call has
        no such option (the refusal does not offer it)."""
        problem = self._quiescence_problem(online)
        if problem:
            raise RuntimeError(problem)
        n = self.scheduler.num_in_flight()
        if n:
            self.scheduler.retract_all()
        return n

    def _quiescence_problem(self, online: bool | None) -> str | None:
        """Why an update must be refused now (requests in flight, generation not paused, not online), or None.
        Read without the lock it is a fast path only (a refusal before any file is opened); the lock's
        check decides."""
        n = self.scheduler.num_in_flight()
        if not n or self._paused or online:
            return None
        retract = "" if online is None else (
            "pass online=True (over HTTP: `online` on /update_weights_from_disk, `force` on "
            "/update_weights_from_tensor; they are retracted and go on under the new weights), ")
        return f"{n} request(s) in flight; call pause_generation() first, {retract}or wait for them to finish"

    def _bump_version(self, weight_version: str | None) -> None:
        """New weights: their label (`weight_version`, or the update count), and a new weights generation."""
        self._num_updates += 1
        if weight_version is None:
            weight_version = str(self._num_updates)
            if weight_version == self.weight_version:  # never the label of the weights it replaces ("1" then "1")
                self._num_updates += 1
                weight_version = str(self._num_updates)
        self._weights_generation += 1
        self._set_weight_version(weight_version)

    def _set_weight_version(self, weight_version: str) -> None:
        """The one place the served version changes (under the engine lock, between steps). The prefix cache's
        isolation key is the label and the weights generation together, so a label used twice (by a caller,
        or the count meeting an earlier label) never lets KV of other weights be reused."""
        self.weight_version = weight_version
        self.scheduler.set_weight_version(weight_version, self._weights_generation)

    def _require_not_shut_down(self, what: str) -> None:
        if self.runner.is_shut_down:
            raise RuntimeError(f"{what}: the engine was shut down (its memory is freed): create a new Engine")

    # ---- memory ------------------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Release `tags` (None: every tag). RuntimeError if one is already released."""
        with self._cv:
            self._require_not_shut_down("release_memory_occupation")
            tags = self.runner.check_memory_transition(tags, release=True)  # before retracting anything
            try:
                self._require_quiescent()
            except RuntimeError as e:
                raise RuntimeError(f"release_memory_occupation refused: {e}") from None
            try:
                self.runner.release_memory_occupation(tags)
            finally:  # the prefix cache points into the KV pool: flush it iff the pool went
                if not self.runner.memory_saver.is_resident("kv_cache"):
                    self.scheduler.flush_cache()

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Resume `tags` (None: every tag). RuntimeError if one is resident (nothing is resumed then)."""
        with self._cv:
            self._require_not_shut_down("resume_memory_occupation")
            self.runner.resume_memory_occupation(tags)
            self._cv.notify_all()

    # ---- weights -----------------------------------------------------------------------------
    def _update(self, what: str, fn, flush_cache: bool, weight_version: str | None,
                online: bool = False, abort_all: bool = False) -> tuple[bool, str, int]:
        """-> (success, message, num_paused_requests). abort_all (SGLang's abort_all_requests): every request
        in flight is aborted, but only once the update has succeeded. The write is all or nothing and no
        step runs while the lock is held, so to every request that is the same as aborting first; a
        refused update then loses nothing (SGLang aborts before it knows whether the update will load)."""
        problem = (weight_version_problem(weight_version) if weight_version is not None else None) or \
            flags_problem(flush_cache=flush_cache, online=online, abort_all_requests=abort_all)
        if problem:  # checked before any weight moves
            return False, f"{what} failed: {problem}", 0
        with self._cv:
            num_paused = 0
            # abort_all: the requests in flight when the update was asked for (the lock's acquisition put the
            # scheduler at a step boundary); one submitted while a slow load runs goes on under the new weights
            to_abort = self._in_flight() if abort_all else []
            try:
                if not abort_all:
                    num_paused = self._require_quiescent(online)
                n = fn()
            except Exception as e:  # any failure is reported, never raised: the (bool, str) contract
                logger.warning("%s failed: %s", what, e)
                if not self.runner.weights_valid:  # not undone: never reuse KV computed from a mix
                    self.scheduler.flush_cache()
                return False, f"{what} failed: {e}", num_paused
            if to_abort:  # their outputs carry the version they were served under
                self._abort_reqs(to_abort, f"aborted by {what}(abort_all_requests=True)")
            # Retracted requests left KV of the old weights in the prefix cache: never keep that cache
            # across an update, whatever flush_cache says.
            if flush_cache or self._paused or num_paused:
                self.scheduler.flush_cache()
            self._bump_version(weight_version)
            self._cv.notify_all()
            return True, f"{what}: loaded {n} tensors; weight_version={self.weight_version}", num_paused

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None, online: bool = False,
                                   abort_all_requests: bool = False) -> tuple[bool, str]:
        """named_tensors: list of (HF name, tensor) with load_format None; with "flattened_bucket" a
        bucket dict {"flattened_tensor", "metadata"} (or a list of them) from weight_sync.bucket; with
        "direct" (runner parameter name, whole tensor) pairs; with one of the engine's
        custom_weight_loader paths, whatever that function fn(model, named_tensors) takes.
        online=True: requests in flight (generation not paused) are retracted at this step boundary and
        go on under the new weights, instead of the update being refused. abort_all_requests=True: every
        request in flight is aborted once the update succeeded (a refused update aborts nothing)."""
        if load_format is not None and not isinstance(load_format, str):  # the runner's lookups would not name it
            return False, f"update_weights_from_tensor failed: load_format must be a string or None, got {load_format!r}"
        # KV computed from the old weights must not be reused: an update without flush is only
        # safe when nothing is cached, so it is forced if requests were retracted.
        return self._update("update_weights_from_tensor",
                            lambda: self.runner.update_weights_from_tensor(_serialized_buckets(named_tensors, load_format),
                                                                           load_format),
                            flush_cache, weight_version, online, abort_all_requests)[:2]

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None, flush_cache: bool = True, online: bool = False,
                                 abort_all_requests: bool = False) -> tuple[bool, str, int]:
        """Load the HF checkpoint at `model_path`. -> (success, message, num_paused_requests), SGLang's
        shape: the last is how many requests were retracted around the update (they go on under the new
        weights, after continue_generation if paused). online=True, abort_all_requests=True: as
        update_weights_from_tensor's."""
        if not isinstance(model_path, str | os.PathLike):
            return (False, f"update_weights_from_disk failed: model_path must be a checkpoint directory (a str), "
                           f"got {type(model_path).__name__}", 0)
        if "\x00" in os.fspath(model_path):  # os calls would raise a bare ValueError ("embedded null byte")
            return False, f"update_weights_from_disk failed: model_path {str(model_path)!r} holds a NUL byte", 0
        problem = flags_problem(flush_cache=flush_cache, online=online, abort_all_requests=abort_all_requests)
        if problem:  # before the fast path below reads `online`, and before any file is opened
            return False, f"update_weights_from_disk failed: {problem}", 0
        if load_format == "delta":  # a delta file (weight_sync/disk.py DiskTarget.sync_delta)
            try:  # read before taking the engine lock: a slow file system stalls only this call
                blob = _read_delta_file(model_path)
            except WeightUpdateError as e:
                return False, f"update_weights_from_disk failed: {e}", 0
            return self._update("update_weights_from_disk",
                                lambda: self.runner.update_weights_from_tensor(blob, "delta"),
                                flush_cache, weight_version, online, abort_all_requests)
        if load_format not in (None, "auto", "safetensors"):
            return (False, f"update_weights_from_disk failed: load_format={load_format!r} is not supported; "
                           f"choose None, 'auto', 'safetensors' or 'delta'", 0)
        if not abort_all_requests:  # refused at once, before opening anything, when it would be refused anyway
            problem = self._quiescence_problem(online)
            if problem:
                return False, f"update_weights_from_disk failed: {problem}", 0
        source = model_path
        # On the class: the TP runner forwards unknown attributes to its rank-0 runner, but its workers
        # open their own copy of the checkpoint, so it takes the path.
        opener = getattr(type(self.runner), "open_checkpoint", None)
        if opener is not None:
            try:  # without the engine lock: a slow or stuck file system stalls only this call, not serving
                source = opener(self.runner, model_path)
            except WeightUpdateError as e:
                return False, f"update_weights_from_disk failed: {e}", 0
        result = self._update("update_weights_from_disk", lambda: self.runner.update_weights_from_disk(source),
                              flush_cache, weight_version, online, abort_all_requests)
        if result[0]:  # SGLang reports the checkpoint now served as the model path (/get_model_info)
            self.model_path = str(model_path)
        return result

    def init_weights_update_group(self, master_address: str, master_port: int | str, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None,
                                  timeout_s: float = 120.0
                                  ) -> tuple[bool, str]:
        """Join the trainer's weight-broadcast group (the trainer is rank 0; this engine is rank_offset).
        backend None: nccl on CUDA, gloo on the CPU. Runs without the engine lock: serving goes on."""
        device = getattr(self.runner, "device", None)
        if backend == "nccl" and getattr(device, "type", "cuda") != "cuda":
            # Refused before connecting: a join that reached the trainer's store and then failed to
            # build the group would leave the trainer waiting for this rank until its timeout.
            return False, (f"init_weights_update_group failed: backend='nccl' needs a CUDA engine; this one runs "
                           f"on {device}: join with backend='gloo' (or None), and use gloo on the trainer too")
        try:
            self.runner.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                                  backend, timeout_s)
        except Exception as e:  # store/connect errors come in many types; report, keep serving
            return False, f"init_weights_update_group failed: {type(e).__name__}: {e}"
        return True, f"joined weight update group {group_name!r} as rank {rank_offset} of {world_size}"

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: str | None = None,
                                        weight_version: str | None = None,
                                        abort_all_requests: bool = False) -> tuple[bool, str]:
        """Receive one bucket broadcast by rank 0 of `group_name`, then load it atomically.
        load_format: the wire format (weight_sync.distributed), None = one broadcast per tensor.
        abort_all_requests=True: as update_weights_from_tensor's.

        The receive runs without the engine lock (serving goes on while the trainer is slow or silent);
        only the load takes it, like any other update."""
        what = "update_weights_from_distributed"
        result: list[tuple[bool, str]] = []
        # load_format="delta": one uint8 tensor, a delta blob (weight_sync/delta_codec.py), sent as a
        # checked bucket (header, CRC per tensor) and applied as a delta.
        delta = load_format == "delta"
        if delta and not (all(isinstance(x, list | tuple) for x in (names, dtypes, shapes)) and list(names) == [
                "delta_blob"] and list(dtypes) == ["uint8"] and len(shapes) == 1):
            return False, f"{what} failed: load_format='delta' takes names=['delta_blob'], dtypes=['uint8'], one shape"

        def load(named) -> int:
            fn = (lambda: self.runner.update_weights_from_tensor(named[0][1], "delta")) if delta else \
                (lambda: self.runner.update_weights_from_tensor(named))
            result.append(self._update(what, fn, flush_cache, weight_version, abort_all=abort_all_requests)[:2])
            return 0

        try:
            self.runner.update_weights_from_distributed(names, dtypes, shapes, group_name,
                                                        "checked_bucket" if delta else load_format, load=load)
        except WeightUpdateError as e:  # refused before receiving (no such group)
            return False, f"{what} failed: {e}"
        except Exception as e:  # nothing was written: a failed receive never reaches the loader
            return False, f"{what} failed while receiving: {type(e).__name__}: {e}"
        return result[0]

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        """Leave `group_name` and free the name (SGLang's name); waits for a receive in progress on it."""
        try:
            self.runner.destroy_weights_update_group(group_name)
        except Exception as e:
            return False, f"destroy_weights_update_group failed: {type(e).__name__}: {e}"
        return True, f"destroyed weight update group {group_name!r}"

    def get_weights_by_name(self, name: str, truncate_size: int = 100, *, max_values: int | None = None):
        """SGLang's: the first `truncate_size` rows (elements of a 1-D weight) of an HF-named weight, as
        lists of floats. `max_values` (ours; the HTTP server passes --max-response-entries) refuses a slice
        of more values with a ValueError naming truncate_size, before any list is built."""
        if not isinstance(name, str):  # else an unhashable name fails in a dict lookup, naming nothing
            raise ValueError(f"get_weights_by_name: name must be a string, got {name!r}")
        if not is_integer(truncate_size):
            raise ValueError(f"get_weights_by_name: truncate_size must be an int, got {truncate_size!r}")
        if max_values is not None and (not is_integer(max_values) or max_values < 0):
            raise ValueError(f"get_weights_by_name: max_values must be None or an int >= 0, got {max_values!r}")
        truncate_size = int(truncate_size)
        with self._cv:
            return self.runner.get_weights_by_name(name, truncate_size, None if max_values is None else int(max_values))


def weight_version_problem(version) -> str | None:
    """Why `version` cannot label the weights, or None. It goes into every output, /metrics and JSON
    bodies, so it must be a string that encodes as UTF-8 (a lone surrogate from a JSON body does not)."""
    if not isinstance(version, str):
        return f"weight_version must be a string or None, got {version!r}"
    try:
        version.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"weight_version {version!r} is not valid UTF-8 text (character {e.start} is a lone surrogate)"
    return None


def flags_problem(**flags) -> str | None:
    """Why a weight update's bool options cannot be read, or None. Truthiness would read the string "false"
    as True: abort_all_requests="false" would abort every request in flight, online="false" retract them."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            return f"{name} must be a bool, got {value!r}"
    return None


def _serialized_buckets(named_tensors, load_format):
    """SGLang's Engine takes flattened buckets serialized, one string per TP rank: here each string is the
    wire encoding (weight_sync.wire.encode_bucket, base64 safetensors); every rank's copy must be the same
    (the runner slices for its ranks itself), so the first is decoded. Anything else passes unchanged."""
    if load_format != "flattened_bucket" or isinstance(named_tensors, dict):
        return named_tensors
    strings = [named_tensors] if isinstance(named_tensors, str) else named_tensors
    if not isinstance(strings, list | tuple) or not strings or not all(isinstance(x, str) for x in strings):
        return named_tensors
    if len(set(strings)) != 1:
        raise WeightUpdateError(f"{len(strings)} serialized buckets differ: give one per TP rank, every one the "
                                f"same full bucket (the engine slices it for its ranks)")
    from rollout.server.tensor_codec import decode_buckets  # the wire decoder (no server dependency)

    try:
        return decode_buckets(strings[0], "named_tensors[0]")
    except (ValueError, RuntimeError) as e:
        raise WeightUpdateError(str(e)) from None


def _read_delta_file(path) -> bytes:
    """A delta file's bytes (validated by the runner's delta route); a missing file is a WeightUpdateError."""
    try:
        # O_NONBLOCK and S_ISREG: a FIFO or device is refused, never opened for a blocking read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise WeightUpdateError(f"delta file {str(path)!r}: not a regular file")
            return f.read()
    except OSError as e:
        raise WeightUpdateError(f"delta file {str(path)!r}: {e.strerror or e}") from None
