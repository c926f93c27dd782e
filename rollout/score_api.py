"""SGLang's scoring API: `Engine.score(query, items, label_token_ids, apply_softmax, item_first)`, mixed into
Engine, and the same work for the HTTP server's `/v1/score` (rollout/server/openai_api.py).

For each item the prompt is query + item (item + query with item_first; text is joined before it is
tokenized, token ids are concatenated), and its score is the next-token distribution at the prompt's end,
read at `label_token_ids`: with apply_softmax, a softmax over those ids' logits (each list sums to 1);
without, their probabilities under the full vocabulary. One prefill per item, all items in one batch
(sharing the query's KV through the prefix cache); the generated token itself is dropped. The
probabilities are the raw model's (temperature 1, no sampling filters), as SGLang's are.

It does not rank, pool or embed (no encode/rerank here), and it does not pack several items into one
sequence (SGLang's multi-item delimiter mode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SCORE_SAMPLING = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def check_apply_softmax(apply_softmax) -> None:
    if not isinstance(apply_softmax, bool):
        raise ValueError(f"apply_softmax must be a bool, got {apply_softmax!r}")


def _one_item(items) -> bool:
    """items is a single item (a string or one token-id list), not a list of them."""
    return isinstance(items, str) or (_is_ids(items) and bool(items))


def num_items(items) -> int:
    """How many items a score request holds (0 for what score_prompts refuses as no items)."""
    return 1 if _one_item(items) else len(items) if isinstance(items, list) else 0


def score_prompts(encode, query, items, label_token_ids, item_first: bool = False,
                  vocab_size: int | None = None) -> list[list[int]]:
    """The token ids of each item's prompt, after checking every argument (ValueError naming it).
    `encode(text) -> ids` tokenizes text."""
    if not _is_ids(label_token_ids) or not label_token_ids:
        raise ValueError(f"label_token_ids must be a non-empty list of token ids, got {label_token_ids!r}")
    if vocab_size is not None:
        bad = [t for t in label_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"label_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if not isinstance(item_first, bool):
        raise ValueError(f"item_first must be a bool, got {item_first!r}")
    if _one_item(items):
        items = [items]
    if isinstance(items, list) and not items:
        return []  # no items, no scores (SGLang's answer too)
    if not isinstance(items, list):
        raise ValueError("items must be a list of strings or of token-id lists")
    if query is None:
        query = "" if isinstance(items[0], str) else []
    if isinstance(query, str):
        if not all(isinstance(i, str) for i in items):
            raise ValueError("query is text, so items must be strings (pass token ids for both, or text for both)")
        return [encode(i + query if item_first else query + i) for i in items]
    if _is_ids(query):
        if not all(_is_ids(i) for i in items):
            raise ValueError("query is token ids, so items must be token-id lists (pass text for both, or ids "
                             "for both)")
        prompts = [list(i) + query if item_first else query + list(i) for i in items]
        if any(not p for p in prompts):
            raise ValueError("a query + item prompt is empty: there is no position to score")
        if vocab_size is not None:
            bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab_size})
            if bad:
                raise ValueError(f"query/items hold token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        return prompts
    raise ValueError(f"query must be a string or a list of token ids, got {type(query).__name__}")


def scores_of(outputs: Sequence[dict], label_token_ids: list[int], apply_softmax: bool) -> list[list[float]]:
    """Each output's label logprobs at its first generated position -> probabilities, in label order."""
    scores = []
    for out in outputs:
        entries = out["meta_info"]["output_token_ids_logprobs"][0]
        by_id = {tid: lp for lp, tid, _ in entries}
        logprobs = [by_id[t] for t in label_token_ids]
        if apply_softmax:
            top = max(logprobs)
            exps = [math.exp(lp - top) for lp in logprobs]
            total = sum(exps)
            scores.append([e / total for e in exps])
        else:
            scores.append([math.exp(lp) for lp in logprobs])
    return scores


def _vocab_size(engine) -> int | None:
    config = getattr(getattr(engine, "runner", None), "model_config", None)
    return getattr(config, "vocab_size", None)


def encoder(engine):
    def encode(text: str) -> list[int]:
        if getattr(engine.tokenizer, "tokenizer", None) is None:
            raise ValueError("text query/items need a tokenizer (the engine was built with skip_tokenizer_init); "
                             "pass token ids")
        return engine.tokenizer.encode(text)

    return encode


async def score_outputs(engine, prompts: list[list[int]], label_token_ids: list[int]) -> list[dict]:
    """The generate outputs of score prompts (one prefill each) through `engine.async_generate`."""
    try:
        outs = await engine.async_generate(input_ids=prompts, sampling_params=dict(SCORE_SAMPLING),
                                           return_logprob=True, token_ids_logprob=list(label_token_ids))
    except ValueError as e:  # the HTTP server's engine client checks the ids in the engine: say which argument
        named = _named(e)
        if named is e:
            raise
        raise named from e
    return outs if isinstance(outs, list) else [outs]


def _checked_prompts(engine, query, items, label_token_ids, apply_softmax, item_first) -> list[list[int]]:
    check_apply_softmax(apply_softmax)
    return score_prompts(encoder(engine), query, items, label_token_ids, item_first, _vocab_size(engine))


async def async_score(engine, query=None, items=None, label_token_ids=None, apply_softmax: bool = False,
                      item_first: bool = False) -> list[list[float]]:
    """The scores through `engine.async_generate` (an Engine, or the HTTP server's engine client)."""
    prompts = _checked_prompts(engine, query, items, label_token_ids, apply_softmax, item_first)
    if not prompts:
        return []
    return scores_of(await score_outputs(engine, prompts, label_token_ids), label_token_ids, apply_softmax)


def _named(e: ValueError) -> ValueError:
    """The engine's error about its token_ids_logprob argument, reworded for score()'s label_token_ids."""
    text = str(e)
    if text.startswith("token_ids_logprob"):
        return ValueError("label_token_ids" + text[len("token_ids_logprob"):])
    return e


class ScoreAPI:
    """Engine.score / Engine.async_score (SGLang's signatures)."""

    def score(self, query=None, items=None, label_token_ids=None, apply_softmax: bool = False,
              item_first: bool = False) -> list[list[float]]:
        """For each item, the probabilities of `label_token_ids` as the next token after query + item (item +
        query with item_first): over the whole vocabulary, or renormalised over the labels with apply_softmax.
        query and items are both text or both token ids; returns one list per item, in label order."""
        prompts = _checked_prompts(self, query, items, label_token_ids, apply_softmax, item_first)
        if not prompts:
            return []
        outs = self.generate(input_ids=prompts, sampling_params=dict(SCORE_SAMPLING), return_logprob=True,
                             token_ids_logprob=list(label_token_ids), show_progress=False)
        return scores_of(outs if isinstance(outs, list) else [outs], label_token_ids, apply_softmax)

    async def async_score(self, query=None, items=None, label_token_ids=None, apply_softmax: bool = False,
                          item_first: bool = False) -> list[list[float]]:
        """score() without blocking the event loop."""
        return await async_score(self, query, items, label_token_ids, apply_softmax, item_first)
