"""Every command-line option declared once: its kind (the type and range its text is parsed into),
its help and its default, beside the value it fills, and the rules across a command's options (one
needs another, two exclude each other, a form of the command uses only some). A command's options
are a dataclass whose fields are declared with `option(...)`; sparkprov/cli/command.py makes the
Invoke task of it, and `parse_options` turns the text Invoke hands over into that dataclass before
anything is read or touched. A value that does not fit, or options that contradict each other, are
one line naming the option (both, for a contradiction) and what it accepts: exit 1.

Invoke types an option by its default: `forks=None` arrives as a string, `streams=4` is cast with
`int()` by Invoke's own parser, which ends in a traceback for `--streams abc`. So every option that
takes a value reaches Invoke with a default of None (Invoke hands over the text as given, and None
means "not given"), and its kind parses the text here.

This module sits below every layer: the plays declare the options they take (plays/serve.py
UpOptions, cluster-up's), and the command line fills them.

Each parser takes the option's name as the user types it (without the dashes, underscores or
dashes both fine) and the raw value; None means "not given" and returns `default`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from sparkprov.defaults import DEFAULT_FORKS
from sparkprov.errors import InputError


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
    words = [p for p in re.split(r"[,:\s]+", value) if p]
    twice = next((w for i, w in enumerate(words) if w in words[:i]), None)
    if twice is not None:  # `spark1,spark1` would be one host where the user counted two
        raise OptionError(f"{_flag(name)} {_show(value)} names {twice!r} twice",
                          fix="name each host once")
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
    from sparkprov.imageref import IMAGE_RE

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


# -- kinds: what an option's text becomes ------------------------------------------------------------


class Kind:
    """How one option's text becomes its value. A `flag` takes no text (a switch); a kind that takes
    `many` is given once per value (`--recipes A --recipes B`)."""

    flag = False
    many = False

    def parse(self, name: str, raw: Any) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Flag(Kind):
    flag = True

    def parse(self, name: str, raw: Any) -> bool:
        return bool(raw)


@dataclass(frozen=True)
class Int(Kind):
    lo: int
    hi: int

    def parse(self, name: str, raw: Any) -> int | None:
        return int_option(name, raw, self.lo, self.hi)


@dataclass(frozen=True)
class Number(Kind):
    """A finite number in (lo, hi], or [lo, hi] with lo_open=False."""
    lo: float
    hi: float
    unit: str = ""
    lo_open: bool = True

    def parse(self, name: str, raw: Any) -> float | None:
        return float_option(name, raw, self.lo, self.hi, unit=self.unit, lo_open=self.lo_open)


@dataclass(frozen=True)
class Size(Kind):
    lo: int
    hi: int

    def parse(self, name: str, raw: Any) -> int | None:
        return size_option(name, raw, self.lo, self.hi)


@dataclass(frozen=True)
class Choice(Kind):
    choices: tuple[str, ...]

    def parse(self, name: str, raw: Any) -> str | None:
        return choice_option(name, raw, self.choices)


@dataclass(frozen=True)
class Words(Kind):
    """A comma-separated list, each word matching `pattern` (or one of `choices`)."""
    pattern: str = r"[A-Za-z0-9][A-Za-z0-9._:@/+-]*"
    allowed_text: str = "letters, digits and . _ - : @ / +"

    def parse(self, name: str, raw: Any) -> list[str] | None:
        return csv_option(name, raw, pattern=self.pattern, allowed_text=self.allowed_text)


@dataclass(frozen=True)
class Ints(Kind):
    """Comma-separated whole numbers, each from lo to hi: sorted, each once."""
    lo: int
    hi: int

    def parse(self, name: str, raw: Any) -> list[int] | None:
        words = csv_option(name, raw, pattern=r"[0-9]+", allowed_text="whole numbers")
        return None if words is None else sorted({int_option(name, w, self.lo, self.hi) for w in words})


@dataclass(frozen=True)
class Hosts(Kind):
    """A host pattern: names, groups, globs, !exclusions, &intersections; each word once."""

    def parse(self, name: str, raw: Any) -> str | None:
        return hosts_option(name, raw)


@dataclass(frozen=True)
class Text(Kind):
    """One line of text, not empty: a path, a name."""
    max_len: int = 4096

    def parse(self, name: str, raw: Any) -> str | None:
        return text_option(name, raw, max_len=self.max_len)


@dataclass(frozen=True)
class Files(Kind):
    """Files given one per use of the option (`--recipes A --recipes B`), each one line of text."""
    many = True

    def parse(self, name: str, raw: Any) -> list[str]:
        if raw is None:
            return []
        if isinstance(raw, str):  # a direct call with one file
            raw = [raw]
        return [text_option(name, v) for v in raw]


@dataclass(frozen=True)
class Pattern(Kind):
    """One line of text matching `regex` (said as `what`, with `example`)."""
    regex: str
    what: str
    example: str
    max_len: int = 256

    def parse(self, name: str, raw: Any) -> str | None:
        text = text_option(name, raw, max_len=self.max_len)
        if text is not None and not re.fullmatch(self.regex, text):
            raise OptionError(f"{_flag(name)} {text!r} is not {self.what}", fix=f"e.g. {_flag(name)} {self.example}")
        return text


@dataclass(frozen=True)
class Image(Kind):
    example: str = "vllm/vllm-openai:v0.19.1"

    def parse(self, name: str, raw: Any) -> str | None:
        return image_option(name, raw, example=self.example)


@dataclass(frozen=True)
class Address(Kind):
    example: str = "127.0.0.1"

    def parse(self, name: str, raw: Any) -> str | None:
        return address_option(name, raw, example=self.example)


@dataclass(frozen=True)
class Revision(Kind):
    def parse(self, name: str, raw: Any) -> str | None:
        return revision_option(name, raw)


# A deployment's name (a playbook's `name:`, cluster-up --name): it labels containers and names files.
DEPLOYMENT_NAME = r"[a-z0-9][a-z0-9_.-]{0,40}"
DEPLOYMENT = Pattern(DEPLOYMENT_NAME, "a deployment name (lowercase letters, digits, '.', '_', '-')", "qwen3.5-122b")


def option(help: str, kind: Kind | None = None, *, default: Any = None, positional: bool = False) -> Any:
    """A dataclass field that is a command-line option: its help, its kind (default: one line of
    text) and the value it holds when not given. A positional option is given without its name."""
    kind = kind or Text()
    if kind.many:
        return dataclasses.field(default_factory=list, metadata={"help": help, "kind": kind, "positional": positional})
    return dataclasses.field(default=bool(default) if kind.flag else default,
                             metadata={"help": help, "kind": kind, "positional": positional})


def options_of(cls: type) -> list[dataclasses.Field]:
    """The fields of an options dataclass that are command-line options, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "kind" in f.metadata]


# The options the commands that act on hosts share: each one's help written here once.
COMMON: dict[str, tuple[str, Kind]] = {
    "hosts": ("Hosts, groups or patterns to act on, comma-separated (default: all in the inventory)", Hosts()),
    "inventory": ("Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)", Text()),
    "limit": ("Further limit the selected hosts (pattern, e.g. 'spark2' or '!spark1')", Hosts()),
    "forks": (f"How many hosts to work on at once (default {DEFAULT_FORKS})", Int(1, 1024)),
    "accept_new_host_keys": ("Record host keys of hosts never seen before (a changed key is still refused)", Flag()),
    "json": ("Print one JSON document instead of the text and tables", Flag()),
}


def common(name: str, help: str | None = None) -> Any:
    """One of the COMMON options (`help`: where it means something narrower for this command)."""
    text, kind = COMMON[name]
    return option(help or text, kind, default=DEFAULT_FORKS if name == "forks" else None)


# -- rules across a command's options ----------------------------------------------------------------


@dataclass(frozen=True)
class Needs:
    """`option` means something only while `when` holds of the parsed options: said as `needed`
    (the options it takes), and `why` where that is not plain."""
    option: str
    when: Callable[[Any], bool]
    needed: str
    why: str = ""
    fix: str | None = None


@dataclass(frozen=True)
class Excludes:
    """`a` and `b` cannot both be given (`why`: what both of them decide)."""
    a: str
    b: str
    why: str


@dataclass(frozen=True)
class Form:
    """A form of the command (`monitor down`, `bench --export`): while `when` holds, the options
    outside `uses` do nothing, so giving one is refused."""
    name: str
    when: Callable[[Any], bool]
    uses: frozenset[str]


@dataclass(frozen=True)
class Check:
    """A rule of its own: `problem(o)` is (message, fix) when the parsed options contradict
    each other, else None."""
    problem: Callable[[Any], tuple[str, str] | None]


Rule = Needs | Excludes | Form | Check


def parse_options(cls: type, raw: dict[str, Any]) -> Any:
    """The options dataclass from the text Invoke hands over (None: not given; flags as booleans),
    every value parsed by its kind, then the class's RULES checked: the first problem raises
    OptionError naming the option (both, for a contradiction)."""
    values: dict[str, Any] = {}
    given: set[str] = set()
    for f in options_of(cls):
        kind: Kind = f.metadata["kind"]
        value = raw.get(f.name)
        if kind.flag:
            on = bool(value) if value is not None else f.default
            values[f.name] = on
            if on != f.default:
                given.add(f.name)
        elif kind.many:
            values[f.name] = kind.parse(f.name, value)
            if values[f.name]:
                given.add(f.name)
        elif value is None:
            values[f.name] = f.default
        else:
            values[f.name] = kind.parse(f.name, value)
            given.add(f.name)
    out = cls(**values)
    check_rules(out, getattr(cls, "RULES", ()), given)
    return out


def check_rules(o: Any, rules: Iterable[Rule], given: set[str]) -> None:
    for rule in rules:
        if isinstance(rule, Form):
            if rule.when(o):
                extra = [f.name for f in options_of(type(o)) if f.name in given and f.name not in rule.uses]
                if extra:
                    raise OptionError(f"{_flag(extra[0])} does nothing in {rule.name}",
                                      fix=f"leave out {_flag(extra[0])}")
        elif isinstance(rule, Needs):
            if rule.option in given and not rule.when(o):
                raise OptionError(f"{_flag(rule.option)} needs {rule.needed}" + (f": {rule.why}" if rule.why else ""),
                                  fix=rule.fix or f"give {rule.needed} too, or leave out {_flag(rule.option)}")
        elif isinstance(rule, Check):
            found = rule.problem(o)
            if found:
                raise OptionError(found[0], fix=found[1])
        elif rule.a in given and rule.b in given:
            raise OptionError(f"{_flag(rule.a)} and {_flag(rule.b)} {rule.why}", fix="give one of them")
