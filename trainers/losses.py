"""Losses and estimators for PPO / GRPO post-training, as pure tensor functions.

Every function takes and returns tensors: no modules, no optimizer, no host syncs (metrics come back
as detached 0-dim tensors; the caller decides when to `.item()` them). Per-token tensors are
[B, T] and aligned so that position t refers to token t of `input_ids` (see `sequence_logprobs`);
`mask` is 1 on tokens that take part in the loss (sampled completion tokens), 0 on prompt and padding.

What this file deliberately does not do: run models, pick hyper-parameters, or log.
"""

import operator
from typing import Literal

import torch
import torch.nn.functional as F

LossAgg = Literal["token_mean", "seq_mean"]


# ---------------------------------------------------------------------------------------------------------
# masked reductions


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero (mask entries act as weights)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) / sum(mask); 0 (not NaN, and with finite gradients) where the mask is all zero."""
    mask = mask.to(values.dtype).expand_as(values)
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    # dividing by 1 where count == 0 keeps both the value (0) and the gradient finite
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8):
    """(x - mean) / sqrt(var + eps) over masked entries (population variance); masked-out entries -> 0.

    With shift_mean=False the mean is added back (scale only), as in TRL's PPO advantage whitening.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


# ---------------------------------------------------------------------------------------------------------
# advantages


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-relative advantage, one scalar per completion.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)   (Shao et al. 2024, DeepSeekMath, sec. 4.1.2,
    "outcome supervision"). std is the population std (unbiased=False): a group of G samples is the
    whole group, not a sample of it. normalize_std=False gives A_i = r_i - mean(r_group), the
    Dr. GRPO variant (Liu et al. 2025, "Understanding R1-Zero-Like Training"), which drops the
    per-question difficulty weighting. A group whose rewards are all equal gets 0, never NaN.

    rewards: [num_prompts * group_size], ordered group by group. Returns the same shape, float32+.
    """
    try:
        size = operator.index(group_size)  # an int (numpy's too), not a float
    except TypeError:
        size = 0
    if size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    group_size = size
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with length a multiple of group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    # float64, and a group of equal rewards set to exactly 0: in float32 the mean of equal non-dyadic rewards
    # (0.1, 0.7, 1/3) rounds off by ~1e-8, the std is that rounding too, and dividing one by the other gave
    # every sample of the group the same spurious advantage of up to ~1 (a full-size optimizer step on no signal).
    grouped = rewards.double().view(-1, group_size)  # [num_prompts, group_size]
    advantages = grouped - grouped.mean(dim=-1, keepdim=True)
    advantages = advantages.masked_fill(grouped.amax(dim=-1, keepdim=True) == grouped.amin(dim=-1, keepdim=True), 0.0)
    if normalize_std:
        advantages = advantages / (grouped.std(dim=-1, unbiased=False, keepdim=True) + eps)
    return advantages.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1)


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over per-token rewards; returns (advantages, returns), [B, T].

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = sum_l (gamma * lam)^l delta_{t+l}
    (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16), computed by the
    recursion A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V_t (the value target).

    `mask` marks valid tokens, contiguous, with padding on the right: the state after the last valid
    token is terminal (V = 0, A = 0), and values/rewards under mask == 0 are ignored. Outputs are 0
    where mask == 0. Loops backwards over T, vectorized over B.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    num_tokens = rewards.shape[1]
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # [B]
    next_advantage = torch.zeros_like(values[:, 0])  # [B]
    for t in reversed(range(num_tokens)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value, next_advantage = values[:, t], advantages[:, t]
    returns = (advantages + values) * mask
    return advantages, returns


# ---------------------------------------------------------------------------------------------------------
# KL estimators and log-probabilities


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimator of KL(pi || ref) for tokens sampled from pi: k1 = log pi - log ref.

    Unbiased, high variance, can be negative (Schulman 2020, "Approximating KL Divergence",
    http://joschu.net/blog/kl-approx.html).
    """
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref) for tokens sampled from pi: k3 = r - log r - 1, r = ref/pi.

    Unbiased, low variance and always >= 0 (Schulman 2020, "Approximating KL Divergence"); it is the
    KL penalty of GRPO (Shao et al. 2024, eq. 4).
    """
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[token_ids], computed in fp32; logits [..., V], ids [...] -> [...].

    No shifting: logits[..., i, :] is the distribution token_ids[..., i] was drawn from. Computed as
    gathered logit - logsumexp so only one fp32 copy of the logits is materialized. The temperature
    must match the one used at sampling time, or the logprobs will not agree with the engine's.
    """
    logits = logits.float() / temperature
    picked = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sequence_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Causal-LM logprobs aligned to tokens: out[:, t] = log p(input_ids[:, t] | input_ids[:, :t]).

    logits: [B, T, V] from model(input_ids); returns [B, T] with out[:, 0] = 0 (nothing predicts the
    first token). This is the same alignment as `Experience.rollout_logprobs`.
    """
    shifted = token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)  # [B, T-1]
    return F.pad(shifted, (1, 0), value=0.0)


def logprob_mismatch(
    rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean |rollout_logp - trainer_logp| over masked tokens: how far the engine's numerics drift from the
    trainer's for the same weights (0-dim float tensor; 0 when the mask is empty)."""
    return masked_mean((rollout_logp.float() - trainer_logp.float()).abs(), mask)


# ---------------------------------------------------------------------------------------------------------
# policy and value losses


def _aggregate(loss: torch.Tensor, mask: torch.Tensor, loss_agg: LossAgg) -> torch.Tensor:
    if loss_agg == "token_mean":
        # every token in the batch weighs the same (DAPO, Yu et al. 2025): long answers are not diluted
        return masked_mean(loss, mask)
    if loss_agg == "seq_mean":
        # mean over each sequence's tokens, then over sequences (GRPO eq. 3's 1/|o_i| then 1/G);
        # sequences without any loss token are left out of the outer mean
        per_seq = masked_mean(loss, mask, dim=-1)  # [B]
        return masked_mean(per_seq, mask.sum(-1) > 0)
    raise ValueError(f"loss_agg must be 'token_mean' or 'seq_mean', got {loss_agg!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    loss_agg: LossAgg = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO / GRPO clipped surrogate, per token; returns (loss to minimize, metrics).

    ratio_t = exp(logp_t - old_logp_t)
    L_t = -min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)
    (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7; applied per token with a
    sequence-level advantage as in GRPO, Shao et al. 2024, eq. 3). clip_eps_high=None means symmetric
    clipping; a larger eps_high is DAPO's clip-higher.

    advantages: [B] (broadcast over tokens) or [B, T]. logp, old_logp, mask: [B, T]. The loss is
    aggregated by `loss_agg`: "token_mean" = sum over all masked tokens / their count; "seq_mean" =
    per-sequence token mean, then mean over sequences.

    Truncated importance sampling (TIS): the rollout engine samples from pi_rollout, whose logprobs differ
    from the trainer's pi_old even for the same weights (kernels, precision). With `rollout_logp` and
    `tis_cap`, each token's loss is multiplied by the detached weight min(exp(old_logp - rollout_logp),
    tis_cap) (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").

    metrics (detached 0-dim tensors, masked token means): clip_frac (tokens where the clipped branch is
    the active one, i.e. gets no gradient), approx_kl (k3 estimate of KL(pi_old || pi) over tokens drawn
    from pi_old), ratio_mean, is_weight_mean (1 without TIS).
    """
    if tis_cap is not None and rollout_logp is None:
        raise ValueError("tis_cap needs rollout_logp (the engine's logprobs of the sampled tokens)")
    if clip_eps_high is None:
        clip_eps_high = clip_eps_low
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1], broadcast over tokens

    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    surr_unclipped = ratio * advantages
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.minimum(surr_unclipped, surr_clipped)  # [B, T]

    is_weight = torch.ones_like(loss)
    if rollout_logp is not None and tis_cap is not None:
        is_weight = torch.exp(old_logp - rollout_logp).clamp(max=tis_cap).detach()
        loss = loss * is_weight

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((surr_clipped < surr_unclipped).to(loss.dtype), mask),
            "approx_kl": masked_mean(kl_k3(old_logp, logp), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "is_weight_mean": masked_mean(is_weight, mask),
        }
    return _aggregate(loss, mask, loss_agg), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss; returns (loss, {"vf_clip_frac"}).

    V_clip = V_old + clip(V - V_old, -eps, eps)
    L = 0.5 * masked_mean(max((V - R)^2, (V_clip - R)^2))
    (the value clipping of the PPO reference implementation, openai/baselines ppo2; Schulman et al.
    2017 eq. 9 gives the unclipped squared error). vf_clip_frac = fraction of tokens where the clipped
    term is the larger one.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask)
    with torch.no_grad():
        clip_frac = masked_mean((loss_clipped > loss_unclipped).to(values.dtype), mask)
    return loss, {"vf_clip_frac": clip_frac}
