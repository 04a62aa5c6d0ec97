"""fabric: the ConnectX-7 rails NCCL uses, addressed and at MTU 9000 (G32, G33).

Rails: the twins ibdev2netdev reports Up (in PCI-domain order), or the `rails` argument /
`fabric_rails` variable. Each rail gets an address on its own subnet (G33: the two twins of a
port must not share one):
- subnets: the `subnets` argument / `fabric_subnets` variable, else the default pool
  192.168.100.0/24, 192.168.101.0/24, ... (NVIDIA's guide: .100 on enp1s0f1np1, .101 on
  enP2p1s0f1np1), skipping pool subnets this host already routes elsewhere; a configured subnet
  that clashes with an existing route fails;
- this host's address: the `addresses` argument / `fabric_addresses` variable (one CIDR per rail),
  else host number `host_id` / `fabric_host_id`, else 10 + the host's position in the
  inventory's groups (spark1 -> .11, spark2 -> .12): the same on every run.
Applied live with iproute2 (mtu, up, `ip addr add`, stale global IPv4 removed; link-local kept),
and persisted as a netplan file (mode 0600, root) checked with `netplan generate` where netplan
exists (the previous file is restored if it fails). Networking is never restarted, and a rail
that carries the SSH session or the default route is refused.

Topology (facts/topology.py). The module runs twice in provision: `phase: discover` in the first
play reads which peer each twin reaches (an IPv6 echo to all nodes of its link, answers known by
their MACs; the facts the configuring phase reads come with it, in the gather that play makes
anyway) and exports it; the configuring phase, a play later, works out the topology of the play's
hosts from every host's discovery, the same on each: a pair, a switch, a three-Spark mesh or a ring.
An owner may pin it (`fabric_topology`, `fabric_links`): a declaration the cabling contradicts fails,
naming the link. A pair and a switch are addressed per rail as above (rail i of every host on subnet
i); a mesh and a ring per link: each twin of each cable is its own point-to-point segment with its
own subnet (link_subnets: 192.168.100.0/24 up, the same on every host, both ends on it; this host's
number as above), MTU 9000, persisted the same way. Without any discovery (IPv6 off on the twins, a
host that cannot probe) and no declaration, a pair or a switch is assumed, as before, and said.

Exports `fabric` (the FabricInfo shape, as configured): {rails: [{iface, address, prefix, subnet,
hca, mtu, up}], node_ip, nccl_socket_ifname, gloo_socket_ifname, ucx_net_devices, nccl_ib_hca,
converged, topology}; on a mesh or ring each rail also names its link's `peer` and `peer_iface`.
`topology`: {kind, order (ranks follow it), links, cables, source}. fabric_mesh verifies it across
hosts in a later play.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any, Literal, TypedDict

from pydantic import Field, field_validator

from sparkprov import inventory_vars as iv
from sparkprov.inventory_vars import interface_name_ok
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.files import PathState
from sparkprov.facts.fabric import Ibdev2netdev, NetState, iface_order, nccl_settings
from sparkprov.facts.topology import (PER_LINK, SPARK_TWINS, TOPOLOGY_RECORD, FabricNeighbours, check_declared,
                                      declared_topology, discover, link_subnets, parse_links)
from sparkprov.modules._provision import cluster_order, setting, write_file_script
from sparkprov.transport.shell import cmd, quote

DEFAULT_POOL = tuple(f"192.168.{n}.0/24" for n in range(100, 110))
NETPLAN_FILE = "/etc/netplan/40-sparkprov-fabric.yaml"


class Args(ModuleArgs):
    phase: Literal["discover", "configure"] = "configure"
    rails: list[str] | None = None      # default: `fabric_rails`, else the Up twins from ibdev2netdev
    subnets: list[str] | None = None    # default: `fabric_subnets`, else the pool
    addresses: list[str] | None = None  # default: `fabric_addresses` (this host's CIDR per rail)
    host_id: int | None = Field(default=None, ge=1, le=254)  # default: `fabric_host_id`, else 10 + position
    mtu: int = Field(default=9000, ge=1280, le=9216)
    netplan_file: str = NETPLAN_FILE

    @field_validator("netplan_file")
    @classmethod
    def _netplan(cls, v):
        if not v.startswith("/etc/netplan/") or not v.endswith(".yaml") or "\n" in v:
            raise ValueError("netplan_file must be /etc/netplan/NAME.yaml")
        return v


def choose_subnets(n: int, configured: list[str] | None, routes: list[dict], rail_ifaces: list[str]
                   ) -> tuple[list[ipaddress.IPv4Network] | None, str | None]:
    """One subnet per rail: the configured ones (checked for clashes), else the pool minus
    subnets routed elsewhere. Returns (subnets, error)."""
    elsewhere = []
    for r in routes:
        if r["dst"] in (None, "default") or r["dev"] in rail_ifaces:
            continue
        try:
            elsewhere.append((ipaddress.ip_network(r["dst"], strict=False), r["dev"]))
        except ValueError:
            continue

    def clash(net):
        return next(((dst, dev) for dst, dev in elsewhere if dst.version == 4 and dst.overlaps(net)), None)

    if configured:
        try:
            nets = [ipaddress.ip_network(str(s), strict=False) for s in configured]
        except ValueError as exc:
            return None, f"bad fabric subnet: {exc}"
        if len(nets) < n:
            return None, f"{n} rails but only {len(nets)} fabric subnets configured"
        nets = nets[:n]
        for i, a in enumerate(nets):
            for b in nets[i + 1:]:
                if a.overlaps(b):
                    return None, f"fabric subnets {a} and {b} overlap: each twin needs its own subnet (G33)"
            c = clash(a)
            if c:
                return None, f"fabric subnet {a} clashes with the existing route {c[0]} via {c[1]}"
        return nets, None
    nets = []
    for s in DEFAULT_POOL:
        net = ipaddress.ip_network(s)
        if not clash(net):
            nets.append(net)
        if len(nets) == n:
            return nets, None
    return None, "every subnet of the default pool clashes with existing routes: set fabric_subnets"


def netplan_text(rails: list[dict[str, Any]], mtu: int) -> str:
    lines = ["# Managed by sparkprov (fabric): ConnectX-7 rails for NCCL. Edits here are replaced.",
             "network:", "  version: 2", "  ethernets:"]
    for r in rails:
        lines += [f"    {r['iface']}:", "      dhcp4: false", "      dhcp6: false", f"      mtu: {mtu}",
                  f"      addresses: [{r['address']}/{r['prefix']}]"]
    return "\n".join(lines) + "\n"


def _rail_text(iface: str, link: dict | None) -> str:
    if not link:
        return f"{iface}: absent\n"
    addrs = " ".join(f"{a['address']}/{a['prefix']}" for a in link["ipv4"]) or "no IPv4"
    return f"{iface}: mtu {link['mtu']} {'up' if link['admin_up'] else 'down'} {addrs}\n"


class Rail(TypedDict):
    iface: str
    address: str
    prefix: int
    subnet: str
    hca: str | None
    mtu: int
    up: bool


class Fabric(TypedDict):
    rails: list[Rail]
    node_ip: str | None             # nccl_settings: the first rail's address and interface, every RoCE device
    nccl_socket_ifname: str | None
    gloo_socket_ifname: str | None
    ucx_net_devices: str | None
    nccl_ib_hca: str | None
    converged: bool                 # False: check mode found a change still to make


FABRIC: Export[Fabric] = Export("fabric", Fabric, "the host's fabric rails as configured, and NCCL's bindings")


def play_fabric(host: HostContext) -> tuple[dict[str, Fabric], Fabric | None]:
    """Every fabric the hosts of the planning host's play exported, and its own (None: no fabric
    configured on it)."""
    fabrics = FABRIC.of_play(host)
    return fabrics, fabrics.get(host.name)


class Discovery(TypedDict):
    ifaces: dict[str, dict[str, Any]]   # twin -> {mac, up, hca, neighbours: [MAC], error}
    routed: list[str]                   # this host's routes on other interfaces (subnets a link must avoid)
    recorded: list[dict[str, Any]]      # the links of this host that provision recorded before
    mgmt: dict[str, Any]                # {iface, address}: the management link the SSH session came in on


FABRIC_DISCOVERY: Export[Discovery] = Export("fabric_discovery", Discovery,
                                             "which peer each ConnectX-7 twin reaches (fabric phase: discover)")


def _discovered(facts: FactView, host: HostContext) -> Plan:
    """The discover phase: what each twin reaches, for the configuring phase a play later."""
    ib, net, nb = facts.ib, facts.net, facts.neighbours
    up = {d["iface"]: d["up"] for d in ib["devices"]}
    hca = {d["iface"]: d["hca"] for d in ib["devices"]}
    ifaces = {i: {"mac": d.get("mac") or (net["links"].get(i) or {}).get("mac"), "id": d.get("id"),
                  "up": up.get(i, d.get("oper") == "up"), "hca": hca.get(i), "neighbours": d["neighbours"],
                  "answers": d.get("answers") or [], "error": d.get("error")}
              for i, d in nb.items() if i in net["links"]}
    fabric = set(ifaces)
    routed = sorted({r["dst"] for r in net["routes"] if r["dst"] not in (None, "default") and r["dev"] not in fabric})
    mgmt_if = next((i for i, link in net["links"].items() if any(a["address"] == net["ssh_server_addr"]
                                                                  for a in link["ipv4"])), None)
    rec = facts.record
    try:
        recorded = json.loads(rec.get("content") or b"{}") if rec.get("exists") else {}
    except ValueError:
        recorded = {}
    seen = sum(len(d["answers"]) or len(d["neighbours"]) for d in ifaces.values())
    return Plan(msg=f"{sum(1 for d in ifaces.values() if d['up'])} twin(s) up, {seen} neighbour answer(s): "
                    + ", ".join(f"{i} {len(d['answers']) or len(d['neighbours'])}" for i, d in sorted(ifaces.items())),
                exports=FABRIC_DISCOVERY({"ifaces": ifaces, "routed": routed,
                                          "mgmt": {"iface": mgmt_if, "address": net["ssh_server_addr"]},
                                          "recorded": [ln for ln in recorded.get("links") or []
                                                       if host.name in (ln["a"][0], ln["b"][0])]}))


def topology_of(host: HostContext) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """(the topology of the play's hosts, what contradicts the owner's declaration, notes) from every
    host's discovery. None without discovery (a playbook without the discover phase: per rail, as before)."""
    found = FABRIC_DISCOVERY.of_play(host)
    order = [h for h in host.play_hosts if h in found]
    if len(order) < 2 or host.name not in order:
        return None, [], []
    kind = iv.value(host.vars, "fabric_topology")
    raw = iv.value(host.vars, "fabric_links")
    try:
        cables = parse_links(raw) if raw is not None else None
    except ValueError as e:  # the inventory loader refuses it first; a playbook's vars may not
        return None, [f"fabric_links: {e}"], []
    ifaces, kept = with_recorded_links(found, order)
    topo = discover(ifaces, order)
    topo["source"] = "discovered"
    problems = check_declared(topo, kind, cables)
    notes: list[str] = []
    if problems:
        return topo, [p + " (fix: recable, or correct fabric_topology/fabric_links in the inventory)" for p in problems], []
    if topo["kind"] is None:
        if topo["probed"]:
            return topo, [f"the fabric is cabled as no pair, mesh, ring or switch: {'; '.join(topo['problems'])} "
                          "(fix: cable each Spark's ports to the others, or put them on a switch)"], []
        if kind in PER_LINK and cables:
            twins = {h: [i for i, d in found[h]["ifaces"].items() if d["up"]] for h in order}
            topo = {**declared_topology(kind, cables, twins, order), "source": "declared, not confirmed"}
            notes.append(f"{host.name}: the link probe found no peer ({topo_why(found, host.name)}): the fabric is "
                         f"addressed as declared (fabric_topology {kind}), not as discovered")
        else:
            topo = {**topo, "kind": kind or ("pair" if len(order) == 2 else "switch"), "source": "assumed"}
            notes.append(f"{host.name}: the link probe found no peer ({topo_why(found, host.name)}): addressed per rail "
                         f"as a {topo['kind']} (set fabric_topology and fabric_links to pin a mesh or ring)")
    elif kind:
        topo["source"] = "discovered, as declared"
    notes += [f"{host.name}: {k}" for k in kept if k.startswith(host.name + " ")]
    return topo, [], notes


def with_recorded_links(found: dict[str, Any], order: list[str]) -> tuple[dict[str, dict], list[str]]:
    """Every host's twins as discovery found them, where a twin that still has its carrier but heard
    no answer this time keeps the peer its host recorded (a lost echo must not re-address a cable);
    and a note for each twin so kept."""
    out = {h: {i: dict(d) for i, d in found[h]["ifaces"].items()} for h in order}
    kept = []
    for h in order:
        for ln in found[h].get("recorded") or []:
            for end, other in ((ln["a"], ln["b"]), (ln["b"], ln["a"])):
                mine, theirs = out[h].get(end[1]), (out.get(other[0]) or {}).get(other[1])
                if (end[0] != h or not mine or not theirs or mine.get("neighbours") or mine.get("answers")
                        or not mine.get("up")):
                    continue
                if theirs.get("mac") or theirs.get("id"):
                    mine["neighbours"] = [theirs.get("mac") or theirs["id"]]
                    kept.append(f"{h} {end[1]}: no answer from {other[0]} {other[1]} this time; its recorded link kept")
    return out, kept


def topo_why(found: dict[str, Any], h: str) -> str:
    errs = sorted({d.get("error") for d in found[h]["ifaces"].values() if d.get("error")})
    return errs[0] if errs else "no answer on any twin"


def per_link(args: Args, host: HostContext, topo: dict[str, Any], hca_of: dict[str, str]
             ) -> tuple[list[dict[str, Any]], str | None]:
    """This host's rails on a mesh or ring: one per link it is an end of, each on the link's subnet."""
    for var in ("fabric_subnets", "fabric_addresses"):
        if iv.given(host.vars, var) is not None:
            return [], (f"{var} is per rail, and a {topo['kind']} is addressed per link (one subnet per cable twin): "
                        f"remove {var}, or declare fabric_topology: switch for rails shared by every host")
    found = FABRIC_DISCOVERY.of_play(host)
    routed = sorted({r for d in found.values() for r in d.get("routed") or []})
    subnets, err = link_subnets(topo["links"], routed)
    if err:
        return [], err
    order = cluster_order(host)
    num = setting(args.host_id, host, "fabric_host_id") or 10 + order.index(host.name) + 1
    if not str(num).isdigit():
        return [], f"fabric_host_id {num!r} is not a whole number"
    desired = []
    for link, subnet in zip(topo["links"], subnets):
        for me, other in ((link["a"], link["b"]), (link["b"], link["a"])):
            if me[0] != host.name:
                continue
            net = ipaddress.ip_network(subnet)
            if not 1 <= int(num) <= net.num_addresses - 2:
                return [], f"host number {num} does not fit in {net}: set fabric_host_id"
            desired.append({"iface": me[1], "address": str(net.network_address + int(num)), "prefix": net.prefixlen,
                            "subnet": subnet, "hca": hca_of.get(me[1]), "mtu": args.mtu, "up": True,
                            "peer": other[0], "peer_iface": other[1]})
    if not desired:
        return [], f"no cable of the {topo['kind']} reaches {host.name}"
    return sorted(desired, key=lambda d: iface_order(d["iface"])), None


def _record_change(facts: FactView, record: dict[str, Any]) -> list[Change]:
    """The topology as provision found it, on the node (root, 0644): what FabricInfo reads for the
    commands that bind NCCL and send over the fabric (cluster-up, stage-weights)."""
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    pst = facts.record
    before = (pst.get("content") or b"").decode(errors="replace") if pst["exists"] else ""
    if pst["exists"] and before == text:
        return []
    return [Change(f"record the fabric topology ({record['kind']}, {record.get('source')}) in {TOPOLOGY_RECORD}",
                   write_file_script(TOPOLOGY_RECORD, text.encode(), mode="0644", umask="022"),
                   Diff(TOPOLOGY_RECORD, before, text), [facts.fact("record")],
                   predicts=[(facts.fact("record"), {**pst, "exists": True, "content": text.encode(), "mode": 0o644})])]


class FabricModule(Module):
    name = "fabric"
    Args = Args
    doc = "Address the Up ConnectX-7 twins (one subnet each), MTU 9000, live with iproute2 and persisted with netplan."

    def needs(self, args: Args, host: HostContext):
        named = {"ib": Ibdev2netdev(), "net": NetState(), "netplan": PathState(args.netplan_file, with_content=True)}
        if args.phase == "discover" or FABRIC_DISCOVERY.read(host.exports, host.name) is not None:
            named["record"] = PathState(TOPOLOGY_RECORD, with_content=True)
        if args.phase == "discover":
            configured = setting(args.rails, host, "fabric_rails")
            ifaces = tuple(str(r) for r in configured if interface_name_ok(str(r))) if isinstance(configured, list) else SPARK_TWINS
            named["neighbours"] = FabricNeighbours(ifaces)
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        if args.phase == "discover":
            return _discovered(facts, host)
        h = host.name
        ib, net = facts.ib, facts.net
        links = net["links"]
        hca_of = {d["iface"]: d["hca"] for d in ib["devices"]}
        rails, problem = _rails(args, host, ib, links)
        if problem:
            return Plan.fail(f"{h}: {problem}")
        if not rails:
            why = ("ibdev2netdev is not installed" if not ib["present"] else
                   "ibdev2netdev shows no twin Up: " + ", ".join(f"{d['iface']} ({'Up' if d['up'] else 'Down'})"
                                                                 for d in ib["devices"]))
            if len(host.play_hosts) > 1:
                return Plan.fail(f"{h}: no fabric rail: {why}. Fix: cable the QSFP ports (a ConnectX-7 twin must be "
                                 "Up), or name the rails with fabric_rails in the inventory")
            return Plan.skip(f"no fabric rail ({why}); a single host needs none")
        mgmt = {r["dev"] for r in net["routes"] if r["dst"] == "default"}
        for r in rails:
            if net["ssh_server_addr"] and any(a["address"] == net["ssh_server_addr"] for a in links[r]["ipv4"]):
                return Plan.fail(f"{h}: {r} carries this SSH session ({net['ssh_server_addr']}): it is the management "
                                 "link, not a fabric rail; fix fabric_rails")
            if r in mgmt:
                return Plan.fail(f"{h}: {r} carries the default route: it is the management link, not a fabric rail")
        topo, problems, notes = topology_of(host)
        if problems:
            return Plan.fail(f"{h}: " + "; ".join(problems))
        if topo and topo["kind"] in PER_LINK:
            desired, err = per_link(args, host, topo, hca_of)
            if err:
                return Plan.fail(f"{h}: {err}")
            return self._converge(args, facts, host, desired, topo, notes)
        subnets, err = choose_subnets(len(rails), setting(args.subnets, host, "fabric_subnets"), net["routes"], rails)
        if err:
            return Plan.fail(f"{h}: {err}")
        want, problem = _addresses(args, host, rails, subnets)
        if problem:
            return Plan.fail(f"{h}: {problem}")
        desired = [{"iface": r, "address": str(w.ip), "prefix": w.network.prefixlen, "subnet": str(w.network),
                    "hca": hca_of.get(r), "mtu": args.mtu, "up": True} for r, w in zip(rails, want)]
        return self._converge(args, facts, host, desired, topo, notes)

    def _converge(self, args: Args, facts: FactView, host: HostContext, desired: list[dict[str, Any]],
                  topo: dict[str, Any] | None, remarks: list[str]) -> Plan:
        """Make the rails what `desired` says, live and in the netplan file (and the topology record)."""
        h = host.name
        net = facts.net
        links = net["links"]
        changes = [c for d in desired if (c := _rail_change(d, links[d["iface"]], args.mtu))]
        netplan = _netplan_change(args, facts, desired, net["netplan"])
        changes += [netplan] if netplan else []
        warnings = []
        if not net["netplan"]:
            warnings.append(f"{h}: netplan is not installed: the rails are configured live and {args.netplan_file} "
                            "is written, but nothing applies it at boot")
        keys = ("iface", "address", "prefix", "subnet", "hca", "mtu", "up") + (("peer", "peer_iface") if topo and
                                                                               topo["kind"] in PER_LINK else ())
        rails_out = [{k: d[k] for k in keys} for d in desired]
        record = None
        if topo is not None:
            record = {**topo, "host": h, "mgmt": FABRIC_DISCOVERY.read(host.exports, h).get("mgmt")}
            if topo.get("kind") == "switch":
                record["shared"] = {}  # who answered varies from run to run; on_switch says which twins are on it
            changes += _record_change(facts, record)
        exports = FABRIC({"rails": rails_out, **nccl_settings(rails_out, record), "converged": not changes,
                          **({"topology": record} if record else {})})
        msg = "; ".join(f"{d['iface']} ({d['hca'] or 'no RoCE device'}) {d['address']}/{d['prefix']} mtu {args.mtu}"
                        + (f" to {d['peer']} {d['peer_iface']}" if d.get("peer") else "") for d in desired)
        if topo is not None:
            msg = f"{topo['kind'] or 'unknown'} ({topo.get('source')}): " + msg
        return Plan(changes, msg=msg, warnings=warnings + remarks, exports=exports)


def _rails(args: Args, host: HostContext, ib: dict, links: dict) -> tuple[list[str], str | None]:
    """The rails: the inventory's fabric_rails (each must exist and have a carrier), else every
    ConnectX-7 twin ibdev2netdev shows Up; and why the configured ones cannot be."""
    configured = setting(args.rails, host, "fabric_rails")
    if not configured:
        return [d["iface"] for d in sorted(ib["devices"], key=lambda d: iface_order(d["iface"]))
                if d["up"] and d["iface"] in links], None
    rails = [str(r) for r in configured]
    for r in rails:
        if not interface_name_ok(r):
            return rails, f"{r!r} is not an interface name"
        if r not in links:
            return rails, f"fabric rail {r} does not exist (interfaces: {', '.join(sorted(links))})"
        if not links[r]["carrier"] and links[r]["admin_up"]:
            return rails, f"fabric rail {r} has no carrier: check the QSFP cable"
    return rails, None


def _addresses(args: Args, host: HostContext, rails: list[str], subnets: list) -> tuple[list, str | None]:
    """Each rail's address in its subnet: the inventory's fabric_addresses, else the host's number
    (fabric_host_id, else 11, 12, ... in the cluster's order) in every subnet; and why not."""
    addresses = setting(args.addresses, host, "fabric_addresses")
    if addresses:
        try:
            want = [ipaddress.ip_interface(str(a)) for a in addresses]
        except ValueError as exc:
            return [], f"bad fabric address: {exc} (write each as ADDRESS/PREFIX)"
        if len(want) < len(rails):
            return [], f"{len(rails)} rails but fabric_addresses has {len(want)}"
        want = want[:len(rails)]
        for w, n in zip(want, subnets):
            if w.network != n:
                return [], f"fabric address {w} is not in the rail's subnet {n}"
        return want, None
    num = setting(args.host_id, host, "fabric_host_id") or 10 + cluster_order(host).index(host.name) + 1
    if not str(num).isdigit():
        return [], f"fabric_host_id {num!r} is not a whole number"
    want = []
    for n in subnets:
        if not 1 <= int(num) <= n.num_addresses - 2:
            return [], f"host number {num} does not fit in {n}: set fabric_host_id"
        want.append(ipaddress.ip_interface(f"{n.network_address + int(num)}/{n.prefixlen}"))
    return want, None


def _rail_change(d: dict, link: dict, mtu: int) -> Change | None:
    """One rail brought to its MTU, up, and its one global address (None: it is)."""
    ifc = d["iface"]
    script, notes = [], []
    if link["mtu"] != mtu:
        script.append(cmd("ip", "link", "set", "dev", ifc, "mtu", mtu))
        notes.append(f"mtu {link['mtu']} -> {mtu}")
    if not link["admin_up"]:
        script.append(cmd("ip", "link", "set", "dev", ifc, "up"))
        notes.append("set up")
    cidr = f"{d['address']}/{d['prefix']}"
    have = {f"{a['address']}/{a['prefix']}" for a in link["ipv4"]}
    for a in link["ipv4"]:
        full = f"{a['address']}/{a['prefix']}"
        if full != cidr and a["scope"] == "global" and not a["address"].startswith("169.254."):
            script.append(cmd("ip", "addr", "del", full, "dev", ifc))
            notes.append(f"remove {full}")
    if cidr not in have:
        script.append(cmd("ip", "addr", "add", cidr, "dev", ifc))
        notes.append(f"add {cidr}")
    if not script:
        return None
    return Change(f"{ifc}: " + ", ".join(notes), "\n".join(script),
                  Diff(f"rail {ifc}", _rail_text(ifc, link), f"{ifc}: mtu {mtu} up {cidr}\n"), [NetState(), Ibdev2netdev()])


def _netplan_change(args: Args, facts, desired: list[dict], netplan: bool) -> Change | None:
    """The rails persisted in the netplan file (0600 root), checked with `netplan generate` where
    netplan is installed, the previous file put back when it rejects it (None: it holds them)."""
    pst = facts.netplan
    text = netplan_text(desired, args.mtu)
    before = (pst.get("content") or b"").decode(errors="replace") if pst["exists"] else ""
    if pst["exists"] and before == text and pst.get("mode") == 0o600 and pst.get("owner") == "root":
        return None
    f = args.netplan_file
    prev = f + ".sparkprov-prev"
    script = ["umask 077", cmd("mkdir", "-p", "/etc/netplan"),
              f"if [ -f {quote(f)} ]; then cp -p -- {quote(f)} {quote(prev)}; else rm -f -- {quote(prev)}; fi",
              write_file_script(f, text.encode(), mode="0600", owner="root", group="root")]
    if netplan:
        script.append(f"if ! netplan generate >/tmp/sparkprov-netplan.log 2>&1; then "
                      f"if [ -f {quote(prev)} ]; then mv -f -- {quote(prev)} {quote(f)}; else rm -f -- {quote(f)}; fi; "
                      "echo \"netplan generate rejected the fabric file: $(tail -n 3 /tmp/sparkprov-netplan.log)\" >&2; exit 1; fi")
    script.append(cmd("rm", "-f", "--", prev))
    verb = "update" if pst["exists"] else "write"
    return Change(f"{verb} {f} (mode 0600" + (", checked with netplan generate)" if netplan else ")"),
                  "\n".join(script), Diff(f, before, text), [facts.fact("netplan")])
