"""Rule-based rewards against hand-written cases: the toy task's exact answer, math's final number."""

import random

import pytest

from trainers.tasks import (
    all_toy_prompts,
    extract_final_number,
    get_task,
    make_math_prompts,
    make_toy_prompts,
    math_reward,
    toy_answer,
    toy_reward,
)


@pytest.mark.parametrize("completion,expected", [
    ("7", 1.0),
    (" 7 ", 1.0),
    ("7</s>", 1.0),
    ("7</s>8", 1.0),    # everything after the eos marker is ignored
    ("77", 0.0),
    ("8", 0.0),
    ("7.0", 0.0),       # exact answer, not numeric equality
    ("", 0.0),
    ("the sum is 7", 0.0),
])  # fmt: skip
def test_toy_reward_is_exact_sum(completion, expected):
    """The toy reward is 1 only for exactly the digit sum (whitespace and eos trimmed)."""
    assert toy_reward("3+4=", completion) == expected
    assert get_task("toy").reward("3+4=", completion, "7") == expected


def test_toy_prompts_and_answers():
    """Toy prompts are 'a+b=' with a, b in 0..9 and the answer their sum; 100 distinct in the eval set."""
    assert toy_answer("9+9=") == "18" and toy_answer("0+0=") == "0"
    with pytest.raises(ValueError):
        toy_answer("12+3=")
    for p in make_toy_prompts(50, random.Random(0)):
        a, b = p["prompt"].rstrip("=").split("+")
        assert p["answer"] == str(int(a) + int(b))
    assert len({p["prompt"] for p in all_toy_prompts()}) == 100


@pytest.mark.parametrize("completion,answer,expected", [
    ("so the total is #### 42", "42", 1.0),
    ("#### 42\nand then 7 more words about 9", "42", 1.0),   # '####' beats later numbers
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{ 41 }", "42", 0.0),
    ("We get 1,000 apples", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("3 boxes of 14 is 42.", "42", 1.0),                      # last number, trailing period
    ("3 boxes of 14 is 42, not 41", "42", 0.0),
    ("42.0", "42", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### $18", "18", 1.0),
    ("I do not know", "42", 0.0),                            # no number at all
    ("", "42", 0.0),
    ("#### 42</s>#### 43", "42", 1.0),                       # text after eos is ignored
    ("blah #### 72", "Natalia sold 48/2 = 24 clips... #### 72", 1.0),  # a GSM8K answer field
])  # fmt: skip
def test_math_reward_final_number(completion, answer, expected):
    """math reward is 1 iff the completion's final number ('####', else boxed, else last) equals the answer."""
    assert math_reward(completion, answer) == expected
    assert get_task("math").reward("Question: ...", completion, answer) == expected


def test_extract_final_number_none_without_number():
    """A text with no number gives None (and so reward 0), not an exception."""
    assert extract_final_number("no digits here") is None
    assert math_reward("42", "no number in the answer") == 0.0


def test_math_prompts_answers_are_integers():
    """Templated math prompts ask for '####' and carry a non-negative integer answer."""
    for p in make_math_prompts(30, random.Random(1)):
        assert "####" in p["prompt"]
        assert p["answer"].isdigit()


def test_unknown_task_is_refused():
    """get_task names the valid tasks when given an unknown one."""
    with pytest.raises(ValueError, match="toy"):
        get_task("chess")
