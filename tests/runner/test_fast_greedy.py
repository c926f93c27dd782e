"""The sampler's vectorised greedy reductions against torch's own: `first_argmax` is `torch.argmax`
(first index of the max, NaN counts as the max, ragged tails included), `logsumexp_at_argmax` is
`torch.logsumexp`, and a greedy batch over a realistic vocabulary reports argmax ids with
log_softmax logprobs."""

from __future__ import annotations

import pytest
import torch

from runner.sampler import Sampler, SamplingBatchInfo, first_argmax, logsumexp_at_argmax

VOCABS = [129, 1000, 32768, 151936]  # ragged tail of 1, ragged tail of 104, whole chunks, Qwen2's vocab


def _logits(bs: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(bs, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("vocab", VOCABS)
def test_first_argmax_is_argmax(vocab):
    """Random rows: the chunked argmax returns exactly torch.argmax's index."""
    x = _logits(16, vocab, vocab)
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("vocab", VOCABS)
def test_first_argmax_ties_nan_inf(vocab):
    """Ties across chunks and in the tail pick the first index; NaN wins; all -inf picks 0; as torch.argmax."""
    x = _logits(6, vocab, 1)
    big = x.max().item() + 1
    x[0, [vocab - 1, 5]] = big  # tie: one in the first chunk, one in the tail (or last chunk)
    x[1, [vocab - 1, vocab - 2]] = big  # tie inside the tail / last chunk
    x[2, [3, vocab - 1]] = float("nan")  # first NaN wins
    x[3, vocab - 1] = float("nan")  # NaN only at the very end
    x[4] = float("-inf")
    x[5, 0] = float("inf")
    x[5, vocab // 2] = float("inf")
    expected = x.argmax(dim=-1)
    assert expected.tolist()[:2] == [5, vocab - 2]  # the oracle itself picks the first occurrence
    assert torch.equal(first_argmax(x), expected)


@pytest.mark.parametrize("vocab", VOCABS)
def test_logsumexp_at_argmax_matches_logsumexp(vocab):
    """logsumexp from log_softmax at the argmax equals torch.logsumexp (fp32 rounding), inf rows included."""
    x = _logits(8, vocab, 2) * 10
    x[6] = float("-inf")
    x[7, 3] = float("inf")
    got = logsumexp_at_argmax(x, first_argmax(x))
    want = torch.logsumexp(x, dim=-1)
    assert torch.allclose(got[:6], want[:6], rtol=1e-6, atol=1e-5)
    assert got[6].item() == float("-inf") and got[7].item() == float("inf")


def test_greedy_batch_over_qwen_vocab():
    """An all-greedy batch over 151936 tokens: ids are argmax, logprobs are log_softmax at those ids."""
    vocab, bs = 151936, 16
    x = _logits(bs, vocab, 3) * 4
    info = SamplingBatchInfo.from_lists([0.0] * bs, [1.0] * bs, [-1] * bs, [0.0] * bs, list(range(bs)),
                                        [0] * bs, vocab, "cpu", top_logprobs_num=3)
    out = Sampler()(x, info)
    ref = torch.log_softmax(x.double(), dim=-1)
    assert torch.equal(out.next_token_ids, x.argmax(dim=-1))
    want = ref.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1).float()
    assert torch.allclose(out.logprobs, want, atol=2e-5)
    top_vals, top_ids = ref.topk(3, dim=-1)
    assert torch.equal(out.top_logprob_ids, top_ids)
    assert torch.allclose(out.top_logprobs, top_vals.float(), atol=2e-5)
