"""rollout/outputs.py's logprob entries of stream chunks: built once per output position, and the prompt's once
while its records stand (a request's chunk cache), yet every chunk equals the entries built from scratch, after growth, after a step taken back, and
whatever a caller does to an earlier chunk.

Oracle: `logprob_meta` with no cache (the final path's whole build, text aside) and hand-written entries.
"""

from __future__ import annotations

import copy
import random

from rollout.outputs import logprob_meta
from rollout.request import Req
from rollout.sampling_params import SamplingParams

IDS_ASKED = [3, 9]


def _req() -> Req:
    req = Req(rid="r", prompt_ids=[5, 6, 7], sampling_params=SamplingParams(max_new_tokens=50), seed=0,
              return_logprob=True, top_logprobs_num=2, token_ids_logprob=IDS_ASKED, logprob_start_len=0)
    _score_prompt(req, random.Random(9))
    return req


def _score_prompt(req: Req, rng: random.Random) -> None:
    """The prompt's records as prefill leaves them (position 0 is not scored): fresh objects, as after a
    retraction recomputes the prompt."""
    req.input_logprobs = {p: (-rng.random(), [(-rng.random(), rng.randrange(100)) for _ in range(2)],
                              [-rng.random() for _ in IDS_ASKED]) for p in range(1, len(req.prompt_ids))}


def _step(req: Req, rng: random.Random) -> None:
    """One sampled token's records, as the scheduler appends them (fresh float and list objects)."""
    req.output_ids.append(rng.randrange(100))
    req.output_logprobs.append(-rng.random())
    req.output_top_logprobs.append([(-rng.random(), rng.randrange(100)) for _ in range(2)])
    req.output_token_ids_logprobs.append([-rng.random() for _ in IDS_ASKED])


def _fresh(req: Req) -> dict:
    """The oracle: the same chunk from an empty cache (every position built anew)."""
    other = copy.copy(req)
    other.chunk_cache = {}
    return logprob_meta(other, None, final=False)


def _by_hand(req: Req) -> dict:
    scored = [req.input_logprobs.get(p) for p in range(len(req.prompt_ids))]
    return {"input_token_logprobs": [(e[0] if e else None, t, None) for e, t in zip(scored, req.prompt_ids)],
            "input_top_logprobs": [[(lp, t, None) for lp, t in e[1]] if e else None for e in scored],
            "input_token_ids_logprobs": [[(lp, t, None) for lp, t in zip(e[2], IDS_ASKED)] if e else None
                                         for e in scored],
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(req.output_logprobs, req.output_ids)],
            "output_top_logprobs": [[(lp, t, None) for lp, t in step] for step in req.output_top_logprobs],
            "output_token_ids_logprobs": [[(lp, t, None) for lp, t in zip(step, IDS_ASKED)]
                                          for step in req.output_token_ids_logprobs]}


def _outputs(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k.startswith(("output_", "input_"))}


def test_chunks_equal_a_fresh_build_through_growth_and_take_backs():
    """Cached chunks equal fresh and hand-built entries as the outputs grow, and after a cut that drops the
    last positions (a step taken back) and appends others in their place: no stale entry survives a cut."""
    rng, req = random.Random(0), _req()
    for step in range(40):
        _step(req, rng)
        if step % 7 == 6:  # take back the last two steps, then sample others in their place
            for lst in (req.output_ids, req.output_logprobs, req.output_top_logprobs, req.output_token_ids_logprobs):
                del lst[-2:]
            _step(req, rng)
        if step == 20:  # a retraction recomputed the prompt: its entries are new objects
            _score_prompt(req, rng)
        got = _outputs(logprob_meta(req, None, final=False))
        assert got == _outputs(_fresh(req)) == _by_hand(req), step


def test_positions_are_built_once_and_chunks_are_independent():
    """A later chunk reuses the earlier chunks' entries (the same tuples: built once per position), and a
    caller who changes a chunk's lists changes no other chunk."""
    rng, req = random.Random(1), _req()
    _step(req, rng)
    _step(req, rng)
    first = logprob_meta(req, None, final=False)
    first["output_top_logprobs"][0].append("junk")
    first["output_token_logprobs"].append("junk")
    _step(req, rng)
    second = logprob_meta(req, None, final=False)
    assert second["output_token_logprobs"][0] is first["output_token_logprobs"][0]
    assert second["output_top_logprobs"][0][0] is first["output_top_logprobs"][0][0]
    assert second["input_top_logprobs"][1][0] is first["input_top_logprobs"][1][0]
    first["input_top_logprobs"][1].append("junk")
    assert _outputs(second) == _by_hand(req)
    assert _outputs(logprob_meta(req, None, final=False)) == _by_hand(req)


def test_a_snapshot_shares_its_requests_cache():
    """Chunks are built from snapshots (Req.snapshot, a shallow copy): they share the live request's cache."""
    rng, req = random.Random(2), _req()
    _step(req, rng)
    a = logprob_meta(req.snapshot(), None, final=False)
    _step(req, rng)
    b = logprob_meta(req.snapshot(), None, final=False)
    assert b["output_token_logprobs"][0] is a["output_token_logprobs"][0]
    assert _outputs(b) == _by_hand(req)
