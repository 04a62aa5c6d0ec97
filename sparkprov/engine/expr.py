"""Variables in playbooks: `{{ name }}` substitution and `when:` conditions.

No Jinja and no eval: substitution takes a dotted name, and conditions are parsed with `ast`
and walked over a small whitelist (and/or/not, comparisons, `in`, literals, names, `.attr`,
`[key]`). Anything else is an error naming what is not allowed.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

_TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*\}\}")


class ExprError(Exception):
    pass


class Undefined(ExprError):
    def __init__(self, name: str):
        super().__init__(f"undefined variable {name!r}")
        self.name = name


def lookup(name: str, variables: dict[str, Any]) -> Any:
    parts = name.split(".")
    if parts[0] not in variables:
        raise Undefined(parts[0])
    value = variables[parts[0]]
    for part in parts[1:]:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise Undefined(name)
    return value


def render(value: Any, variables: dict[str, Any]) -> Any:
    """Substitute `{{ var }}` in every string of a nested value. A string that is only one
    reference takes the variable's own type (a list stays a list)."""
    if isinstance(value, str):
        whole = _TEMPLATE.fullmatch(value.strip())
        if whole:
            return lookup(whole.group(1), variables)
        return _TEMPLATE.sub(lambda m: _as_text(lookup(m.group(1), variables)), value)
    if isinstance(value, list):
        return [render(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: render(v, variables) for k, v in value.items()}
    return value


def _as_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def has_template(value: Any) -> bool:
    if isinstance(value, str):
        return bool(_TEMPLATE.search(value))
    if isinstance(value, list):
        return any(has_template(v) for v in value)
    if isinstance(value, dict):
        return any(has_template(v) for v in value.values())
    return False


_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
        ast.NotIn: lambda a, b: a not in b}
_CONSTS = {"true": True, "false": False, "True": True, "False": False, "none": None, "None": None}


def check_condition(expr: str) -> None:
    """Parse only: reject syntax and constructs we do not evaluate."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"cannot parse condition {expr!r}: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise ExprError(f"condition nested too deeply ({len(expr)} characters)") from None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not,
                                 ast.Compare, ast.Name, ast.Load, ast.Constant, ast.Attribute, ast.Subscript,
                                 ast.List, ast.Tuple, *_CMP)):
            raise ExprError(f"{type(node).__name__} is not allowed in a condition")


def evaluate(expr: str | bool, variables: dict[str, Any]) -> bool:
    if isinstance(expr, bool):
        return expr
    check_condition(expr)
    try:
        return bool(_eval(ast.parse(expr, mode="eval").body, variables))
    except TypeError as exc:  # e.g. `arch < 5`, `x in 5`: values of kinds that do not compare
        raise ExprError(f"cannot evaluate condition {expr!r}: {exc}") from None
    except RecursionError:
        raise ExprError(f"condition nested too deeply ({len(expr)} characters)") from None


def _eval(node: ast.AST, v: dict[str, Any]) -> Any:
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_eval(n, v) for n in node.values)
        return any(_eval(n, v) for n in node.values)
    if isinstance(node, ast.UnaryOp):
        return not _eval(node.operand, v)
    if isinstance(node, ast.Compare):
        left = _eval(node.left, v)
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node, v)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval(n, v) for n in node.elts]
    if isinstance(node, ast.Name):
        if node.id in _CONSTS:
            return _CONSTS[node.id]
        return lookup(node.id, v)
    if isinstance(node, ast.Attribute):
        base = _eval(node.value, v)
        if isinstance(base, dict) and node.attr in base:
            return base[node.attr]
        raise Undefined(node.attr)
    if isinstance(node, ast.Subscript):
        base = _eval(node.value, v)
        key = _eval(node.slice, v)
        try:
            return base[key]
        except (KeyError, IndexError, TypeError):
            raise Undefined(str(key)) from None
    raise ExprError(f"{type(node).__name__} is not allowed in a condition")
