"""The `calculator` tool: arithmetic on numbers, evaluated from Python's syntax tree.

    calculator("(3 + 4) * 2 / 7")   # "2"
    calculator("2 ** 0.5")          # "1.41421356237"
    calculator("7 // 2, 7 % 2")     # ValueError: tuples (a comma) are not allowed ...
    calculator("1 / 0")             # ZeroDivisionError: division by zero

Numbers (int and float literals), + - * / // % **, unary + and -, and
parentheses; nothing else is evaluated (no eval/exec): a name, a call, an
attribute, a subscript, a string, a comparison or any other syntax is
refused with a ValueError that says what is allowed. The work is bounded:
an expression of at most MAX_CHARS characters, integers of at most MAX_BITS
bits (10**100000 is refused before it is computed), finite floats. An
integral result prints as an integer ("2", also for 6/3), others with up to
SIGNIFICANT_DIGITS significant digits.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 1000
MAX_BITS = 4000  # about 1200 decimal digits
SIGNIFICANT_DIGITS = 12
_ALLOWED = "the calculator takes numbers, + - * / // % **, unary + -, and parentheses"

SCHEMA = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "The expression, e.g. (12 + 30) * 3 / 7 or 2 ** 10"},
        },
        "required": ["expression"],
    },
}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, as text; ValueError or ZeroDivisionError when it has none."""
    text = expression.strip()
    if not text:
        raise ValueError(f"the expression is empty; {_ALLOWED}")
    if len(text) > MAX_CHARS:
        raise ValueError(f"the expression has {len(text)} characters, more than {MAX_CHARS}; split the work")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg}); {_ALLOWED}") from None
    except (RecursionError, MemoryError):
        raise ValueError("the expression is nested too deeply") from None
    try:
        return format_number(_eval(tree.body))
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def format_number(value: int | float) -> str:
    """An integer, an integral float below 1e15 as an integer; else up to SIGNIFICANT_DIGITS digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{SIGNIFICANT_DIGITS}g}"


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_REFUSED = {  # node type -> what it is, for the refusal
    ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes", ast.Subscript: "subscripts",
    ast.Compare: "comparisons", ast.BoolOp: "and/or", ast.Tuple: "tuples (a comma)", ast.List: "lists",
    ast.Lambda: "lambdas", ast.IfExp: "if/else", ast.JoinedStr: "strings",
}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = "strings" if isinstance(value, (str, bytes)) else f"{type(value).__name__} values"
            raise ValueError(f"{kind} are not allowed ({node.value!r:.40}); {_ALLOWED}")
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _binary(node.op, _eval(node.left), _eval(node.right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError(f"^ is not allowed (for a power write **); {_ALLOWED}")
    what = _REFUSED.get(type(node), f"'{type(node).__name__}' expressions")
    if isinstance(node, ast.Name):
        what = f"names ('{node.id}')"
    elif isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"the operator {type(node.op).__name__}"
    raise ValueError(f"{what} are not allowed; {_ALLOWED}")


def _binary(op: ast.operator, left, right) -> int | float:
    if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
        raise ZeroDivisionError("division by zero")
    if isinstance(op, ast.Pow):
        _check_power(left, right)
    elif isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_BITS + 1:
            raise ValueError(f"the result is too large (more than {MAX_BITS} bits)")
    try:
        result = _BINARY[type(op)](left, right)
    except OverflowError:
        raise ValueError("the result is too large for a floating-point number") from None
    except ZeroDivisionError:  # 0 ** -1
        raise ZeroDivisionError("division by zero") from None
    if isinstance(result, complex):
        raise ValueError("the result is not a real number (a fractional power of a negative number)")
    return _checked(result)


def _check_power(base, exponent) -> None:
    """Refuse an integer power whose result would be too large, before computing it
    (a float power is computed at once, and overflows to OverflowError)."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exponent > MAX_BITS:  # a lower bound of the result's bits
            raise ValueError(f"the result is too large (more than {MAX_BITS} bits)")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError(f"the result is too large (more than {MAX_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large for a floating-point number")
    return value
