"""Countdown's reward, with TinyZero's semantics (verl/utils/reward_score/countdown.py
in Jiayi-Pan/TinyZero):

1. the equation is the last `<answer>...</answer>` on the response's LAST
   LINE (TinyZero keeps only the text after the final newline, so an answer
   followed by a newline and more text is not found);
2. its numbers (every run of digits) must be exactly ground_truth["numbers"],
   each used once;
3. it may hold only digits, + - * / ( ) . and spaces, and must evaluate to
   ground_truth["target"] within 1e-5.

Score: `score` (1.0) when all hold; `format_score` (0.1) when an equation was
found but 2 or 3 fails (wrong numbers, bad characters, not evaluable,
division by zero, wrong value); 0 when no equation was found.

Where this differs from TinyZero, and why:
- TinyZero scores prompt + response and first cuts everything before
  "Assistant:" (or "<|im_start|>assistant"), scoring 0 when neither is
  there. posttrain scores the response alone, so no marker is needed: for
  TinyZero's prompts (whose last line holds no answer tags) the result is
  the same as TinyZero's.
- TinyZero calls eval() on the equation; here the expression is parsed and
  walked, allowing only numbers and the arithmetic Python would do on those
  characters (+ - * / // ** and signs), so nothing else can run. A power too
  large to compute quickly scores format_score, where TinyZero would hang.

    GT = {"target": 24, "numbers": [4, 6, 1]}
    compute_score("<think>4*6=24</think>\\n<answer> 4 * 6 * 1 </answer>", GT)   # 1.0
    compute_score("<answer>4 + 6 + 1</answer>", GT)                         # 0.1 (11)
    compute_score("<answer>4 * 6</answer>", GT)                             # 0.1 (1 unused)
    compute_score("<answer>4 * 6 * 1</answer>\\nDone.", GT)                  # 0.0 (not on the last line)
"""

from __future__ import annotations

import ast
import math
import operator
import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>")
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow}
_MAX_CHARS = 300  # longer "equations" are not arithmetic over a handful of numbers
_MAX_POW_BITS = 4096  # a result above 2**4096 cannot be a countdown target


def extract_equation(solution_str: str) -> str | None:
    """The stripped text of the last <answer>...</answer> on the last line, or None."""
    last_line = solution_str.split("\n")[-1]
    found = _ANSWER.findall(last_line)
    return found[-1].strip() if found else None


def uses_exactly(equation: str, numbers) -> bool:
    """True when the runs of digits in `equation` are `numbers`, each once (any order)."""
    try:
        return sorted(int(n) for n in re.findall(r"\d+", equation)) == sorted(int(n) for n in numbers)
    except (TypeError, ValueError):
        return False


def _pow(x, y):
    if isinstance(x, int) and isinstance(y, int) and abs(x) > 1 and y > 0 and y * math.log2(abs(x)) > _MAX_POW_BITS:
        raise ValueError("power too large")
    return operator.pow(x, y)


def _walk(node):
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        return _pow(left, right) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    raise ValueError(f"{type(node).__name__} is not arithmetic")


def evaluate(equation: str):
    """The value of an arithmetic expression over numbers, + - * / // ** and
    parentheses; ValueError (or ZeroDivisionError, OverflowError) otherwise.
    The text is only parsed, never executed.

        evaluate("(1 + 2) / 3")   # 1.0
    """
    if len(equation) > _MAX_CHARS or not _ALLOWED.match(equation):
        raise ValueError("not a plain arithmetic expression")
    try:
        tree = ast.parse(equation.strip(), mode="eval")
    except (SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError("not a valid expression") from e
    return _walk(tree)


def compute_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.1,
                  score: float = 1.0) -> float:
    """TinyZero's countdown score (see the module docstring); `method` is
    accepted for TinyZero's signature and unused, as there."""
    target, numbers = ground_truth["target"], ground_truth["numbers"]
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    if not uses_exactly(equation, numbers):
        return float(format_score)
    try:
        value = evaluate(equation)
        correct = abs(value - target) < 1e-5
    except (ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError):
        return float(format_score)
    return float(score) if correct else float(format_score)
