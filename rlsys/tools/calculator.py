"""The `calculator` tool: arithmetic on numbers with + - * / // % ** and parentheses, by walking the
expression's syntax tree (never eval), with guards that keep every call to microseconds: a bounded
expression, bounded numbers and exponents, so `9**9**9` is refused before it is computed."""
from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 500  # of the expression
MAX_NODES = 200  # of its syntax tree
MAX_BITS = 4096  # of any integer along the way (about 1,200 digits)
MAX_EXPONENT = 10_000

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    pass


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. "123*456" or "(7+5)/3"."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is {len(expression)} characters long, over {MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"the expression has over {MAX_NODES} parts")
    try:
        return format_number(_value(tree.body))
    except (ZeroDivisionError, OverflowError) as e:
        raise CalculatorError(f"{type(e).__name__}: {e}") from None


def format_number(value: int | float) -> str:
    """An integer as its digits; a float that is a whole number too (6/3 -> "2"), else its shortest repr."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return str(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        result = BINARY[type(node.op)](left, right)
        if isinstance(result, complex):  # (-8) ** 0.5
            raise CalculatorError("the result is not a real number")
        return _checked(result)
    raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed, not {_describe(node)}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would pass MAX_BITS before computing it."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is over {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exponent > MAX_BITS:
            raise CalculatorError(f"the result would have over {MAX_BITS} bits")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalculatorError(f"a number has over {MAX_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    return f"{type(node).__name__}"
