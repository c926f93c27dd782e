"""The paged KV cache: ReqToTokenPool (request slot -> KV slot per position) and TokenToKVPool
(KV slot -> K and V for every layer), each with a free-slot allocator.

Pages hold one token (page size 1), as SGLang's default: prefix sharing and retraction then work at
token granularity. Slot 0 of the KV pool is reserved as a padding target and never handed out.
The K and V buffers are one allocation each so the memory saver can release them in one go.
Allocation failure is a clear error; deciding what to do about it (retract, queue) is the scheduler's.
"""

from __future__ import annotations

import torch


class KVPoolExhaustedError(RuntimeError):
    pass


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        # [size, max_context_len]: KV slot of each position of the request living in that row.
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64, device=device)
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int:
        if not self.free_slots:
            raise KVPoolExhaustedError(f"all {self.size} request slots are in use (max_running_requests)")
        return self.free_slots.pop()

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)

    def clear(self) -> None:
        """Every row free again (the caller has dropped every request)."""
        self.free_slots = list(range(self.size))

    def write(self, slot: int, start: int, locs: torch.Tensor) -> None:
        self.req_to_token[slot, start : start + locs.numel()] = locs


class TokenToKVPool:
    def __init__(
        self, size: int, dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int,
        device: torch.device | str,
    ) -> None:
        self.size = size
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = num_layers
        # [num_layers, size + 1, num_kv_heads, head_dim]; slot 0 is the padding slot.
        shape = (num_layers, size + 1, num_kv_heads, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)
        # Freed slots wait here and are merged only when an alloc needs them: a free is then O(freed),
        # not a copy of the whole (possibly million-entry) free list.
        self._freed: list[torch.Tensor] = []
        self._num_freed = 0

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.k_buffer[:, 0].numel() * self.k_buffer.element_size()

    def available_size(self) -> int:
        return int(self.free_slots.numel()) + self._num_freed

    def alloc(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > self.free_slots.numel() and self._freed:
            self.free_slots = torch.cat([self.free_slots, *self._freed])
            self._freed, self._num_freed = [], 0
        if num_tokens > self.free_slots.numel():
            raise KVPoolExhaustedError(
                f"KV cache exhausted: need {num_tokens} token slots, {self.free_slots.numel()} free "
                f"of {self.size} (raise max_total_tokens or mem_fraction_static)"
            )
        out, self.free_slots = self.free_slots[:num_tokens], self.free_slots[num_tokens:]
        return out

    def free(self, locs: torch.Tensor, owned: bool = False) -> None:
        """Return slots to the pool. `owned`: the caller hands `locs` over and never writes it again (the radix
        tree's evicted entries), so a CPU int64 tensor is kept as it is; otherwise it is copied, since callers
        pass views of req_to_token rows, which get reused."""
        if locs.numel():
            if not (owned and locs.device.type == "cpu" and locs.dtype == torch.int64):
                locs = locs.to("cpu", torch.int64, copy=True)
            self._freed.append(locs)
            self._num_freed += locs.numel()

    def set_kv(self, layer_id: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id].index_copy_(0, locs, k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, locs, v.to(self.dtype))

    def buffers(self) -> list[torch.Tensor]:
        return [self.k_buffer, self.v_buffer]
