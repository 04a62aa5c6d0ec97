"""Fabric facts: the ConnectX-7 twins from ibdev2netdev and their firmware, links, addresses and
routes from `ip -j`, the rails NCCL uses (FabricInfo), the mesh probe (jumbo pings, SSH logins).

FabricInfo is the fabric contract other commands rely on (stage-weights, cluster-up): gather it
in one call with any other facts; it yields, per host,

    {"rails": [{"iface", "address", "prefix", "hca", "mtu", "up"}],   # Up ConnectX-7 twins
     "node_ip", "nccl_socket_ifname", "gloo_socket_ifname", "ucx_net_devices", "nccl_ib_hca"}

Rails are the twins ibdev2netdev reports Up that carry a global IPv4 address, ordered by PCI
domain (enp1s0f1np1 before enP2p1s0f1np1); node_ip is the first rail's address. The rails'
measured throughput is facts/rail.py's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.facts.topology import TOPOLOGY_RECORD
from sparkprov.transport.shell import cmd, quote

def parse_rdma_firmware(text: str) -> dict[str, str]:
    """`DEVICE FW_VER` lines (RdmaFirmware's script) -> {device: firmware version}."""
    out = {}
    for line in text.splitlines():
        dev, _, ver = line.strip().partition(" ")
        if dev and ver.strip():
            out[dev] = ver.strip()
    return out


def firmware_summary(devices: dict[str, str]) -> str | None:
    """One version when every ConnectX-7 function runs the same (a Spark's four do), else each
    device's; None where the host has no RDMA device (the lab, a host without a ConnectX-7)."""
    if not devices:
        return None
    versions = set(devices.values())
    if len(versions) == 1:
        return versions.pop()
    return ", ".join(f"{d} {v}" for d, v in sorted(devices.items()))


class RdmaFirmware(Fact):
    """The ConnectX-7 firmware of each RDMA device (/sys/class/infiniband/DEV/fw_ver: what `ibstat`
    prints as "Firmware version", without infiniband-diags installed). No device: {}."""

    def command(self, sh: ShellCtx) -> str:
        return ('for d in /sys/class/infiniband/*; do [ -r "$d/fw_ver" ] || continue; '
                'printf \'%s %s\\n\' "${d##*/}" "$(cat "$d/fw_ver")"; done; true')

    def parse(self, out: str, err: str, rc: int) -> dict[str, str]:
        return parse_rdma_firmware(out)


# ---------------------------------------------------------------------------------------------
# Fabric: ibdev2netdev, ip -j
# ---------------------------------------------------------------------------------------------

_IBDEV_RE = re.compile(r"^(\S+) port (\d+) ==> (\S+) \((\w+)\)\s*$")


def parse_ibdev2netdev(text: str) -> list[dict[str, Any]]:
    """`roceP2p1s0f1 port 1 ==> enP2p1s0f1np1 (Up)` lines."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _IBDEV_RE.match(line.strip())
        if not m:
            raise ValueError(f"unexpected ibdev2netdev line {line!r}")
        out.append({"hca": m.group(1), "port": int(m.group(2)), "iface": m.group(3), "up": m.group(4) == "Up"})
    return out


@dataclass(frozen=True)
class Ibdev2netdev(Fact):
    """The RDMA devices and their interfaces. {"present": False} without ibdev2netdev."""

    def command(self, sh: ShellCtx) -> str:
        return "if command -v ibdev2netdev >/dev/null 2>&1; then ibdev2netdev; else echo @absent; fi"

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        if out.strip() == "@absent":
            return {"present": False, "devices": []}
        if rc != 0:
            raise FactError(err.strip() or f"ibdev2netdev failed (rc={rc})")
        return {"present": True, "devices": parse_ibdev2netdev(out)}


def iface_order(name: str) -> tuple[int, str]:
    """ConnectX-7 twins in PCI-domain order: enp1s0f1np1 (domain 0) before enP2p1s0f1np1."""
    m = re.match(r"enP(\d+)p", name)
    return (int(m.group(1)) if m else 0, name)


def parse_ip_addr(text: str) -> dict[str, dict[str, Any]]:
    """`ip -j addr show` -> {ifname: {mtu, up, carrier, admin_up, mac, ipv4: [{address, prefix, scope}]}}."""
    links = {}
    for link in json.loads(text or "[]"):
        flags = link.get("flags", [])
        ipv4 = [{"address": a["local"], "prefix": int(a["prefixlen"]), "scope": a.get("scope", "global")}
                for a in link.get("addr_info", []) if a.get("family") == "inet"]
        links[link["ifname"]] = {"mtu": link.get("mtu"), "up": link.get("operstate") == "UP",
                                 "admin_up": "UP" in flags, "carrier": "NO-CARRIER" not in flags and "LOWER_UP" in flags,
                                 "mac": link.get("address"), "ipv4": ipv4}
    return links


def parse_ip_route(text: str) -> list[dict[str, Any]]:
    """`ip -j route show` -> [{dst, dev, gateway}] ("default" for the default route)."""
    return [{"dst": r.get("dst"), "dev": r.get("dev"), "gateway": r.get("gateway")} for r in json.loads(text or "[]")]


@dataclass(frozen=True)
class NetState(Fact):
    """Links with their addresses and MTU, routes (main table), which address the SSH session
    came in on (the management link: never touched), and whether netplan is installed."""

    def command(self, sh: ShellCtx) -> str:
        return ("printf 'ssh=%s\\n' \"${SSH_CONNECTION:-}\"\n"
                "printf 'netplan=%s\\n' \"$(command -v netplan || true)\"\n"
                "echo @addr; ip -j addr show\necho @route; ip -j -4 route show")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_net_state(out)


def parse_net_state(out: str) -> dict[str, Any]:
    m = re.search(r"ssh=(.*)\nnetplan=(.*)\n@addr\n(.*)\n@route\n(.*)", out, re.S)
    if not m:
        raise FactError(f"unexpected ip output: {out.strip()[:200]!r}")
    ssh = m.group(1).split()
    return {"ssh_server_addr": ssh[2] if len(ssh) >= 3 else None, "netplan": m.group(2).strip() or None,
            "links": parse_ip_addr(m.group(3).strip()), "routes": parse_ip_route(m.group(4).strip())}


def fabric_info(devices: list[dict[str, Any]], links: dict[str, dict[str, Any]],
                topology: dict[str, Any] | None = None) -> dict[str, Any]:
    """The FabricInfo contract from ibdev2netdev devices and parsed `ip -j addr` (and the topology
    provision recorded, facts/topology.py TOPOLOGY_RECORD)."""
    rails = []
    for dev in sorted(devices, key=lambda d: iface_order(d["iface"])):
        link = links.get(dev["iface"])
        if not dev["up"] or link is None:
            continue
        glob = [a for a in link["ipv4"] if a["scope"] == "global" and not a["address"].startswith("169.254.")]
        if not glob:
            continue
        rails.append({"iface": dev["iface"], "address": glob[0]["address"], "prefix": glob[0]["prefix"],
                      "hca": dev["hca"], "mtu": link["mtu"], "up": link["up"]})
    out = {"rails": rails, **nccl_settings(rails, topology)}
    if (topology or {}).get("kind") in ("mesh", "ring"):
        out.update(links_of(rails, topology))
    return out


def links_of(rails: list[dict[str, Any]], topology: dict[str, Any]) -> dict[str, Any]:
    """On a mesh or ring (the recorded topology): `reach`, peer -> this host's address on the first link
    with it (where that peer sends to this host: each cable twin is its own subnet), and `order`, the
    hosts in ring order (`host`: which of them this is, as provision recorded it)."""
    mine = {r["iface"]: r["address"] for r in rails}
    me = topology.get("host")
    reach: dict[str, str] = {}
    for ln in topology.get("links") or []:
        for end, other in ((ln["a"], ln["b"]), (ln["b"], ln["a"])):
            if end[0] == me and end[1] in mine:
                reach.setdefault(other[0], mine[end[1]])
    return {"reach": reach, "order": list(topology.get("order") or []), "host": me}


def nccl_settings(rails: list[dict[str, Any]], topology: dict[str, Any] | None = None) -> dict[str, Any]:
    """NCCL/Gloo/UCX bindings for a host's rails (G32): sockets on the first rail, RoCE on all.

    On a mesh or a ring (the topology provision recorded) no one fabric subnet reaches every rank:
    each cable twin is its own. The sockets (NCCL's bootstrap, Gloo, vLLM's rendezvous) then go over
    the management link the SSH session came in on, the way the owners' rings run (eugr/
    spark-vllm-docker#252: the management interface as NCCL_SOCKET_IFNAME; LLMKube PR#1816: "the
    management IP as the bootstrap plane"), and NCCL's data over RoCE on every twin; `bootstrap` says so."""
    kind = (topology or {}).get("kind")
    mgmt = (topology or {}).get("mgmt") or {}
    if kind in ("mesh", "ring") and mgmt.get("address") and mgmt.get("iface"):
        return {"node_ip": mgmt["address"], "nccl_socket_ifname": mgmt["iface"], "gloo_socket_ifname": mgmt["iface"],
                "ucx_net_devices": mgmt["iface"],
                "nccl_ib_hca": ",".join(r["hca"] for r in rails if r.get("hca")) or None,
                "topology": kind, "bootstrap": f"management ({mgmt['iface']} {mgmt['address']}): a {kind} has no "
                                               "fabric subnet every rank reaches"}
    first = rails[0] if rails else None
    return {"node_ip": first["address"] if first else None,
            "nccl_socket_ifname": first["iface"] if first else None,
            "gloo_socket_ifname": first["iface"] if first else None,
            "ucx_net_devices": first["iface"] if first else None,
            "nccl_ib_hca": ",".join(r["hca"] for r in rails if r.get("hca")) or None}


@dataclass(frozen=True)
class FabricInfo(Fact):
    """The fabric as NCCL should use it (see the module docstring for the shape)."""

    def command(self, sh: ShellCtx) -> str:
        return ("if command -v ibdev2netdev >/dev/null 2>&1; then ibdev2netdev; else echo @absent; fi\n"
                "echo @addr; ip -j addr show\n"
                f"echo @topology; cat {quote(TOPOLOGY_RECORD)} 2>/dev/null; true")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        ib, _, rest = out.partition("@addr\n")
        addr, _, topo = rest.partition("@topology\n")
        devices = [] if ib.strip() == "@absent" else parse_ibdev2netdev(ib)
        try:
            topology = json.loads(topo) if topo.strip() else None
        except ValueError:
            topology = None
        return fabric_info(devices, parse_ip_addr(addr.strip()), topology if isinstance(topology, dict) else None)


def parse_ping(text: str) -> dict[str, Any]:
    """Summary of `ping -c N`: received count and the first error line."""
    m = re.search(r"(\d+) packets transmitted, (\d+) (?:packets )?received", text)
    sent, got = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    err = next((ln.strip() for ln in text.splitlines()
                if re.search(r"error|too long|unreachable|Frag|not permitted|Cannot|invalid", ln, re.I)), None)
    # one unfragmented jumbo reply proves the path carries 9000-byte frames; a lost one among
    # them is loss, not a wrong MTU (which answers "message too long" and nothing)
    return {"sent": sent, "received": got, "ok": got > 0, "error": err}


SSH_AT_ONCE = 4  # logins one host runs at once (MaxStartups is 10 per sshd by default)
# pings one host runs at once: ping's raw socket sees every ICMP reply reaching the host, and 30
# jumbo pings at once overflowed its receive buffer (a lost reply read as a broken path)
PINGS_AT_ONCE = 8
PROOF_RECORD = "~/.cache/sparkprov/mesh-ssh-proof"  # the login user's: the digest its last full login round proved


@dataclass(frozen=True)
class MeshProbe(Fact):
    """From this host: unfragmented jumbo pings (`ping -M do -s SIZE -I SRC ADDR`) for every
    (own rail address, peer rail address), and `ssh -o BatchMode=yes -o StrictHostKeyChecking=yes user@addr
    true` to every ssh target, run as the login user."""

    pings: tuple[tuple[str, str], ...]
    size: int = 8972
    ssh_user: str = ""
    ssh_targets: tuple[str, ...] = ()
    # The logins are skipped when PROOF_RECORD holds proof_key: the digest of everything they
    # depend on that sparkprov manages (see fabric_mesh.proof_key); "" = always log in.
    proof_key: str = ""

    def command(self, sh: ShellCtx) -> str:
        # Probes run a few at a time (PINGS_AT_ONCE, SSH_AT_ONCE), each writing its own block
        # (head, output, exit status) to its own file, printed afterwards: the wall time is that of
        # the slowest wave, not the sum. One echo per try (the second of `-c 2` only waits out
        # ping's 0.2 s interval); a try that gets no reply is repeated twice, so a lost packet is
        # not a broken path. A ping costs one subshell and the ping itself: its output is filtered
        # on the control machine (parse), not by a grep per ping; at 16 hosts that is 480 pings.
        jobs = []
        for src, addr in self.pings:
            ping = cmd("ping", "-n", "-M", "do", "-s", self.size, "-c", "1", "-W", "2", "-I", src, addr)
            jobs.append((f"@ping {src} {addr}", f"for t in 1 2 3; do o=$({ping} 2>&1) && break; done; r=$?"))
        logins = []
        for addr in self.ssh_targets:
            login = cmd("ssh", "-n", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                        "-o", "ConnectTimeout=5", f"{self.ssh_user}@{addr}", "true")
            # An sshd sheds connections beyond its MaxStartups (10 unauthenticated by default)
            # before the key exchange: the targets come in an order rotated per host (so that at
            # any moment the hosts log in to different peers), at most SSH_AT_ONCE at a time, and
            # a shed connection is retried, never an authentication or host-key failure.
            logins.append((f"@ssh {addr}", f"for t in 1 2 3 4; do o=$({login} 2>&1); r=$?; "
                           "case \"$o\" in *kex_exchange_identification*|*'Connection reset'*|*'Connection closed'*) "
                           "[ $r -eq 255 ] && [ $t -lt 4 ] && { sleep $t; continue; } ;; esac; break; done"))
        if not jobs and not logins:
            return ":"
        lines = ['__mp=$(mktemp -d)', "trap 'rm -rf \"$__mp\"' EXIT"]

        def in_waves(kind: str, probes: list[tuple[str, str]], at_once: int) -> list[str]:
            # braces: `a; b &` would run a in the foreground and only b in the background (the
            # probes then ran one after another: 30 pings took 6 s instead of 0.2 s)
            out = []
            for k in range(0, len(probes), at_once):
                out += [f"{{ {body}; printf '%s\\n%s\\n@rc=%s\\n' {quote(head)} \"$o\" \"$r\" > \"$__mp/{kind}{n:04d}\"; }} &"
                        for n, (head, body) in enumerate(probes[k:k + at_once], start=k)] + ["wait"]
            return out

        lines += in_waves("p", jobs, PINGS_AT_ONCE)
        waves = in_waves("s", logins, SSH_AT_ONCE)
        show_pings = ['cat "$__mp"/p*'] if jobs else []
        show_logins = ['cat "$__mp"/s*'] if logins else []
        if logins and self.proof_key:
            record = sh.path(PROOF_RECORD)
            # proven before with the same keys, pins and addresses: the pings' lines only
            lines.append(f"if [ \"$(cat {record} 2>/dev/null)\" = {quote(self.proof_key)} ]; then __mp_proven=1; echo @ssh-proven")
            lines += ["else __mp_proven=0"] + waves + ["fi"]
            lines += show_pings + ["[ $__mp_proven = 1 ] || {"] + show_logins + ["}"]
        else:
            lines += waves + show_pings + show_logins
        return "\n".join(lines)

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        pings, ssh = {}, {}
        for block in re.split(r"(?m)^(?=@(?:ping|ssh) )", out):
            head, _, body = block.partition("\n")
            m = re.search(r"(?m)^@rc=(\d+)\s*$", body)
            code = int(m.group(1)) if m else -1
            body = re.sub(r"(?m)^@rc=\d+\s*$", "", body)
            if head.startswith("@ping "):
                # the error and statistics lines only (not the banner, replies, rtt or blanks)
                body = "\n".join(ln for ln in body.splitlines() if ln.strip() and not ln.startswith(("PING ", "---", "rtt "))
                                 and " bytes from " not in ln)
            body = "\n".join(body.strip().splitlines()[-3:])
            if head.startswith("@ping "):
                _, src, addr = head.split()
                res = parse_ping(body)
                res["ok"] = res["ok"] and code == 0
                if not res["ok"] and not res["error"]:
                    res["error"] = body.splitlines()[-1] if body else f"ping exit status {code}"
                pings[f"{src} {addr}"] = res
            elif head.startswith("@ssh "):
                addr = head.split()[1]
                ssh[addr] = {"ok": code == 0, "error": None if code == 0 else
                             (body.splitlines()[-1] if body else f"ssh exit status {code}")}
        return {"ping": pings, "ssh": ssh, "ssh_proven": re.search(r"(?m)^@ssh-proven$", out) is not None}
