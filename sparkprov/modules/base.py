"""The module contract (Ansible's, with pyinfra's split between reading and planning).

A module says which facts it reads, and plans from those facts alone: either nothing to do,
or a list of changes, each with a human summary, an optional before/after diff, the script
that makes it so, and the facts that script touches (read again afterwards to verify).
"""

from __future__ import annotations

import difflib
import posixpath
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generic, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict

from sparkprov.facts.base import Fact, FactError


class ModuleArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class Diff:
    """Before and after of one thing (a file, a setting, a membership)."""

    label: str
    before: str
    after: str

    def unified(self) -> str:
        lines = difflib.unified_diff(self.before.splitlines(keepends=True), self.after.splitlines(keepends=True),
                                     fromfile=f"before: {self.label}", tofile=f"after: {self.label}")
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)

    def as_dict(self) -> dict[str, str]:
        return {"label": self.label, "before": self.before, "after": self.after}


@dataclass
class Change:
    summary: str
    script: str
    diff: Diff | None = None
    touches: list[Fact] = field(default_factory=list)
    reconnect: bool = False  # group membership only counts in a new login session
    verify: bool = True      # re-plan after applying must find nothing left to do
    # What the touched facts will read once applied. Check mode records these so that later
    # tasks plan against the state earlier tasks would have made (a group about to be created
    # is there for the membership task that follows).
    predicts: list[tuple[Fact, Any]] = field(default_factory=list)
    # None: as the task says. A change that alone needs root (dropping the page cache before a
    # load) says True, and the engine sends it in a call of its own.
    become: bool | None = None
    timeout: float | None = None  # seconds this change may take (a model load, a download)
    # Reads what the change's script printed and says why it failed (None: it worked). For the
    # stateful steps whose result is an answer, not a state: a smoke test, a benchmark.
    outcome: Callable[[str], str | None] | None = None
    exports: dict[str, Any] = field(default_factory=dict)  # what it found out, for other hosts and plays
    # What it changes is not known beyond `touches` (an arbitrary command): the tasks after it
    # plan against the host as it really is after it, so the engine applies it before planning them.
    opaque: bool = False
    # Run on the control machine right before this change's call (never in check mode); the
    # (local file, path under the login user's home) pairs it returns are uploaded first.
    prepare: Callable[[], list[tuple[str, str]]] | None = None
    last_output: str = ""  # set by the engine: what the script printed (for outcome)


@dataclass
class Plan:
    changes: list[Change] = field(default_factory=list)
    msg: str = ""
    failed: str | None = None
    skipped: str | None = None
    warnings: list[str] = field(default_factory=list)
    exports: dict[str, Any] = field(default_factory=dict)  # values other hosts and plays may read

    @classmethod
    def fail(cls, msg: str, **kw) -> "Plan":
        return cls(failed=msg, **kw)

    @classmethod
    def skip(cls, reason: str, **kw) -> "Plan":
        return cls(skipped=reason, **kw)

    @property
    def changed(self) -> bool:
        return bool(self.changes)


T = TypeVar("T")

Exports = Mapping[str, Mapping[str, Any]]  # host name -> what its tasks exported, key -> value


class Export(Generic[T]):
    """One value a module exports for other hosts and plays, declared beside the module that
    produces it: its key in the run's exports and its type (a TypedDict, or a mapping of them).
    The producer writes it with `X(value)` (the dict Plan.exports and Change.exports take),
    every reader goes through `X.read(exports, host)`, so renaming or retyping it is one edit and
    a reader of an export nobody declares fails at import. The value is stored as the plain
    dict or list it is, so a reader that still indexes exports[host][key] keeps working."""

    declared: ClassVar[dict[str, "Export[Any]"]] = {}  # key -> its declaration, every module's

    def __init__(self, key: str, type_: type[T] | Any, doc: str = ""):
        # the declaring module, so that a second declaration of a key (a typo in another module) fails
        # at import while reloading the same module does not
        owner = sys._getframe(1).f_globals.get("__name__", "")
        other = Export.declared.get(key)
        if other is not None and other.owner != owner:
            raise ValueError(f"export {key!r} is declared in {other.owner} and again in {owner}")
        self.key, self.type, self.doc, self.owner = key, type_, doc, owner
        Export.declared[key] = self

    def __repr__(self) -> str:
        return f"Export({self.key!r} of {self.owner})"

    def __call__(self, value: T) -> dict[str, T]:
        """The entry for Plan(exports=...) or Change.exports; several: {**A(a), **B(b)}."""
        return {self.key: value}

    def read(self, exports: Exports, host: str) -> T | None:
        """What `host` exported under this declaration in the run so far (None: nothing)."""
        return (exports.get(host) or {}).get(self.key)

    def entry(self, exports: Exports, host: str, key: str) -> Any:
        """One entry of what `host` exported under this declaration: a deployment's (the value keyed
        by its name), an image's, a field's (None: the host exported none, or none for `key`)."""
        value = self.read(exports, host)
        return None if value is None else value.get(key)

    def of(self, exported: Mapping[str, Any]) -> T | None:
        """This value from one host's exports."""
        return exported.get(self.key)

    def by_host(self, exports: Exports, hosts: list[str] | None = None) -> dict[str, T]:
        """host -> value, for the hosts (default: every host of the run) that exported it."""
        found = {h: (exports.get(h) or {}).get(self.key) for h in (exports if hosts is None else hosts)}
        return {h: v for h, v in found.items() if v is not None}

    def of_play(self, host: "HostContext") -> dict[str, T]:
        """host -> value for the hosts of the planning host's play that exported it (while the
        engine plans one host at a time, for the hosts planned so far)."""
        return self.by_host(host.exports, host.play_hosts or list(host.exports))


class HostContext:
    """What a module may know about the host it plans for, besides its facts."""

    def __init__(self, name: str, vars: dict[str, Any], info: dict[str, str], *, check: bool,
                 exports: dict[str, dict[str, Any]], play_hosts: list[str], become: bool):
        self.name = name
        self.vars = vars
        self.info = info
        self.check = check
        self.exports = exports  # host name -> exported values (all hosts of the run)
        self.play_hosts = play_hosts
        self.become = become

    @property
    def user(self) -> str:
        return self.info.get("user", "")

    @property
    def home(self) -> str:
        return self.info.get("home", "")

    def path(self, p: str) -> str:
        """Expand `~` to the login user's home, as every module sees paths."""
        if p == "~" or p.startswith("~/"):
            return posixpath.normpath(self.home.rstrip("/") + p[1:]) if self.home else p
        return p


class FactView:
    """Read-only access to gathered facts; a fact that failed to parse raises FactError."""

    def __init__(self, values: dict[tuple, Any], errors: dict[tuple, str]):
        self._values = values
        self._errors = errors

    def bind(self, named: dict[str, Fact]) -> "NamedFacts":
        return NamedFacts(self, named)

    def __getitem__(self, fact: Fact) -> Any:
        if fact.key in self._errors:
            raise FactError(f"{fact}: {self._errors[fact.key]}")
        if fact.key not in self._values:
            raise FactError(f"{fact} was not gathered (declare it in facts())")
        return self._values[fact.key]


class NamedFacts:
    """The facts a module declared in `needs`, read by the names it gave them: `facts.store`.
    Each fact is declared once; a name that was not declared is an AttributeError at once."""

    def __init__(self, view: FactView, named: dict[str, Fact]):
        self._view = view
        self._named = named

    def __getattr__(self, name: str) -> Any:
        try:
            fact = self._named[name]
        except KeyError:
            raise AttributeError(f"fact {name!r} is not declared in needs()") from None
        return self._view[fact]

    def fact(self, name: str) -> Fact:
        return self._named[name]

    def named(self, name: str) -> Any:
        """A fact whose name is not an identifier (e.g. "group docker")."""
        return self._view[self._named[name]]


class Module:
    """A module declares the facts it reads once, by name, in `needs`; `plan` reads them as
    `facts.NAME` (the engine hands it NamedFacts through `view`). `facts` is what the engine
    gathers: the same declaration."""

    name: ClassVar[str]
    Args: ClassVar[type[ModuleArgs]]
    doc: ClassVar[str] = ""

    def needs(self, args: Any, host: HostContext) -> dict[str, Fact]:
        return {}

    def facts(self, args: Any, host: HostContext) -> list[Fact]:
        return list(self.needs(args, host).values())

    def stale(self, args: Any, host: HostContext) -> list[Fact]:
        """Facts of this host that another host's task may have changed since they were read
        (bytes another host sent here): the engine reads them again before planning."""
        return []

    def view(self, args: Any, facts: FactView, host: HostContext) -> "NamedFacts":
        return facts.bind(self.needs(args, host))

    def plan(self, args: Any, facts: FactView, host: HostContext) -> Plan:  # pragma: no cover
        raise NotImplementedError

