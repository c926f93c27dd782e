"""Applying a sparse weight delta (weight_sync/delta_codec.py) to the model, and the checksums it checks.

`apply_delta(runner, blob)` is the `load_format="delta"` route of `update_weights_from_tensor`. Every
entry is checked before the first element is written: the name and shape are the model's, the dtype is
the one the model holds (a delta is exact bit patterns, so it is never cast), the codes decode
(positions in range and strictly increasing, counts and byte lengths as announced), every new value is
finite, the tensor's current checksum is the delta's base (else the refusal says "stale base" and to
send a full sync), and the checksum the changes produce is the one the sender announced. Then the
changed elements are written through the runner's one writer (runner/weights/routes.py `write`), which
snapshots exactly those elements and restores them if anything fails, repacks the prepacked shadows of
what changed and keeps the validity flags; captured graphs read the parameters in place, so they see
the new values.

`WeightHashes` caches each tensor's checksum on the runner. Any write through `routes.write` and any
release of the weights drops the cached values it may have changed; a delta sets the new ones, which it
computed in O(changed elements) while checking. A full checksum is computed lazily, once per tensor
after a full update.

Tensor parallelism: each rank decodes the same delta and applies only its own slice (positions are
mapped from the whole HF tensor to the slice); the checksum is additive, so each rank reports the
partial sums of its slice (`partial_hashes`) and rank 0 (runner/tp/runner.py) compares their sum with
the delta's base and result before any rank writes. A slice held by several ranks (a replicated tensor
or KV head) counts once.
Not here: the format itself, or deciding what to send.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runner.layers.linear import tp_slice
from runner.weights.loader import LoadTarget, WeightUpdateError, WeightWriter
from weight_sync.delta_codec import (
    BIT_DTYPES,
    NAME_DTYPES,
    STALE_BASE,
    DeltaFormatError,
    DeltaUpdate,
    combine,
    decode_entry,
    from_bits,
    hash_change,
    tensor_hash,
    to_bits,
)


class WeightHashes:
    """hf_name -> this rank's checksum of that tensor (the whole tensor without tensor parallelism)."""

    def __init__(self) -> None:
        self._h: dict[str, int] = {}

    def invalidate(self, hf_names=None) -> None:
        if hf_names is None:
            self._h.clear()
        else:
            for n in hf_names:
                self._h.pop(n, None)

    def get(self, runner, target: LoadTarget) -> int:
        h = self._h.get(target.hf_name)
        if h is None:
            h = self._h[target.hf_name] = _local_hash(runner, target)
        return h

    def set(self, hf_name: str, h: int) -> None:
        self._h[hf_name] = h


def _is_tp_rank(runner) -> bool:
    tp = getattr(runner, "tp", None)
    return tp is not None and tp.size > 1


def _slice(target: LoadTarget) -> tuple[torch.Tensor, tuple | None]:
    """The elements of the HF tensor this rank holds (padding dropped) and the slice spec."""
    view, spec = target.view(), tp_slice(target.param, target.shard_id)
    if spec is not None:
        view = view.narrow(spec[0], 0, spec[2])
    return view, spec


def _global_of_local(spec, local_shape) -> Callable[[torch.Tensor], torch.Tensor]:
    """local flat index -> flat index in the whole HF tensor, for slice `spec` (dim, start, size, full)."""
    dim, start, size, full = spec
    inner = math.prod(local_shape[dim + 1:])

    def index_of(j: torch.Tensor) -> torch.Tensor:
        outer, rest = j // (size * inner), j % (size * inner)
        return (outer * full + rest // inner + start) * inner + rest % inner
    return index_of


def _local_of_global(spec, hf_shape, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of global positions in this rank's slice, their local flat indices)."""
    dim, start, size, full = spec
    inner = math.prod(hf_shape[dim + 1:])
    outer, mid, rest = positions // (full * inner), (positions // inner) % full, positions % inner
    keep = (mid >= start) & (mid < start + size)
    return keep, ((outer * size + mid - start) * inner + rest)[keep]


def _local_hash(runner, target: LoadTarget) -> int:
    view, spec = _slice(target)
    if spec is None:
        return tensor_hash(view)
    index_of = _global_of_local(spec, tuple(view.shape))
    return tensor_hash(view, lambda s, e: index_of(torch.arange(s, e, dtype=torch.int64)))


@dataclass
class _Planned:
    target: LoadTarget
    entry: dict
    alias: bool
    local_pos: torch.Tensor | None  # into this rank's slice, flat; None: all of it
    new_bits: torch.Tensor  # [len(local_pos) or numel] int64 signed patterns
    base_partial: int
    result_partial: int


def _refuse(e: Exception) -> WeightUpdateError:
    return WeightUpdateError(f"delta refused: {e}")


def _entries(runner, update: DeltaUpdate) -> list[tuple[dict, LoadTarget]]:
    name_map = runner.name_map
    return [(e, name_map.resolve(e["name"])) for e in update.entries if not name_map.is_ignored(e["name"])]


def plan_delta(runner, update: DeltaUpdate, check_base: bool) -> list[_Planned]:
    """Decode and check every entry for this rank (nothing is written). Raises WeightUpdateError.
    `check_base`: compare each tensor's checksum with the delta's base first (off on a TP rank)."""
    name_map = runner.name_map
    out = []
    for entry, target in _entries(runner, update):
        name = entry["name"]
        dtype = NAME_DTYPES[entry["dtype"]]
        if dtype != target.param.dtype:
            raise WeightUpdateError(f"delta tensor {name!r} is {dtype}, the engine holds {target.param.dtype}: a "
                                    f"delta carries exact bit patterns and is never cast; send a full sync")
        if tuple(entry["shape"]) != target.hf_shape():
            raise WeightUpdateError(f"delta tensor {name!r}: shape {tuple(entry['shape'])} does not match the "
                                    f"model's {target.hf_shape()}")
        base = runner.weight_hashes.get(runner, target)
        if check_base:
            check_sums([entry], [base], None)
        try:
            dec = decode_entry(entry, update.payload)
        except DeltaFormatError as e:
            raise _refuse(e) from None
        view, spec = _slice(target)
        width = BIT_DTYPES[dtype][1]
        positions, values = dec.positions, dec.values
        if spec is None:
            local_pos, global_pos = positions, positions
        elif positions is None:
            keep, local_pos = _local_of_global(spec, target.hf_shape(), torch.arange(dec.numel))
            values, local_pos, global_pos = values[keep], None, torch.arange(dec.numel)[keep]
        else:
            keep, local_pos = _local_of_global(spec, target.hf_shape(), positions)
            values, global_pos = values[keep], positions[keep]
        flat = view.reshape(-1)  # a copy when the slice is not contiguous: only read here
        old_bits = to_bits(flat if local_pos is None else flat[local_pos.to(flat.device)]).to("cpu")
        dec.values = values
        try:
            new_bits = dec.new_bits(old_bits)
        except DeltaFormatError as e:
            raise _refuse(e) from None
        new_vals = from_bits(new_bits, dtype)
        if new_vals.numel() and not bool(torch.isfinite(new_vals).all()):
            bad = int(torch.nonzero(~torch.isfinite(new_vals))[0])
            where = bad if global_pos is None else int(global_pos[bad])
            raise WeightUpdateError(f"delta refused: tensor {name!r}: the new value at position {where} is "
                                    f"{float(new_vals[bad])} (NaN or inf)")
        if global_pos is None:  # 'all' without tensor parallelism
            global_pos = torch.arange(dec.numel)
        result = combine(base, hash_change(global_pos, old_bits, new_bits, width))
        out.append(_Planned(target, entry, name in name_map.aliases, local_pos, new_bits, base, result))
    _check_aliases(runner, out)
    return out


def _check_aliases(runner, planned: list[_Planned]) -> None:
    """A tied alias (lm_head.weight) is never written: its change must be that of what it is tied to."""
    by_name = {p.entry["name"]: p for p in planned}
    for p in planned:
        if not p.alias:
            continue
        tied = by_name.get(runner.name_map.aliases[p.entry["name"]])
        want = (tied.entry["base"], tied.entry["result"]) if tied else (p.entry["base"], p.entry["base"])
        if (p.entry["base"], p.entry["result"]) != want:
            raise WeightUpdateError(f"delta refused: {p.entry['name']!r} is tied to "
                                    f"{runner.name_map.aliases[p.entry['name']]!r} and must change with it "
                                    f"(send the same change for both, or only the tied-to tensor)")


def check_sums(entries: list[dict], base: list[int], result: list[int] | None) -> None:
    """The whole tensors' checksums (summed over ranks) against the delta's base and result."""
    for i, (entry, b) in enumerate(zip(entries, base)):
        if b != entry["base"]:
            raise WeightUpdateError(
                f"delta refused: tensor {entry['name']!r}: {STALE_BASE}: the engine's weights are not the base "
                f"this delta was computed against (checksum {b:#x}, the delta's base {entry['base']:#x}; a full "
                f"update in between, another trainer or a restart); nothing was changed: send a full sync")
        if result is not None and result[i] != entry["result"]:
            raise WeightUpdateError(f"delta refused: tensor {entry['name']!r}: its changes give checksum "
                                    f"{result[i]:#x}, the delta announces {entry['result']:#x} (a corrupted payload)")


def parse(blob) -> DeltaUpdate:
    try:
        return DeltaUpdate.from_blob(blob)
    except DeltaFormatError as e:
        raise _refuse(e) from None


def partial_hashes(runner, blob) -> dict:
    """This rank's partial checksums of its slices: {"span": [[start, size], ...], "base": [...], "result":
    [...] or None, "error": str}, one per applicable entry ("error" when the delta does not decode here,
    then no results). Ranks holding the same span (a replicated tensor or KV head) count it once."""
    update = parse(blob)
    entries = _entries(runner, update)
    base = [runner.weight_hashes.get(runner, t) for _, t in entries]
    spans = []
    for _, t in entries:
        spec = tp_slice(t.param, t.shard_id)
        spans.append([0, -1] if spec is None else [spec[1], spec[2]])
    try:
        result = [p.result_partial for p in plan_delta(runner, update, check_base=False)]
    except WeightUpdateError as e:
        return {"span": spans, "base": base, "result": None, "error": str(e)}
    return {"span": spans, "base": base, "result": result, "error": ""}


def apply_delta(runner, blob, write) -> int:
    """The load_format="delta" route: check everything, then write the changed elements all or nothing
    through `write` (routes.write, passed in: routes imports this module). Returns how many tensors changed."""
    update = parse(blob)
    tp = _is_tp_rank(runner)  # under tensor parallelism rank 0 checked the summed partials first
    planned = plan_delta(runner, update, check_base=not tp)
    if not tp:
        check_sums([p.entry for p in planned], [p.base_partial for p in planned],
                   [p.result_partial for p in planned])
    to_write = [p for p in planned if not p.alias and p.new_bits.numel()]

    def fill(writer: WeightWriter) -> None:
        with writer:
            for p in to_write:
                _write(writer, p)

    write(runner, fill)
    for p in planned:
        if not p.alias:
            runner.weight_hashes.set(p.target.hf_name, p.result_partial)
    return len(to_write)


def _write(writer: WeightWriter, p: _Planned) -> None:
    target = p.target
    view, spec = _slice(target)
    int_dtype = BIT_DTYPES[view.dtype][0]
    new = from_bits(p.new_bits, view.dtype).view(int_dtype).to(view.device)
    pos = None if p.local_pos is None else p.local_pos.to(view.device)
    if view.is_contiguous():
        writer.write_elements(target, view.view(-1).view(int_dtype), pos, new)
        return
    # A non-contiguous slice: build the whole new slice and write it the ordinary way.
    part = view.contiguous().clone()
    flat = part.view(-1).view(int_dtype)
    if pos is None:
        flat.copy_(new)
    else:
        flat[pos] = new
    whole = target.view().clone()
    (whole.narrow(spec[0], 0, spec[2]) if spec is not None else whole).copy_(part)
    writer.write(target, whole)
