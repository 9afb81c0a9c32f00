"""The agent tests' tool task: multiply two two-digit numbers with a tool, then say the product.

One task for both halves of tool use (issue 64): SFT on tool-calling traces in TRL's SFT form
(`messages` with an assistant `tool_calls` turn and a `tool` turn, and a `tools` column of JSON
schemas, stored as a JSON string as TRL's SFTTrainer accepts it), and GRPO prompts with the answer
in a column (`xla_train.rewards:number_match` scores the final turn). A tiny model cannot multiply
two-digit numbers by itself, so the final answer's reward rises only through the tool.

`--tools tests/tool_task.py:multiply` names the tool; `--environment tests/tool_task.py:Ledger` gives
it as an environment's method (TRL's environment_factory)."""

import json
import random


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


class Ledger:
    """The task as an environment (TRL's environment_factory contract): `multiply` is its tool,
    bound to it; it counts its calls since its last reset, which are its reward; its reset tells
    the model to use the tool (text appended to the prompt)."""

    NOTE = " Use the tool."

    def __init__(self):
        self.calls = 0
        self.answer = None

    def reset(self, answer: str, **row) -> str:
        self.calls, self.answer = 0, answer
        return self.NOTE

    def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls)


def schema():
    """`multiply`'s JSON schema, as transformers' `get_json_schema` writes it for chat templates."""
    from transformers.utils import get_json_schema

    return get_json_schema(multiply)


def tool_rows(n, seed, form="traces"):
    """`n` rows of the task: `traces` (SFT: the whole exchange with the tool's call and result) or
    `prompts` (GRPO: the question, and the product in an `answer` column)."""
    rng = random.Random(seed)
    tools = json.dumps([schema()])
    rows = []
    for _ in range(n):
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        question = [{"role": "user", "content": f"What is {a} times {b}?"}]
        if form == "prompts":
            rows.append({"prompt": question, "answer": str(a * b)})
            continue
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
        rows.append({"messages": [*question,
                                  {"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "name": "multiply", "content": str(a * b)},
                                  {"role": "assistant", "content": f"The product is {a * b}."}],
                     "tools": tools})
    return rows
