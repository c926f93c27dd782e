"""The Engine's weight checker and post-processing calls (SGLang's /weights_checker, /post_process_weights).

Mixed into Engine, beside WeightsAPI. `check_weights(action)` is SGLang's WeightChecker, which slime's
check-weight-update mode drives: "snapshot" keeps a host copy of every parameter, "reset_tensors"
overwrites every parameter with random values (a weight write like any update: between steps, refused
under running requests unless paused, prefix cache flushed, weight_version bumped, prepacked shadows
refreshed), "compare" checks the parameters against the snapshot exactly and names those that differ
(with each one's max_abs_err), "checksum" hashes every parameter (`weights_checksums`: SGLang's per-rank
answer, 16 hex digits per tensor).
The tensor work is runner/weights/checker.py's.

`post_process_weights` is SGLang's hook for re-packing quantized weights after a sync. This engine has
no quantized weights, and every weight write already refreshes what it derives from the weights (the
CPU's oneDNN-prepacked linear weights and the cached per-tensor checksums, in runner/weights/routes.py
`write`), so it only reports that; it waits for any update in progress first.

Every call returns (success, message); a refusal is (False, reason), never an exception.
What it does not do: check tensor-parallel ranks (refused by name: each holds a slice) or LoRA adapters.
"""

from __future__ import annotations

from runner.weights import checker

CHECK_ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
MAX_NAMED = 10  # parameter names listed in a failed compare's message


class WeightCheckerAPI:
    _weight_snapshot: dict | None = None

    def check_weights(self, action: str) -> tuple[bool, str]:
        """SGLang's weights checker: action "snapshot" | "reset_tensors" | "compare" -> (success, message)."""
        what = f"check_weights({action!r})"
        if action not in CHECK_ACTIONS:
            return False, f"{what}: Unsupported action; choose one of {list(CHECK_ACTIONS)}"
        tp = getattr(self.args, "tp_size", 1)
        if tp > 1:
            return False, (f"{what}: not supported with tp_size={tp} (each rank holds a slice of the weights); "
                           f"compare get_weights_checksum before and after instead")
        if action == "reset_tensors":
            seed = self._rng.getrandbits(63)
            ok, msg, _ = self._update(what, lambda: checker.reset(self.runner, seed), True, None)
            if ok:
                msg = (f"{what}: every parameter overwritten with random values; prefix cache flushed; "
                       f"weight_version={self.weight_version}")
            return ok, msg
        if action == "checksum":
            try:
                ranks = self.weights_checksums()
            except Exception as e:  # weights released, engine shut down: the (bool, str) contract
                return False, f"{what} failed: {e}"
            return True, f"{what}: {len(ranks[0]['checksums'])} parameters hashed"
        with self._cv:
            try:
                if action == "snapshot":
                    self._weight_snapshot = None  # never two snapshots at once
                    self._weight_snapshot = checker.snapshot(self.runner)
                    nbytes = sum(t.numel() * t.element_size() for t in self._weight_snapshot.values())
                    return True, (f"{what}: {len(self._weight_snapshot)} parameters ({nbytes / 2**20:.1f} MiB) "
                                  f"copied to the host")
                if self._weight_snapshot is None:
                    return False, f"{what}: no snapshot to compare against; call check_weights('snapshot') first"
                differ, total = checker.compare(self.runner, self._weight_snapshot)
            except Exception as e:  # weights released, engine shut down: the (bool, str) contract
                return False, f"{what} failed: {e}"
        if differ:
            more = f"; and {len(differ) - MAX_NAMED} more" if len(differ) > MAX_NAMED else ""
            listed = "; ".join(f"{name} ({why})" for name, why in differ[:MAX_NAMED])
            return False, f"{what}: {len(differ)} of {total} parameters differ from the snapshot: {listed}{more}"
        return True, f"{what}: all {total} parameters equal the snapshot"

    def weights_checksums(self) -> list[dict]:
        """SGLang's "checksum" action: one entry per rank (one here, tp_size 1) with {"checksums": {parameter
        name: 16 hex digits}, "parallelism_info": ranks and sizes}, taken between steps (never mid-update)."""
        with self._cv:
            sums = checker.checksums(self.runner)
        info = dict(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)
        return [{"checksums": sums, "parallelism_info": info}]

    def post_process_weights(self, restore_weights_before_load: bool = False,
                             post_process_quantization: bool = False) -> tuple[bool, str]:
        """SGLang's post-processing after a weight sync. Nothing to do here (no quantized weights; every
        update already refreshes the derived copies): returns (True, why), after any update in progress."""
        for name, value in (("restore_weights_before_load", restore_weights_before_load),
                            ("post_process_quantization", post_process_quantization)):
            if not isinstance(value, bool):
                return False, f"post_process_weights: {name} must be a bool, got {value!r}"
        with self._cv:  # ordered after an update in progress: the answer is about the weights it wrote
            version = self.weight_version
        return True, (f"post_process_weights: nothing to do (restore_weights_before_load="
                      f"{restore_weights_before_load}, post_process_quantization={post_process_quantization}): "
                      f"this engine holds no quantized weights, and every weight update already refreshes the "
                      f"copies derived from them (prepacked CPU linear weights, cached checksums); serving "
                      f"weight_version={version}")
