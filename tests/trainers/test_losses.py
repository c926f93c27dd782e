"""Losses against hand-computed values on tiny tensors (2 sequences x 3 tokens and the like)."""

import math

import pytest
import torch

from trainers.losses import (
    gae,
    group_advantages,
    kl_k1,
    kl_k3,
    logprob_mismatch,
    masked_mean,
    masked_sum,
    masked_whiten,
    policy_loss,
    sequence_logprobs,
    token_logprobs,
    value_loss,
)

LN = math.log


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> bool:
    return torch.allclose(actual.float(), torch.as_tensor(expected, dtype=torch.float32), atol=atol)


# --- masked reductions --------------------------------------------------------------------------------


def test_masked_mean_ignores_padding():
    """masked_mean counts only mask==1 entries, overall and per row."""
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert close(masked_mean(values, mask), 10.0 / 4)
    assert close(masked_mean(values, mask, dim=-1), [2.0, 4.0])
    assert close(masked_sum(values, mask), 10.0)


def test_masked_mean_empty_mask_is_zero_with_finite_grad():
    """An all-zero mask gives 0 (not NaN) and a finite gradient."""
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[0, 0], [1, 0]])
    out = masked_mean(values, mask, dim=-1)
    assert close(out, [0.0, 3.0])
    out.sum().backward()
    assert torch.isfinite(values.grad).all()
    assert close(masked_mean(values, torch.zeros(2, 2)), 0.0)


def test_masked_whiten_has_zero_mean_unit_var_on_mask():
    """masked_whiten gives mean 0 / variance 1 over the mask and zeros on padding."""
    values = torch.tensor([[1.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = masked_whiten(values, mask)
    assert close(out, [[-1.0, 1.0, 0.0]])  # mean 2, population std 1


# --- advantages ---------------------------------------------------------------------------------------


def test_group_advantages_hand_values():
    """Rewards [1,0,0,1 | 1,1,1,1]: +-1 in the mixed group, 0 (no NaN) in the all-equal group."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4)
    scale = 0.5 / (0.5 + 1e-6)  # (r - 0.5) / (population std 0.5 + eps)
    assert close(adv, [scale, -scale, -scale, scale, 0, 0, 0, 0])
    assert not torch.isnan(adv).any()
    assert close(adv.view(2, 4).mean(-1), [0.0, 0.0])


@pytest.mark.parametrize("normalize_std", [True, False])
def test_groups_of_equal_non_dyadic_rewards_get_exactly_zero(normalize_std):
    """All-equal groups of rewards float32 cannot hold exactly (0.1, 0.7, 1/3, 123.456, 1e6 + 0.1) get advantage
    exactly 0, beside a mixed group whose values stay the hand-computed ones (float32 rounding of the mean
    divided by the std of that rounding gave up to ~1 to every sample of such a group)."""
    for value, size in [(0.1, 8), (0.7, 8), (1 / 3, 16), (123.456, 5), (1e6 + 0.1, 8)]:
        rewards = torch.tensor([value] * size + [1.0, 0.0] * (size // 2) + [1.0] * (size % 2))
        adv = group_advantages(rewards, group_size=size, normalize_std=normalize_std)
        assert adv.dtype == torch.float32
        assert torch.equal(adv[:size], torch.zeros(size)), (value, adv[:size])
        mixed = rewards[size:].double()
        want = mixed - mixed.mean()
        if normalize_std:
            want = want / (mixed.std(unbiased=False) + 1e-6)
        assert close(adv[size:], want.float().tolist())


def test_group_advantages_without_std_is_centered_reward():
    """normalize_std=False (Dr. GRPO) gives r - group mean."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 0.0])
    adv = group_advantages(rewards, group_size=2, normalize_std=False)
    assert close(adv, [0.5, -0.5, -0.5, 0.5, 1.0, -1.0])


def test_group_advantages_rejects_partial_group():
    """A reward count that is not a multiple of group_size is an error, not a silent reshape."""
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(5), group_size=2)


@pytest.mark.parametrize("group_size", [0, -1, -2, 2.0])
def test_group_advantages_rejects_a_group_size_below_one_by_name(group_size):
    """group_size 0, negative or not an int is a ValueError naming group_size (0 was a ZeroDivisionError, -2 a
    view error, and -1 with 4 rewards gave a shape error from deep inside torch)."""
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        group_advantages(torch.zeros(4), group_size=group_size)


def naive_gae(rewards, values, lengths, gamma, lam):
    """Reference: A_t = sum_l (gamma*lam)^l delta_{t+l}, V past the end = 0, as a double loop."""
    advantages = torch.zeros_like(values)
    for b, length in enumerate(lengths):
        v = [values[b, t].item() for t in range(length)] + [0.0]
        deltas = [rewards[b, t].item() + gamma * v[t + 1] - v[t] for t in range(length)]
        for t in range(length):
            advantages[b, t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t))
    return advantages


def test_gae_monte_carlo_hand_values():
    """gamma=lam=1: advantage = reward-to-go - V_t, padding (and its value) ignored."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.3, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert close(adv, [[0.5, 0.5, 0.5], [0.8, 0.7, 0.0]])
    assert close(ret, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_gae_matches_naive_double_loop():
    """Vectorized GAE equals the naive per-sequence double sum for gamma=0.9, lam=0.8."""
    torch.manual_seed(0)
    lengths = [5, 3, 1, 4]
    rewards, values = torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.arange(5) < torch.tensor(lengths)[:, None]).long()
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected = naive_gae(rewards, values, lengths, 0.9, 0.8)
    assert close(adv, expected)
    assert close(ret, (expected + values) * mask)


def test_gae_lam_zero_is_one_step_td():
    """lam=0: A_t = r_t + gamma * V_{t+1} - V_t."""
    rewards = torch.tensor([[1.0, 2.0]])
    values = torch.tensor([[0.5, 1.5]])
    adv, _ = gae(rewards, values, torch.ones(1, 2), gamma=0.5, lam=0.0)
    assert close(adv, [[1.0 + 0.5 * 1.5 - 0.5, 2.0 - 1.5]])


# --- KL and logprobs ----------------------------------------------------------------------------------


def test_kl_estimators_at_known_points():
    """k1 = log(p/q) and k3 = q/p - log(q/p) - 1 at p,q in {1/2, 1/4}; both 0 when p == q."""
    logp = torch.tensor([LN(0.5), LN(0.25), LN(0.3)])
    ref = torch.tensor([LN(0.25), LN(0.5), LN(0.3)])
    assert close(kl_k1(logp, ref), [LN(2), -LN(2), 0.0])
    assert close(kl_k3(logp, ref), [0.5 + LN(2) - 1, 2 - LN(2) - 1, 0.0])


def test_kl_k3_nonnegative():
    """k3 >= 0 everywhere, unlike k1."""
    grid = torch.linspace(-8, 0, 41)
    logp, ref = torch.meshgrid(grid, grid, indexing="ij")
    assert (kl_k3(logp, ref) >= 0).all()
    assert (kl_k1(logp, ref) < 0).any()


def test_kl_estimators_unbiased_by_enumeration():
    """E_{x~p}[k1] = E_{x~p}[k3] = KL(p||q) exactly, summing over a 3-token vocabulary."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    kl = (p * (p / q).log()).sum()
    assert torch.allclose((p * kl_k1(p.log(), q.log())).sum(), kl)
    assert torch.allclose((p * kl_k3(p.log(), q.log())).sum(), kl)


def test_token_logprobs_hand_values_and_temperature():
    """logits [0, 2 ln 3] -> probs [1/10, 9/10] at T=1 and [1/4, 3/4] at T=2; logits [0, 0] -> log 1/2."""
    logits = torch.tensor([[0.0, 0.0], [0.0, 2 * LN(3)]])
    assert close(token_logprobs(logits, torch.tensor([1, 1])), [LN(0.5), LN(0.9)])
    assert close(token_logprobs(logits, torch.tensor([0, 1]), temperature=2.0), [LN(0.5), LN(0.75)])
    assert token_logprobs(logits.bfloat16(), torch.tensor([0, 1])).dtype == torch.float32


def test_sequence_logprobs_alignment():
    """out[:, t] is the logprob of input_ids[:, t] under logits[:, t-1]; out[:, 0] is 0."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    out = sequence_logprobs(logits, ids)
    assert out.shape == (2, 4)
    assert close(out[:, 0], [0.0, 0.0])
    for t in range(1, 4):
        expected = torch.log_softmax(logits[:, t - 1], -1).gather(-1, ids[:, t : t + 1]).squeeze(-1)
        assert close(out[:, t], expected)


def test_logprob_mismatch_masked_mean_abs():
    """Mean |rollout - trainer| over masked tokens: (0.5 + 0) / 2, the masked 7.0 gap ignored."""
    rollout = torch.tensor([[-1.0, -2.0, 0.0]])
    trainer = torch.tensor([[-1.5, -2.0, -7.0]])
    assert close(logprob_mismatch(rollout, trainer, torch.tensor([[1, 1, 0]])), 0.25)


# --- policy loss --------------------------------------------------------------------------------------

# ratios [1, 1.5, 0.5] in both rows; advantage +1 in row 0, -1 in row 1; eps = 0.2.
# row 0: min(r, clip(r)) = [1, 1.2 (clipped), 0.5]  -> loss [-1, -1.2, -0.5]
# row 1: min(-r, -clip(r)) = [-1, -1.5, -0.8 (clipped)] -> loss [1, 1.5, 0.8]
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]])
ADV = torch.tensor([1.0, -1.0])


def make_logps():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, -2.0]])
    logp = (old + RATIOS.log()).requires_grad_()
    return logp, old


def test_policy_loss_picks_min_branch_full_mask():
    """Clipped surrogate takes the pessimistic branch for +/- advantages; token mean = 0.6 / 6."""
    logp, old = make_logps()
    loss, metrics = policy_loss(logp, old, ADV, torch.ones(2, 3))
    assert close(loss, (-1 - 1.2 - 0.5 + 1 + 1.5 + 0.8) / 6)
    assert close(metrics["clip_frac"], 2 / 6)
    assert close(metrics["ratio_mean"], 3.0 / 3)
    k3 = [0.0, 0.5 - LN(1.5), -0.5 - LN(0.5)]  # r - 1 - log r
    assert close(metrics["approx_kl"], 2 * sum(k3) / 6)
    assert close(metrics["is_weight_mean"], 1.0)


def test_policy_loss_clipped_tokens_get_no_gradient():
    """Gradient is zero exactly on clipped tokens and -A*r/N elsewhere."""
    logp, old = make_logps()
    loss, _ = policy_loss(logp, old, ADV, torch.ones(2, 3))
    loss.backward()
    expected = torch.tensor([[-1.0, 0.0, -0.5], [1.0, 1.5, 0.0]]) / 6
    assert close(logp.grad, expected)


def test_policy_loss_mask_and_aggregation():
    """Masking the last token of row 1: token_mean = -0.2/5, seq_mean = mean(-0.9, 1.25), clip_frac 1/5."""
    logp, old = make_logps()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, metrics = policy_loss(logp, old, ADV, mask)
    assert close(loss, -0.2 / 5)
    assert close(metrics["clip_frac"], 1 / 5)
    loss, _ = policy_loss(logp, old, ADV, mask, loss_agg="seq_mean")
    assert close(loss, (-2.7 / 3 + 2.5 / 2) / 2)


def test_policy_loss_per_token_advantages_equal_broadcast():
    """[B, T] advantages equal to the broadcast [B] ones give the same loss."""
    logp, old = make_logps()
    mask = torch.ones(2, 3)
    a, _ = policy_loss(logp, old, ADV, mask)
    b, _ = policy_loss(logp, old, ADV[:, None].expand(2, 3), mask)
    assert close(a, b)


def test_policy_loss_clip_higher():
    """clip_eps_high=0.6 leaves ratio 1.5 unclipped for A>0 (DAPO clip-higher); low side unchanged."""
    logp, old = make_logps()
    loss, metrics = policy_loss(logp, old, ADV, torch.ones(2, 3), clip_eps_high=0.6)
    assert close(loss, (-1 - 1.5 - 0.5 + 1 + 1.5 + 0.8) / 6)
    assert close(metrics["clip_frac"], 1 / 6)


def test_policy_loss_tis_weight_is_capped_and_detached():
    """TIS weight = min(exp(old - rollout), cap): [0.5, 1, 3 -> 2]; it scales loss and grad, no grad itself."""
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = (old - torch.tensor([[LN(0.5), 0.0, LN(3.0)]])).requires_grad_()
    logp = old.clone().requires_grad_()  # ratio 1, nothing clipped
    loss, metrics = policy_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 3), rollout_logp=rollout, tis_cap=2.0
    )
    assert close(loss, -3.5 / 3)
    assert close(metrics["is_weight_mean"], 3.5 / 3)
    loss.backward()
    assert close(logp.grad, [[-0.5 / 3, -1 / 3, -2 / 3]])
    assert rollout.grad is None


def test_policy_loss_tis_cap_without_rollout_logp_errors():
    """Asking for TIS without the engine's logprobs is an error."""
    logp, old = make_logps()
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(logp, old, ADV, torch.ones(2, 3), tis_cap=2.0)


# --- value loss ---------------------------------------------------------------------------------------


def test_value_loss_takes_max_branch():
    """V=[1, 0], V_old=[.5, .5], R=0, eps=.2: max(1, .49)=1 and max(0, .09)=.09 -> 0.5*mean = 0.2725."""
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.5]])
    loss, metrics = value_loss(values, old, torch.zeros(1, 2), torch.ones(1, 2))
    assert close(loss, 0.5 * (1.0 + 0.09) / 2)
    assert close(metrics["vf_clip_frac"], 0.5)
