"""Tasks for RL post-training: prompt generators and rule-based rewards.

A `Task` pairs a prompt generator with a reward. Rewards are plain functions of strings, so they
run anywhere (no model, no tokenizer) and are trivial to test. Two tasks ship:

- "toy":  single-digit addition, prompt "3+4=", answer "7" (the full sum, 0..18). The completion
          must be exactly the answer (whitespace stripped, cut at the first "</s>"). This is the
          README demo: the tiny model in assets/demo-model was warm-started on it with noisy
          labels (scripts/make_demo_model.py) and GRPO lifts its accuracy.
- "math": GSM8K-style word problems; reward 1.0 when the final number of the completion equals
          the answer ("#### 42", "\\boxed{42}", else the last number in the text).

What this module deliberately does not do: load datasets from the network, or shape rewards
(partial credit, length penalties). Reward is 1.0 or 0.0.
"""

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

EOS_TEXT = "</s>"


@dataclass
class Task:
    """A prompt source and its reward.

    make_prompts(num, rng) -> [{"prompt": str, "answer": str}, ...]
    reward(prompt, completion, answer) -> float in [0, 1]
    """

    name: str
    make_prompts: Callable[[int, random.Random], list[dict]]
    reward: Callable[[str, str, str], float]


def _cut_completion(completion: str) -> str:
    """The completion up to the first eos marker, whitespace stripped.

    Engines usually drop the eos token from the text; this also covers detokenizers that keep it.
    """
    return completion.split(EOS_TEXT, 1)[0].strip()


# ---------------------------------------------------------------------------------------------
# toy: single-digit addition
# ---------------------------------------------------------------------------------------------

_TOY_PROMPT = re.compile(r"^\s*(\d)\+(\d)=\s*$")


def toy_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def toy_answer(prompt: str) -> str:
    """The answer string for a toy prompt such as "3+4=" -> "7"."""
    match = _TOY_PROMPT.match(prompt)
    if match is None:
        raise ValueError(f"not a toy prompt (expected like '3+4='): {prompt!r}")
    return str(int(match.group(1)) + int(match.group(2)))


def toy_reward(prompt: str, completion: str) -> float:
    """1.0 when the completion is exactly the sum of the two digits in the prompt, else 0.0."""
    return 1.0 if _cut_completion(completion) == toy_answer(prompt) else 0.0


def make_toy_prompts(num: int, rng: random.Random) -> list[dict]:
    """`num` prompts with both digits drawn uniformly from 0..9 (100 distinct prompts)."""
    out = []
    for _ in range(num):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append({"prompt": toy_prompt(a, b), "answer": str(a + b)})
    return out


def all_toy_prompts() -> list[dict]:
    """Every toy prompt once, in a fixed order: the natural evaluation set."""
    return [{"prompt": toy_prompt(a, b), "answer": str(a + b)} for a in range(10) for b in range(10)]


def _toy_task_reward(prompt: str, completion: str, answer: str) -> float:
    return 1.0 if _cut_completion(completion) == answer.strip() else 0.0


# ---------------------------------------------------------------------------------------------
# math: GSM8K-style final-number match
# ---------------------------------------------------------------------------------------------

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_HASH_ANSWER = re.compile(r"####\s*(" + _NUMBER + r")")
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
_ANY_NUMBER = re.compile(_NUMBER)


def parse_number(text: str) -> Decimal | None:
    """'1,234.50' -> Decimal('1234.50'); '$-3' / '-$3' -> -3; None when it is not a number."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def extract_final_number(text: str) -> Decimal | None:
    """The answer a completion commits to: the last "#### N", else the last "\\boxed{N}", else
    the last number anywhere in the text; None when there is no number."""
    text = text.split(EOS_TEXT, 1)[0]
    for pattern in (_HASH_ANSWER, _BOXED):
        found = pattern.findall(text)
        if found:
            return parse_number(found[-1])
    found = _ANY_NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final number equals the answer numerically ("42.0" == "42",
    "1,000" == "1000"); 0.0 otherwise. A GSM8K answer field ("... #### 42") is accepted as is."""
    expected = extract_final_number(answer)
    got = extract_final_number(completion)
    if expected is None or got is None:
        return 0.0
    return 1.0 if got == expected else 0.0


def _math_task_reward(prompt: str, completion: str, answer: str) -> float:
    return math_reward(completion, answer)


# Templated GSM8K-style problems so the task runs without a dataset download; pass real GSM8K
# rows through load_gsm8k_jsonl instead when you have the file.
_MATH_TEMPLATES = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", lambda a, b: a + b),
    ("{name} had {a} marbles and gave away {b}. How many marbles are left?", lambda a, b: a - b),
    ("A box holds {a} pencils. How many pencils are in {b} boxes?", lambda a, b: a * b),
    ("{name} reads {a} pages a day. How many pages does {name} read in {b} days?", lambda a, b: a * b),
    (
        "{name} earns ${a} per hour and works {b} hours. How many dollars does {name} earn?",
        lambda a, b: a * b,
    ),
]
_NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana"]


def make_math_prompts(num: int, rng: random.Random) -> list[dict]:
    """`num` templated word problems; the answer is the bare integer as a string."""
    out = []
    for _ in range(num):
        template, solve = rng.choice(_MATH_TEMPLATES)
        a, b = rng.randint(2, 60), rng.randint(2, 12)
        a = max(a, b)  # keeps subtraction non-negative
        question = template.format(name=rng.choice(_NAMES), a=a, b=b)
        prompt = f"Question: {question}\nAnswer step by step, then write the final number after ####.\n"
        out.append({"prompt": prompt, "answer": str(solve(a, b))})
    return out


def load_gsm8k_jsonl(path: str | Path) -> list[dict]:
    """GSM8K rows ({"question", "answer": "... #### 42"}) -> [{"prompt", "answer": "42"}]."""
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            final = extract_final_number(row["answer"])
            if final is None:
                raise ValueError(f"GSM8K row without a final number: {row['answer']!r}")
            prompt = (
                f"Question: {row['question']}\nAnswer step by step, then write the final number after ####.\n"
            )
            rows.append({"prompt": prompt, "answer": str(final)})
    return rows


# ---------------------------------------------------------------------------------------------

_TASKS = {
    "toy": Task(name="toy", make_prompts=make_toy_prompts, reward=_toy_task_reward),
    "math": Task(name="math", make_prompts=make_math_prompts, reward=_math_task_reward),
}


TASK_NAMES = tuple(_TASKS)  # what --task accepts (trainers/config.py checks it before anything starts)


def get_task(name: str) -> Task:
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(_TASKS)}")
    return _TASKS[name]
