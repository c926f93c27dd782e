"""Req: one sequence being generated, and the only object the scheduler and engine share about it.

It records the tokens, the sampled logprobs, the finish reason and where its KV lives (its row in
ReqToTokenPool, how many tokens of `fill_ids` are computed, the radix node it holds a lock on). Only
rollout.kv_manager.KVManager writes the KV fields; the scheduler reads them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from rollout.sampling_params import SamplingParams


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or string; for "length", the limit reached
    message: str | None = None

    def to_dict(self) -> dict:
        """SGLang's JSON: {"type": "length", "length": N}, {"type": "stop", "matched": token id or string},
        {"type": "abort", "message": why}."""
        if self.type == "length":
            return {"type": "length", "length": self.matched}
        if self.type == "abort":
            return {"type": "abort", "message": self.message}
        d = {"type": self.type, "matched": self.matched}
        if self.message:
            d["message"] = self.message
        return d


@dataclass(eq=False)  # identity semantics: `req in queue` must not compare every field
class Req:
    rid: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    index: int = 0  # position in the caller's batch (after n-expansion)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    # KV bookkeeping
    req_pool_idx: int | None = None
    num_computed: int = 0  # tokens of fill_ids whose KV is in the cache
    num_allocated: int = 0  # positions of its row holding KV slots (>= num_computed while a step runs)
    num_cached: int = 0  # tokens reused from the prefix cache at (last) admission
    cached_tokens: int = 0  # reported: prompt tokens served from the cache at first admission
    is_cache_counted: bool = False  # cached_tokens is set (an admission undone before running is not counted)
    last_node: Any = None
    admitted_order: int = -1
    num_retractions: int = 0
    weight_version: str = "default"
    sink: Any = None  # where the engine delivers outputs
    text: str = ""
    error: str | None = None
    created_time: float = 0.0  # time.perf_counter() at submission
    finished_time: float = 0.0  # ... when the final output was delivered

    def snapshot(self) -> Req:
        """A copy of the outputs so far, for a stream chunk (the scheduler goes on mutating self)."""
        snap = copy.copy(self)
        snap.output_ids = list(self.output_ids)
        snap.output_logprobs = list(self.output_logprobs)
        snap.output_top_logprobs = list(self.output_top_logprobs)
        return snap

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None
