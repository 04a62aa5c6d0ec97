"""What every foreign recipe's value must be, whichever format holds it (the importer and the readers
of sparkprov/catalog/import_formats.py check through these): one value, a command with lines only
where \\n ends them, and only the top-level keys its format has."""

from __future__ import annotations

import difflib
import re
from typing import Any

from sparkprov.errors import one_line
from sparkprov.yamlpos import Positions

# What ends a line for someone (Python's str.splitlines, YAML, a terminal). In a foreign value each one
# splits one value into two lines, and a line of a command into two options: a value holds none of
# them. In a command only \n separates its lines.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
# A shell expansion: the foreign tool's shell would have replaced it; sparkprov runs no shell, so it
# would reach vLLM as these very characters.
_EXPANSION = re.compile(r"\$\([^)]{0,40}\)?|\$\{[^}]{0,40}\}?|\$[A-Za-z_][A-Za-z0-9_]*|`[^`]{0,40}`?")


def _line_break(text: str) -> str | None:
    return next((c for c in text if c in LINE_BREAKS), None)


def not_one_value(text: str) -> tuple[str, str, str] | None:
    """(what, the part of `text` that shows it, fix) when a foreign value is more than one value: a
    line break in it, or a shell expansion; None for one value."""
    brk = _line_break(text)
    if brk is not None:
        return (f"a line break ({one_line(brk)})", brk,
                "write the value on one line: a line break in it would start another option")
    m = _EXPANSION.search(text)
    if m:
        return (f"the shell expansion {m[0]!r}", m[0],
                "write the value itself: sparkprov runs no shell, so it would reach vLLM as these characters")
    return None


def one_value(value: Any, where: tuple, pos: Positions, what: str, *, text: str | None = None) -> None:
    """Refuse a foreign value that is not one value, at its line (`text`: the value as the file holds
    it at `where`, when `value` is a part of it, such as one word of a command)."""
    if not isinstance(value, str):
        return
    found = not_one_value(value)
    if found:
        raise pos.error_in(where, text if text is not None else value, found[1],
                           f"{what}: {value[:60]!r} holds {found[0]}", fix=found[2])


def command_text(text: str, where: tuple, pos: Positions) -> None:
    """A command (a shell context in its own tool) has lines only where \\n ends them: a CR, a form
    feed or a Unicode line separator would be a line break to one reader and not to another."""
    brk = next((c for c in text if c in LINE_BREAKS and c != "\n"), None)
    if brk is not None:
        raise pos.error_in(where, text, brk, f"the command holds a line break other than \\n ({one_line(brk)})",
                           fix="end each line of the command with a plain newline")


def check_keys(data: dict[str, Any], known: set[str], what: str, pos: Positions) -> None:
    """A top-level key the format does not have is named, with the keys it has."""
    for key in data:
        if str(key) not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            raise pos.error((key,), f"{str(key)[:40]!r} is not a key of {what}", key=True,
                            fix=f"did you mean {close[0]!r}?" if close else f"its keys: {', '.join(sorted(known))}")
