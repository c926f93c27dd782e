"""The one way weights enter a model: resolve HF names, check everything, then write all or nothing.

`WeightPlan` maps each (HF name, tensor) to the exact parameter slice it fills and checks name, shape,
dtype and finiteness (after the cast to the parameter's dtype, which is where a float64 1e300 or an
fp32 1e5 headed for float16 becomes inf) for every tensor before anything is written. Tensors that a
plain `copy_` cannot take are normalised first: sparse tensors are densified, DTensors (an FSDP2
trainer's state_dict) are gathered with `full_tensor()`; meta tensors are refused. `WeightWriter` then
copies, snapshotting each slice just before it writes it; if anything fails inside its block (a copy,
or a checkpoint read between two writes) it puts every written slice back, and if even that fails it
raises `WeightsCorruptedError` so the caller can refuse to serve. The initial load, updates from
tensors, buckets, disk and a distributed broadcast all go through these two classes.

A tied LM head (`lm_head.weight` sharing the embedding's storage) reads as the embedding; a write to it
is accepted only when it equals the embedding it is tied to, and is then a no-op.

SGLang's `load_format="direct"` names runner parameters (fused `qkv_proj`, `gate_up_proj`) and copies
whole tensors: `plan_direct_load` checks those the same way. `load_weights_direct(model, named_tensors)`
is that copy as a plain function, the built-in for `custom_weight_loader` (SGLang's
`_model_load_weights_direct`); `WeightWriter.protect` snapshots what such a foreign function may write.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from runner.layers.linear import default_weight_loader, shard_view, tp_hf_shape, tp_narrow
from runner.weights.snapshot import SnapshotStore

# Present in some older checkpoints; derived, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
TIED_LM_HEAD = "lm_head.weight"


class WeightUpdateError(ValueError):
    pass


class WeightsCorruptedError(WeightUpdateError):
    """A write failed and the old values of `names` could not be put back: the model holds a mix."""

    def __init__(self, message: str, names: set[str]) -> None:
        super().__init__(message)
        self.names = names


@dataclass
class LoadTarget:
    hf_name: str
    param_name: str
    shard_id: object
    param: nn.Parameter

    def view(self) -> torch.Tensor:
        return shard_view(self.param, self.shard_id)

    def hf_shape(self) -> tuple[int, ...]:
        """Shape of the HF tensor: the view's, or under tensor parallelism the whole tensor this rank
        holds a slice of."""
        return tp_hf_shape(self.param, self.shard_id, tuple(self.view().shape))

    def narrow(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole HF tensor (the tensor itself without tensor parallelism)."""
        return tp_narrow(self.param, self.shard_id, tensor, tuple(self.view().shape))


class WeightNameMap:
    """HF checkpoint names <-> runner parameters for one model instance."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.targets: dict[str, LoadTarget] = {}
        # A model may declare (HF name, param, shard) targets itself (MoE: per-expert tensors into
        # stacked params); the params it names are then reachable only through those HF names.
        declared = list(getattr(model, "extra_weight_targets", lambda: [])())
        for hf_name, pname, shard in declared:
            self.targets[hf_name] = LoadTarget(hf_name, pname, shard, self.params[pname])
        declared_params = {pname for _, pname, _ in declared}
        for pname, param in self.params.items():
            if pname in declared_params:
                continue
            fused = [(hf, shard) for p, hf, shard in model.stacked_params_mapping if f".{p}." in f".{pname}"]
            if fused:
                for hf_piece, shard in fused:
                    runner_piece = next(p for p, hf, s in model.stacked_params_mapping if hf == hf_piece)
                    hf_name = pname.replace(runner_piece, hf_piece)
                    self.targets[hf_name] = LoadTarget(hf_name, pname, shard, param)
            else:
                self.targets[pname] = LoadTarget(pname, pname, None, param)
        # Tied HF names -> the name whose storage they share (named_parameters lists a shared one once).
        self.aliases: dict[str, str] = {}
        lm_head = getattr(model, "lm_head", None)
        if self.tied and lm_head is not None and TIED_LM_HEAD not in self.targets:
            self.aliases[TIED_LM_HEAD] = next(n for n, p in self.params.items() if p is lm_head.weight)

    def is_ignored(self, hf_name: str) -> bool:
        return hf_name.endswith(IGNORED_SUFFIXES)

    def resolve(self, hf_name: str) -> LoadTarget:
        """The slice `hf_name` lives in; a tied alias resolves to the tensor it shares (for reads)."""
        try:
            return self.targets[self.aliases.get(hf_name, hf_name)]
        except KeyError:
            raise WeightUpdateError(f"unknown weight name {hf_name!r}: not a parameter of this model "
                                    f"(expected Hugging Face names like 'model.layers.0.self_attn.q_proj.weight')"
                                    ) from None

    def hf_names(self) -> list[str]:
        """Every name a full checkpoint must hold (tied aliases excluded)."""
        return list(self.targets)

    def covering_hf_names(self, names) -> set[str]:
        """HF names whose values `names` (HF or runner parameter names, as writes record them) cover:
        a runner name like `...qkv_proj.weight` covers its q, k and v; unknown names cover nothing."""
        out: set[str] = set()
        for name in names:
            if name in self.targets:
                out.add(name)
            elif name in self.params:
                out.update(t.hf_name for t in self.targets.values() if t.param_name == name)
        return out

    def param_target(self, param_name: str) -> LoadTarget:
        """A whole runner parameter by its runner name (SGLang's load_format="direct" names)."""
        if param_name not in self.params:
            some = [n for n in self.params if "layers.0." in n][:4]
            raise WeightUpdateError(f"unknown parameter name {param_name!r}: load_format='direct' takes this "
                                    f"model's own parameter names (e.g. {some}); Hugging Face names go with "
                                    f"load_format=None")
        return LoadTarget(param_name, param_name, None, self.params[param_name])


_SPARSE_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_csc: ("ccol_indices", "row_indices"),
                      torch.sparse_bsr: ("crow_indices", "col_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices")}


def _densified(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """A sparse tensor as a dense one, its indices checked first: torch builds sparse tensors without checking
    them by default, and to_dense() of an index past the size writes out of bounds (a silent change of other
    memory, or a crash). Nested and other layouts are refused by name."""
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            if tensor.layout == torch.sparse_coo:
                torch.sparse_coo_tensor(tensor._indices(), tensor._values(), tensor.shape)
            elif tensor.layout in _SPARSE_COMPRESSED:
                compressed, plain = (getattr(tensor, f)() for f in _SPARSE_COMPRESSED[tensor.layout])
                torch.sparse_compressed_tensor(compressed, plain, tensor.values(), tensor.shape, layout=tensor.layout)
            else:
                raise WeightUpdateError(f"{what}: layout {'nested' if tensor.is_nested else tensor.layout} is not "
                                        f"supported; send dense (strided) or sparse tensors")
    except WeightUpdateError:
        raise
    except (RuntimeError, ValueError, IndexError) as e:
        raise WeightUpdateError(f"{what}: invalid sparse tensor ({str(e).splitlines()[0]})") from None
    return tensor.to_dense()


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def prepare_tensor(target: LoadTarget, tensor, source: str = "", check_finite: bool = True) -> torch.Tensor:
    """Check one tensor against its slice; return it in a form `copy_` takes (dense, local).

    Sparse tensors are densified and DTensors gathered (`full_tensor()`, a collective: every rank of the
    trainer's mesh must make the same call, as FSDP2's full state dict does) before any check, so the
    checks see exactly what will be written.
    """
    where = f" (from {source})" if source else ""
    name = target.hf_name
    if not isinstance(tensor, torch.Tensor):
        raise WeightUpdateError(f"weight {name!r}{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        try:
            tensor = tensor.full_tensor()
        except Exception as e:
            raise WeightUpdateError(f"weight {name!r}{where}: DTensor.full_tensor() failed ({type(e).__name__}: "
                                    f"{e}); send plain tensors") from e
    if tensor.device.type == "meta":
        raise WeightUpdateError(f"weight {name!r}{where}: is a meta tensor (no data)")
    if tensor.layout != torch.strided or tensor.is_nested:
        tensor = _densified(tensor, f"weight {name!r}{where}")
    expected = target.hf_shape()
    if tuple(tensor.shape) != expected:
        raise WeightUpdateError(f"weight {name!r}{where}: shape {tuple(tensor.shape)} does not match "
                                f"the model's {expected}")
    if not tensor.is_floating_point():
        raise WeightUpdateError(f"weight {name!r}{where}: dtype {tensor.dtype} is not a floating-point "
                                f"dtype (the model holds {target.param.dtype})")
    if check_finite:
        # Check what will be stored: the value after the cast to the parameter's dtype.
        cast = tensor if tensor.dtype == target.param.dtype else tensor.to(target.param.dtype)
        # A float32 sum is finite iff every element is (barring overflow, which the exact check
        # catches); it runs ~10x faster than isfinite().all() on the CPU.
        if not (bool(cast.sum(dtype=torch.float32).isfinite()) or bool(torch.isfinite(cast).all())):
            cast_note = "" if cast is tensor else f" after the cast from {tensor.dtype} to {cast.dtype}"
            raise WeightUpdateError(f"weight {name!r}{where}: contains NaN or inf{cast_note}")
    return target.narrow(tensor)


class WeightPlan:
    """Checks (name, tensor) pairs one by one; `finish()` runs the whole-update checks.

    With `keep=False` (a disk pass that re-reads from the same mapping to write) the checked tensors
    are not held, so checking a checkpoint costs one tensor of memory at a time.
    """

    def __init__(self, name_map: WeightNameMap, keep: bool = True, check_finite: bool = True,
                 check_tied: bool = True, last_wins: bool = False) -> None:
        self.name_map = name_map
        self.keep, self.check_finite, self.check_tied = keep, check_finite, check_tied
        # last_wins: a name sent twice takes its last value, as SGLang's in-order load gives (every value is
        # still checked, and only the last is written: a slice written twice would be snapshotted mid-update).
        # Without it (a checkpoint on disk) a repeated name is ambiguous and refused.
        self.last_wins = last_wins
        self.items: list[tuple[LoadTarget, torch.Tensor]] = []
        self.seen: dict[str, int | None] = {}  # name -> its index in items (None: not kept)
        self._tied: dict[str, tuple[torch.Tensor, str]] = {}  # alias or tied-to name -> (tensor, source)

    def add(self, name, tensor, source: str = "") -> None:
        if not isinstance(name, str):
            raise WeightUpdateError(f"weight names must be strings, got {name!r}")
        if self.name_map.is_ignored(name):
            return
        if name in self.seen and not self.last_wins:
            raise WeightUpdateError(f"weight {name!r} appears twice in one update")
        target = self.name_map.resolve(name)
        if name in self.name_map.aliases:  # never written: checked against what it is tied to
            alias_target = LoadTarget(name, target.param_name, target.shard_id, target.param)
            tensor = prepare_tensor(alias_target, tensor, source, self.check_finite)
            self._tied[name] = (tensor, source)
            self.seen[name] = None
            return
        tensor = prepare_tensor(target, tensor, source, self.check_finite)
        if name in self.name_map.aliases.values():
            self._tied[name] = (tensor, source)
        if not self.keep:
            self.seen[name] = None
        elif self.seen.get(name) is not None:
            self.items[self.seen[name]] = (target, tensor)
        else:
            self.seen[name] = len(self.items)
            self.items.append((target, tensor))

    def finish(self) -> list[tuple[LoadTarget, torch.Tensor]]:
        if not self.check_tied:
            return self.items
        for alias, tied_to in self.name_map.aliases.items():
            if alias not in self._tied:
                continue
            tensor, source = self._tied[alias]
            target = self.name_map.resolve(tied_to)
            if tied_to in self._tied:
                other, what = self._tied[tied_to][0].to(target.param.dtype), "the one in this update"
            else:
                other, what = target.view(), "the current one"
            new = tensor.to(device=other.device, dtype=target.param.dtype)
            if not torch.equal(new, other):
                diff = (new.float() - other.float()).abs().max().item()
                where = f" (from {source})" if source else ""
                raise WeightUpdateError(
                    f"weight {alias!r}{where}: this model ties it to {tied_to!r}, and it differs from {what} "
                    f"(max abs diff {diff:.3g}); update {tied_to!r} (and send an equal {alias!r}, or none)")
        return self.items


def plan_weight_load(name_map: WeightNameMap, named_tensors: Iterable[tuple[str, torch.Tensor]], source: str = "",
                     check_finite: bool = True) -> list[tuple[LoadTarget, torch.Tensor]]:
    """Every (target, tensor) to write, all checked; raises WeightUpdateError naming the first bad one."""
    plan = WeightPlan(name_map, check_finite=check_finite, last_wins=True)
    for name, tensor in named_tensors:
        plan.add(name, tensor, source)
    return plan.finish()


def plan_direct_load(name_map: WeightNameMap, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     check_finite: bool = True) -> list[tuple[LoadTarget, torch.Tensor]]:
    """load_format="direct": (runner parameter name, whole tensor) pairs, every one checked first; a name sent
    twice takes its last value (SGLang's in-order copy)."""
    plan: dict[str, tuple[LoadTarget, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        if not isinstance(name, str):
            raise WeightUpdateError(f"weight names must be strings, got {name!r}")
        target = name_map.param_target(name)
        plan[name] = (target, prepare_tensor(target, tensor, "load_format='direct'", check_finite))
    return list(plan.values())


def load_weights_direct(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy whole tensors into `model`'s parameters by their own names, unchecked (SGLang's
    `_model_load_weights_direct`). Name it in `custom_weight_loader` as
    "runner.weights.loader.load_weights_direct"; the runner makes the call all-or-nothing."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"{name!r} is not a parameter of {type(model).__name__}")
            default_weight_loader(params[name], tensor)


class WeightWriter:
    """All-or-nothing writes: `with WeightWriter() as w: w.write(target, tensor) ...`.

    Each slice is snapshotted right before it is written (runner/weights/snapshot.py: on its own device
    while the device has room, else in pinned host memory), so the extra memory is what this update
    touched, never the whole model unless it touches all of it. If the block raises, every written slice gets its old value back and
    the error is re-raised (as WeightUpdateError saying so); if putting them back fails too,
    WeightsCorruptedError names what may be mixed. `snapshot=False` (the initial load: there is
    nothing to go back to) skips both.
    """

    def __init__(self, snapshot: bool = True) -> None:
        self.snapshot = snapshot
        self.written: set[str] = set()
        self._undo: list[tuple[LoadTarget, torch.Tensor]] = []
        self.snapshots = SnapshotStore()

    def __enter__(self) -> WeightWriter:
        return self

    @torch.no_grad()
    def protect(self, target: LoadTarget) -> None:
        """Snapshot a slice that code outside this writer (a custom loader) may write."""
        if self.snapshot:
            self._undo.append((target, self.snapshots.take(target.view())))

    @torch.no_grad()
    def write(self, target: LoadTarget, tensor: torch.Tensor) -> None:
        if self.snapshot:
            self._undo.append((target, self.snapshots.take(target.view())))
        loader = getattr(target.param, "weight_loader", default_weight_loader)
        self.written.add(target.hf_name)  # before the call: a failing copy may have written part of it
        try:
            loader(target.param, tensor.to(target.param.device), target.shard_id)
        except Exception as e:
            raise WeightUpdateError(f"weight {target.hf_name!r}: writing it failed ({type(e).__name__}: {e})") from e

    @torch.no_grad()
    def write_elements(self, target: LoadTarget, flat: torch.Tensor, positions: torch.Tensor | None,
                       values: torch.Tensor) -> None:
        """flat[positions] = values (positions None: every element), where `flat` is a 1-D view of the
        storage of `target`'s slice (a sparse delta). Only those elements are snapshotted."""
        if self.snapshot:
            old = self.snapshots.take(flat) if positions is None else self.snapshots.take(flat[positions], owned=True)
            self._undo.append((target, _Elements(flat, positions, old)))
        self.written.add(target.hf_name)
        try:
            if positions is None:
                flat.copy_(values)
            else:
                flat[positions] = values
        except Exception as e:
            raise WeightUpdateError(f"weight {target.hf_name!r}: writing it failed ({type(e).__name__}: {e})") from e

    @torch.no_grad()
    def __exit__(self, exc_type, exc, tb) -> None:
        undo, self._undo = self._undo, []  # dropped on every exit: the snapshot lives only this long
        if exc is None or not self.snapshot:
            del undo
            self.snapshots.close()
            return
        num_restored = len(undo)
        try:
            for target, old in reversed(undo):
                restore(target, old)
        except Exception as e:
            mixed = set(self.written) | {t.hf_name for t, _ in undo}
            raise WeightsCorruptedError(
                f"{exc}; restoring the old values failed too ({type(e).__name__}: {e}): {len(mixed)} "
                f"tensors may hold a mix of old and new weights", mixed) from exc
        finally:
            undo.clear()
            self.snapshots.close()
        if isinstance(exc, Exception):
            restored = (f"the {num_restored} tensors written so far were restored" if num_restored
                        else "nothing was written")
            raise WeightUpdateError(f"{exc}; {restored}, the weights are unchanged") from exc


@dataclass
class _Elements:
    """The snapshot of some elements of a flat view (WeightWriter.write_elements)."""
    flat: torch.Tensor
    positions: torch.Tensor | None
    old: torch.Tensor


def restore(target: LoadTarget, old) -> None:
    """Put a snapshotted slice back (a module function so a test can make it fail)."""
    if isinstance(old, _Elements):
        if old.positions is None:
            old.flat.copy_(old.old)
        else:
            old.flat[old.positions] = old.old.to(old.flat.device)
        return
    target.view().copy_(old)


def write_all(plan: list[tuple[LoadTarget, torch.Tensor]], snapshot: bool = True) -> set[str]:
    """Write a checked plan all or nothing; returns the HF names written."""
    with WeightWriter(snapshot) as writer:
        for target, tensor in plan:
            writer.write(target, tensor)
    return writer.written
