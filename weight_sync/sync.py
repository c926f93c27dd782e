"""sync_weights: one call that moves a trainer's weights into an engine, whatever the transport.

The target decides the transport:
- anything with `update_weights_from_tensor` (an in-process `rollout.Engine`, or a
  `cross_process.RemoteEngine` handle, which ships each bucket through shared memory) gets the
  weights bucket by bucket in the flattened-bucket format;
- a server's URL (a string) goes through `http.HttpEngine`, the same calls over HTTP;
- a transport object with `sync_from(...)` (`distributed.DistributedTarget`, `disk.DiskTarget`)
  runs its own protocol.

Each bucket is one atomic update on the engine side; a sync of several buckets is not atomic as a
whole, so call it while the engine is idle or paused (the trainers do). On the first failed bucket
it stops and returns (False, reason), the reason saying how many buckets were applied before it (the
engine then holds a mix until a sync completes; `rollout.ray.EngineGroup` commits all or none). Duplicate
names are refused before anything is sent, and so is a source with no tensors (an empty state dict, or a
name_map that drops every name): (False, reason), as the engine answers an empty update, never a
success that changed nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from weight_sync.bucket import iter_buckets, iter_named_tensors
from weight_sync.lora import is_peft_model, sync_lora_adapter

DEFAULT_BUCKET_BYTES = 512 << 20

Source = nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def sync_weights(source: Source, target, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 name_map: Callable[[str], str | None] | None = None,
                 weight_version: str | None = None, lora_name: str | None = None) -> tuple[bool, str]:
    """Push `source`'s tensors (HF names after `name_map`) into `target`. Returns (ok, message).

    A PEFT model sends only its adapter, loaded as the adapter version `lora_name` (default:
    `weight_version`) through load_lora_adapter_from_tensors (weight_sync/lora.py).

    `target` may also be a list of engines: each bucket goes to every engine before the next bucket is
    built. A list has no rollback: an engine that refuses a bucket is named and the call stops, with the
    engines before it already holding that bucket. For one version on all engines or none, pass a
    `rollout.ray.EngineGroup`, which snapshots and restores around every bucket.
    """
    if isinstance(target, str):  # a server's URL
        from weight_sync.http import HttpEngine

        target = HttpEngine(target)
    if is_peft_model(source):
        return sync_lora_adapter(source, target, lora_name or weight_version)
    source, empty = _peek_empty(source, name_map)
    if empty:
        return False, ("nothing to sync: the source holds no tensors" + (" after name_map" if name_map else "")
                       + "; nothing was sent")
    if isinstance(target, list | tuple):
        return _sync_many(source, list(target), bucket_bytes, name_map, weight_version)
    if hasattr(target, "sync_from"):
        return target.sync_from(source, bucket_bytes=bucket_bytes, name_map=name_map,
                                weight_version=weight_version)
    if not hasattr(target, "update_weights_from_tensor"):
        raise TypeError(f"cannot sync weights into {type(target).__name__}: it has neither "
                        f"update_weights_from_tensor nor sync_from")
    _check_names(source, name_map)
    num_buckets, num_tensors = 0, 0
    with torch.no_grad():
        for bucket, last in _with_last(iter_buckets(source, bucket_bytes=bucket_bytes, name_map=name_map)):
            ok, msg = target.update_weights_from_tensor(bucket.to_dict(), load_format="flattened_bucket",
                                                        flush_cache=True,
                                                        weight_version=part_version(weight_version, num_buckets, last))
            if not ok:
                return False, f"bucket {num_buckets} ({len(bucket)} tensors): {msg}" + _partial(num_buckets,
                                                                                               num_tensors)
            num_buckets += 1
            num_tensors += len(bucket)
    return True, f"synced {num_tensors} tensors in {num_buckets} bucket(s)"


def part_version(weight_version: str | None, k: int, last: bool) -> str | None:
    """The label part k of a many-part update gives the engine: `weight_version` on the last part only, before it
    `<weight_version>-partial-<k>`. An update refused midway (no rollback into one engine) then never leaves the
    engine, and every output after it, labelled with a version whose weights it does not hold."""
    return weight_version if weight_version is None or last else f"{weight_version}-partial-{k}"


def _with_last(items: Iterator) -> Iterator[tuple[Any, bool]]:
    """(item, whether it is the last) for a lazy iterator: one item read ahead (a bucket: one more alive at once)."""
    it = iter(items)
    current = next(it, _END)
    while current is not _END:
        following = next(it, _END)
        yield current, following is _END
        current = following


_END = object()


def _peek_empty(source: Source, name_map) -> tuple[Source, bool]:
    """(the source, whether it yields no tensor after name_map). A one-shot iterator is read up to its first kept
    tensor and handed back whole (the items read, then the rest)."""
    if isinstance(source, nn.Module | Mapping | list | tuple):
        return source, next(iter_named_tensors(source, name_map), None) is None
    it: Iterator = iter(source)
    head = []
    for item in it:
        head.append(item)
        if name_map is None or name_map(item[0]) is not None:
            return itertools.chain(head, it), False
    return iter(head), True


def _check_names(source: Source, name_map) -> None:
    """Duplicate names (after name_map) refused before any bucket is sent, where the source can be read twice
    (a module or a mapping; an iterator is checked as its buckets are built)."""
    if isinstance(source, nn.Module | Mapping):
        seen: set[str] = set()
        for name, _ in iter_named_tensors(source, name_map):
            if name in seen:
                raise ValueError(f"duplicate tensor name {name!r} (after name_map); nothing was sent")
            seen.add(name)


def _partial(num_buckets: int, num_tensors: int) -> str:
    if not num_buckets:
        return "; nothing was applied"
    return (f"; buckets 0..{num_buckets - 1} ({num_tensors} tensors) were applied before it, so the engine holds "
            f"a mix of the old and the new weights until a sync completes (sync again; a rollout.ray.EngineGroup "
            f"commits all buckets or none)")


def _sync_many(source: Source, targets: list, bucket_bytes: int, name_map, weight_version) -> tuple[bool, str]:
    if not targets:
        raise ValueError("sync_weights: empty list of targets")
    bad = [type(t).__name__ for t in targets if not hasattr(t, "update_weights_from_tensor")]
    if bad:
        raise TypeError(f"cannot sync weights into {bad[0]}: every target in a list needs update_weights_from_tensor")
    _check_names(source, name_map)
    num_buckets, num_tensors = 0, 0
    with torch.no_grad():
        for bucket, last in _with_last(iter_buckets(source, bucket_bytes=bucket_bytes, name_map=name_map)):
            payload = bucket.to_dict()
            version = part_version(weight_version, num_buckets, last)
            for i, target in enumerate(targets):
                ok, msg = target.update_weights_from_tensor(payload, load_format="flattened_bucket",
                                                            flush_cache=True, weight_version=version)
                if not ok:
                    return False, (f"engine {i} refused bucket {num_buckets} ({len(bucket)} tensors): {msg}; "
                                   f"engines 0..{i - 1} already hold it")
            num_buckets += 1
            num_tensors += len(bucket)
    return True, f"synced {num_tensors} tensors in {num_buckets} bucket(s) into {len(targets)} engines"
