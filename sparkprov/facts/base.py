"""The fact contract: parameterised reads of a host's state, gathered many at a time in one
remote call (the engine's gather script: sparkprov/engine/gather.py).

A fact is a frozen dataclass (its parameters are its identity) with a `command` (POSIX sh,
built with quoting) and a pure `parse`. The gather script runs as the login user; facts that
need root run through `__sp_root`, which the script defines from what sudo allows.
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass
from typing import Any, ClassVar

from sparkprov.transport.shell import quote


# systemd is the init: its runtime directory *and* its private socket (what systemctl talks to as
# root). The directory alone is not proof: `netplan generate` creates /run/systemd/system
# (netplan-ovs-cleanup.service) on any host it runs on, systemd or not; found in the lab, whose
# hosts boot their fabric through netplan and then looked like systemd hosts to the guard.
SYSTEMD_IS_INIT = "[ -d /run/systemd/system ] && [ -S /run/systemd/private ]"


def home_of(var: str, user: str) -> str:
    """Shell that sets $var to USER's home (a shell word: "$u", a quoted name) from the passwd
    entry: its sixth field, cut by parameter expansions (no process beyond getent); empty when
    the user is unknown."""
    return f'{var}=$(getent passwd {user} 2>/dev/null); {var}=${{{var}#*:*:*:*:*:}}; {var}=${{{var}%%:*}}'


class ShellCtx:
    """What a fact's command may need to know about the host while being rendered."""

    def __init__(self, home: str | None):
        self.home = home

    def path(self, p: str) -> str:
        """A path as a shell word; `~` means the login user's home."""
        if p == "~" or p.startswith("~/"):
            rest = p[2:]
            if self.home:
                return quote(self.home.rstrip("/") + ("/" + rest if rest else ""))
            return '"$__sp_home"' + (quote("/" + rest) if rest else "")
        return quote(p)


@dataclass(frozen=True)
class Fact:
    needs_root: ClassVar[bool] = False

    @property
    def key(self) -> tuple:
        return (type(self).__name__,) + astuple(self)

    def command(self, sh: ShellCtx) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def parse(self, out: str, err: str, rc: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __str__(self) -> str:
        params = ", ".join(repr(v) for v in astuple(self))
        return f"{type(self).__name__}({params})"


class FactError(Exception):
    """A fact whose output could not be understood; the task reading it fails."""


# -- the host's identity: always gathered -------------------------------------------------

@dataclass(frozen=True)
class HostInfo(Fact):
    """Who we are and what the machine is. Read first, on every host."""

    def command(self, sh: ShellCtx) -> str:
        return (
            "printf 'user=%s\\nuid=%s\\nhome=%s\\n' \"${__sp_user:-$(id -un)}\" \"${__sp_uid:-$(id -u)}\" \"$__sp_home\"; "
            # hostname and kernel through `read` (a builtin): one process fewer each, per host
            "read -r __h < /proc/sys/kernel/hostname; read -r __k < /proc/sys/kernel/osrelease; "
            "printf 'hostname=%s\\narch=%s\\nkernel=%s\\n' \"$__h\" \"$(uname -m)\" \"$__k\"; "
            "sed -n -e 's/^\\(ID\\|VERSION_ID\\|PRETTY_NAME\\)=/os_&/p' "
            "-e 's/^\\(DGX_NAME\\|DGX_PRETTY_NAME\\|DGX_OTA_VERSION\\)=/&/p' /etc/os-release /etc/dgx-release 2>/dev/null; :"
        )

    def parse(self, out: str, err: str, rc: int) -> dict[str, str]:
        info: dict[str, str] = {}
        for line in out.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                info[key.strip().lower()] = value.strip().strip('"')
        if "user" not in info:
            raise FactError(f"host info unreadable: {err.strip() or out.strip()}")
        return info


def key_values(text: str) -> dict[str, str]:
    """`key=value` lines of a fact's script (keys in lowercase and _), other lines passed over."""
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep and re.fullmatch(r"[a-z_]+", k):
            out[k] = v
    return out
