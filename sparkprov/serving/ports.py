"""Who may reach what a deployment opens: the firewall a member of a multi-node deployment wants,
and the report of every listening port of a host (pure: facts in, rows out).

What the serving internals open, measured in the lab with `ss -tulpn` (docs/security.md):
Ray's GCS on `*:RAY_PORT`, the raylet, object manager, dashboard agent, metrics and the Ray
workers on every interface (`--node-ip-address` sets what Ray advertises, not what it binds);
vLLM's native rendezvous (torch's TCPStore on `*:MASTER_PORT`) and its data-parallel RPC port;
Gloo, NCCL and vLLM's ZMQ sockets on ports the kernel picks (port 0: the ephemeral range). None of
them can be bound to the fabric address alone, so each member drops new connections to those
ports from anyone but the deployment's members (their fabric addresses) and loopback. Established
connections (this node's own outgoing ones), the API port and sshd stay as they were.
"""

from __future__ import annotations

import hashlib
import ipaddress
from typing import Any, Iterable

from sparkprov.facts.ports import TABLE_PREFIX

# Ray's fixed ports besides the GCS (Ray 2.60's defaults: `ray start --help`): the client server,
# the workers' range, the dashboard (off: sparkprov starts the head without it) and its agent.
RAY_CLIENT_PORT = 10001
RAY_WORKER_PORTS = (10002, 19999)
RAY_DASHBOARD_PORT = 8265
RAY_AGENT_PORT = 52365
DP_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default
SSH_PORT = 22

PortRanges = list[tuple[int, int]]
LOOPBACK, PEERS, EVERYONE = "loopback", "fabric peers", "everyone"


def table_name(deployment: str) -> str:
    return TABLE_PREFIX + deployment


def internal_ports(executor: str, *, ray_port: int, master_port: int, ephemeral: tuple[int, int]) -> PortRanges:
    """The ports a multi-node deployment's internals listen on, as closed ranges, merged."""
    if executor == "ray":
        fixed = [(ray_port, ray_port), (RAY_DASHBOARD_PORT, RAY_DASHBOARD_PORT), (RAY_CLIENT_PORT, RAY_CLIENT_PORT),
                 RAY_WORKER_PORTS, (RAY_AGENT_PORT, RAY_AGENT_PORT)]
    else:
        fixed = [(master_port, master_port), (DP_RPC_PORT, DP_RPC_PORT)]
    return merge(fixed + [ephemeral])


def merge(ranges: Iterable[tuple[int, int]]) -> PortRanges:
    out: PortRanges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def minus(ranges: PortRanges, ports: Iterable[int]) -> PortRanges:
    """Ranges without some ports (the API port and sshd stay open even inside a closed range)."""
    out = list(ranges)
    for p in sorted(set(ports)):
        nxt: PortRanges = []
        for lo, hi in out:
            if lo <= p <= hi:
                nxt += [r for r in ((lo, p - 1), (p + 1, hi)) if r[0] <= r[1]]
            else:
                nxt.append((lo, hi))
        out = nxt
    return out


def _set(ranges: PortRanges) -> str:
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)


def ruleset(deployment: str, members: list[str], open_ports: list[int], closed: PortRanges) -> str:
    """The nftables file of one deployment on one member: its own table, replaced as a whole when
    loaded (the `table` + `delete table` lines make a load idempotent, at boot too). The table's
    comment is the hash of the rest, which the fact reads back to tell whether the live rules are
    these."""
    name = table_name(deployment)
    closed = minus(merge(closed), open_ports)
    body = "\n".join([
        "\tset members4 {", "\t\ttype ipv4_addr", f"\t\telements = {{ {', '.join(sorted(members))} }}", "\t}",
        "\tchain input {",
        "\t\ttype filter hook input priority filter; policy accept;",
        '\t\tiif "lo" accept',
        "\t\tct state established,related accept",
        "\t\tip saddr @members4 accept",
        f"\t\ttcp dport {{ {_set([(p, p) for p in sorted(set(open_ports))])} }} accept",
        f"\t\tmeta l4proto {{ tcp, udp }} th dport {{ {_set(closed)} }} drop",
        "\t}",
    ])
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return (f"# sparkprov: deployment {deployment}: its internal ports only from its members\n"
            f"table inet {name}\ndelete table inet {name}\n"
            f"table inet {name} {{\n\tcomment \"sparkprov {digest}\"\n{body}\n}}\n")


def ruleset_hash(text: str) -> str:
    """The hash a ruleset's table carries as its comment."""
    for line in text.splitlines():
        if line.strip().startswith('comment "sparkprov '):
            return line.strip()[len('comment "'):-1]
    return ""


def _in(port: int, ranges: Iterable[tuple[int, int]]) -> bool:
    return any(lo <= port <= hi for lo, hi in ranges)


def reach(address: str, port: int, tables: dict[str, dict[str, Any]], fabric: set[str]) -> tuple[str, str]:
    """From where a socket bound to ADDRESS:PORT can be reached: (loopback | fabric peers |
    everyone, why)."""
    try:
        ip = ipaddress.ip_address(address) if address not in ("*", "") else None
    except ValueError:
        ip = None
    if ip is not None and (ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped and ip.ipv4_mapped.is_loopback)):
        return LOOPBACK, f"bound to {address}"
    for name, t in sorted(tables.items()):
        if _in(port, t.get("closed") or []):
            return PEERS, f"closed to all but {', '.join(t.get('members') or []) or 'loopback'} ({name})"
    if address in fabric:
        return PEERS, "bound to the fabric address"
    return EVERYONE, f"bound to {address or '*'}"


def report(sockets: list[dict[str, Any]], containers: list[dict[str, Any]], tables: dict[str, dict[str, Any]],
           fabric: Iterable[str]) -> list[dict[str, Any]]:
    """One row per listening socket: proto, address, port, processes, container and deployment,
    reach, why, and `flag` (open to everyone, and neither an API port with a key nor sshd)."""
    by_id = {c["id"]: c for c in containers if c.get("id")}
    keyed = {int(c["labels"]["sparkprov.port"]) for c in containers
             if (c.get("labels") or {}).get("sparkprov.port") and c["labels"].get("sparkprov.api_key_file")}
    fab = set(fabric)
    rows = []
    for s in sockets:
        procs = s.get("processes") or []
        cont = next((by_id[p["container_id"]] for p in procs if p.get("container_id") in by_id), None)
        where, why = reach(s["address"], s["port"], tables, fab)
        names = sorted({p["name"] for p in procs})
        role = "api" if s["proto"] == "tcp" and s["port"] in keyed and cont is not None else \
            "sshd" if names == ["sshd"] else ""
        flag = where == EVERYONE and not role
        rows.append({"proto": s["proto"], "address": s["address"], "port": s["port"], "processes": names,
                     "container": cont["name"] if cont else None,
                     "deployment": (cont.get("labels") or {}).get("sparkprov.deployment") if cont else None,
                     "reach": where, "why": why + (" (API port, keyed)" if role == "api" else ""), "flag": flag})
    rows.sort(key=lambda r: (not r["flag"], r["reach"] != EVERYONE, r["proto"], r["port"], r["address"]))
    return rows
