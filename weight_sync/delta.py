"""DeltaSync: after the first full sync, send an engine only the elements whose bits changed.

    ds = DeltaSync(target)            # Engine, RemoteEngine, EngineGroup, a list, a server URL,
                                      # DistributedTarget, DiskTarget (anything sync_weights takes)
    ok, msg = ds.sync(model)          # the first call (and every `full_sync_every`-th) sends everything
    ds.last                           # {"mode", "bytes_sent", "bytes_full", "elements_changed",
                                      #  "elements_total", "encode_ms", "apply_ms", ...}

The sender keeps the last synced weights, cast to the engine's dtype, on the host as its baseline.
Each sync casts the model the same way, compares bit patterns per tensor and encodes the changed
elements (weight_sync/delta_codec.py picks the cheapest code per tensor). Every delta names the
checksum of its base per tensor; an engine that holds anything else refuses it and changes nothing
(the message contains "stale base"); `sync(model, fallback=True)` then sends a full sync and says so.
Any other failure drops the baseline, so the next sync is full (after a half-applied list of engines
the sender no longer knows what each one holds); so does an exception from a target (a dead RemoteEngine),
which propagates.

Transports, per target: `update_weights_from_tensor(delta, load_format="delta")` (an in-process Engine,
a RemoteEngine through shared memory, `HttpEngine` over `/update_weights_from_tensor`), or the target's
own `sync_delta(updates, weight_version)` (an EngineGroup: all engines or none; DistributedTarget:
the blob broadcast as a checked bucket; DiskTarget: a delta file next to the full checkpoint). A
delta bigger than `bucket_bytes` is split by tensors; each part is one atomic update.

`apply_ms` is the wall time of the target calls (transport, checks and write on the engine side);
`encode_ms` the cast, compare and encode (and, after a full sync, the baseline's checksums, computed
once). Not here: the code itself (delta_codec.py) or the engine side (runner/weights/delta.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from weight_sync.bucket import iter_named_tensors, str_to_dtype
from weight_sync.delta_codec import (
    BIT_DTYPES,
    STALE_BASE,
    DeltaUpdate,
    EncodedTensor,
    encode_tensor,
    tensor_hash,
)
from weight_sync.lora import is_peft_model
from weight_sync.sync import DEFAULT_BUCKET_BYTES, part_version, sync_weights


class DeltaSync:
    """Full sync first, then exact sparse deltas against the last synced cast (module docstring)."""

    def __init__(self, target, dtype: torch.dtype | str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 name_map: Callable[[str], str | None] | None = None, full_sync_every: int = 0) -> None:
        if full_sync_every < 0:
            raise ValueError(f"full_sync_every must be >= 0 (0: never forced), got {full_sync_every}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if isinstance(target, str):
            from weight_sync.http import HttpEngine

            target = HttpEngine(target)
        self.target = target
        self.dtype = _as_dtype(dtype) if dtype is not None else None
        self.bucket_bytes, self.name_map, self.full_sync_every = bucket_bytes, name_map, full_sync_every
        self._base: dict[str, torch.Tensor] | None = None
        self._hash: dict[str, int] = {}
        self._deltas_since_full = 0
        self.last: dict = {}

    def reset(self) -> None:
        """Forget the baseline: the next sync is a full one."""
        self._base, self._hash = None, {}

    # ---- the one call ------------------------------------------------------------------------
    def sync(self, model, fallback: bool = False, weight_version: str | None = None,
             full: bool = False) -> tuple[bool, str]:
        """Send `model`'s weights (a module, a state dict or (name, tensor) pairs): a delta when a baseline
        exists and matches, else (or with `full=True`) everything. Returns (ok, message)."""
        if is_peft_model(model):
            raise TypeError("DeltaSync sends a model's full weights; a PEFT model's adapter goes by "
                            "sync_weights(model, target, lora_name=...) (or merge it first: merge_and_unload())")
        t0 = time.perf_counter()
        dtype = self.dtype or self._probe_dtype()
        with torch.no_grad():
            cast, ties = {}, {}
            for name, t in iter_named_tensors(model, self.name_map):
                if name in cast:
                    raise ValueError(f"DeltaSync: tensor {name!r} appears twice in the source")
                # tensors that are one in the source (a tied embedding and LM head): sent in one part
                ties[name] = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                cast[name] = t.detach().to(device="cpu", dtype=dtype, copy=True)
        why = self._full_reason(cast, full)
        if why:
            return self._full(cast, t0, weight_version, why)
        encoded = []
        for name, new in cast.items():
            base = self._base[name]
            h = self._hash.get(name)
            if h is None:
                h = self._hash[name] = tensor_hash(base)
            encoded.append(encode_tensor(name, base, new, h))
        updates = _split(encoded, self.bucket_bytes, ties)
        encode_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        try:
            ok, msg, applied = send_deltas(self.target, updates, weight_version)
        except BaseException:  # a dead engine (RemoteEngine raises): what each engine holds is unknown now
            self.reset()
            raise
        apply_ms = (time.perf_counter() - t1) * 1e3
        for update in updates[:applied]:
            for e in update.entries:
                self._base[e["name"]] = cast[e["name"]]
                self._hash[e["name"]] = e["result"]
        stats = {"mode": "delta", "bytes_sent": sum(u.wire_nbytes() for u in updates[:max(applied, 1)]),
                 "bytes_full": _nbytes(cast), "elements_changed": sum(e.changed for e in encoded),
                 "elements_total": sum(t.numel() for t in cast.values()), "encode_ms": encode_ms,
                 "apply_ms": apply_ms, "num_updates": len(updates),
                 "tensors_changed": sum(1 for e in encoded if e.changed)}
        if ok:
            self._deltas_since_full += 1
            self.last = stats
            return True, f"delta sync: {msg}"
        self.reset()
        if fallback and STALE_BASE in msg:
            ok2, msg2 = self._full(cast, t0, weight_version, f"the engine refused the delta ({msg})")
            self.last["fallback"] = True
            return ok2, f"fell back to a full sync: {msg2}"
        self.last = stats
        return False, f"delta sync failed: {msg}; the next sync will be a full one"

    # ---- helpers -----------------------------------------------------------------------------
    def _full_reason(self, cast: dict, full: bool) -> str:
        if full:
            return "asked for"
        if self._base is None:
            return "no baseline yet"
        if self.full_sync_every and self._deltas_since_full >= self.full_sync_every - 1:
            return f"every {self.full_sync_every} syncs"
        if cast.keys() != self._base.keys():
            return "the set of tensors changed"
        for name, t in cast.items():
            b = self._base[name]
            if b.shape != t.shape or b.dtype != t.dtype:
                return f"tensor {name!r} changed shape or dtype"
        return ""

    def _full(self, cast: dict, t0: float, weight_version: str | None, why: str) -> tuple[bool, str]:
        encode_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        try:
            ok, msg = sync_weights(list(cast.items()), self.target, bucket_bytes=self.bucket_bytes,
                                   weight_version=weight_version)
        except BaseException:
            self.reset()
            raise
        apply_ms = (time.perf_counter() - t1) * 1e3
        total = _nbytes(cast)
        self.last = {"mode": "full", "bytes_sent": total, "bytes_full": total,
                     "elements_changed": sum(t.numel() for t in cast.values()),
                     "elements_total": sum(t.numel() for t in cast.values()), "encode_ms": encode_ms,
                     "apply_ms": apply_ms, "reason": why}
        if ok:
            self._base, self._hash, self._deltas_since_full = cast, {}, 0
        else:
            self.reset()
        return ok, f"full sync ({why}): {msg}"

    def _probe_dtype(self) -> torch.dtype:
        """The engine's weight dtype: from an in-process runner, else get_server_info()['weights_dtype']."""
        t = self.target
        candidates = [t[0] if isinstance(t, list | tuple) and t else t, getattr(t, "engine", None)]
        failed = ""
        for c in candidates:
            runner = getattr(c, "runner", None)
            if isinstance(getattr(runner, "dtype", None), torch.dtype):
                self.dtype = runner.dtype
                return self.dtype
            if c is not None and hasattr(c, "get_server_info"):
                try:
                    info = c.get_server_info()
                except Exception as e:  # an old engine or a dead one: the caller can still pass dtype=
                    failed = f" (its get_server_info() raised {type(e).__name__}: {e})"
                    continue
                info = info[0] if isinstance(info, list) and info else info
                if isinstance(info, dict) and info.get("weights_dtype"):
                    self.dtype = _as_dtype(info["weights_dtype"])
                    return self.dtype
        raise ValueError(f"DeltaSync: cannot tell the weight dtype of {type(t).__name__}{failed}; pass dtype= "
                         f"(the engine's, e.g. torch.bfloat16)")


def _as_dtype(d) -> torch.dtype:
    dtype = d if isinstance(d, torch.dtype) else str_to_dtype(str(d).replace("torch.", ""))
    if dtype not in BIT_DTYPES:
        raise ValueError(f"DeltaSync: dtype {dtype} has no delta encoding; use float32, bfloat16 or float16")
    return dtype


def _nbytes(cast: dict) -> int:
    return sum(t.numel() * t.element_size() for t in cast.values())


def _split(encoded: list[EncodedTensor], bucket_bytes: int, ties: dict | None = None) -> list[DeltaUpdate]:
    """Pack encoded tensors into updates of at most ~bucket_bytes of payload each (at least one). Tensors that
    may be one tensor in the engine (a tied embedding and LM head) go in one update, or a part changing one
    would leave the other's base stale: those with the same `ties` key (one storage in the source) and
    embedding / LM-head tensors whose new values are equal (same shape, dtype and checksum: a tied pair
    gathered into two copies, as a full state dict from FSDP2 is)."""
    units: dict = {}  # unit key -> its tensors, in first-seen order
    by_value: dict = {}  # (dtype, shape, checksum) of an embedding / LM-head tensor -> the unit key it joined
    for e in encoded:
        name = e.entry["name"]
        key = (ties or {}).get(name, name)
        # By value only for the names a tie joins (an embedding, the LM head): equal norms or untouched twin
        # layers grouped by value would make one part past bucket_bytes for nothing.
        if "embed" in name or "lm_head" in name:
            key = by_value.setdefault((e.entry["dtype"], tuple(e.entry["shape"]), e.entry["result"]), key)
        units.setdefault(key, []).append(e)
    groups, cur, size = [], [], 0
    for unit in units.values():
        n = sum(e.pos_bytes.numel() + e.val_bytes.numel() for e in unit)
        if cur and size + n > bucket_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.extend(unit)
        size += n
    groups.append(cur)
    return [DeltaUpdate.pack(g) for g in groups]


def send_deltas(target, updates: list[DeltaUpdate], weight_version: str | None = None) -> tuple[bool, str, int]:
    """Deliver `updates` in order. -> (ok, message, how many updates every engine applied)."""
    if isinstance(target, list | tuple):
        if not target:
            raise ValueError("DeltaSync: empty list of targets")
        for k, update in enumerate(updates):
            version = part_version(weight_version, k, k == len(updates) - 1)
            for i, engine in enumerate(target):
                ok, msg = engine.update_weights_from_tensor(update, load_format="delta", flush_cache=True,
                                                            weight_version=version)[:2]
                if not ok:
                    done = [f"parts 0-{k - 1} were applied"] if k else []
                    done += [f"part {k} was applied by engines 0-{i - 1}"] if i else []
                    done = f"; {' and '.join(done)}: the engines hold part of this step" if done else ""
                    return False, f"engine {i} refused delta part {k} of {len(updates)}: {msg}{done}", k
        return True, f"{len(updates)} delta part(s) into {len(target)} engines", len(updates)
    if hasattr(target, "sync_delta"):
        return target.sync_delta(updates, weight_version=weight_version)
    if not hasattr(target, "update_weights_from_tensor"):
        raise TypeError(f"cannot send a delta to {type(target).__name__}: it has neither update_weights_from_tensor "
                        f"nor sync_delta")
    for k, update in enumerate(updates):
        ok, msg = target.update_weights_from_tensor(update, load_format="delta", flush_cache=True,
                                                    weight_version=part_version(weight_version, k,
                                                                                k == len(updates) - 1))[:2]
        if not ok:
            if len(updates) == 1:
                return False, msg, k
            done = f"; parts 0-{k - 1} were applied, so the engine holds part of this step" if k else ""
            return False, f"delta part {k} of {len(updates)}: {msg}{done}", k
    return True, f"{len(updates)} delta part(s): {msg}", len(updates)
