"""Tools ready for `--tools` (as `xla_train.rewards` holds ready reward functions), named
`xla_train.tools:NAME`:

    calculator    an arithmetic expression's value (numbers, + - * / and parentheses): the tool of
                  recipes/qwen3-0.6b-tool-sft-tpu.yaml's GSM8K traces and of the GRPO recipe after it

Each has the type hints and Google-style docstring TRL's tools need (tasks/tools.py describes it)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.USub: operator.neg, ast.UAdd: operator.pos}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers, + - * / and parentheses")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: The expression: numbers, + - * / and parentheses.
    """
    value = _value(ast.parse(expression.replace(",", ""), mode="eval").body)  # GSM8K writes 1,000
    return f"{value:.10g}"
