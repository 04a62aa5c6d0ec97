"""Facts about what a host lets in: its listening sockets (`ss -H -tulpn`) and sparkprov's own
nftables tables (`inet sparkprov-DEPLOYMENT`, see modules/firewall.py). Both are read as root:
`ss` names the processes of other users (the containers' root processes) only to root, and
nftables is root's."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx

TABLE_PREFIX = "sparkprov-"  # every table sparkprov makes, one per deployment
_USERS = re.compile(r'\("([^"]*)",pid=(\d+),fd=\d+\)')


def split_addr(local: str) -> tuple[str, str, int]:
    """`ss`'s local address column as (address, interface, port): `0.0.0.0:22`, `[::]:22`,
    `*:6379`, `127.0.0.53%lo:53`, `[::ffff:10.0.0.1]:80`, `[fe80::1]%eth0:546`."""
    addr, _, port = local.rpartition(":")
    iface = ""
    if "%" in addr:
        addr, _, iface = addr.partition("%")
    addr = addr.strip("[]")
    if not port.isdigit():
        raise ValueError(f"no port in {local!r}")
    return addr, iface, int(port)


def parse_ss(out: str) -> list[dict[str, Any]]:
    """`ss -H -tulpn` (no header): one row per listening TCP socket and bound UDP socket. Columns:
    Netid State Recv-Q Send-Q Local Peer [Process]. The process column lists every process that
    holds the socket: `users:(("raylet",pid=12,fd=30),("python",pid=13,fd=9))`."""
    rows = []
    for line in out.splitlines():
        words = line.split()
        if len(words) < 6 or words[0] not in ("tcp", "udp"):
            continue
        try:
            addr, iface, port = split_addr(words[4])
        except ValueError:
            continue
        procs = [{"name": n, "pid": int(p)} for n, p in _USERS.findall(" ".join(words[6:]))]
        rows.append({"proto": words[0], "state": words[1], "address": addr, "iface": iface, "port": port,
                     "processes": procs})
    return rows


@dataclass(frozen=True)
class ListeningSockets(Fact):
    """Every listening TCP and bound UDP socket, with the processes holding it and, per process,
    the container ID in its cgroup path (`docker-ID.scope` under systemd, `docker/ID` with
    cgroupfs, `PARENT/ID` with a --cgroup-parent as in the lab), matched to containers later."""

    needs_root = True

    def command(self, sh: ShellCtx) -> str:
        return ("command -v ss >/dev/null 2>&1 || { echo @noss; exit 0; }\n"
                "o=$(ss -H -tulpn) || exit $?\nprintf '%s\\n' \"$o\"\necho @cgroups\n"
                # the container of each pid: one read of /proc per process that holds a socket
                "for p in $(printf '%s\\n' \"$o\" | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -un); do "
                "c=$(grep -o -m1 '[0-9a-f]\\{64\\}' /proc/$p/cgroup 2>/dev/null | head -n 1); "
                "[ -z \"$c\" ] || echo \"$p $c\"; done")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        if out.strip() == "@noss":
            raise FactError("ss is not installed (iproute2)")
        if rc != 0:
            raise FactError(err.strip() or f"ss failed (rc={rc})")
        body, _, cg = out.partition("@cgroups\n")
        containers = {}
        for line in cg.splitlines():
            pid, _, cid = line.partition(" ")
            if pid.isdigit() and len(cid) == 64:
                containers[int(pid)] = cid
        rows = parse_ss(body)
        for r in rows:
            for p in r["processes"]:
                p["container_id"] = containers.get(p["pid"])
        return {"sockets": rows}


_TABLE = re.compile(r"^table inet (\S+) \{$", re.M)
_COMMENT = re.compile(r'^\s*comment "([^"]*)"$', re.M)
_MEMBERS = re.compile(r"elements = \{([^}]*)\}")
_DROP = re.compile(r"th dport \{([^}]*)\} drop")
_OPEN = re.compile(r"tcp dport \{([^}]*)\} accept")


def port_set(text: str) -> list[tuple[int, int]]:
    """`22, 8000, 10001-19999` as [(22, 22), (8000, 8000), (10001, 19999)]."""
    out = []
    for part in text.replace("\n", " ").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit():
            out.append((int(lo), int(hi) if hi.isdigit() else int(lo)))
    return out


def parse_tables(out: str) -> dict[str, dict[str, Any]]:
    """sparkprov's tables as `nft list table inet NAME` prints them, one after another: per table
    its comment (the desired rules' hash), member addresses, the ports closed to others and the
    ones kept open."""
    tables: dict[str, dict[str, Any]] = {}
    starts = list(_TABLE.finditer(out))
    for i, m in enumerate(starts):
        text = out[m.start(): starts[i + 1].start() if i + 1 < len(starts) else len(out)]
        if not m.group(1).startswith(TABLE_PREFIX):
            continue
        comment = _COMMENT.search(text)
        members = _MEMBERS.search(text)
        drop, keep = _DROP.search(text), _OPEN.search(text)
        tables[m.group(1)] = {
            "comment": comment.group(1) if comment else "",
            "members": [a.strip() for a in members.group(1).replace("\n", " ").split(",") if a.strip()]
            if members else [],
            "closed": port_set(drop.group(1)) if drop else [], "open": port_set(keep.group(1)) if keep else []}
    return tables


@dataclass(frozen=True)
class FirewallTables(Fact):
    """sparkprov's nftables tables on the host (`inet sparkprov-*`); `nft` None: not installed."""

    needs_root = True

    def command(self, sh: ShellCtx) -> str:
        return ("command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || { echo @nonft; exit 0; }\n"
                "PATH=$PATH:/usr/sbin\n"
                "for t in $(nft list tables inet | awk '$3 ~ /^" + TABLE_PREFIX + "/ {print $3}'); do "
                "nft list table inet \"$t\"; done")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        if out.strip() == "@nonft":
            return {"nft": False, "tables": {}}
        if rc != 0:
            raise FactError(err.strip() or f"nft failed (rc={rc})")
        return {"nft": True, "tables": parse_tables(out)}


@dataclass(frozen=True)
class EphemeralPorts(Fact):
    """The kernel's range for ephemeral ports: where Gloo, NCCL, vLLM's ZMQ sockets and Ray's
    unnamed ports listen (they bind port 0)."""

    def command(self, sh: ShellCtx) -> str:
        return "cat /proc/sys/net/ipv4/ip_local_port_range"

    def parse(self, out: str, err: str, rc: int) -> tuple[int, int]:
        words = out.split()
        if rc != 0 or len(words) != 2 or not all(w.isdigit() for w in words):
            raise FactError(f"ip_local_port_range unreadable: {(err or out).strip()[:100]}")
        return int(words[0]), int(words[1])


@dataclass(frozen=True)
class RuleFiles(Fact):
    """The names of the `*.nft` files in a directory (the rules loaded at boot; root's)."""

    directory: str
    needs_root = True

    def command(self, sh: ShellCtx) -> str:
        return f"for f in {sh.path(self.directory)}/*.nft; do [ ! -e \"$f\" ] || basename \"$f\" .nft; done"

    def parse(self, out: str, err: str, rc: int) -> list[str]:
        return sorted(w for w in out.split())
