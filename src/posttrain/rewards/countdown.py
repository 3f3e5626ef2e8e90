"""Countdown's reward, with TinyZero's semantics: the equation in the last
`<answer>...</answer>` must use exactly the given numbers, each once, and
evaluate to the target (within 1e-5): 1.0; an equation that fails: 0.1
(format score); no equation: 0.

The response alone is searched (no "Assistant:" marker is needed), and the
equation is evaluated by walking its syntax tree over + - * / and numbers
only, never with eval().
"""

from __future__ import annotations

import ast
import operator
import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS = re.compile(r"^[\d+\-*/().\s]+$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def extract_equation(solution_str: str) -> str | None:
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def evaluate(equation: str) -> float:
    """Value of an arithmetic expression of numbers, + - * / and parentheses."""
    if not _ALLOWED_CHARS.match(equation) or len(equation) > 200:
        raise ValueError("not a plain arithmetic expression")

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -walk(node.operand) if isinstance(node.op, ast.USub) else walk(node.operand)
        raise ValueError("unsupported expression")

    return walk(ast.parse(equation, mode="eval"))


def uses_exactly(equation: str, numbers) -> bool:
    return sorted(int(n) for n in re.findall(r"\d+", equation)) == sorted(int(n) for n in numbers)


def compute_score(solution_str: str, ground_truth, format_score: float = 0.1, score: float = 1.0) -> float:
    target, numbers = ground_truth["target"], ground_truth["numbers"]
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    if not uses_exactly(equation, numbers):
        return format_score
    try:
        value = evaluate(equation)
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError):
        return format_score
    return score if abs(value - float(target)) < 1e-5 else format_score
