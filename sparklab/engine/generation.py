"""Deterministic "model output": right answers to arithmetic, thinking, tool calls, and the
degenerate output of a broken FP4 MoE kernel. Tokens are whitespace-separated words."""
from __future__ import annotations

import ast
import hashlib
import json
import operator
import re

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}
_WORDS = [(r"\bmultiplied by\b", "*"), (r"\btimes\b", "*"), (r"\bdivided by\b", "/"),
          (r"\bover\b", "/"), (r"\bplus\b", "+"), (r"\bminus\b", "-"), (r"\bmod(ulo)?\b", "%")]
_CANDIDATE = re.compile(r"[-(]*\d[\d\s.+\-*/%^()x×÷·]*\d\)*")


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError("not arithmetic")


def _fmt(v) -> str:
    if isinstance(v, float):
        if v.is_integer():
            return str(int(v))
        return f"{v:.6g}"
    return str(v)


def arithmetic(text: str):
    """(expression, result string) for the last arithmetic expression in text, or None."""
    t = text.lower()
    for pat, op in _WORDS:
        t = re.sub(pat, f" {op} ", t)
    best = None
    for m in _CANDIDATE.finditer(t):
        expr = m.group(0).strip()
        expr = re.sub(r"(?<=[\d)])\s*[x×·]\s*(?=[\d(])", " * ", expr)
        expr = expr.replace("÷", "/").replace("^", "**")
        if not re.search(r"\d\s*(\*\*|[-+*/%])\s*[-(]*\d", expr):
            continue
        # trim unbalanced parentheses
        while expr.count("(") > expr.count(")") and expr.startswith("("):
            expr = expr[1:]
        while expr.count(")") > expr.count("(") and expr.endswith(")"):
            expr = expr[:-1]
        try:
            value = _eval(ast.parse(expr, mode="eval"))
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
            continue
        best = (re.sub(r"\s+", " ", expr.replace("**", "^")), _fmt(value))
    return best


def answer(question: str, served_name: str) -> str:
    a = arithmetic(question)
    if a:
        return f"The answer is {a[1]}."
    q = " ".join(question.split()[:24])
    if not q:
        return "Hello! How can I help you today?"
    return f"Hello! This is {served_name} answering: you said \"{q}\"."


def reasoning(question: str) -> str:
    a = arithmetic(question)
    q = " ".join(question.split()[:24])
    if a:
        return (f"Okay, the user asks: \"{q}\". This is arithmetic: {a[0]}. "
                f"Working it through, {a[0]} = {a[1]}. Let me double-check: yes, {a[1]}. "
                f"So the answer is {a[1]}.")
    return (f"Okay, the user says: \"{q}\". There is nothing to compute here, "
            "so I should reply briefly and helpfully.")


def gibberish(seed: str, n: int) -> str:
    """What random (dummy) weights produce: deterministic noise."""
    words = []
    h = hashlib.sha256(seed.encode()).digest()
    while len(words) < n:
        h = hashlib.sha256(h).digest()
        words.append("".join(chr(0x61 + b % 26) for b in h[:2 + h[3] % 6]))
    return " ".join(words)


def extend(pieces: list, at_least: int) -> list:
    """The output made at least `at_least` tokens long (the last piece goes on with filler words),
    as a model whose stop token is ignored keeps generating."""
    n = sum(len(w) for _, w in pieces)
    if n >= at_least:
        return pieces
    channel, words = pieces[-1] if pieces else ("content", [])
    filler = [FILLER[i % len(FILLER)] for i in range(at_least - n)]
    return (pieces[:-1] if pieces else []) + [(channel, list(words) + filler)]


FILLER = "and so the answer goes on at length as the stop token was ignored".split()


def take(words: list, budget: int):
    """(taken words, remaining budget, truncated?)"""
    if budget >= len(words):
        return words, budget - len(words), False
    return words[:budget], 0, True


def make_tool_call(tools: list, tool_choice, text: str):
    """Pick a tool and arguments deterministically, or None when the model would just answer."""
    funcs = [t.get("function", {}) for t in tools if isinstance(t, dict) and t.get("type", "function") == "function"]
    funcs = [f for f in funcs if f.get("name")]
    if not funcs or tool_choice == "none":
        return None
    chosen = None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        chosen = next((f for f in funcs if f["name"] == name), None)
    elif tool_choice == "required":
        chosen = funcs[0]
    else:  # auto: call a tool whose name words appear in the request
        low = text.lower()
        for f in funcs:
            parts = [p for p in re.split(r"[_\-.\s]+", f["name"].lower()) if len(p) > 2]
            if any(p in low for p in parts):
                chosen = f
                break
    if chosen is None:
        return None
    params = chosen.get("parameters") or {}
    props = params.get("properties") or {}
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    caps = re.findall(r"\b[A-Z][a-zA-Z]+(?:\s+[A-Z][a-zA-Z]+)*", text)
    caps = [c for c in caps if c.split()[0] not in ("What", "How", "Please", "Can", "Could", "The", "I", "Use", "Call")]
    args = {}
    for key in params.get("required") or list(props)[:1]:
        typ = (props.get(key) or {}).get("type", "string")
        enum = (props.get(key) or {}).get("enum")
        if enum:
            args[key] = enum[0]
        elif typ in ("number", "integer"):
            v = numbers.pop(0) if numbers else "0"
            args[key] = int(float(v)) if typ == "integer" else float(v)
        elif typ == "boolean":
            args[key] = True
        else:
            args[key] = caps.pop(0) if caps else " ".join(text.split()[-3:]) or "unknown"
    return chosen["name"], json.dumps(args)
