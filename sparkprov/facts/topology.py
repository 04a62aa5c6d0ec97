"""The fabric's topology: which local port reaches which peer's port, and what the cabling is.

A Spark has two QSFP ports, each seen twice (one ConnectX-7 twin per PCIe domain: port 1 is
enp1s0f1np1 and enP2p1s0f1np1, port 0 enp1s0f0np0 and enP2p1s0f0np0; gb10-outputs.md). Owners cable
them four ways (issue 34): a pair (one or two cables between two Sparks), a switch (every Spark's
ports on one switch), a three-Spark mesh (each to both others: a Spark has two ports) and a ring of
four or more (each port 0 to the next Spark's port 1: eugr/spark-vllm-docker NETWORKING.md,
sparkrun#157). On a pair or a switch every peer is one hop away on every rail; on a mesh or a ring
each cable is its own point-to-point segment, reaching one peer.

- `FabricNeighbours`: per fabric interface, its MAC and who answers on it: an IPv6 echo to all
  nodes of the link (ff02::1, from the interface itself: no address needed, nothing written) and
  the link-layer addresses the kernel's neighbour table then holds for the answers. A peer is known
  by its MAC (every host reports its own), so the same probe reads a cable (one peer), a switch
  (several) and a dark port (none).
- `discover`: the topology of the hosts from what each found (pure): the links (one per twin of a
  cable), the cables, the kind, the ring order (ranks follow the cabling), and why it could not say.
- `check_declared`: an owner's `fabric_topology` and `fabric_links` against the cabling; a
  contradiction names the link.
- `link_subnets`: one subnet per link of a mesh or ring (both ends on it), the same on every host.

The inventory variables it reads (fabric_topology, fabric_links, fabric_requalify,
fabric_qualify_max_age_hours) are declared in sparkprov/inventory_vars.py; check_var is their rule.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from sparkprov.facts.base import Fact, ShellCtx
from sparkprov.transport.shell import cmd, quote

PER_LINK = ("mesh", "ring")   # each cable twin its own subnet; pair and switch: rail i of every host on one
# What provision's fabric module found, on the node (root, 0644): FabricInfo reads it for the commands
# that bind NCCL and send over the fabric.
TOPOLOGY_RECORD = "/var/lib/sparkprov/fabric/topology.json"

PORTS = ("p0", "p1")
# The twins of a Spark's ConnectX-7 (two ports, two twins each): what discovery probes
SPARK_TWINS = ("enp1s0f0np0", "enp1s0f1np1", "enP2p1s0f0np0", "enP2p1s0f1np1")
_IFACE_PORT_RE = re.compile(r"f(\d)np\d+$")
_END_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*):([A-Za-z0-9][A-Za-z0-9._@-]{0,14})$")


def port_of(iface: str) -> str | None:
    """The QSFP port a ConnectX-7 twin is half of: enp1s0f1np1 and enP2p1s0f1np1 -> "p1"."""
    m = _IFACE_PORT_RE.search(iface)
    return f"p{m.group(1)}" if m and m.group(1) in "01" else None


def domain_of(iface: str) -> int:
    """The twin's PCIe domain (0 for enp1s0..., 2 for enP2p1s0...): twins pair up by it across a cable."""
    m = re.match(r"enP(\d+)p", iface)
    return int(m.group(1)) if m else 0


def parse_end(text: str) -> tuple[str, str]:
    """`HOST:PORT` -> (host, port or interface). ValueError naming what is wrong."""
    m = _END_RE.match(text.strip()) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"{text!r} is not HOST:PORT (PORT: p0, p1 or an interface name)")
    return m.group(1), m.group(2)


def parse_links(value: Any) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """`fabric_links` -> [((host, port), (host, port))], each port p0/p1 (an interface becomes its
    port). ValueError for anything else."""
    if not isinstance(value, list) or not value:
        raise ValueError("fabric_links must be a list of cables, each \"HOST:PORT HOST:PORT\"")
    out = []
    for item in value:
        words = item.split() if isinstance(item, str) else []
        if len(words) != 2:
            raise ValueError(f"cable {item!r}: two ends, \"HOST:PORT HOST:PORT\"")
        ends = []
        for w in words:
            host, port = parse_end(w)
            p = port if port in PORTS else port_of(port)
            if p is None:
                raise ValueError(f"cable {item!r}: {port!r} is neither p0, p1 nor a ConnectX-7 twin (…f0np0, …f1np1)")
            ends.append((host, p))
        if ends[0][0] == ends[1][0]:
            raise ValueError(f"cable {item!r}: both ends on {ends[0][0]}")
        out.append((ends[0], ends[1]))
    seen: dict[tuple[str, str], str] = {}
    for a, b in out:
        for e in (a, b):
            if e in seen:
                raise ValueError(f"{e[0]}:{e[1]} is in two cables ({seen[e]} and {a[0]}:{a[1]} {b[0]}:{b[1]})")
            seen[e] = f"{a[0]}:{a[1]} {b[0]}:{b[1]}"
    return out


def check_var(name: str, value: Any, hosts: list[str] | None = None) -> tuple[str, str] | None:
    """(message, fix) when fabric_links (inventory_vars.py: its kind names this rule; the list shape is
    checked there) names a cable it does not accept or a host the inventory lacks."""
    if value is None:
        return None
    if name == "fabric_links":
        try:
            cables = parse_links(value)
        except ValueError as e:
            return f"fabric_links: {e}", "e.g. fabric_links: [\"spark1:p0 spark2:p1\", \"spark2:p0 spark1:p1\"]"
        unknown = sorted({h for c in cables for h, _ in c if hosts is not None and h not in hosts})
        if unknown:
            return (f"fabric_links: {', '.join(unknown)} is no host of the inventory",
                    "name the inventory's hosts at both ends of each cable")
    return None


# -- discovery ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class FabricNeighbours(Fact):
    """Per interface: its MAC, operstate and carrier, its own IPv6 link-local address (its identity
    here), and who answers an IPv6 echo to all nodes of the link sent from it (`ping -6 -i 0.2 -c 2
    -w 2 -I IFACE ff02::1`: the answers come within a millisecond; each answer's source address, and
    its MAC where the neighbour table holds it). A twin without a carrier is not probed (ping would
    wait out its deadline). All interfaces at once. Writes nothing."""

    ifaces: tuple[str, ...]
    # ping refuses a multicast echo more often than once a second to anyone but root ("multicast ping
    # with too short interval"): as root the two echoes take 0.2 s, as another user 1 s
    needs_root: ClassVar[bool] = True

    def command(self, sh: ShellCtx) -> str:
        if not self.ifaces:
            return ":"
        lines = ['__fn=$(mktemp -d)', "trap 'rm -rf \"$__fn\"' EXIT",
                 'if [ "$(id -u)" = 0 ]; then __fn_i=0.2; else __fn_i=1; fi']
        for n, ifc in enumerate(self.ifaces):
            sys = quote(f"/sys/class/net/{ifc}")
            ping = cmd("ping", "-6", "-n", "-c", 2, "-w", 2, "-I", ifc, "ff02::1").replace(
                "ping -6 -n", 'ping -6 -n -i "$__fn_i"', 1)
            lines.append(
                f"{{ [ -e {sys} ] || exit 0; printf '@iface %s\\nmac=%s\\noper=%s\\ncarrier=%s\\n' {quote(ifc)} "
                f"\"$(cat {sys}/address 2>/dev/null)\" \"$(cat {sys}/operstate 2>/dev/null)\" "
                f"\"$(cat {sys}/carrier 2>/dev/null)\"; echo @ll; "
                f"{cmd('ip', '-j', '-6', 'addr', 'show', 'dev', ifc, 'scope', 'link')} 2>/dev/null; echo; echo @ping; "
                f"if [ \"$(cat {sys}/carrier 2>/dev/null)\" = 1 ]; then {ping} 2>&1 | "
                "grep -E 'bytes from|rror|nreachable|nterval|ermitted'; "
                f"echo @neigh; {cmd('ip', '-j', '-6', 'neigh', 'show', 'dev', ifc)} 2>/dev/null; echo; fi; "
                f"}} > \"$__fn/{n:02d}\" 2>&1 &")
        lines += ["wait", 'cat "$__fn"/* 2>/dev/null; true']
        return "\n".join(lines)

    def parse(self, out: str, err: str, rc: int) -> dict[str, dict[str, Any]]:
        return parse_neighbours(out)


_REPLY_RE = re.compile(r"bytes from ([0-9A-Fa-f:]+)(?:%[^:\s]+)?:")


def _json(text: str) -> list:
    try:
        v = json.loads(text.strip() or "[]")
    except ValueError:
        return []
    return v if isinstance(v, list) else []


def parse_neighbours(out: str) -> dict[str, dict[str, Any]]:
    """FabricNeighbours' output -> {iface: {mac, oper, id, answers: [addresses that answered, not its
    own], neighbours: [their MACs the neighbour table holds], error}}. `id`: the twin's own link-local
    address, what a peer's answers name it by."""
    res: dict[str, dict[str, Any]] = {}
    for block in re.split(r"(?m)^(?=@iface )", out):
        head, _, body = block.partition("\n")
        if not head.startswith("@iface "):
            continue
        iface = head.split(None, 1)[1].strip()
        meta, _, rest = body.partition("@ping\n")
        meta, _, ll = meta.partition("@ll\n")
        ping, _, neigh = rest.partition("@neigh\n")
        kv = dict(ln.split("=", 1) for ln in meta.splitlines() if "=" in ln)
        own = [a["local"].lower() for link in _json(ll) if isinstance(link, dict)
               for a in link.get("addr_info") or [] if a.get("family") == "inet6" and a.get("local")]
        answered = {m.group(1).lower() for m in _REPLY_RE.finditer(ping)} - set(own)
        macs = sorted({(e.get("lladdr") or "").lower() for e in _json(neigh) if isinstance(e, dict)
                       and (e.get("dst") or "").lower() in answered and e.get("lladdr")})
        error = next((ln.strip() for ln in ping.splitlines() if "bytes from" not in ln and ln.strip()), None)
        res[iface] = {"mac": (kv.get("mac") or "").strip().lower() or None, "oper": (kv.get("oper") or "").strip(),
                      "carrier": (kv.get("carrier") or "").strip() == "1", "id": own[0] if own else None,
                      "answers": sorted(answered), "neighbours": macs,
                      "error": error if not (macs or answered) else None}
    return res


# -- the topology, from every host's discovery (pure) ---------------------------------------------

def _link_name(a: tuple[str, str], b: tuple[str, str]) -> str:
    return f"{a[0]} {a[1]} <-> {b[0]} {b[1]}"


def discover(found: dict[str, dict[str, dict[str, Any]]], order: list[str]) -> dict[str, Any]:
    """The topology of `order`'s hosts from what each one's interfaces found
    ({host: {iface: {mac, up, neighbours}}}; `up`: the twin has a carrier). Returns
    {kind, links: [{a: [host, iface], b: [host, iface]}], cables: [{a: [host, port], b: [host, port]}],
     order, shared: {host iface: [peer hosts]}, problems: [...], probed: bool}
    kind is pair, mesh, ring, switch, or None when the cabling is none of them (problems says why)."""
    # a twin is known by its link-local address (the source of its answers) and by its MAC
    owner = {k: (h, i) for h in order for i, d in (found.get(h) or {}).items()
             for k in (d.get("mac"), d.get("id")) if k}
    links: dict[frozenset, tuple[tuple[str, str], tuple[str, str]]] = {}
    shared: dict[str, list[str]] = {}
    heard_on_switch: set[str] = set()   # the twins a twin that heard several peers heard
    probed = False
    for h in order:
        for iface, d in sorted((found.get(h) or {}).items(), key=lambda kv: (domain_of(kv[0]), kv[0])):
            if not d.get("up"):
                continue
            probed = probed or bool(d.get("neighbours") or d.get("answers"))
            heard = list(d.get("neighbours") or []) + list(d.get("answers") or [])
            ends = sorted({owner[m] for m in heard if m in owner and owner[m][0] != h})
            peers = sorted({p for p, _ in ends}, key=order.index)
            if len(peers) > 1:
                shared[f"{h} {iface}"] = peers
                heard_on_switch |= {f"{p} {i}" for p, i in ends}
                continue
            if not ends:
                continue
            # a real port answers from both its twins: pair this twin with the peer's twin of its domain
            same = [e for e in ends if domain_of(e[1]) == domain_of(iface)] or ends
            a, b = (h, iface), sorted(same)[0]
            links.setdefault(frozenset((a, b)), tuple(sorted((a, b), key=lambda e: (order.index(e[0]), e[1]))))
    cables: dict[frozenset, tuple[tuple[str, str], tuple[str, str]]] = {}
    for a, b in links.values():
        pa, pb = (a[0], port_of(a[1]) or a[1]), (b[0], port_of(b[1]) or b[1])
        cables.setdefault(frozenset((pa, pb)), (pa, pb))
    adjacency: dict[str, set[str]] = {h: set() for h in order}
    for a, b in cables.values():
        adjacency[a[0]].add(b[0])
        adjacency[b[0]].add(a[0])
    out = {"links": [{"a": list(a), "b": list(b)} for a, b in sorted(links.values(), key=lambda ab: _sort(ab, order))],
           "cables": [{"a": list(a), "b": list(b)} for a, b in sorted(cables.values(), key=lambda ab: _sort(ab, order))],
           "shared": shared, "problems": [], "probed": probed or bool(shared), "order": list(order), "kind": None}
    n = len(order)
    if shared:
        # a switch: a twin that heard one peer this time is on it too (the others did not answer in
        # time), and so is one that heard none but was heard (its own echo failed, e.g. its link-local
        # address still tentative right after boot); the record keeps which twins are on it, never who
        # answered (that varies run to run)
        out["kind"] = "switch"
        out["on_switch"] = sorted(set(shared) | heard_on_switch
                                  | {f"{e[0]} {e[1]}" for ln in out["links"] for e in (ln["a"], ln["b"])},
                                  key=lambda k: (order.index(k.split(" ")[0]), k))
        out["links"], out["cables"] = [], []
        return out
    if not links:
        out["problems"].append("no interface of any host reached a peer" if out["probed"] else
                               "no interface answered the link probe (IPv6 off, or every twin down)")
        return out
    if n == 2 and adjacency[order[0]] == {order[1]}:
        out["kind"] = "pair"
    elif n == 3 and all(len(adjacency[h]) == 2 for h in order):
        out["kind"] = "mesh"
    elif n >= 4 and all(len(adjacency[h]) == 2 for h in order) and _one_cycle(adjacency, order):
        out["kind"] = "ring"
        out["order"] = ring_order(cables.values(), order)
    else:
        lone = [h for h in order if len(adjacency[h]) < (1 if n == 2 else 2)]
        many = [h for h in order if len(adjacency[h]) > 2]
        why = ([f"{', '.join(lone)} reach{'es' if len(lone) == 1 else ''} fewer peers than a "
                f"{'pair' if n == 2 else 'mesh or ring'} needs ({_reach(adjacency, lone)})"] if lone else [])
        why += [f"{', '.join(many)} reach{'es' if len(many) == 1 else ''} more than two peers point to point"] if many else []
        out["problems"].append("; ".join(why) or "the cables form more than one ring")
    return out


def _sort(ab, order):
    (a, b) = ab
    return (order.index(a[0]), domain_of(a[1]), a[1], order.index(b[0]), domain_of(b[1]), b[1])


def _reach(adjacency: dict[str, set[str]], hosts: list[str]) -> str:
    return "; ".join(f"{h}: {', '.join(sorted(adjacency[h])) or 'none'}" for h in hosts)


def _one_cycle(adjacency: dict[str, set[str]], order: list[str]) -> bool:
    seen, stack = set(), [order[0]]
    while stack:
        h = stack.pop()
        if h not in seen:
            seen.add(h)
            stack += sorted(adjacency[h] - seen)
    return len(seen) == len(order)


def ring_order(cables, order: list[str]) -> list[str]:
    """The hosts around the ring from the first of `order`, each followed by the one its port 0 is
    cabled to (the canonical cabling), else by the neighbour that comes first in `order`."""
    nxt: dict[str, list[tuple[str, str]]] = {}
    for a, b in cables:
        nxt.setdefault(a[0], []).append((a[1], b[0]))
        nxt.setdefault(b[0], []).append((b[1], a[0]))
    out = [order[0]]
    while len(out) < len(order):
        here = out[-1]
        options = sorted(((port != "p0", order.index(peer), peer) for port, peer in nxt.get(here, [])
                          if peer not in out))
        if not options:
            break
        out.append(options[0][2])
    return out + [h for h in order if h not in out]


def check_declared(topo: dict[str, Any], kind: str | None, cables: list | None) -> list[str]:
    """What the cabling contradicts of what the owner declared (one line each, naming the link).
    `kind`: fabric_topology; `cables`: parse_links of fabric_links. [] when nothing was declared or
    the probe found nothing to compare with."""
    out: list[str] = []
    if not topo.get("probed"):
        return out
    found = topo.get("kind")
    if kind and found and kind != found and {kind, found} != {"pair", "switch"}:
        why = ""
        if found == "switch":
            where, peers = next(iter(topo["shared"].items()))
            why = f": {where} reaches {', '.join(peers)} (a switch), not one peer"
        elif kind == "switch":
            ln = topo["links"][0]
            why = f": {ln['a'][0]} {ln['a'][1]} reaches only {ln['b'][0]} {ln['b'][1]} (a point-to-point cable)"
        elif kind in ("mesh", "ring"):
            why = f": {len(topo['order'])} hosts cabled as a {found}"
        out.append(f"fabric_topology is {kind} but the cabling is a {found}{why}")
    if cables:
        have = {frozenset(map(tuple, (c["a"], c["b"]))) for c in topo["cables"]}
        port_peer = {tuple(c[e]): tuple(c["b" if e == "a" else "a"]) for c in topo["cables"] for e in ("a", "b")}
        declared = {frozenset(c) for c in cables}
        for a, b in cables:
            if frozenset((a, b)) in have:
                continue
            got = port_peer.get(a) or port_peer.get(b)
            end = a if a in port_peer else b
            if got:
                out.append(f"fabric_links declares {a[0]}:{a[1]} <-> {b[0]}:{b[1]}, but {end[0]}:{end[1]} is cabled to "
                           f"{got[0]}:{got[1]}")
            else:
                out.append(f"fabric_links declares {a[0]}:{a[1]} <-> {b[0]}:{b[1]}, but neither end reaches a peer")
        for c in topo["cables"]:
            if frozenset(map(tuple, (c["a"], c["b"]))) not in declared:
                out.append(f"{c['a'][0]}:{c['a'][1]} <-> {c['b'][0]}:{c['b'][1]} is cabled but not in fabric_links")
    return out


def declared_topology(kind: str, cables: list, twins: dict[str, list[str]], order: list[str]) -> dict[str, Any]:
    """The topology as declared, for hosts whose probe found nothing: each cable's twins paired by
    domain (`twins`: host -> its Up twins)."""
    links = []
    for (ha, pa), (hb, pb) in cables:
        ta = sorted((i for i in twins.get(ha, []) if port_of(i) == pa), key=domain_of)
        tb = sorted((i for i in twins.get(hb, []) if port_of(i) == pb), key=domain_of)
        links += [{"a": [ha, x], "b": [hb, y]} for x, y in zip(ta, tb)]
    cab = [{"a": [ha, pa], "b": [hb, pb]} for (ha, pa), (hb, pb) in cables]
    out = {"kind": kind, "links": links, "cables": cab, "shared": {}, "problems": [], "probed": False,
           "order": list(order)}
    if kind == "ring":
        out["order"] = ring_order([(tuple(c["a"]), tuple(c["b"])) for c in cab], order)
    return out


# -- addressing per link ---------------------------------------------------------------------------

# One subnet per link of a mesh or ring: 192.168.100.0/24 up (the pool of a pair's and a switch's
# rails, NVIDIA's guide: .100, .101), as many as the links need, each its own /24 as a rail's is.
LINK_POOL = tuple(f"192.168.{n}.0/24" for n in range(100, 164))


def link_subnets(links: list[dict[str, Any]], routed: list[str]) -> tuple[list[str] | None, str | None]:
    """A subnet per link (in the order given), skipping pool subnets any host routes elsewhere
    (`routed`: every host's non-fabric routes). The same on every host, which computes it from the
    same exports. (subnets, error)."""
    nets = []
    for r in routed:
        try:
            nets.append(ipaddress.ip_network(r, strict=False))
        except ValueError:
            continue
    free = [s for s in LINK_POOL if not any(n.version == 4 and n.overlaps(ipaddress.ip_network(s)) for n in nets)]
    if len(free) < len(links):
        return None, (f"{len(links)} fabric links need {len(links)} subnets; the pool 192.168.100-163.0/24 has "
                      f"{len(free)} free of the hosts' routes")
    return free[:len(links)], None


def host_view(topo: dict[str, Any], host: str) -> dict[str, Any]:
    """What one host's part of a topology is, for `invoke facts`: the kind, the ring order, and each of
    its twins with the peer twin it reaches ("enp1s0f0np0": "spark2 enp1s0f1np1")."""
    links = {}
    for ln in topo.get("links") or []:
        for end, other in ((ln["a"], ln["b"]), (ln["b"], ln["a"])):
            if end[0] == host:
                links[end[1]] = f"{other[0]} {other[1]}"
    for where in topo.get("on_switch") or []:
        h, iface = where.split(" ", 1)
        if h == host:
            links[iface] = "switch"
    for where, peers in (topo.get("shared") or {}).items():
        h, iface = where.split(" ", 1)
        if h == host:
            links[iface] = "switch: " + ", ".join(peers)
    return {"kind": topo.get("kind") or "unknown", "order": topo.get("order"), "links": links,
            **({"problems": topo["problems"]} if topo.get("problems") else {})}


@dataclass(frozen=True)
class TopologyRecord(Fact):
    """The topology provision recorded on the node (TOPOLOGY_RECORD): {} when there is none."""

    def command(self, sh: ShellCtx) -> str:
        return f"cat {quote(TOPOLOGY_RECORD)} 2>/dev/null; true"

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        try:
            doc = json.loads(out) if out.strip() else {}
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}
