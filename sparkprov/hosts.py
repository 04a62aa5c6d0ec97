"""The hosts a run acts on: a resolved Host (how to reach it, its merged variables) and the
Inventory (the hosts, their groups, host patterns). data/inventory.py loads them from the
inventory file; the engine, the transport and the serving model take them as they are.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Literal

from pydantic import BaseModel, Field

from sparkprov.errors import InputError
from sparkprov.yamlpos import Positions


class Host(BaseModel):
    """A resolved host: connection settings with defaults applied, and merged variables."""

    name: str
    address: str
    connection: Literal["ssh", "local"] = "ssh"
    user: str | None = None
    port: int | None = None
    ssh_key: str | None = None
    known_hosts: str | None = None
    become_password_env: str | None = None
    become_password_file: str | None = None
    connect_timeout: float = 10.0
    vars: dict[str, Any] = Field(default_factory=dict)
    groups: list[str] = Field(default_factory=list)


class Inventory:
    def __init__(self, path: str, hosts: dict[str, Host], groups: dict[str, list[str]], pos: Positions,
                 vars_order: list[str] | None = None):
        self.path = path
        self.hosts = hosts
        self.groups = groups  # group -> host names (flattened)
        self.pos = pos
        self.vars_order = vars_order if vars_order is not None else list(groups)  # groups whose vars apply, in order

    def host_vars(self, name: str) -> dict[str, Any]:
        return dict(self.hosts[name].vars)

    def var_where(self, host: str, var: str) -> tuple:
        """Where the value a host has for `var` is written: its own vars, else the last of its
        groups' that sets it, else the inventory-wide vars."""
        own = ("hosts", host, "vars", var)
        if own in self.pos.marks:
            return own
        for group in reversed(self.vars_order):
            if host in self.groups.get(group, ()) and ("groups", group, "vars", var) in self.pos.marks:
                return ("groups", group, "vars", var)
        return ("vars", var)

    def var_error(self, host: str, var: str, message: str, *, fix: str | None = None) -> InputError:
        """An error at the line of the value `host` has for `var`."""
        return self.pos.error(self.var_where(host, var), message, fix=fix)

    def resolve(self, pattern: str | list[str], *, where: tuple[str, int | None, int | None] | None = None,
                what: str = "host pattern") -> list[str]:
        """Names matching a pattern: names, groups, `all`, globs, `!exclusions`, `&intersections`,
        comma-separated. Order follows the inventory. Unknown plain names are an error."""
        parts = pattern if isinstance(pattern, list) else [p for p in re.split(r"[,:\s]+", pattern) if p]
        order = list(self.hosts)
        chosen: set[str] = set()
        for raw in parts:
            raw = str(raw).strip()
            if not raw:
                continue
            neg, inter = raw.startswith("!"), raw.startswith("&")
            term = raw[1:] if (neg or inter) else raw
            matched = self._match(term)
            if matched is None:
                file, line, col = where or (self.path, None, None)
                close = close_match(term, list(self.hosts) + list(self.groups))
                raise InputError(f"unknown host or group {term!r} in {what}", file=file, line=line, column=col,
                                 fix=f"did you mean {close!r}?" if close else
                                 f"define it under hosts: or groups: in {self.path}")
            if neg:
                chosen -= matched
            elif inter:
                chosen &= matched
            else:
                chosen |= matched
        return [h for h in order if h in chosen]

    def _match(self, term: str) -> set[str] | None:
        if term == "all" or term == "*":
            return set(self.hosts)
        if term in self.groups:
            return set(self.groups[term])
        if term in self.hosts:
            return {term}
        if any(c in term for c in "*?["):
            return {h for h in self.hosts if fnmatch.fnmatchcase(h, term)} | {
                h for g, members in self.groups.items() if fnmatch.fnmatchcase(g, term) for h in members}
        return None



def close_match(term: str, names: list[str]) -> str | None:
    """The name a misspelt one most likely meant (None: none is close)."""
    import difflib

    found = difflib.get_close_matches(term, names, n=1)
    return found[0] if found else None
