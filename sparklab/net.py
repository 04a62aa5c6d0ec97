"""The lab's links: management bridge sparklab0 and the ConnectX-7-named fabric.

Root-namespace link names made by the lab all start with "sl" (veth peers) or "sparklab"
(bridges), so `lab.down` can find every one of them even without the state file.
"""
from __future__ import annotations

import json
import subprocess

from .state import (BRIDGE, BRIDGE_IP, DARK_IFACES, FABRIC_IFACES, MGMT_IFACE, PORT_TWINS, PREFIX,
                    RAIL_BRIDGES, RAIL_IFACES, cables, default_topology)


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r


def links(ns: str | None = None) -> dict[str, dict]:
    r = ip("-j", "link", "show", ns=ns, check=False)
    if r.returncode != 0 or not r.stdout.strip():
        return {}
    return {l["ifname"]: l for l in json.loads(r.stdout)}


def netns_list() -> list[str]:
    r = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True)
    if not r.stdout.strip():
        return []
    return [n["name"] for n in json.loads(r.stdout)]


def mac(index: int, port: int) -> str:
    # ConnectX-7 OUI seen on Sparks (4c:bb:47); unique per host and port
    return f"4c:bb:47:{index:02x}:91:{port:02x}"


def peer_name(index: int, tag: str) -> str:
    return f"sl{index}{tag}"  # root-namespace end of a host's veth (<= 15 chars)


def ensure_bridge(name: str, addr: str | None = None, mtu: int = 1500) -> bool:
    changed = False
    if name not in links():
        ip("link", "add", "name", name, "type", "bridge")
        changed = True
    ip("link", "set", name, "mtu", str(mtu), "up")
    if addr:
        cur = ip("-j", "addr", "show", "dev", name).stdout
        if addr.split("/")[0] not in cur:
            ip("addr", "add", addr, "dev", name)
            changed = True
    return changed


# What a DGX OS host boots with that a fresh network namespace lacks. systemd's
# 50-default.conf lets every group open ICMP datagram sockets, so ping does not need a raw
# socket. A raw ICMP socket receives a copy of every ICMP packet the host gets: with 30 jumbo
# pings in flight per host (the mesh check at 16 hosts), replies were dropped from full socket
# buffers, and each drop cost a 2 s retry that a Spark never pays.
DGX_OS_SYSCTLS = {"net.ipv4.ping_group_range": "0 2147483647"}


def ensure_netns(name: str) -> bool:
    created = name not in netns_list()
    if created:
        ip("netns", "add", name)
    for key, value in DGX_OS_SYSCTLS.items():
        subprocess.run(["ip", "netns", "exec", name, "sysctl", "-qw", f"{key}={value}"], check=True,
                       capture_output=True)
    return created


def ensure_mgmt(name: str, index: int, address: str) -> bool:
    """veth: root end on sparklab0, host end named like the Spark's onboard NIC."""
    changed = ensure_bridge(BRIDGE, f"{BRIDGE_IP}/{PREFIX}")
    peer = peer_name(index, "m")
    if MGMT_IFACE not in links(name):
        if peer in links():
            ip("link", "del", peer)
        ip("link", "add", "name", peer, "type", "veth", "peer", "name", MGMT_IFACE,
           "netns", name)
        changed = True
    ip("link", "set", peer, "master", BRIDGE, "up")
    ip("link", "set", "lo", "up", ns=name)
    ip("link", "set", MGMT_IFACE, "address", f"4c:bb:47:{index:02x}:00:07", "up", ns=name)
    if f'"{address}"' not in ip("-j", "addr", "show", "dev", MGMT_IFACE, ns=name).stdout:
        ip("addr", "add", f"{address}/{PREFIX}", "dev", MGMT_IFACE, ns=name)
        changed = True
    return changed


def _cable(a: tuple[str, int], b: tuple[str, int], ifa: str, ifb: str, tag: str) -> None:
    """One twin of a cable: a veth between host a's `ifa` and host b's `ifb` (MTU 1500, up: a fresh
    Spark's), made in the two namespaces at once; whatever had those names goes first."""
    (na, ia), (nb, ib) = a, b
    for n, ifc in ((na, ifa), (nb, ifb)):
        if ifc in links(n):
            ip("link", "del", ifc, ns=n)
    ip("link", "add", "name", f"sltmp{tag}a", "netns", na, "type", "veth", "peer",
       "name", f"sltmp{tag}b", "netns", nb)
    for n, i, tmp, ifc in ((na, ia, f"sltmp{tag}a", ifa), (nb, ib, f"sltmp{tag}b", ifb)):
        ip("link", "set", tmp, "name", ifc, "address", mac(i, FABRIC_IFACES.index(ifc)), ns=n)
        ip("link", "set", ifc, "mtu", "1500", "up", ns=n)


def ensure_fabric(hosts: list[tuple[str, int]], topology: str | None = None) -> bool:
    """Create the four ConnectX-7 twins on every host, cabled as `topology` says (sparklab/state.py;
    default: a pair at two hosts, a switch above). pair: both port-1 twins point to point; switch:
    a bridge per port-1 twin; mesh and ring: a veth per twin of every cable, point to point.
    Twins no cable reaches stay dark (admin up, no carrier)."""
    topology = topology or default_topology(len(hosts))
    changed = False
    plugged = {(hosts[i - 1][0], ifc) for end in cables(topology, len(hosts)) for i, port in end
               for ifc in PORT_TWINS[port]}
    for name, index in hosts:
        have = links(name)
        for port, ifname in enumerate(DARK_IFACES):
            if (name, ifname) in plugged:
                continue
            if ifname not in have:
                peer = peer_name(index, f"d{port}")
                if peer in links():
                    ip("link", "del", peer)
                # the root end stays down: the twin is admin-up with no carrier
                ip("link", "add", "name", peer, "type", "veth", "peer", "name", ifname,
                   "netns", name)
                ip("link", "set", ifname, "address", mac(index, FABRIC_IFACES.index(ifname)),
                   ns=name)
                ip("link", "set", ifname, "up", ns=name)
                changed = True
    if topology == "p2p":
        (a, ia), (b, ib) = hosts
        for rail, ifname in RAIL_IFACES.items():
            if ifname in links(a) and ifname in links(b):
                continue
            _cable((a, ia), (b, ib), ifname, ifname, str(rail))
            changed = True
    elif topology in ("mesh", "ring"):
        for (i, pi), (j, pj) in cables(topology, len(hosts)):
            a, b = hosts[i - 1], hosts[j - 1]
            for twin, (ifa, ifb) in enumerate(zip(PORT_TWINS[pi], PORT_TWINS[pj])):
                if ifa in links(a[0]) and ifb in links(b[0]):
                    continue
                _cable(a, b, ifa, ifb, f"{i}{twin}")
                changed = True
    elif topology == "switch":
        for rail, ifname in RAIL_IFACES.items():
            br = RAIL_BRIDGES[rail]
            changed |= ensure_bridge(br, mtu=9000)
            for name, index in hosts:
                peer = peer_name(index, f"r{rail}")
                if ifname not in links(name):
                    if peer in links():
                        ip("link", "del", peer)
                    ip("link", "add", "name", peer, "mtu", "9000", "type", "veth", "peer",
                       "name", ifname, "netns", name)
                    ip("link", "set", ifname, "mtu", "1500", "address",
                       mac(index, FABRIC_IFACES.index(ifname)), "up", ns=name)
                    changed = True
                ip("link", "set", peer, "mtu", "9000", "master", br, "up")
    return changed


def lab_root_links() -> list[str]:
    """Every root-namespace link the lab made (found by name)."""
    return [n for n in links() if n == BRIDGE or n.startswith("sparklab-")
            or (n.startswith("sl") and n[2:3].isdigit()) or n.startswith("sltmp")]


def teardown(host_names: list[str]) -> None:
    for n in netns_list():
        if n in host_names:
            ip("netns", "del", n, check=False)
    # veths die with their namespace; bridges and stray root ends are removed by name
    for n in lab_root_links():
        ip("link", "del", n, check=False)
