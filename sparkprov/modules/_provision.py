"""Pieces the provision modules share: settings from args or inventory vars, atomic file
writes with ownership, the cluster order of hosts. (What the hosts of a play exported: Export.of_play.)"""

from __future__ import annotations

from typing import Any

from sparkprov import inventory_vars
from sparkprov.modules.base import HostContext
from sparkprov.transport.shell import cmd, heredoc_bytes, quote


def setting(value: Any, host: HostContext, var: str) -> Any:
    """An argument given in the task wins; else the inventory/play variable `var`, checked as
    declared (sparkprov/inventory_vars.py), else its declared default."""
    return inventory_vars.setting(value, host.vars, var)


def write_file_script(path: str, data: bytes, *, mode: str, owner: str | None = None,
                      group: str | None = None, umask: str = "077") -> str:
    """Write `data` to `path` atomically (temp file in the same directory, then rename), with
    mode and ownership set before it appears. `owner:` with an empty group = the login group.
    `umask` "022" for a record every user reads: a directory it makes is 0755, not 0700."""
    tmp = f"{path}.sparkprov-tmp"
    lines = [f"umask {umask}", cmd("mkdir", "-p", "--", path.rsplit("/", 1)[0] or "/"),
             heredoc_bytes(data, "cat > " + quote(tmp)).rstrip("\n"), cmd("chmod", mode, "--", tmp)]
    if owner or group:
        lines.append(cmd("chown", (owner or "") + ":" + (group or ""), "--", tmp))
    lines.append(cmd("mv", "-f", "--", tmp, path))
    return "\n".join(lines)


def cluster_order(host: HostContext) -> list[str]:
    """Every host sparkprov knows of, in a stable order: the members of the inventory's groups
    in inventory order, then the hosts of this run. Used to number hosts on the fabric."""
    seen: list[str] = []
    for members in (host.vars.get("groups") or {}).values():
        for m in members:
            if m not in seen:
                seen.append(m)
    for m in list(host.exports) + [host.name]:
        if m not in seen:
            seen.append(m)
    return seen
