"""The wire form of a request's progress between the engine process and the HTTP server: both ends.

The engine process sends, per engine step, one delta per request that step delivered (`encode`, on the
scheduler thread under the step lock, reading the live Req); the server keeps its own copy of each
request (a Req made from the one the engine built at submission) and applies them (`apply`), so its
outputs come from the same rollout.outputs.build_output as an in-process Engine's.

A delta is a tuple (kept small: one step of 64 streams is one message):
(call_id, index, final, tails, input_logprobs, fields, times)
- tails: per output list (ids, logprobs, top logprobs, token-id logprobs) None (unchanged) or (offset,
  items): the copy is cut to `offset` and extended, so a list that shrank (a step taken back) stays exact;
- input_logprobs: the whole dict when it changed (it fills during prefill), else None;
- fields: (cached_tokens, num_retractions, the engine's weight version, the request's, finished_reason,
  stop_at, error, the output tokens' weight-version spans, the version at its submission);
- times (final only): (created, first token, last token, finished, routed experts as a numpy array or
  None, prefill weight-version spans or None); perf_counter values of the engine process, compared only
  with each other.

What it does not do: send anything, or decide when (engine_process.py batches; engine_client.py reads).
"""

from __future__ import annotations

import time

from rollout.request import FinishReason, Req

NOTHING_SENT = (0, 0, 0, 0, -1)  # lengths of the four output lists and of input_logprobs


def _lists(req: Req) -> tuple[list, list, list, list]:
    return req.output_ids, req.output_logprobs, req.output_top_logprobs, req.output_token_ids_logprobs


def encode(call_id: int, req: Req, final: bool, sent: tuple, engine_version: str) -> tuple[tuple, tuple]:
    """-> (the delta since `sent`, what is sent after it)."""
    if req.return_logprob:
        lists = _lists(req)
        tails = tuple((min(o, len(seq)), seq[min(o, len(seq)):]) if seq or o else None
                      for o, seq in zip(sent[:4], lists))
        num_inputs = len(req.input_logprobs)
        inputs = dict(req.input_logprobs) if num_inputs and num_inputs != sent[4] else None
        now_sent = (*(len(seq) for seq in lists), num_inputs)
    else:  # the common case, per token of every stream: only the ids move
        ids = req.output_ids
        offset = min(sent[0], len(ids))
        tails, inputs, now_sent = ((offset, ids[offset:]), None, None, None), None, (len(ids), 0, 0, 0, -1)
    fields = (req.cached_tokens, req.num_retractions, engine_version, req.weight_version, req.finished_reason,
              req.stop_at, req.error, _spans(req), req.weight_version_start)
    times = None
    if final:
        routed = req.routed_experts
        times = (req.created_time, req.first_token_time, req.last_token_time, req.finished_time,
                 None if routed is None else routed.numpy(), req.prefill_version_spans)
    return (call_id, req.index, final, tails, inputs, fields, times), now_sent


def _spans(req: Req) -> tuple:
    return tuple(tuple(s) for s in req.output_version_spans)  # a run per version change: a few entries


def abort_delta(call_id: int, req: Req, message: str, engine_version: str) -> tuple:
    """A final delta that ends the request as abort with `message` (its outputs as the server has them)."""
    fields = (req.cached_tokens, req.num_retractions, engine_version, engine_version,
              FinishReason("abort", message=message), None, message, _spans(req), req.weight_version_start)
    times = (req.created_time, req.first_token_time, req.last_token_time, time.perf_counter(), None, None)
    return call_id, req.index, True, (None, None, None, None), None, fields, times


def apply(req: Req, delta: tuple) -> None:
    """Bring the server's copy `req` up to the engine's as of `delta`."""
    _, _, final, tails, inputs, fields, times = delta
    for seq, tail in zip(_lists(req), tails):
        if tail is not None:
            del seq[tail[0]:]
            seq.extend(tail[1])
    if inputs is not None:
        req.input_logprobs = inputs
    (req.cached_tokens, req.num_retractions, engine_version, final_version, req.finished_reason, req.stop_at,
     req.error, spans, req.weight_version_start) = fields
    req.output_version_spans = [list(s) for s in spans]
    # A chunk reports the version served now, a final output the one it finished under (as in-process).
    req.weight_version = final_version if final else engine_version
    if final:
        req.created_time, req.first_token_time, req.last_token_time, req.finished_time, routed, prefill = times
        req.prefill_version_spans = prefill
        if routed is not None:
            import torch

            req.routed_experts = torch.from_numpy(routed)
