"""fabric_mesh: every host reaches every peer on each rail, with jumbo frames and SSH.

Runs in a play after fabric and ssh_mesh (plays are barriers) from what they exported:
- all hosts put rail i on the same subnet (a host whose routes pushed it to another pool subnet
  is named, with the fix);
- every link between two hosts carries unfragmented 9000-byte frames on every rail: `ping -M do
  -s 8972` from one end, sourced from its address on that rail. The echo and its reply cross
  the link both ways at full size, and an MTU of 1500 on either end fails it (too long to send,
  or dropped on arrival), so each pair is pinged once, by the end the pair is given to: host i
  pings the next (n-1)/2 hosts of the ring. At 16 hosts that is 240 pings, not 480, each
  failure reported once, on the host that checked that link;
- `ssh -o BatchMode=yes -o StrictHostKeyChecking=yes USER@ADDR true` succeeds for every peer,
  on its first rail (the ssh_mesh guarantee; `ssh: false` leaves it out). Pings run eight at a
  time, logins four at a time in an order rotated per host, so that no peer's sshd sheds logins.
  Logins are n x (n-1) SSH handshakes: a round that succeeds is recorded on the host
  (~/.cache/sparkprov/mesh-ssh-proof) under a key made of everything they depend on that
  sparkprov manages (user, both ends' mesh keys, host keys, authorized_keys, known_hosts and
  ssh config as ssh_mesh converged them, the addresses). A rerun with the same key logs in to
  no one, so a no-op provision costs the same at 16 hosts as at 2; any change on either end
  (a key, a pin, an address, a re-imaged peer) changes the key and the round runs again.
  `ssh: always` logs in on every run; deleting the record forces one round.
Exports the settings the cluster step binds NCCL to (G32) as `nccl`: {node_ip,
NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, UCX_NET_DEVICES, NCCL_IB_HCA} and `fabric_verified`.
In check mode, with fabric or ssh changes still pending anywhere, it is skipped.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal, TypedDict

from pydantic import Field

from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.fabric import MeshProbe, PROOF_RECORD
from sparkprov.modules._provision import write_file_script
from sparkprov.modules.fabric import FABRIC, play_fabric
from sparkprov.modules.ssh_keypair import SSH_KEY
from sparkprov.modules.ssh_mesh import SSH_MESH


class Args(ModuleArgs):
    size: int = Field(default=8972, ge=0, le=65507)  # 9000 - 20 (IP) - 8 (ICMP)
    ssh: bool | Literal["always"] = True


def proof_key(host: HostContext, targets: list[str]) -> str:
    """The digest of what this host's logins to its peers depend on, from the exports of
    ssh_keypair (`ssh`: public key, host keys), ssh_mesh (`ssh_mesh.digest`: authorized_keys,
    known_hosts, config as converged) and fabric (addresses) of this host and every peer.
    "" when any of them is missing: then the logins always run."""
    parts = {"user": host.user, "targets": targets}
    fabrics = FABRIC.of_play(host)
    for h in sorted(fabrics):
        ssh, mesh = SSH_KEY.read(host.exports, h), SSH_MESH.read(host.exports, h)
        if not (ssh and ssh["pub"] and mesh and mesh["digest"]):
            return ""
        parts[h] = {"pub": ssh["pub"], "host_keys": ssh["host_keys"], "mesh": mesh["digest"],
                    "rails": [r["address"] for r in fabrics[h]["rails"]]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def per_link(fabrics: dict, host: HostContext) -> list[tuple[dict, str, dict]] | None:
    """On a mesh or a ring (the fabric module's rails name their link's peer): (this host's rail,
    the peer, the peer's rail on that link) for every link this host is an end of. None otherwise."""
    mine = fabrics[host.name]["rails"]
    if not any(r.get("peer") for r in mine):
        return None
    out = []
    for r in mine:
        other = next((p for p in (fabrics.get(r.get("peer")) or {}).get("rails") or []
                      if p["iface"] == r.get("peer_iface")), None)
        if other is not None:
            out.append((r, r["peer"], other))
    return out


def first_end(host: HostContext, fabrics: dict, peer: str) -> bool:
    """Whether this host, not the peer, pings their links (the earlier of the two in ring order)."""
    names = ring(host, fabrics)
    return names.index(host.name) < names.index(peer)


def _probe(args: Args, host: HostContext) -> MeshProbe | None:
    fabrics, mine = play_fabric(host)
    if not mine or len(fabrics) < 2 or _pending(args, host):
        return None
    links = per_link(fabrics, host)
    if links is not None:
        # every link pinged once, by its earlier end, from its address on the link; one login per
        # cabled peer over a link between them (a ring's other hosts share no link with this one)
        pings = [(r["address"], p["address"]) for r, peer, p in links if first_end(host, fabrics, peer)]
        firsts: dict[str, str] = {}
        for _, peer, p in links:
            firsts.setdefault(peer, p["address"])
        targets = list(firsts.values()) if args.ssh else []
        key = proof_key(host, targets) if targets and args.ssh is True else ""
        return MeshProbe(tuple(pings), args.size, host.user, tuple(targets), key)
    pings, targets = [], []
    names = ring(host, fabrics)
    me = names.index(host.name)
    n = len(names)
    # peers in an order rotated by this host's place: at step k host i logs in to peer i+k, so
    # each sshd sees about one login per step from the whole mesh, not all of them at once
    for k, peer in enumerate(names[me + 1:] + names[:me], start=1):
        fab = fabrics[peer]
        if pings_the_pair(me, k, n):
            for i, rail in enumerate(fab["rails"]):
                if i < len(mine["rails"]):
                    pings.append((mine["rails"][i]["address"], rail["address"]))
        # one login per peer proves the SSH mesh (keys and pinned host keys); jumbo frames are
        # proven per rail by the pings
        if fab["rails"]:
            targets.append(fab["rails"][0]["address"])
    if not args.ssh:
        targets = []
    key = proof_key(host, targets) if targets and args.ssh is True else ""
    return MeshProbe(tuple(pings), args.size, host.user, tuple(targets), key)


def ring(host: HostContext, fabrics: dict) -> list[str]:
    """The hosts with a fabric, in the same order on every host (the play's, then the rest)."""
    return [h for h in host.play_hosts if h in fabrics] + sorted(h for h in fabrics if h not in host.play_hosts)


def checked_by(host: HostContext, fabrics: dict) -> list[str]:
    """The peers that ping their links to this host (this host pings the others)."""
    names = ring(host, fabrics)
    n, me = len(names), names.index(host.name)
    return [p for i, p in enumerate(names) if p != host.name and pings_the_pair(i, (me - i) % n, n)]


def pings_the_pair(me: int, k: int, n: int) -> bool:
    """Whether the host at ring place `me` pings the one k places after it: each pair once, and
    every host gets (n-1)/2 of them (n even: the pair across the ring goes to the first half)."""
    return 2 * k < n or (2 * k == n and me < n // 2)


def _pending(args: Args, host: HostContext) -> list[str]:
    if not host.check:
        return []
    read = [FABRIC] + ([SSH_MESH] if args.ssh else [])
    return sorted({h for x in read for h, v in x.of_play(host).items() if not v.get("converged", True)})


Nccl = TypedDict("Nccl", {"node_ip": "str | None", "NCCL_SOCKET_IFNAME": "str | None",
                          "GLOO_SOCKET_IFNAME": "str | None", "UCX_NET_DEVICES": "str | None",
                          "NCCL_IB_HCA": "str | None"})

NCCL: Export[Nccl] = Export("nccl", Nccl, "the environment NCCL, Gloo and UCX need on this node (provision's output)")
FABRIC_VERIFIED: Export[bool] = Export("fabric_verified", bool, "every rail of every link passed the jumbo pings")


class FabricMeshModule(Module):
    name = "fabric_mesh"
    Args = Args
    doc = "Verify the full mesh: jumbo pings (-M do -s 8972) on every rail of every link, BatchMode SSH to every peer."

    def needs(self, args: Args, host: HostContext):
        probe = _probe(args, host)
        return {"probe": probe} if probe else {}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        h = host.name
        fabrics, mine = play_fabric(host)
        if not mine:
            return Plan.skip("no fabric configured on this host")
        nccl: Nccl = {"node_ip": mine["node_ip"], "NCCL_SOCKET_IFNAME": mine["nccl_socket_ifname"],
                "GLOO_SOCKET_IFNAME": mine["gloo_socket_ifname"], "UCX_NET_DEVICES": mine["ucx_net_devices"],
                "NCCL_IB_HCA": mine["nccl_ib_hca"]}
        if len(fabrics) < 2:
            return Plan.skip("single host: no peer to verify", exports=NCCL(nccl))
        problems = []
        links = per_link(fabrics, host)
        for i, rail in enumerate(mine["rails"] if links is None else []):
            for peer, fab in sorted(fabrics.items()):
                if i >= len(fab["rails"]):
                    problems.append(f"{peer} has {len(fab['rails'])} rail(s), {h} has {len(mine['rails'])}")
                elif fab["rails"][i]["subnet"] != rail["subnet"]:
                    problems.append(f"rail {i + 1}: {h} uses {rail['subnet']} but {peer} uses {fab['rails'][i]['subnet']} "
                                    "(a pool subnet clashed with a route on one of them): set fabric_subnets in the inventory")
        if problems:
            return Plan.fail(f"{h}: " + "; ".join(sorted(set(problems))))
        pending = _pending(args, host)
        if pending:
            return Plan.skip(f"check mode: fabric/ssh changes pending on {', '.join(pending)}; the mesh is verified "
                             "once they are applied")
        probe = facts.probe
        peers = {r["address"]: (p, r["iface"]) for p, f in fabrics.items() if p != h for r in f["rails"]}
        for key, res in sorted(probe["ping"].items()):
            src, dst = key.split()
            if not res["ok"]:
                peer, iface = peers.get(dst, ("?", "?"))
                why = res["error"] or f"{res['received']}/{res['sent']} replies"
                problems.append(f"{h} -> {peer} on {iface} ({src} -> {dst}): `ping -M do -s {args.size}` failed: {why}")
        for dst, res in sorted(probe["ssh"].items()):
            if not res["ok"]:
                peer, _ = peers.get(dst, ("?", "?"))
                problems.append(f"{h} -> {peer}: `ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {host.user}@{dst} "
                                f"true` failed: {res['error']}")
        if problems:
            return Plan.fail("; ".join(problems) + ". Fix: MTU 9000 and addresses on both ends (rerun provision), "
                             "check the QSFP cable")
        if links is not None:
            return self._links_verified(args, host, fabrics, links, facts.fact("probe"), probe, nccl)
        n_peers = len(fabrics) - 1
        proven = probe.get("ssh_proven")
        ssh_note = ("" if not args.ssh else f"; ssh to {n_peers} peer(s) proven by an earlier round, nothing changed since"
                    if proven else f"; ssh to {len(probe['ssh'])} peer(s)")
        lossy = sorted(k for k, r in probe["ping"].items() if r["received"] < r["sent"])
        loss_note = f" ({len(lossy)} lost a reply: {', '.join(lossy[:3])})" if lossy else ""
        checked = len({peers.get(k.split()[1], ("?",))[0] for k in probe["ping"]})
        by = checked_by(host, fabrics)
        others = (f" ({', '.join(by) if len(by) <= 3 else f'{len(by)} peers'} check{'s' if len(by) == 1 else ''} "
                  f"theirs to {h})" if by else "")
        msg = (f"{len(probe['ping'])} jumbo path(s) ({args.size} B, DF) to {checked} peer(s){others} on "
               f"{len(mine['rails'])} rail(s)" + loss_note + ssh_note + f"; NCCL_SOCKET_IFNAME={nccl['NCCL_SOCKET_IFNAME']} NCCL_IB_HCA={nccl['NCCL_IB_HCA']}")
        exports = {**NCCL(nccl), **FABRIC_VERIFIED(True)}
        return _verified(host, facts.fact("probe"), probe, msg, exports)

    def _links_verified(self, args: Args, host: HostContext, fabrics: dict, links: list, mesh: MeshProbe,
                        probe: dict, nccl: Nccl) -> Plan:
        """A mesh or ring whose pings and logins passed: what was checked, the peers that share no link
        with this host (nothing reaches them over the fabric, and nothing is sent to them over the
        management network instead), and the SSH proof to record."""
        h = host.name
        cabled = sorted({peer for _, peer, _ in links}, key=ring(host, fabrics).index)
        by = sorted({peer for _, peer, _ in links if not first_end(host, fabrics, peer)})
        far = [p for p in ring(host, fabrics) if p != h and p not in cabled]
        proven = probe.get("ssh_proven")
        ssh_note = ("" if not args.ssh else f"; ssh to {len(cabled)} cabled peer(s) proven by an earlier round, nothing "
                    "changed since" if proven else f"; ssh to {len(probe['ssh'])} cabled peer(s) over their links")
        far_note = (f"; no link to {', '.join(far)} (a {(mine_topology(fabrics, h) or 'ring')} reaches its cabled "
                    "neighbours only: nothing goes to them over the fabric, nor over the management network in its "
                    "place)" if far else "")
        msg = (f"{len(probe['ping'])} jumbo link(s) ({args.size} B, DF) to {', '.join(cabled)}"
               + (f" ({', '.join(by)} check{'s' if len(by) == 1 else ''} theirs to {h})" if by else "")
               + ssh_note + far_note + f"; NCCL_SOCKET_IFNAME={nccl['NCCL_SOCKET_IFNAME']} NCCL_IB_HCA={nccl['NCCL_IB_HCA']}")
        exports = {**NCCL(nccl), **FABRIC_VERIFIED(True)}
        return _verified(host, mesh, probe, msg, exports)


def _verified(host: HostContext, mesh: MeshProbe, probe: dict, msg: str, exports: dict) -> Plan:
    """The mesh passed: record the SSH proof where a login round just ran under a key."""
    if mesh.proof_key and not probe.get("ssh_proven") and probe["ssh"]:
        record = host.path(PROOF_RECORD)
        return Plan([Change(f"record the SSH mesh proof ({len(probe['ssh'])} peer(s)) in {record}",
                            write_file_script(record, mesh.proof_key.encode(), mode="0644"),
                            touches=[mesh], become=False,
                            predicts=[(mesh, {**probe, "ssh": {}, "ssh_proven": True})])],
                    msg=msg, exports=exports)
    return Plan(msg=msg, exports=exports)


def mine_topology(fabrics: dict, h: str) -> str | None:
    return ((fabrics.get(h) or {}).get("topology") or {}).get("kind")

