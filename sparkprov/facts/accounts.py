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


# What the docker client prints when it cannot use the daemon (docker 28.2.2, captured: the socket
# of a running daemon without access, and no daemon at the socket). Both start on a line of their
# own; `docker image inspect --format` prints an empty line before them, so the first line of the
# output is not the reason.
_DOCKER_DENIED = ("permission denied while trying to connect to the docker daemon socket",
                  "got permission denied while trying to connect to the docker daemon socket")
_DOCKER_DOWN = ("cannot connect to the docker daemon", "is the docker daemon running?")
# `docker info --format '{{.ServerVersion}}'` when no daemon answered it (a lab host whose dockerd
# was just killed, docker 28.2.2): the client renders its template over no Info at all and prints
# only the template's failure.
_DOCKER_NO_INFO = "indirection through nil pointer to embedded struct field info"


def docker_reason(output: str) -> str:
    """docker's own reason from what its client printed: the line saying it could not reach or
    may not use the daemon, else the first line naming an error (not a WARNING), else the first
    line that is not blank."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        low = ln.lower()
        if low.startswith(_DOCKER_DENIED) or any(p in low for p in _DOCKER_DOWN) or _DOCKER_NO_INFO in low:
            return ln
    for ln in lines:
        if not ln.upper().startswith("WARNING") and any(w in ln.lower() for w in ("error", "denied", "cannot")):
            return ln
    return lines[0] if lines else ""


def docker_unusable(output: str) -> str:
    """Which of docker's failures this is: "down" (no daemon answers at the socket), "denied"
    (a daemon answers, this user may not use it: not in the docker group), or "other"."""
    low = docker_reason(output).lower()
    if low.startswith(_DOCKER_DENIED) or "connect: permission denied" in low:
        return "denied"
    if any(p in low for p in _DOCKER_DOWN) or _DOCKER_NO_INFO in low:
        return "down"
    return "other"


def docker_problem(output: str, host: str, user: str | None) -> str:
    """One line (the caller puts the host before it) for a command that needs docker on `host`
    and cannot use it, with the fix that fits: start the daemon, or let the user use it
    (provision adds the user to the docker group)."""
    reason = docker_reason(output) or "docker gave no reason"
    kind = docker_unusable(output)
    who = user or "the login user"
    if kind == "down":
        if _DOCKER_NO_INFO in reason.lower():
            reason = f"no daemon answered docker info ({reason})"
        return f"dockerd is down: {reason} (fix: start docker on the host: sudo systemctl start docker)"
    if kind == "denied":
        return (f"{who} may not use docker: {reason} "
                f"(fix: invoke provision --hosts {host} --tags docker, which adds {who} to the docker group)")
    return f"docker cannot be used: {reason} (fix: check docker on the host: docker info)"
