"""Facts about users and groups, read from the name service (getent), as the system sees them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.transport.shell import quote


@dataclass(frozen=True)
class GroupInfo(Fact):
    name: str

    def command(self, sh: ShellCtx) -> str:
        return f"getent group {quote(self.name)} || test $? -eq 2"

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any] | None:
        if rc != 0:
            raise FactError(err.strip() or f"getent failed (rc={rc})")
        line = out.strip()
        if not line:
            return None
        name, _pw, gid, members = (line.split(":") + [""])[:4]
        return {"name": name, "gid": int(gid), "members": [m for m in members.split(",") if m]}


@dataclass(frozen=True)
class UserInfo(Fact):
    name: str

    def command(self, sh: ShellCtx) -> str:
        u = quote(self.name)
        return f"if getent passwd {u}; then id -Gn {u}; fi"

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any] | None:
        if rc != 0:
            raise FactError(err.strip() or f"getent failed (rc={rc})")
        lines = out.splitlines()
        if not lines:
            return None
        fields = lines[0].split(":")
        if len(fields) < 7:
            raise FactError(f"unexpected passwd line {lines[0]!r}")
        return {"name": fields[0], "uid": int(fields[2]), "gid": int(fields[3]), "home": fields[5],
                "shell": fields[6], "groups": lines[1].split() if len(lines) > 1 else []}
