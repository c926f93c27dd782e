"""The registry of weight-update broadcast groups a runner has joined (SGLang's init_weights_update_group).

A trainer is rank 0 of a broadcast group; the runner joins it by name, receives buckets on it and leaves
it. The registry reserves a name before the (slow) join so a concurrent join under the same name is
refused, serialises receives per group (collectives must pair up in order) and lets a destroy wait for
a receive in progress. It does not write weights: a receive hands the tensors to a `load` callable
(ModelRunner.update_weights_from_tensor by default). Process groups themselves are weight_sync's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from runner.weights.loader import WeightUpdateError

logger = logging.getLogger(__name__)


class _UpdateGroup:
    """A joined broadcast group and the lock that serialises receives on it."""

    def __init__(self, group) -> None:
        self.group = group
        self.lock = threading.Lock()
        self.destroyed = False


class UpdateGroupRegistry:
    def __init__(self) -> None:
        self._groups: dict[str, _UpdateGroup | None] = {}  # weight update groups by name (None: joining)
        self._lock = threading.Lock()

    def join(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str, timeout_s: float) -> None:
        """Join a trainer's broadcast group as rank `rank_offset` (the trainer is rank 0)."""
        from weight_sync.distributed import create_weight_update_group

        with self._lock:
            if group_name in self._groups:
                raise WeightUpdateError(f"weight update group {group_name!r} already exists; destroy it first")
            self._groups[group_name] = None  # reserved: a concurrent join under the same name is refused
        try:
            group = create_weight_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                               backend, timeout_s)
        except BaseException:
            with self._lock:
                del self._groups[group_name]
            raise
        with self._lock:
            self._groups[group_name] = _UpdateGroup(group)

    def get(self, group_name: str) -> _UpdateGroup:
        with self._lock:
            entry = self._groups.get(group_name)
        if entry is None:
            raise WeightUpdateError(f"no weight update group {group_name!r}; call init_weights_update_group first"
                                    f" (groups: {sorted(self._groups)})")
        return entry

    def receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                device: torch.device, load_format: str | None, load: Callable[[list], int]) -> int:
        """Receive one bucket broadcast by rank 0 of `group_name`, then `load(named_tensors)` it, both
        under the group's lock. A failed or timed-out receive loads nothing."""
        from weight_sync.distributed import receive_named_tensors

        entry = self.get(group_name)
        with entry.lock:
            if entry.destroyed:
                raise WeightUpdateError(f"weight update group {group_name!r} was destroyed")
            named = receive_named_tensors(entry.group, names, dtypes, shapes, device, load_format=load_format)
            return load(named)

    def destroy(self, group_name: str) -> None:
        """Leave `group_name` and free the name; waits for a receive in progress on it to end."""
        from weight_sync import distributed

        with self._lock:
            entry = self._groups.get(group_name)
            if entry is None:
                raise WeightUpdateError(f"no weight update group {group_name!r} (groups: {sorted(self._groups)})")
            del self._groups[group_name]
        with entry.lock:
            entry.destroyed = True
            destroy = getattr(distributed, "destroy_weight_update_group", None)
            if destroy is not None:
                destroy(entry.group)
            else:  # older weight_sync: dropping the last reference closes the group
                entry.group = None

    def destroy_all(self) -> None:
        """Leave every joined group (at shutdown); a group that fails to close is logged, not raised."""
        with self._lock:
            names = [n for n, e in self._groups.items() if e is not None]
        for name in names:
            try:
                self.destroy(name)
            except Exception:  # a group already broken must not stop the shutdown
                logger.warning("destroying weight update group %r at shutdown failed", name, exc_info=True)
