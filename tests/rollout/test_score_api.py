"""Engine.score (SGLang's scoring API): the next-token probabilities of label_token_ids after query + item
equal HF's on the same checkpoint (over the whole vocabulary, or renormalised over the labels), for token
ids and text, item_first or not; bad arguments are refused by name and the engine keeps serving."""

from __future__ import annotations

import asyncio

import pytest
import torch

LABELS = [3, 17, 40, 2]


@pytest.fixture(scope="module")
def engine(tiny_llama, module_engines):
    return module_engines(tiny_llama)


def _hf_scores(hf, prompts: list[list[int]], labels: list[int], apply_softmax: bool) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = hf(torch.tensor([ids])).logits[0, -1].double()  # the next token after the whole prompt
            probs = logits[labels].softmax(-1) if apply_softmax else logits.softmax(-1)[labels]
            out.append(probs.tolist())
    return out


@pytest.mark.parametrize("apply_softmax", [True, False])
@pytest.mark.parametrize("item_first", [False, True])
def test_token_id_scores_equal_hf(engine, tiny_llama, hf_models, apply_softmax, item_first):
    """Three items of different lengths after (or before) one query: HF's probabilities at the labels."""
    query, items = [5, 9, 12, 7], [[30, 31], [44], [8, 8, 8, 60, 61]]
    got = engine.score(query=query, items=items, label_token_ids=LABELS, apply_softmax=apply_softmax,
                       item_first=item_first)
    prompts = [i + query if item_first else query + i for i in items]
    want = _hf_scores(hf_models(tiny_llama), prompts, LABELS, apply_softmax)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               atol=1e-5, rtol=1e-4)
    if apply_softmax:
        assert all(abs(sum(s) - 1.0) < 1e-9 for s in got)
    else:
        assert all(0 < sum(s) < 1 for s in got)


def test_text_scores_join_text_before_tokenizing(engine, tiny_llama, hf_models):
    """Text query and items are joined, then tokenized (SGLang's f"{query}{item}"), and scored like ids."""
    query, items = "hello world", [" one", "two three"]
    got = engine.score(query=query, items=items, label_token_ids=LABELS, apply_softmax=True)
    prompts = [engine.tokenizer.encode(query + i) for i in items]
    want = _hf_scores(hf_models(tiny_llama), prompts, LABELS, True)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               atol=1e-5, rtol=1e-4)
    one = engine.score(query=query, items=items[0], label_token_ids=LABELS, apply_softmax=True)  # a bare string
    torch.testing.assert_close(torch.tensor(one), torch.tensor(got[:1]), atol=1e-5, rtol=1e-4)


def test_async_score_equals_score(engine):
    """async_score gives score's numbers (up to the last bits: the second call reuses the cached query)."""
    kw = dict(query=[5, 6], items=[[7], [8, 9]], label_token_ids=[4, 5], apply_softmax=False)
    torch.testing.assert_close(torch.tensor(asyncio.run(engine.async_score(**kw))), torch.tensor(engine.score(**kw)),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(query=[5], items=[[6]], label_token_ids=[]), "label_token_ids must be a non-empty list"),
    (dict(query=[5], items=[[6]], label_token_ids=[1, 10**6]), r"label_token_ids \[1000000\] are outside"),
    (dict(query=[5], items=[[6]], label_token_ids="3"), "label_token_ids must be"),
    (dict(query=[5], items=5, label_token_ids=[3]), "items must be a list"),
    (dict(query="a", items=[[6]], label_token_ids=[3]), "query is text, so items must be strings"),
    (dict(query=[5], items=["b"], label_token_ids=[3]), "query is token ids, so items must be token-id lists"),
    (dict(query=[5, -1], items=[[6]], label_token_ids=[3]), r"token ids \[-1\] outside the vocabulary"),
    (dict(query=[], items=[[]], label_token_ids=[3]), "prompt is empty"),
    (dict(query=[5], items=[[6]], label_token_ids=[3], item_first="yes"), "item_first must be a bool"),
    (dict(query=[5], items=[[6]], label_token_ids=[3], apply_softmax="x"), "apply_softmax must be a bool"),
    (dict(query=[5], items=[[True]], label_token_ids=[3]), "items must be token-id lists"),
])
def test_bad_arguments_are_refused_by_name(engine, kwargs, message):
    """Each bad argument raises ValueError naming it; the next call is served as usual."""
    with pytest.raises(ValueError, match=message):
        engine.score(**kwargs)
    assert len(engine.score(query=[5], items=[[6]], label_token_ids=[3])[0]) == 1
