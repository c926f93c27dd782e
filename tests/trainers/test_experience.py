"""Experience batch: padding layout, token alignment of rollout logprobs, and shape validation."""

import pytest
import torch

from trainers.experience import Experience
from trainers.losses import group_advantages, sequence_logprobs

PAD = 0


def make_experience(**kwargs) -> Experience:
    return Experience.from_rollouts(
        prompt_ids=[[5, 6], [7]],
        completion_ids=[[8, 9, 10], [11]],
        completion_logprobs=[[-0.1, -0.2, -0.3], [-0.4]],
        rewards=[1.0, 0.0],
        pad_token_id=PAD,
        **kwargs,
    )


def test_from_rollouts_layout():
    """Rows are prompt + completion right-padded; masks mark prompt+completion and completion only."""
    exp = make_experience()
    assert exp.input_ids.tolist() == [[5, 6, 8, 9, 10], [7, 11, PAD, PAD, PAD]]
    assert exp.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert exp.completion_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert exp.input_ids.dtype == torch.long
    assert exp.rewards.tolist() == [1.0, 0.0]
    assert exp.advantages.tolist() == [0.0, 0.0]
    assert len(exp) == 2


def test_from_rollouts_logprob_sits_at_its_token():
    """The logprob of the completion token at position t is stored at index t, 0 elsewhere."""
    exp = make_experience()
    expected = torch.tensor([[0, 0, -0.1, -0.2, -0.3], [0, -0.4, 0, 0, 0]])
    assert torch.allclose(exp.rollout_logprobs, expected)
    assert exp.input_ids[0, 2] == 8 and exp.rollout_logprobs[0, 2] == pytest.approx(-0.1)
    assert exp.input_ids[1, 1] == 11 and exp.rollout_logprobs[1, 1] == pytest.approx(-0.4)


def test_rollout_logprobs_align_with_sequence_logprobs():
    """Engine-style logprobs (token t scored by logits at t-1) match sequence_logprobs on the completion."""
    torch.manual_seed(0)
    prompts, completions = [[1, 2, 3], [4]], [[5, 6], [2, 3, 1]]
    exp = Experience.from_rollouts(prompts, completions, [[0.0] * 2, [0.0] * 3], [0.0, 0.0], PAD)
    logits = torch.randn(2, exp.input_ids.shape[1], 8)
    # what the engine reports while sampling: completion token j was drawn from logits at position p+j-1
    engine_logprobs = [
        [torch.log_softmax(logits[b, len(p) + j - 1], -1)[tok].item() for j, tok in enumerate(c)]
        for b, (p, c) in enumerate(zip(prompts, completions))
    ]
    exp = Experience.from_rollouts(prompts, completions, engine_logprobs, [0.0, 0.0], PAD)
    trainer = sequence_logprobs(logits, exp.input_ids) * exp.completion_mask
    assert torch.allclose(trainer, exp.rollout_logprobs, atol=1e-6)


def test_from_rollouts_with_advantages():
    """Advantages passed in (e.g. group advantages) are stored per sequence."""
    exp = make_experience(advantages=group_advantages(torch.tensor([1.0, 0.0]), group_size=2))
    assert exp.advantages.shape == (2,)
    assert exp.advantages[0] > 0 > exp.advantages[1]


def test_from_rollouts_rejects_mismatched_inputs():
    """Logprob/completion length and batch-size mismatches raise errors naming the field."""
    with pytest.raises(ValueError, match=r"completion_logprobs\[0\]"):
        Experience.from_rollouts([[1]], [[2, 3]], [[-0.1]], [1.0], PAD)
    with pytest.raises(ValueError, match="rewards"):
        Experience.from_rollouts([[1]], [[2]], [[-0.1]], [1.0, 0.0], PAD)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]"):
        Experience.from_rollouts([[]], [[2]], [[-0.1]], [1.0], PAD)


@pytest.mark.parametrize(
    "field",
    [
        "attention_mask",
        "completion_mask",
        "rollout_logprobs",
        "old_logprobs",
        "ref_logprobs",
        "values",
        "returns",
    ],
)
def test_post_init_names_bad_per_token_field(field):
    """A per-token field whose shape differs from input_ids is rejected with its name in the message."""
    exp = make_experience()
    kwargs = {f: getattr(exp, f) for f in exp.__dataclass_fields__}
    kwargs[field] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=field):
        Experience(**kwargs)


def test_post_init_checks_rewards_advantages_and_ids():
    """rewards must be [B]; advantages [B] or [B, T]; input_ids 2-D long."""
    exp = make_experience()
    base = {f: getattr(exp, f) for f in exp.__dataclass_fields__}
    with pytest.raises(ValueError, match="rewards"):
        Experience(**{**base, "rewards": torch.zeros(3)})
    with pytest.raises(ValueError, match="advantages"):
        Experience(**{**base, "advantages": torch.zeros(2, 2)})
    Experience(**{**base, "advantages": torch.zeros(2, 5)})  # per-token advantages are fine
    with pytest.raises(ValueError, match="input_ids"):
        Experience(**{**base, "input_ids": exp.input_ids.float()})


def test_to_moves_tensors_and_keeps_none():
    """to(device) returns an equal Experience on the device; unset optional fields stay None."""
    exp = make_experience()
    exp.values = torch.ones(2, 5)
    moved = exp.to("cpu")
    assert moved is not exp
    assert torch.equal(moved.input_ids, exp.input_ids) and torch.equal(moved.values, exp.values)
    assert moved.old_logprobs is None and moved.returns is None
    assert moved.input_ids.device.type == "cpu"
