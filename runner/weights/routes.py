"""The weight update routes: how tensors from a trainer, a checkpoint or a custom loader reach the model.

Every route ends in `write`: `update_from_tensor` (pairs or flattened buckets, unpacked here; or
load_format="direct", runner parameter names and whole tensors, checked the same way; or
load_format="delta", a sparse delta of bit patterns, runner/weights/delta.py), `update_from_disk`
(one snapshot of the checkpoint directory) and a `custom_weight_loader` (a function fn(model,
named_tensors) allowed at construction, run with every parameter snapshotted first so a failure or a
non-finite result is undone). All go through the check-everything-then-write-all-or-nothing loader
(runner/weights/loader.py). A write that fails half-way is undone; if undoing fails, the weights are
marked invalid on the runner and its forward() refuses. The distributed route receives through
runner/weights/update_groups.py and then loads here as a tensor update.

Each function takes the ModelRunner (`runner`) whose model, name map, memory saver and validity flags it
reads and updates; the runner's public methods are thin calls into these. Nothing here pauses requests
or flushes caches: that is the caller's.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from runner.config import ModelConfig
from runner.weights import delta
from runner.weights.checkpoint import CheckpointError, CheckpointIndex
from runner.weights.loader import (
    WeightPlan,
    WeightsCorruptedError,
    WeightUpdateError,
    WeightWriter,
    plan_direct_load,
    plan_weight_load,
    prepare_tensor,
)


def require_weights_resident(runner) -> None:
    if runner.is_shut_down:
        raise WeightUpdateError("the engine was shut down: its weights are freed")
    if not runner.memory_saver.is_resident("weights"):
        raise WeightUpdateError("weights are released; call resume_memory_occupation(['weights']) first")


def write(runner, fill: Callable[[WeightWriter], None], repack_all: bool = False) -> int:
    """Run `fill(writer)` all or nothing; keep the prepacked shadows and validity in step.
    `writer.written` may hold HF or runner parameter names (direct); both count here."""
    writer = runner.new_weight_writer()
    try:
        fill(writer)  # enters `writer`: any failure inside restores what it wrote
    except WeightsCorruptedError as e:
        names = runner.name_map.covering_hf_names(e.names)
        runner.weights_valid = False
        runner.invalid_weights |= names
        runner.invalid_reason = f"a failed update could not be undone ({len(names)} tensors may be mixed)"
        raise
    finally:  # shadows and cached checksums follow whatever the weights now hold, restored or new
        touched = None if repack_all else runner.name_map.covering_hf_names(writer.written)
        runner._repack(touched)
        runner.weight_hashes.invalidate(touched)
    mark_loaded(runner, runner.name_map.covering_hf_names(writer.written))
    return len(writer.written)


def mark_loaded(runner, hf_names: set[str]) -> None:
    if runner.invalid_weights:
        runner.invalid_weights -= hf_names
        runner.weights_valid = not runner.invalid_weights
        if runner.weights_valid:
            runner.invalid_reason = ""


def update_from_tensor(runner, named_tensors, load_format: str | None = None) -> int:
    """See ModelRunner.update_weights_from_tensor."""
    require_weights_resident(runner)
    if load_format in runner.custom_loaders:
        return custom_load(runner, load_format, named_tensors)
    if load_format == "delta":  # a sparse delta (weight_sync/delta_codec.py): runner/weights/delta.py
        return delta.apply_delta(runner, named_tensors, write)
    named = _pairs(named_tensors) if load_format == "direct" else \
        unpack_named_tensors(named_tensors, load_format, list(runner.custom_loaders))
    if not named:  # an update of nothing would still move the weight version (a tied alias alone is something)
        raise WeightUpdateError("no tensors to load: named_tensors is empty")
    if load_format != "direct" and all(isinstance(n, str) and runner.name_map.is_ignored(n) for n, _ in named):
        shown = ", ".join(repr(n) for n, _ in named[:3]) + (f" (+{len(named) - 3} more)" if len(named) > 3 else "")
        raise WeightUpdateError(f"no tensors to load: every name in this update is one the engine does not load "
                                f"(computed at start-up, not a weight): {shown}")
    plan = plan_direct_load(runner.name_map, named) if load_format == "direct" else \
        plan_weight_load(runner.name_map, named)

    def fill(writer: WeightWriter) -> None:
        with writer:
            for target, tensor in plan:
                writer.write(target, tensor)

    return write(runner, fill)


def custom_load(runner, path: str, named_tensors) -> int:
    """SGLang's custom loader: fn(model, named_tensors) with the tensors on the runner's device. Every
    parameter is snapshotted (on the host) first, since the function may write any of them; if it
    raises or leaves a non-finite value, all are put back."""
    fn = runner.custom_loaders[path]
    named = _pairs(named_tensors)
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"custom weight loader {path!r} takes (name: str, tensor) pairs, got "
                                    f"({name!r}, {type(tensor).__name__})")
    named = [(n, t.to(runner.device)) for n, t in named]
    name_map = runner.name_map
    targets = [name_map.param_target(n) for n in name_map.params]

    def fill(writer: WeightWriter) -> None:
        with writer:
            for target in targets:
                writer.protect(target)
            try:
                fn(runner.model, named)
            except Exception as e:
                raise WeightUpdateError(f"custom weight loader {path!r} failed: {type(e).__name__}: {e}") from e
            for target in targets:
                prepare_tensor(target, target.view(), f"custom weight loader {path!r}")  # finite?
            writer.written |= {n for n, _ in named if n in name_map.params or n in name_map.targets}

    return write(runner, fill, repack_all=True)


def open_checkpoint(runner, model_path: str | Path) -> CheckpointIndex:
    """Open a checkpoint (headers, config check, mappings) without touching runner state, so a caller can
    do it outside its locks: a slow or stuck file system stalls only that call."""
    try:
        index = CheckpointIndex(model_path)
    except CheckpointError as e:
        raise WeightUpdateError(str(e)) from None
    try:
        check_checkpoint_config(runner, index)
    except BaseException:
        index.close()
        raise
    return index


def update_from_disk(runner, model_path: str | Path | CheckpointIndex) -> int:
    """Load a whole HF checkpoint directory (or one open_checkpoint opened), read as one snapshot (see
    runner/weights/checkpoint.py)."""
    require_weights_resident(runner)
    try:
        index = model_path if isinstance(model_path, CheckpointIndex) else open_checkpoint(runner, model_path)
        with index:
            return write(runner, lambda writer: load_checkpoint(runner, index, writer, check=True))
    except CheckpointError as e:
        raise WeightUpdateError(str(e)) from None


def load_checkpoint(runner, index: CheckpointIndex, writer: WeightWriter, check: bool) -> None:
    """Headers first, then (check=True) pass 1 reads and checks every tensor, then pass 2 writes.

    Both passes read from the snapshot `index` opened, so they see the same bytes; the model is
    touched only after the whole checkpoint proved good, without holding a second copy. Pass 2
    checks again as it writes (cheap, and a failure there is undone by `writer` anyway).
    """
    name_map = runner.name_map
    check_checkpoint_header(runner, index)
    if check:
        plan = WeightPlan(name_map, keep=False)
        for name, tensor in index.iter_tensors():
            plan.add(name, tensor, str(index.entries[name].file))
        plan.finish()
    # aliases were compared in pass 1 (updates); they share a written tensor: neither they nor ignored
    # tensors are read again
    written = [n for n in index.entries if not name_map.is_ignored(n) and n not in name_map.aliases]
    with writer:
        for name, tensor in index.iter_tensors(written):
            target = name_map.resolve(name)
            tensor = prepare_tensor(target, tensor, str(index.entries[name].file), check_finite=check)
            writer.write(target, tensor)
        index.check_unchanged()  # a shard written to during either pass: the writer puts everything back


def check_checkpoint_header(runner, index: CheckpointIndex) -> None:
    """Names, shapes and dtypes from the safetensors headers, before any data is read."""
    name_map = runner.name_map
    for name, entry in index.entries.items():
        if name_map.is_ignored(name):
            continue
        try:
            target = name_map.resolve(name)
        except WeightUpdateError as e:
            raise WeightUpdateError(f"{entry.file}: {e}") from None
        if target.hf_shape() != entry.shape:
            raise WeightUpdateError(f"{entry.file}: tensor {name!r} has shape {entry.shape}, the model "
                                    f"expects {target.hf_shape()}")
        if not entry.dtype.is_floating_point:
            raise WeightUpdateError(f"{entry.file}: tensor {name!r} has non-float dtype {entry.dtype}")
    missing = [n for n in name_map.hf_names() if n not in index.entries]
    if missing:
        raise WeightUpdateError(f"{index.root}: checkpoint is missing {len(missing)} tensors, e.g. {missing[0]!r}")


def check_checkpoint_config(runner, index: CheckpointIndex) -> None:
    where = index.root / "config.json"
    if index.config_text is None:
        raise WeightUpdateError(f"{where}: no config.json in the checkpoint directory")
    try:
        other = ModelConfig.from_dict(json.loads(index.config_text))
    except (ValueError, KeyError, TypeError) as e:  # KeyError: a required key is missing
        raise WeightUpdateError(f"{where}: {type(e).__name__}: {e}") from None
    mine, theirs = runner.model_config.shape_signature(), other.shape_signature()
    diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
    if diff:
        raise WeightUpdateError(f"{where}: does not match the running model: "
                                + ", ".join(f"{k} {a!r} != {b!r}" for k, (a, b) in diff.items()))


class TooManyValues(ValueError):
    """get_weights_by_name's slice holds more values than its `max_values` allows."""


def truncated_values(t: torch.Tensor, truncate_size: int, max_values: int | None = None,
                     name: str = "") -> list:
    """The first `truncate_size` elements (1-D) or rows (else) of t, as lists of floats, sliced as a Python
    list is (SGLang's `[:truncate_size]`: 0 is none, -1 all but the last). `max_values`
    bounds how many values that may be: over it, a TooManyValues (ValueError) naming truncate_size before any list is
    built (a whole embedding as Python floats is gigabytes, built while the step lock is held)."""
    part = t.reshape(-1)[:truncate_size] if t.dim() == 1 else t[:truncate_size]
    if max_values is not None and part.numel() > max_values:
        raise TooManyValues(f"get_weights_by_name: the first {truncate_size} rows of {name!r} hold {part.numel()} "
                            f"values, over max_values={max_values}: ask for a smaller truncate_size")
    return part.float().cpu().tolist()


def get_weights_by_name(runner, name: str, truncate_size: int = 100, max_values: int | None = None) -> list:
    """See ModelRunner.get_weights_by_name."""
    require_weights_resident(runner)
    try:
        target = runner.name_map.resolve(name)
    except WeightUpdateError:
        # A runner parameter name (a fused qkv_proj / gate_up_proj, as load_format="direct" writes them):
        # read it whole, as SGLang's params_dict lookup does.
        param = runner.name_map.params.get(name)
        if param is None:
            raise
        if runner.invalid_weights:
            raise WeightUpdateError(f"weight {name!r} is invalid ({runner.invalid_weights_message()})") from None
        view = param.detach()
    else:
        if target.hf_name in runner.invalid_weights:
            raise WeightUpdateError(f"weight {name!r} is invalid ({runner.invalid_weights_message()})")
        view = target.view()
    return truncated_values(view, truncate_size, max_values, name)


def _pairs(named_tensors) -> list[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, dict):
        named_tensors = list(named_tensors.items())
    if not hasattr(named_tensors, "__iter__") or isinstance(named_tensors, str | bytes):  # a generator is fine
        raise WeightUpdateError(f"named_tensors must be a list of (name, tensor) pairs or a dict, got "
                                f"{type(named_tensors).__name__}")
    items = list(named_tensors)
    if not all(isinstance(x, tuple | list) and len(x) == 2 for x in items):
        raise WeightUpdateError("named_tensors must be a list of (name, tensor) pairs or a dict")
    return [(n, t) for n, t in items]


def import_custom_loaders(paths: list[str] | None) -> dict[str, Callable]:
    """custom_weight_loader's dotted paths -> the functions, imported now so a bad path fails at init."""
    loaders = {}
    for path in paths or []:
        module, _, attr = path.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"custom_weight_loader {path!r} cannot be imported: {type(e).__name__}: {e}") from None
        if not callable(fn):
            raise ValueError(f"custom_weight_loader {path!r} is not callable")
        loaders[path] = fn
    return loaders


def unpack_named_tensors(named_tensors, load_format: str | None,
                         custom: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an update: plain pairs, a dict, or flattened buckets (weight_sync's
    wire format, unpacked into views without copies)."""
    if load_format in (None, "auto"):
        return _pairs(named_tensors)
    if load_format == "flattened_bucket":
        from weight_sync.bucket import FlattenedTensorBucket

        buckets = named_tensors if isinstance(named_tensors, list) else [named_tensors]
        out = []
        for b in buckets:
            bucket = b if isinstance(b, FlattenedTensorBucket) else FlattenedTensorBucket.from_dict(b)
            out.extend(bucket.named_tensors())
        return out
    raise WeightUpdateError(f"load_format={load_format!r}: choose None, 'direct', 'flattened_bucket', 'delta' or one of "
                            f"custom_weight_loader {custom or []} (given when the engine is created)")
