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
    matched: int | str | None = None  # the stop token id or string; for "length", max_new_tokens (clipped to the room)
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


def extend_runs(runs: list[list], pos: int, value) -> None:
    """Add position `pos` with `value` to [start, end, value] runs (weight-version spans): it lengthens the
    last run when that one ends at `pos` with the same value, else starts a new one."""
    if runs and runs[-1][2] == value and runs[-1][1] == pos:
        runs[-1][1] = pos + 1
    else:
        runs.append([pos, pos + 1, value])


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
    logprob_start_len: int = -1  # first prompt position of input_token_logprobs (-1: the last, as SGLang)
    token_ids_logprob: list[int] | None = None  # ids whose logprobs every position reports
    # SGLang's RETURN_ORIGINAL_LOGPROB: logprobs of the processed logits (penalties, bias, bans) before temperature
    return_original_logprob: bool = False
    return_raw_logprob: bool = False  # logprobs of the raw logits, before every processor (vLLM's "raw_logprobs")
    # logprobs of the truncated, renormalised distribution sampled from (vLLM's "processed_logprobs")
    # instead of SGLang's log_softmax(logits / temperature) over the whole vocabulary
    return_processed_logprob: bool = False
    return_routed_experts: bool = False
    # [rows, num_layers, top_k] int32 on the host, set as it finishes when asked: the experts of every
    # position it computed or read from the prefix cache (rollout.kv_manager keeps them per KV slot)
    routed_experts: Any = None
    # LoRA: the adapter's name and load uid (runner/lora/manager.py); None = the base model. The uid keys the
    # prefix cache and the runner's batch, so an adapter replaced under the same name is another adapter.
    lora_name: str | None = None
    lora_id: int | None = None
    # The prefix-cache namespace of this admission (rollout.kv_manager): the adapter uid, or (uid, weight
    # version admitted under) with weight-version KV isolation.
    kv_namespace: Any = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    # Prompt logprobs by the position of the token scored (logprob_start_len < position < prompt length),
    # filled as prefill chunks run: (logprob, top [(logprob, id)] or None, token_ids logprobs or None).
    input_logprobs: dict[int, tuple] = field(default_factory=dict)
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
    weight_version: str = "default"  # the engine's version when the final output was delivered
    weight_version_start: str = "default"  # ... when the request was submitted
    # SGLang's meta_info["weight_versions"]: [start, end, version] runs over output_ids, the version of the
    # weights each token was sampled from (a new run each time it changes); kept across retractions.
    output_version_spans: list[list] = field(default_factory=list)
    # enable_prefill_weight_versions: the same runs over the prompt (the version each position's KV was
    # computed under, cache hits included), set as the request finishes; None when not asked for.
    prefill_version_spans: list[list] | None = None
    sink: Any = None  # where the engine delivers outputs
    text: str = ""
    detok_head: str | None = None  # the text of the prompt tokens decoded ahead of the output (rollout.tokenizer)
    stop_min_end: int | None = None  # with min_new_tokens: a stop match must end past this character
    stop_scan_from: int = 0  # decoded characters already searched for stop strings (rollout.stop_match)
    stop_at: int | None = None  # where in the decoded output the stop match begins
    # The decoded output ends with the start of a stop string (rollout.stop_match): a stream chunk now
    # would send text the final output may cut, so the engine holds it (SGLang's check_match_stop_str_prefix).
    stop_prefix_pending: bool = False
    stream_sent_len: int = 0  # output tokens the last stream chunk carried (stream_interval counts from it)
    error: str | None = None
    created_time: float = 0.0  # time.perf_counter() at submission
    finished_time: float = 0.0  # ... when the final output was delivered
    first_token_time: float = 0.0  # ... when the first output token was sampled (0: none yet)
    last_token_time: float = 0.0  # ... when the latest output token was sampled
    # Stream chunks' logprob entries, built once per output position (rollout.outputs.logprob_meta); shared
    # with this request's snapshots (a shallow copy), so each chunk builds only the positions new since the last.
    chunk_cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.logprob_start_len < 0:  # SGLang's default: only the last prompt token (its logprob None)
            self.logprob_start_len = len(self.prompt_ids) - 1

    def snapshot(self) -> Req:
        """A copy of the outputs so far, for a stream chunk (the scheduler goes on mutating self)."""
        snap = copy.copy(self)
        snap.output_ids = list(self.output_ids)
        snap.output_logprobs = list(self.output_logprobs)
        snap.output_top_logprobs = list(self.output_top_logprobs)
        snap.output_token_ids_logprobs = list(self.output_token_ids_logprobs)
        snap.input_logprobs = dict(self.input_logprobs)
        # The runs are [start, end, version] lists the scheduler lengthens in place: copy each one.
        snap.output_version_spans = [list(r) for r in self.output_version_spans]
        if self.prefill_version_spans is not None:
            snap.prefill_version_spans = [list(r) for r in self.prefill_version_spans]
        return snap

    @property
    def input_logprob_positions(self) -> range:
        """Prompt positions whose token gets an input logprob (the one at logprob_start_len is None, as
        SGLang pads it); empty without return_logprob."""
        if not self.return_logprob:
            return range(0)
        return range(self.logprob_start_len + 1, len(self.prompt_ids))

    @property
    def needs_input_logprobs(self) -> bool:
        """Some prompt position still has to be scored: its logits must be computed, not cached."""
        return len(self.input_logprobs) < len(self.input_logprob_positions)

    @property
    def max_cached_prefix(self) -> int | None:
        """How many prompt tokens admission may take from the prefix cache (None: no limit). A position
        is scored by the logits of the one before it, so positions from logprob_start_len on are computed."""
        return self.logprob_start_len if self.needs_input_logprobs else None

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None
