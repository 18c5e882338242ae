"""`calculator`: evaluates an arithmetic expression in-process, without a sandbox.

Only numbers, + - * / // % ** and parentheses are accepted (parsed with `ast`, never
`eval`), with bounded exponents so a policy cannot stall the worker with 9**9**9.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING

from envs.tools.base import ToolResult, function_schema
from envs.types import JsonObject

if TYPE_CHECKING:
    from envs.trajectory_env import TrajectoryEnv

Number = int | float
_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_EXPRESSION_CHARS = 200


def evaluate_arithmetic(expression: str) -> Number:
    """Value of an arithmetic expression; ValueError says what is not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Number:
    value = node.value if isinstance(node, ast.Constant) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent above {MAX_EXPONENT}")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and ()")


class CalculatorTool:
    name = "calculator"
    schema = function_schema("calculator", "Evaluate an arithmetic expression, e.g. (3 + 4) * 5.",
                             {"expression": {"type": "string"}}, required=("expression",))

    def __init__(self, env: "TrajectoryEnv | None" = None) -> None:
        pass  # in-process: needs nothing of the trajectory's environment

    async def execute(self, arguments: JsonObject) -> ToolResult:
        try:
            return ToolResult(str(evaluate_arithmetic(str(arguments["expression"]))))
        except ValueError as exc:
            return ToolResult(f"error: {exc}", is_error=True)
