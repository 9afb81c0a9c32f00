"""Reward functions to start from, for `xla-train train --problem grpo --reward xla_train.rewards:NAME`.

Each is called as TRL's GRPOTrainer calls a reward function, `f(prompts, completions, **kwargs)`
with the rows' other columns as keyword arguments (a list per column, one value per completion),
and returns a float per completion (None: no reward for it). A completion is text, or for chat
prompts a list holding the assistant's turn ({"role": "assistant", "content": ...}), as in TRL, so
TRL's own reward functions (`trl.rewards`) can be named too.

    exact_match     1.0 where the completion's answer equals the row's `answer` column, else 0.0; the
                    answer is what the last <answer>...</answer> holds, else the whole completion,
                    both stripped
    number_match    1.0 where the last number of the completion equals the `answer` column's (a
                    math word problem's: "#### 42" or "42"; commas and a trailing ".0" ignored)
    think_format    1.0 where the completion opens with one <think>...</think> block (TRL's
                    think_format_reward)

Own variants: `match_on(extract, column)` and `format_match(pattern)` make one, e.g. in a file
named with `--reward my_rewards.py:boxed`:

    from xla_train.rewards import match_on
    boxed = match_on(r"\\boxed\\{([^}]*)\\}", column="solution", name="boxed")
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def text_of(completion: Any) -> str:
    """A completion's text: itself, or the content of its (last) turn."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


def match_on(extract: str | None = None, column: str = "answer", name: str = "match") -> Callable[..., list[float]]:
    """A reward of 1.0 where the completion's answer, `extract`'s last match in it (its first group
    where it has one; no match: no answer), equals the row's `column` (both stripped), else 0.0.
    Without `extract`: the last <answer>...</answer>, else the whole completion. `name`: its name
    in the metrics (rewards/NAME/mean), as a function's __name__ is."""
    pattern = re.compile(extract, re.DOTALL) if extract else None

    def answer_of(text: str) -> str | None:
        if pattern is None:
            found = ANSWER.findall(text)
            return (found[-1] if found else text).strip()
        matches = list(pattern.finditer(text))
        if not matches:
            return None
        last = matches[-1]
        return (last.group(1) if pattern.groups else last.group(0)).strip()

    def reward(completions: list, **kwargs: Any) -> list[float]:
        if column not in kwargs:
            raise KeyError(f"the rows have no {column!r} column (columns: {', '.join(sorted(kwargs)) or 'none'})")
        return [float(answer_of(text_of(c)) == str(a).strip()) for c, a in zip(completions, kwargs[column])]

    reward.__name__ = reward.__qualname__ = name
    return reward


def _number(text: str) -> str | None:
    found = NUMBER.findall(text.split("####")[-1])
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def number_match(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 where the completion's last number is the `answer` column's last number (after "####"
    where there is one, as GSM8K writes them), else 0.0."""
    return [float(_number(text_of(c)) is not None and _number(text_of(c)) == _number(str(a)))
            for c, a in zip(completions, answer)]


def format_match(pattern: str, name: str = "format") -> Callable[..., list[float]]:
    """A reward of 1.0 where the whole completion matches the regular expression `pattern`
    (re.fullmatch, DOTALL), else 0.0; `name` as match_on's."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: list, **kwargs: Any) -> list[float]:
        return [float(compiled.fullmatch(text_of(c)) is not None) for c in completions]

    reward.__name__ = reward.__qualname__ = name
    return reward


exact_match = match_on(name="exact_match")
think_format = format_match(r"<think>(?!.*<think>).*?</think>.*", name="think_format")
