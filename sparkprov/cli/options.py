"""Every command-line option parsed into its type and range, in one place.

Invoke types an option by its default: `forks=None` arrives as a string, `streams=4` is cast with
`int()` by Invoke's own parser, which ends in a traceback for `--streams abc`. So the tasks declare
typed options with a default of None (Invoke hands over the text as given) and parse the text here;
a value that does not fit is one line naming the option and what it accepts, exit 1, before
anything is read or touched.

Each parser takes the option's name as the user types it (without the dashes, underscores or
dashes both fine) and the raw value; None means "not given" and returns `default`.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import sys
from typing import Iterable, Sequence

from sparkprov.errors import InputError

__all__ = ["OptionError", "int_option", "float_option", "choice_option", "csv_option", "size_option",
           "hosts_option", "text_option", "image_option", "address_option", "inventory_host_option", "positional",
           "FORKS", "parse_forks"]


class OptionError(InputError):
    """A command-line option with a value it does not accept (exit 1, nothing touched)."""


def _flag(name: str) -> str:
    return "--" + name.lstrip("-").replace("_", "-")


def _show(value) -> str:
    # repr() keeps an empty or whitespace-only value visible; InputError.line() escapes
    # control characters, so a pasted newline cannot split the message.
    return repr(value) if isinstance(value, str) else repr(str(value))


def int_option(name: str, value, lo: int, hi: int, *, default: int | None = None) -> int | None:
    """A whole number from lo to hi (decimal only: '0x10', '1e3', '4.0' and booleans are refused)."""
    if value is None:
        return default
    if isinstance(value, bool):  # a flag given without a value
        raise OptionError(f"{_flag(name)} needs a value", fix=f"give a whole number from {lo} to {hi}")
    if isinstance(value, int):
        v = value
    else:
        text = str(value).strip()
        if not re.fullmatch(r"[+-]?[0-9]{1,30}", text):
            raise OptionError(f"{_flag(name)} {_show(value)} is not a whole number",
                              fix=f"give a whole number from {lo} to {hi}")
        v = int(text, 10)
    if not lo <= v <= hi:
        raise OptionError(f"{_flag(name)} {v} is out of range", fix=f"give a whole number from {lo} to {hi}")
    return v


def float_option(name: str, value, lo: float, hi: float, *, default: float | None = None,
                 lo_open: bool = True, unit: str = "") -> float | None:
    """A finite number in (lo, hi] (or [lo, hi] with lo_open=False); 'nan', 'inf' are refused."""
    if value is None:
        return default
    what = f" of {unit}" if unit else ""
    accepted = f"a number{what} {'above' if lo_open else 'from'} {lo:g} {'and at most' if lo_open else 'to'} {hi:g}"
    if isinstance(value, bool):
        raise OptionError(f"{_flag(name)} needs a value", fix=f"give {accepted}")
    try:
        v = float(value) if isinstance(value, (int, float)) else float(str(value).strip())
    except ValueError:
        raise OptionError(f"{_flag(name)} {_show(value)} is not a number", fix=f"give {accepted}") from None
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise OptionError(f"{_flag(name)} {_show(value)} is out of range", fix=f"give {accepted}")
    return v


def choice_option(name: str, value, choices: Sequence[str], *, default: str | None = None) -> str | None:
    """One of a fixed set of words (exact, case-sensitive: what the help lists)."""
    if value is None:
        return default
    if not isinstance(value, str) or value not in choices:
        raise OptionError(f"{_flag(name)} {_show(value)} is not one of {', '.join(choices)}",
                          fix=f"e.g. {_flag(name)} {choices[0]}")
    return value


def csv_option(name: str, value, *, choices: Iterable[str] | None = None,
               pattern: str = r"[A-Za-z0-9][A-Za-z0-9._:@/+-]*", default: list[str] | None = None,
               allowed_text: str = "letters, digits and . _ - : @ / +") -> list[str] | None:
    """A comma-separated list of words. Given but empty ('', ' , ') is an error, not "nothing":
    a script with an empty variable must not silently mean "no filter"."""
    if value is None:
        return default
    if not isinstance(value, str):
        raise OptionError(f"{_flag(name)} needs a value", fix=f"e.g. {_flag(name)} a,b")
    items = [v.strip() for v in value.split(",")]
    words = [v for v in items if v]
    if not words:
        raise OptionError(f"{_flag(name)} {_show(value)} names nothing", fix=f"give one or more names, comma-separated, or leave out {_flag(name)}")
    allowed = list(choices) if choices is not None else None
    for w in words:
        if allowed is not None and w not in allowed:
            raise OptionError(f"{_flag(name)}: {_show(w)} is not one of {', '.join(allowed)}",
                              fix=f"e.g. {_flag(name)} {allowed[0]}" if allowed else None)
        if allowed is None and not re.fullmatch(pattern, w):
            raise OptionError(f"{_flag(name)}: {_show(w)} is not a valid name",
                              fix=f"use {allowed_text}")
    return list(dict.fromkeys(words))


_SIZE = re.compile(r"([0-9]{1,15})\s*([KMGT]?)(i?B?)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def size_option(name: str, value, lo: int, hi: int, *, default: int | None = None) -> int | None:
    """A byte count: 1048576, 512K, 256M, 2G, 1T (binary units, as nccl-tests reads them)."""
    if value is None:
        return default
    m = _SIZE.fullmatch(str(value).strip()) if not isinstance(value, bool) else None
    accepted = f"a size from {human(lo)} to {human(hi)}, e.g. 256M or 2G"
    if not m:
        raise OptionError(f"{_flag(name)} {_show(value)} is not a size", fix=f"give {accepted}")
    v = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if not lo <= v <= hi:
        raise OptionError(f"{_flag(name)} {_show(value)} is out of range", fix=f"give {accepted}")
    return v


def human(n: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def hosts_option(name: str, value) -> str | None:
    """A host pattern (names, groups, globs, !exclusions, &intersections, comma-separated).
    Not given: None (the command's default). Given but empty or only separators: an error, since
    `--hosts "$EMPTY"` must never widen to every host."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise OptionError(f"{_flag(name)} needs a value", fix=f"e.g. {_flag(name)} spark1,spark2")
    if not [p for p in re.split(r"[,:\s]+", value) if p]:
        raise OptionError(f"{_flag(name)} {_show(value)} names no host",
                          fix=f"give host or group names, e.g. {_flag(name)} spark1,spark2 (or leave out {_flag(name)})")
    if not re.fullmatch(r"[A-Za-z0-9._\-*?\[\]!&,:\s]+", value):
        bad = next(c for c in value if not re.fullmatch(r"[A-Za-z0-9._\-*?\[\]!&,:\s]", c))
        raise OptionError(f"{_flag(name)} {_show(value)}: {_show(bad)} cannot appear in a host pattern",
                          fix="use host and group names, * ? [ ] globs, !name and &name, comma-separated")
    return value


def text_option(name: str, value, *, default: str | None = None, max_len: int = 4096) -> str | None:
    """Free text that must not be empty and stays one line (a path, an image reference, a name)."""
    if value is None:
        return default
    if not isinstance(value, str) or not value.strip():
        raise OptionError(f"{_flag(name)} {_show(value) if isinstance(value, str) else ''} is empty".replace("  ", " "),
                          fix=f"give a value or leave out {_flag(name)}")
    if len(value) > max_len or any(not c.isprintable() for c in value):
        raise OptionError(f"{_flag(name)} {_show(value[:80])}: control characters or too long",
                          fix=f"give one line of at most {max_len} characters")
    return value


def revision_option(name: str, value) -> str | None:
    """A hub revision: a branch, a tag, refs/pr/N or a commit id."""
    if value is None:
        return None
    text_option(name, value, max_len=256)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", value) or ".." in value or value.endswith("/"):
        raise OptionError(f"{_flag(name)} {_show(value)} is not a branch, tag or commit",
                          fix=f"e.g. {_flag(name)} main, {_flag(name)} refs/pr/1 or a 40-character commit id")
    return value


def image_option(name: str, value, *, example: str) -> str | None:
    """An image reference: registry/repo[:tag][@sha256:...], as recipes write it."""
    from sparkprov.catalog.load import IMAGE_RE  # the catalog (pydantic) here: `invoke --list` imports this module

    image = text_option(name, value, max_len=512)
    if image is not None and not IMAGE_RE.match(image):
        raise OptionError(f"{_flag(name)} {image!r} is not an image reference", fix=f"e.g. {_flag(name)} {example}")
    return image


def address_option(name: str, value, *, example: str) -> str | None:
    """An IP address (v4 or v6), as a listener binds it."""
    address = text_option(name, value, max_len=64)
    if address is not None:
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise OptionError(f"{_flag(name)} {address!r} is not an IP address",
                              fix=f"e.g. {_flag(name)} {example}") from None
    return address


def inventory_host_option(name: str, value, inventory) -> str | None:
    """One host of the inventory, by its name."""
    host = text_option(name, value, max_len=256)
    if host is not None and host not in inventory.hosts:
        raise OptionError(f"{_flag(name)} {host!r} is not a host of {inventory.path}",
                          fix=f"one of {', '.join(list(inventory.hosts)[:8])}")
    return host


def positional(task: str, name: str, value) -> str:
    """A task's first argument (a model, alias or playbook). Invoke fills it with whatever comes
    first, so `invoke stage-weights --help` arrives here as the model '--help': that is shown
    the task's help, as `invoke --help stage-weights` does; any other option in its place is one
    line saying where the argument goes."""
    if value in ("--help", "-h") and task in sys.argv:
        at = sys.argv.index(task)
        os.execv(sys.executable, [sys.executable, "-m", "invoke", *sys.argv[1:at], "--help", task])
    text_option(name, value)
    if value.startswith("-"):
        raise OptionError(f"{task}: {value!r} stands where the {name} goes",
                          fix=f"give the {name} first: invoke {task} {name.upper()} [options] "
                              f"(the options: invoke --help {task})")
    return value


FORKS = (1, 1024)


def parse_forks(value, default: int) -> int:
    """--forks, shared by every command that works on hosts in parallel."""
    return int_option("forks", value, *FORKS, default=default)
