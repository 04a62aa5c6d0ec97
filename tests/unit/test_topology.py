"""The fabric's topology (issue 34): discovered from which peer each twin reaches, declared where the
owner pins it, contradictions named by link; per-link addressing of a mesh and a ring; the mesh check
and qualification following the links. On literal data: the lab's cabling (sparklab/state.py cables:
each port 0 to the next host's port 1; MACs as sparklab/net.py mac gives them) and the output of
FabricNeighbours as it reads it."""

from __future__ import annotations

import pytest

from sparkprov.facts import topology as t
from sparkprov.facts.fabric import nccl_settings
from sparkprov.modules import fabric as fab
from sparkprov.modules import fabric_mesh as fm
from sparkprov.modules import fabric_qualify as fq
from sparkprov.modules.base import FactView, HostContext

TWINS = {"p0": ("enp1s0f0np0", "enP2p1s0f0np0"), "p1": ("enp1s0f1np1", "enP2p1s0f1np1")}
ALL = ("enp1s0f1np1", "enP2p1s0f1np1", "enp1s0f0np0", "enP2p1s0f0np0")
HCA = {"enp1s0f0np0": "rocep1s0f0", "enp1s0f1np1": "rocep1s0f1", "enP2p1s0f0np0": "roceP2p1s0f0",
       "enP2p1s0f1np1": "roceP2p1s0f1"}


def mac(host: str, iface: str) -> str:
    """The lab's MAC of a host's twin (sparklab/net.py mac: index, place in FABRIC_IFACES)."""
    index = int(host.removeprefix("spark"))
    return f"4c:bb:47:{index:02x}:91:{('enp1s0f0np0', 'enp1s0f1np1', 'enP2p1s0f0np0', 'enP2p1s0f1np1').index(iface):02x}"


def cabled(kind: str, n: int) -> dict[str, dict[str, dict]]:
    """What every host's discovery finds on the lab's cabling of `kind` (the ring rule of
    sparklab/state.py cables; a switch: every port-1 twin on one bridge per twin)."""
    hosts = [f"spark{i}" for i in range(1, n + 1)]
    found = {h: {i: {"mac": mac(h, i), "up": False, "hca": HCA[i], "neighbours": []} for i in ALL} for h in hosts}
    if kind == "switch" or kind == "pair":
        for h in hosts:
            for i in TWINS["p1"]:
                found[h][i].update(up=True, neighbours=sorted(mac(o, i) for o in hosts if o != h))
        return found
    for k, h in enumerate(hosts):
        nxt = hosts[(k + 1) % n]
        for a, b in zip(TWINS["p0"], TWINS["p1"]):
            found[h][a].update(up=True, neighbours=[mac(nxt, b)])
            found[nxt][b].update(up=True, neighbours=[mac(h, a)])
    return found


ORDER = {n: [f"spark{i}" for i in range(1, n + 1)] for n in (2, 3, 4, 6)}


@pytest.mark.parametrize("kind, n", [("pair", 2), ("mesh", 3), ("ring", 4), ("ring", 6), ("switch", 4)])
def test_the_kind_is_read_from_who_each_twin_reaches(kind, n):
    topo = t.discover(cabled("ring" if kind == "mesh" else kind, n), ORDER[n])
    assert topo["kind"] == kind and topo["problems"] == []
    if kind in ("mesh", "ring"):
        assert len(topo["cables"]) == n and len(topo["links"]) == 2 * n
        # each cable twin pairs with the peer's twin of its PCIe domain
        assert {"a": ["spark1", "enp1s0f0np0"], "b": ["spark2", "enp1s0f1np1"]} in topo["links"]
        assert {"a": ["spark1", "p0"], "b": ["spark2", "p1"]} in topo["cables"]


def test_a_real_port_answers_from_both_twins_and_still_is_one_peer():
    """On a Spark both twins of the peer's port share the cable: an echo from one twin is answered by
    both. Still one peer per port: the twin pairs with its own domain's."""
    found = cabled("ring", 4)
    for h, ifaces in found.items():
        for i, d in ifaces.items():
            d["neighbours"] = sorted({m for x in ifaces for m in found[h][x]["neighbours"]
                                      if t.port_of(x) == t.port_of(i)})
    topo = t.discover(found, ORDER[4])
    assert topo["kind"] == "ring" and len(topo["links"]) == 8
    assert {"a": ["spark1", "enP2p1s0f0np0"], "b": ["spark2", "enP2p1s0f1np1"]} in topo["links"]


def test_ranks_follow_the_cabling_not_the_inventory():
    # cabled spark1 -> spark3 -> spark2 -> spark4 -> spark1 (port 0 to the next one's port 1)
    cab = [("spark1", "spark3"), ("spark3", "spark2"), ("spark2", "spark4"), ("spark4", "spark1")]
    found = {h: {i: {"mac": mac(h, i), "up": False, "neighbours": []} for i in ALL} for h in ORDER[4]}
    for a, b in cab:
        for x, y in zip(TWINS["p0"], TWINS["p1"]):
            found[a][x].update(up=True, neighbours=[mac(b, y)])
            found[b][y].update(up=True, neighbours=[mac(a, x)])
    topo = t.discover(found, ORDER[4])
    assert topo["kind"] == "ring" and topo["order"] == ["spark1", "spark3", "spark2", "spark4"]


def test_a_broken_ring_and_a_dark_fabric_say_why():
    found = cabled("ring", 4)
    for i in TWINS["p0"]:               # spark4's port 0 (to spark1) unplugged
        found["spark4"][i].update(up=False, neighbours=[])
    for i in TWINS["p1"]:
        found["spark1"][i].update(up=False, neighbours=[])
    topo = t.discover(found, ORDER[4])
    assert topo["kind"] is None and "spark1, spark4 reach fewer peers than a mesh or ring needs" in topo["problems"][0]
    dark = {h: {i: {**d, "neighbours": []} for i, d in ifs.items()} for h, ifs in cabled("ring", 4).items()}
    topo = t.discover(dark, ORDER[4])
    assert topo["kind"] is None and not topo["probed"] and "IPv6 off" in topo["problems"][0]


def test_a_declaration_the_cabling_contradicts_names_the_link():
    ring = t.discover(cabled("ring", 4), ORDER[4])
    assert t.check_declared(ring, "ring", t.parse_links(["spark1:p0 spark2:p1", "spark2:p0 spark3:p1",
                                                         "spark3:p0 spark4:p1", "spark4:p0 spark1:p1"])) == []
    (line,) = t.check_declared(ring, "switch", None)
    assert line == ("fabric_topology is switch but the cabling is a ring: spark1 enp1s0f0np0 reaches only "
                    "spark2 enp1s0f1np1 (a point-to-point cable)")
    wrong = t.check_declared(ring, None, t.parse_links(["spark1:p0 spark3:p1", "spark2:p0 spark4:p1",
                                                        "spark3:p0 spark4:p0"]))
    assert wrong[0] == "fabric_links declares spark1:p0 <-> spark3:p1, but spark1:p0 is cabled to spark2:p1"
    assert "spark1:p0 <-> spark2:p1 is cabled but not in fabric_links" in wrong
    switch = t.discover(cabled("switch", 4), ORDER[4])
    (line,) = t.check_declared(switch, "ring", None)
    assert line == "fabric_topology is ring but the cabling is a switch: spark1 enp1s0f1np1 reaches spark2, spark3, spark4 (a switch), not one peer"
    # two hosts on a switch look like a pair: the same addressing, no contradiction
    assert t.check_declared(t.discover(cabled("pair", 2), ORDER[2]), "switch", None) == []


def test_fabric_topology_var():
    from sparkprov import inventory_vars as iv
    with pytest.raises(ValueError, match="is not one of pair, mesh, ring, switch"):
        iv.VARS["fabric_topology"].check("donut")
    assert [iv.VARS["fabric_topology"].check(name) for name in iv.TOPOLOGIES] == list(iv.TOPOLOGIES)


@pytest.mark.parametrize("value, says", [
    ("spark1:p0 spark2:p1", "must be a list"),
    (["spark1:p0"], "two ends"),
    (["spark1:p7 spark2:p1"], "'p7' is neither p0, p1 nor a ConnectX-7 twin"),
    (["spark1:p0 spark1:p1"], "both ends on spark1"),
    (["spark1:p0 spark2:p1", "spark1:enp1s0f0np0 spark3:p1"], "spark1:p0 is in two cables"),
    (["spark1:p0 spark9:p1"], "spark9 is no host of the inventory"),
])
def test_fabric_links_var(value, says):
    assert says in t.check_var("fabric_links", value, hosts=["spark1", "spark2", "spark3"])[0]
    assert t.check_var("fabric_links", ["spark1:enp1s0f0np0 spark2:p1"], hosts=["spark1", "spark2"]) is None


def test_the_inventory_refuses_a_bad_topology_var_at_its_line(tmp_path):
    from sparkprov.data.inventory import load_inventory
    from sparkprov.errors import InputError

    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  spark1: {address: 10.77.0.11}\n  spark2: {address: 10.77.0.12}\nvars:\n"
                   "  fabric_topology: ring\n  fabric_links: [\"spark1:p0 spark3:p1\"]\n")
    with pytest.raises(InputError) as e:
        load_inventory(inv)
    assert e.value.line() .startswith(f"{inv}:6:") and "spark3 is no host of the inventory" in e.value.line()


# -- the fabric module: per link on a mesh and a ring ----------------------------------------------

def net_state(host: str, found: dict) -> dict:
    links = {i: {"mtu": 1500, "up": True, "admin_up": True, "carrier": d["up"], "mac": d["mac"], "ipv4": []}
             for i, d in found[host].items()}
    links["enP7s7"] = {"mtu": 1500, "up": True, "admin_up": True, "carrier": True, "mac": "x",
                       "ipv4": [{"address": f"10.77.0.{10 + int(host[5:])}", "prefix": 24, "scope": "global"}]}
    return {"ssh_server_addr": f"10.77.0.{10 + int(host[5:])}", "netplan": "/usr/sbin/netplan", "links": links,
            "routes": [{"dst": "default", "dev": "enP7s7", "gateway": "10.77.0.1"},
                       {"dst": "10.77.0.0/24", "dev": "enP7s7", "gateway": None}]}


def ib(found: dict, host: str) -> dict:
    return {"present": True, "devices": [{"hca": HCA[i], "port": 1, "iface": i, "up": d["up"]}
                                         for i, d in found[host].items()]}


def discovery_exports(found: dict, hosts: list[str]) -> dict:
    out = {}
    for h in hosts:
        m = fab.FabricModule()
        a = m.Args(phase="discover")
        c = HostContext(h, {}, {"user": "nvidia", "home": "/home/nvidia"}, exports={}, play_hosts=hosts, check=False, become=False)
        named = m.needs(a, c)
        values = {"ib": ib(found, h), "net": net_state(h, found), "netplan": {"exists": False},
                  "record": {"exists": False},
                  "neighbours": {i: {"mac": d["mac"], "oper": "up" if d["up"] else "down",
                                     "neighbours": d["neighbours"], "error": None} for i, d in found[h].items()}}
        p = m.plan(a, m.view(a, FactView({f.key: values[n] for n, f in named.items()}, {}), c), c)
        out[h] = p.exports
    return out


def configure(found: dict, hosts: list[str], host: str, vars: dict | None = None):
    exports = discovery_exports(found, hosts)
    m = fab.FabricModule()
    a = m.Args()
    c = HostContext(host, {"groups": {"sparks": hosts}, **(vars or {})}, {"user": "nvidia", "home": "/home/nvidia"},
                    exports=exports, play_hosts=hosts, check=False, become=False)
    named = m.needs(a, c)
    values = {"ib": ib(found, host), "net": net_state(host, found), "netplan": {"exists": False},
              "record": {"exists": False}}
    return m.plan(a, m.view(a, FactView({f.key: values[n] for n, f in named.items()}, {}), c), c)


def test_a_ring_is_addressed_per_link_both_ends_on_one_subnet():
    found = cabled("ring", 4)
    plans = {h: configure(found, ORDER[4], h) for h in ORDER[4]}
    assert all(p.failed is None for p in plans.values()), [p.failed for p in plans.values()]
    rails = {h: p.exports["fabric"]["rails"] for h, p in plans.items()}
    s1 = {r["iface"]: r for r in rails["spark1"]}
    assert len(s1) == 4 and s1["enp1s0f0np0"]["peer"] == "spark2" and s1["enp1s0f1np1"]["peer"] == "spark4"
    # both ends of every link on its subnet, every link its own subnet
    subnets = {}
    for h, rs in rails.items():
        for r in rs:
            subnets.setdefault(r["subnet"], set()).add((h, r["iface"]))
    assert len(subnets) == 8 and all(len(v) == 2 for v in subnets.values())
    assert s1["enp1s0f0np0"]["subnet"] == "192.168.100.0/24" and s1["enp1s0f0np0"]["address"] == "192.168.100.11"
    peer = {r["iface"]: r for r in rails["spark2"]}["enp1s0f1np1"]
    assert peer["subnet"] == "192.168.100.0/24" and peer["address"] == "192.168.100.12"
    # the record on the node, and NCCL's bootstrap on the management link, said
    p1 = plans["spark1"]
    topo = p1.exports["fabric"]["topology"]
    assert topo["kind"] == "ring" and topo["order"] == ORDER[4] and topo["mgmt"] == {"iface": "enP7s7",
                                                                                      "address": "10.77.0.11"}
    assert any(t.TOPOLOGY_RECORD in c.summary for c in p1.changes)
    f = p1.exports["fabric"]
    assert f["node_ip"] == "10.77.0.11" and f["nccl_socket_ifname"] == "enP7s7"
    assert f["nccl_ib_hca"] == "rocep1s0f0,rocep1s0f1,roceP2p1s0f0,roceP2p1s0f1" and "management" in f["bootstrap"]
    assert p1.msg.startswith("ring (discovered): ")


def test_a_mesh_reaches_both_others_and_a_switch_stays_per_rail():
    found = cabled("ring", 3)
    p = configure(found, ORDER[3], "spark3")
    assert p.exports["fabric"]["topology"]["kind"] == "mesh"
    assert {r["peer"] for r in p.exports["fabric"]["rails"]} == {"spark1", "spark2"}
    sw = configure(cabled("switch", 4), ORDER[4], "spark2")
    assert sw.failed is None and [r["subnet"] for r in sw.exports["fabric"]["rails"]] == ["192.168.100.0/24",
                                                                                          "192.168.101.0/24"]
    assert "peer" not in sw.exports["fabric"]["rails"][0] and sw.exports["fabric"]["node_ip"] == "192.168.100.12"


def test_provision_refuses_a_declared_ring_on_a_switch_naming_the_link():
    p = configure(cabled("switch", 4), ORDER[4], "spark1", {"fabric_topology": "ring"})
    assert p.failed.startswith("spark1: fabric_topology is ring but the cabling is a switch: spark1 enp1s0f1np1 "
                               "reaches spark2, spark3, spark4")
    p = configure(cabled("ring", 4), ORDER[4], "spark1", {"fabric_links": ["spark1:p0 spark3:p1"]})
    assert "fabric_links declares spark1:p0 <-> spark3:p1, but spark1:p0 is cabled to spark2:p1" in p.failed


def test_per_rail_variables_are_refused_on_a_ring():
    p = configure(cabled("ring", 4), ORDER[4], "spark1", {"fabric_subnets": ["10.0.0.0/24"]})
    assert "fabric_subnets is per rail, and a ring is addressed per link" in p.failed


def test_nccl_settings_of_a_pair_are_unchanged_by_a_pair_record():
    rails = [{"iface": "enp1s0f1np1", "address": "192.168.100.11", "hca": "rocep1s0f1"}]
    assert nccl_settings(rails, {"kind": "pair", "mgmt": {"iface": "enP7s7", "address": "10.77.0.11"}}) == \
        nccl_settings(rails)


# -- the mesh check and the qualification follow the links ----------------------------------------

def fabrics_of(kind: str, n: int) -> dict:
    found = cabled(kind, n)
    return {h: {"fabric": configure(found, ORDER[n], h).exports["fabric"]} for h in ORDER[n]}


def ctx(host: str, exports: dict, hosts: list[str]) -> HostContext:
    return HostContext(host, {}, {"user": "nvidia", "home": "/home/nvidia"}, exports=exports, play_hosts=hosts,
                       check=False, become=False)


def test_the_mesh_check_pings_every_link_once_and_logs_in_only_to_cabled_peers():
    exports = fabrics_of("ring", 4)
    probes = {h: fm._probe(fm.Args(), ctx(h, exports, ORDER[4])) for h in ORDER[4]}
    pings = [p for pr in probes.values() for p in pr.pings]
    assert len(pings) == 8 and len(set(pings)) == 8     # 4 cables x 2 twins, each pinged once
    # spark1 pings its links to spark2 (100.x) and to spark4 (it comes first in the ring)
    assert ("192.168.100.11", "192.168.100.12") in probes["spark1"].pings
    assert len(probes["spark1"].ssh_targets) == 2          # spark2 and spark4, never spark3
    srcs = {a.rsplit(".", 1)[0] for a, _ in pings}
    dsts = {b.rsplit(".", 1)[0] for _, b in pings}
    assert srcs == dsts and len(srcs) == 8                 # each ping stays on its link's subnet


def test_the_qualification_measures_every_link_both_directions():
    exports = fabrics_of("ring", 4)
    seen = []
    for h in ORDER[4]:
        bw = fq.throughput_fact(fq.Args(), ctx(h, exports, ORDER[4]), {k: v["fabric"] for k, v in exports.items()})
        seen += [(h, iface, addr) for iface, _, addr, _, _ in bw.rails]
    assert len(seen) == 16                                 # 8 links, each end sends
    spark1 = [s for s in seen if s[0] == "spark1"]
    assert ("spark1", "enp1s0f0np0", "192.168.100.12") in spark1


# -- layouts that fit the topology ------------------------------------------------------------------

def test_a_ring_of_four_carries_tp_on_the_native_executor_only():
    from sparkprov.catalog.layout import Layout, topology_problem

    assert topology_problem(Layout(4, 1, 1, executor="native"), "ring") is None
    why, fix = topology_problem(Layout(4, 1, 1, executor="ray"), "ring")
    assert "runs vLLM's own executor only" in why and "cluster_topology.py" in why and fix == "--executor native"
    for lay in (Layout(2, 2, 1, executor="native"), Layout(1, 1, 4, executor="native"), Layout(1, 4, 1, executor="native")):
        why, fix = topology_problem(lay, "ring")
        assert "tensor parallelism only (pp 1, dp 1)" in why and fix == "--tp 4 --pp 1 --dp 1"
    assert "3 of a ring's 4 Sparks are a chain" in topology_problem(Layout(3, executor="native"), "ring", 4)[0]
    # two neighbours of a ring, a mesh and a switch carry anything the catalog allows
    assert topology_problem(Layout(1, 1, 2, executor="native"), "ring") is None
    assert topology_problem(Layout(1, 1, 3, executor="native"), "mesh") is None
    assert topology_problem(Layout(2, 2, 1, executor="ray"), "switch") is None


def test_cluster_up_refuses_a_layout_the_declared_ring_cannot_carry_before_any_host(tmp_path):
    from helpers import refused
    from invoke import Context
    from sparkprov.cli import cluster

    inv = tmp_path / "inventory.yaml"
    inv.write_text("defaults: {port: 9, connect_timeout: 1}\nhosts:\n"
                   + "".join(f"  spark{i}: {{address: 127.0.0.1}}\n" for i in range(1, 5))
                   + "vars:\n  fabric_topology: ring\n  fabric_links: [\"spark1:p0 spark2:p1\", \"spark2:p0 spark3:p1\", "
                     "\"spark3:p0 spark4:p1\", \"spark4:p0 spark1:p1\"]\n")
    msg = refused(lambda: cluster.cluster_up(Context(), model="lab-tiny", tp="2", pp="2", executor="native",
                                             inventory=str(inv)))
    assert "a ring of 4 Sparks carries tensor parallelism only" in msg and "fabric_topology in the inventory" in msg
    msg = refused(lambda: cluster.cluster_up(Context(), model="lab-tiny", tp="1", dp="4", inventory=str(inv)))
    assert "tensor parallelism only" in msg
    msg = refused(lambda: cluster.cluster_up(Context(), model="lab-tiny", tp="1", dp="4", executor="native",
                                             hosts="spark1,spark3,spark2,spark4", inventory=str(inv)))
    assert "tensor parallelism only" in msg


def test_ranks_out_of_ring_order_are_refused():
    from sparkprov.catalog.layout import ring_order_problem

    cables = t.parse_links(["spark1:p0 spark2:p1", "spark2:p0 spark3:p1", "spark3:p0 spark4:p1", "spark4:p0 spark1:p1"])
    assert ring_order_problem(["spark1", "spark2", "spark3", "spark4"], cables) is None
    assert "spark1 and spark3 share no cable" in ring_order_problem(["spark1", "spark3", "spark2", "spark4"], cables)


def test_a_ring_and_a_mesh_render_their_nccl_settings_each_with_its_source():
    from sparkprov.catalog.load import load_catalog
    from sparkprov.catalog.render import HostServeContext, render_launch

    cat = load_catalog()
    r = cat.get("lab-tiny")

    def env(topology):
        ctx = HostServeContext(host="spark1", host_known=True, fabric_ifaces=["enP7s7"], node_ip="10.77.0.11",
                               cluster_size=2, fabric_topology=topology, model_store="/home/nvidia/vllm",
                               compile_cache="/home/nvidia/vllm-compile-cache", api_key_file=None)
        return {e.name: e for e in render_launch(r, ctx, 2, catalog=cat).env}

    ring, mesh, pair, none = env("ring"), env("mesh"), env("pair"), env(None)
    assert {k: ring[k].value for k in ("NCCL_IB_SUBNET_AWARE_ROUTING", "NCCL_IB_MERGE_NICS", "NCCL_ALGO",
                                       "NCCL_NET_PLUGIN")} == {"NCCL_IB_SUBNET_AWARE_ROUTING": "1",
                                                               "NCCL_IB_MERGE_NICS": "0", "NCCL_ALGO": "Ring",
                                                               "NCCL_NET_PLUGIN": "none"}
    assert "cluster_topology.py" in ring["NCCL_IB_SUBNET_AWARE_ROUTING"].source.where
    assert "PR#3" in ring["NCCL_ALGO"].source.where
    assert mesh["NCCL_IB_SUBNET_AWARE_ROUTING"].value == "1" and "NCCL_ALGO" not in mesh
    assert set(pair) == set(none) and not any(k.startswith("NCCL_IB_SUBNET") for k in pair)


def test_plan_takes_the_topology_into_account():
    import json as _json
    import contextlib
    import io

    from invoke import Context

    from sparkprov.cli import plan as plan_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_cli.plan(Context(), "lab-tiny", sparks="4", topology="ring", json=True)
    doc = _json.loads(out.getvalue())
    by = {(x["tp"], x["pp"], x["dp"]): x for x in doc["layouts"]}
    assert doc["topology"] == "ring" and "tensor parallelism only" in by[(2, 2, 1)]["refused"]
    assert by[(2, 1, 1)]["refused"] is None and by[(1, 1, 4)]["mode"] == "replicas behind the gateway"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_cli.plan(Context(), "lab-tiny", sparks="4", json=True)
    assert _json.loads(out.getvalue())["topology"] is None


# -- staging over the topology -------------------------------------------------------------------

def test_a_ring_stages_by_relaying_both_ways_round_it_over_its_links():
    import subprocess

    from sparkprov.modules import weights_download as wd
    from sparkprov.modules.weights_store import routes_to
    from sparkprov.staging import fanout
    from sparkprov.staging.plan import Item

    exports = fabrics_of("ring", 4)
    order = ORDER[4]
    it = Item(repo="org/m", revision="main", commit="c" * 40, path="model.safetensors", size=10, oid="b" * 40,
              sha256="a" * 64)
    # what each host's store play exports there: its address on the link to each cabled peer
    for h in order:
        f = exports[h]["fabric"]
        reach = {}
        for r in f["rails"]:
            reach.setdefault(r["peer"], r["address"])
        exports[h]["stage"] = {"ok": [] if h != "spark1" else [it.rel], "need": [it.rel] if h != "spark1" else [],
                               "partial": [], "store": "/home/nvidia/vllm", "user": "nvidia", "fabric": None,
                               "image": None, "reach": reach, "ring": order}
    host = HostContext("spark1", {}, {"user": "nvidia", "home": "/home/nvidia"}, exports=exports, play_hosts=order,
                       check=False, become=False)

    class A:
        hosts, local_hosts, addresses, ssh_options, source = order, [], {}, {}, "spark1"

    assert wd.ring_chains(A, host) == [["spark2", "spark3"], ["spark4"]]
    receivers, wants = wd.fan_out(A, host, [it.rel], [])
    assert [r.name for r in receivers] == ["spark2", "spark3", "spark4"]
    spark2 = receivers[0]
    # spark1 reaches spark2 on their link; spark2 relays to spark3 at spark3's address on theirs
    assert spark2.routes == [(exports["spark2"]["stage"]["reach"]["spark1"], fanout.SSH_BASE)]
    assert spark2.relay == ((1, exports["spark3"]["stage"]["reach"]["spark2"]),)
    assert receivers[1].routes == [] and receivers[2].relay == ()
    # no host sends to one it shares no link with, and nothing falls back to the management network
    assert routes_to(A, "spark1", "spark3", exports["spark3"]["stage"]) == []
    start, feed, finish = fanout.pipeline("/home/nvidia/vllm", receivers, [it], wants, streams=2)
    send = start.split("<<'SPARKPROV_SEND'\n", 1)[1].split("SPARKPROV_SEND", 1)[0]
    assert subprocess.run(["sh", "-n"], input=send, text=True).returncode == 0
    assert "0.0) QPUT=" in send and "tee" in send
    queue = start.split("__sp_queue() {", 1)[1]
    assert "'0 0 c'" in queue and "'2 0 c'" in queue and "'1 0 c'" not in queue   # spark3 only through spark2


def test_invoke_facts_shows_each_hosts_links_and_the_kind():
    from sparkprov.plays.facts import add_topology

    found = cabled("ring", 4)
    result = {h: {"ok": True, "errors": {}, "facts": {
        "fabric": {"rails": []},
        "neighbours": {i: {"mac": d["mac"], "oper": "up" if d["up"] else "down", "neighbours": d["neighbours"],
                           "error": None} for i, d in found[h].items()}}} for h in ORDER[4]}
    add_topology(result, ORDER[4])
    view = result["spark1"]["facts"]["topology"]
    assert "neighbours" not in result["spark1"]["facts"]
    assert view["kind"] == "ring" and view["order"] == ORDER[4]
    assert view["links"] == {"enp1s0f0np0": "spark2 enp1s0f1np1", "enP2p1s0f0np0": "spark2 enP2p1s0f1np1",
                             "enp1s0f1np1": "spark4 enp1s0f0np0", "enP2p1s0f1np1": "spark4 enP2p1s0f0np0"}


def test_two_hosts_measuring_into_one_peer_never_ask_it_for_the_same_port():
    """On a ring each host receives on four twins from two peers at once: each rail's server port is
    its peer twin's (one link per twin), so the servers on a host never share a port."""
    exports = fabrics_of("ring", 4)
    into: dict[str, list[int]] = {}
    for h in ORDER[4]:
        bw = fq.throughput_fact(fq.Args(), ctx(h, exports, ORDER[4]), {k: v["fabric"] for k, v in exports.items()})
        for (iface, _, addr, peer_iface, _), port in zip(bw.rails, bw.ports):
            peer = next(p for p, v in exports.items() if any(r["address"] == addr for r in v["fabric"]["rails"]))
            into.setdefault(peer, []).append(port)
        assert f"-p {bw.ports[0]}" in bw.command(None)
    assert all(len(ps) == 4 and len(set(ps)) == 4 for ps in into.values()), into


def test_fabric_neighbours_reads_who_answered_on_each_twin(fixtures):
    """Real output (tests/fixtures/topology/README.md): the cabled twin reaches the peer's MAC (its
    own answer is no neighbour), the dark twin and the absent ones reach nobody."""
    got = t.parse_neighbours((fixtures / "topology" / "fabric-neighbours.txt").read_text())
    assert got["enp1s0f0np0"] == {"mac": "4c:bb:47:01:91:00", "oper": "up", "carrier": True,
                                  "id": "fe80::4ebb:47ff:fe01:9100", "answers": ["fe80::4ebb:47ff:fe02:9101"],
                                  "neighbours": ["4c:bb:47:02:91:01"], "error": None}
    assert got["enP2p1s0f0np0"]["answers"] == [] and got["enP2p1s0f0np0"]["carrier"] is False
    assert set(got) == {"enp1s0f0np0", "enP2p1s0f0np0"}   # the absent twins print nothing
    # a peer known by its link-local address alone (no neighbour entry, another address scheme) is found
    found = {"a": {"enp1s0f0np0": {**got["enp1s0f0np0"], "neighbours": [], "up": True}},
             "b": {"enp1s0f1np1": {"mac": None, "id": "fe80::4ebb:47ff:fe02:9101", "up": True, "answers": [],
                                   "neighbours": []}}}
    assert t.discover(found, ["a", "b"])["kind"] == "pair"


def test_a_lost_echo_keeps_the_recorded_link_instead_of_re_addressing_the_cable():
    found = cabled("ring", 4)
    first = {h: configure(found, ORDER[4], h) for h in ORDER[4]}
    record = first["spark1"].exports["fabric"]["topology"]
    # the echoes on one cable twin went unanswered this time (carriers up): with the record, the ring stands
    found["spark1"]["enp1s0f0np0"]["neighbours"] = []
    found["spark2"]["enp1s0f1np1"]["neighbours"] = []
    exports = discovery_exports(found, ORDER[4])
    exports["spark1"]["fabric_discovery"]["recorded"] = [ln for ln in record["links"]
                                                         if "spark1" in (ln["a"][0], ln["b"][0])]
    c = HostContext("spark1", {"groups": {"sparks": ORDER[4]}}, {"user": "nvidia", "home": "/home/nvidia"},
                    exports=exports, play_hosts=ORDER[4], check=False, become=False)
    topo, problems, notes = fab.topology_of(c)
    assert problems == [] and topo["kind"] == "ring" and topo["links"] == record["links"]
    assert notes == ["spark1: spark1 enp1s0f0np0: no answer from spark2 enp1s0f1np1 this time; its recorded link kept"]
    # without the record, that twin would have dropped out of the ring's links (and its addresses)
    exports["spark1"]["fabric_discovery"]["recorded"] = []
    topo, problems, _ = fab.topology_of(c)
    assert len(topo["links"]) == len(record["links"]) - 1


def test_cluster_ups_preflight_refuses_what_the_recorded_ring_cannot_carry():
    from sparkprov.modules.serve_preflight import topology_problems
    from sparkprov.serving.deployment import Deployment

    ring = {"topology": "ring", "order": ORDER[4]}
    dep = Deployment(name="x", model="lab-tiny", hosts=ORDER[4], tp=2, pp=2, executor="native")
    (line,) = topology_problems("spark1", ring, dep)
    assert "a ring of 4 Sparks carries tensor parallelism only" in line and "the ring provision recorded" in line
    dep = Deployment(name="x", model="lab-tiny", hosts=["spark1", "spark3", "spark2", "spark4"], tp=4,
                     executor="native")
    (line,) = topology_problems("spark1", ring, dep)
    assert "spark1 and spark3 share no cable" in line and "--hosts spark1,spark2,spark3,spark4" in line
    dep = Deployment(name="x", model="lab-tiny", hosts=["spark2", "spark1", "spark4", "spark3"], tp=4,
                     executor="native")
    assert topology_problems("spark1", ring, dep) == []       # the ring the other way round, from spark2
    assert topology_problems("spark1", {"topology": "mesh"}, dep) == []


def test_a_switch_record_does_not_depend_on_who_answered_in_time():
    """On a switch every twin hears several peers, but not every answer comes in time on a loaded
    host (the lab's 4-switch rewrote its record on a second provision): what is recorded is which
    twins are on the switch, never who answered."""
    full = cabled("switch", 4)
    short = cabled("switch", 4)
    short["spark3"]["enp1s0f1np1"]["neighbours"] = [mac("spark1", "enp1s0f1np1")]   # one answer this time
    # none: its own echo failed (seen once in the lab: a 4-switch's second provision rewrote every
    # host's record, the twin missing from the first), while the others heard it
    silent = cabled("switch", 4)
    silent["spark4"]["enP2p1s0f1np1"].update(neighbours=[], error="ping: bind icmp socket: Cannot assign requested address")
    a, b, c = t.discover(full, ORDER[4]), t.discover(short, ORDER[4]), t.discover(silent, ORDER[4])
    assert a["kind"] == b["kind"] == c["kind"] == "switch" and a["links"] == b["links"] == c["links"] == []
    assert a["on_switch"] == b["on_switch"] == c["on_switch"] and "spark3 enp1s0f1np1" in b["on_switch"]
    assert "spark4 enP2p1s0f1np1" in c["on_switch"]
    recs = []
    for found in (full, short, silent):
        p = configure(found, ORDER[4], "spark2")
        recs.append(p.exports["fabric"]["topology"])
    assert recs[0] == recs[1] == recs[2] and recs[0]["shared"] == {}
