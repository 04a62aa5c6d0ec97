"""Fabric qualification on literal data: perftest's ib_write_bw parsed from real GB10 captures
(tests/fixtures/gb10/ib_write_bw-*.txt, from gb10-failure-outputs.md §4.5: NVIDIA/dgx-spark-playbooks
performance_benchmarking_guide.md, TrevorSquillario/gb10-training, a RoCE/RDMA setup blog post), each
rail judged against the floor and expected figure (PR#108's degraded 13.23 Gb/s, §4.8), NCCL_IB_HCA
against a port's two halves (the real ibdev2netdev capture of gb10-outputs.md), the record provision
writes, and cluster-up's refusal of a node whose record says degraded."""

from __future__ import annotations

from pathlib import Path

import time

import pytest

from sparkprov.facts import fabric as fabric_facts
from sparkprov.facts import rail
from sparkprov.modules import fabric_qualify as fq
from sparkprov.modules import serve_preflight
from sparkprov.modules.base import FactView, HostContext

GB10 = Path(__file__).resolve().parents[1] / "fixtures" / "gb10"


def read(name: str) -> str:
    return (GB10 / name).read_text()


@pytest.mark.parametrize("name,device,qps,gbps,rows", [
    # NVIDIA's guide, spark-bd26, --run_infinitely: five and six one-second rows, 1 QP per rail
    ("ib_write_bw-rocep1s0f0-1qp.txt", "rocep1s0f0", 1, 92.57, 5),
    ("ib_write_bw-roceP2p1s0f0-1qp.txt", "roceP2p1s0f0", 1, 97.28, 6),
    # Dell Pro Max GB10 pair, 4 QPs over rdma_cm: one row
    ("ib_write_bw-4qp-rdma-cm.txt", "rocep1s0f0", 4, 111.61, 1),
    # two runs at once, their output interleaved as posted (TABs in the rows)
    ("ib_write_bw-two-concurrent.txt", "rocep1s0f1", 4, 98.04, 2),
])
def test_ib_write_bw_real_captures(name, device, qps, gbps, rows):
    out = rail.parse_ib_write_bw(read(name))
    assert (out["device"], out["qps"], out["gbps"], len(out["rows"]), out["error"]) == (device, qps, gbps, rows, None)


def test_ib_write_bw_that_could_not_connect_has_no_figure_and_says_why():
    out = rail.parse_ib_write_bw(" Couldn't connect to 192.168.100.12:18515 (Connection refused)\n"
                                 " Unable to open file descriptor for socket connection Unable to init the socket connection\n")
    assert out["gbps"] is None and out["error"].startswith("Couldn't connect to 192.168.100.12:18515")


def fact_output(rails: dict[str, tuple[str, str, int]]) -> str:
    """RailThroughput's framing around client outputs: iface -> (client output, peer mtu, client rc)."""
    parts = []
    for iface, (client, peer_mtu, rc) in rails.items():
        parts.append(f"@rail {iface}\nmtu=9000\n@server\npeer_mtu={peer_mtu}\n@rc=0\n@client\n{client}\n@crc={rc}\n")
    return "".join(parts)


def test_rail_throughput_output_per_rail():
    out = rail.parse_rail_throughput(fact_output({
        "enp1s0f1np1": (read("ib_write_bw-rocep1s0f0-1qp.txt"), "9000", 0),
        "enP2p1s0f1np1": (" Couldn't connect to 192.168.101.12:18516\n", "1500", 1)}))
    assert out["enp1s0f1np1"]["gbps"] == 92.57 and out["enp1s0f1np1"]["peer_mtu"] == 9000
    assert out["enP2p1s0f1np1"]["gbps"] is None and "Couldn't connect" in out["enP2p1s0f1np1"]["error"]
    assert out["enP2p1s0f1np1"]["peer_mtu"] == 1500
    missing = rail.parse_rail_throughput("@rail enp1s0f1np1\nmtu=9000\n@no-tool\n")
    assert missing["enp1s0f1np1"]["tool"] is False and "not installed here" in missing["enp1s0f1np1"]["error"]
    server_failed = rail.parse_rail_throughput(
        "@rail enp1s0f1np1\nmtu=9000\n@server\nHost key verification failed.\n@rc=255\n@client\n"
        " Couldn't connect to 192.168.100.12:18515\n@crc=1\n")
    assert server_failed["enp1s0f1np1"]["error"] == "the server on the peer did not start: Host key verification failed."


def measured(gbps, **kw):
    return {"iface": "enp1s0f1np1", "hca": "rocep1s0f1", "peer": "spark2", "peer_addr": "192.168.100.12",
            "gbps": gbps, "mtu": 9000, "peer_mtu": 9000, "tool": True, "error": None, **kw}


def test_a_rail_is_judged_against_the_floor_and_the_expected_figure():
    ok = rail.judge_rail(measured(92.57), floor=rail.MIN_GBPS, expected=rail.EXPECTED_GBPS)
    assert ok["status"] == "ok" and ok["problem"] is None
    # NVIDIA/dgx-spark-playbooks PR#108: 13.23 Gb/s on a 200G link that ethtool called healthy
    bad = rail.judge_rail(measured(13.23), floor=rail.MIN_GBPS, expected=rail.EXPECTED_GBPS)
    assert bad["status"] == "degraded"
    for part in ("enp1s0f1np1", "spark2", "13.23 Gb/s measured", "floor 46 Gb/s", "ethtool", "FEC", "QSFP cable",
                 "PCIe slot power"):
        assert part in bad["problem"], part
    slow = rail.judge_rail(measured(60.0), floor=rail.MIN_GBPS, expected=rail.EXPECTED_GBPS)
    assert slow["status"] == "slow" and "60 Gb/s" in slow["problem"] and "90 Gb/s" in slow["problem"]
    mtu = rail.judge_rail(measured(92.57, peer_mtu=1500), floor=rail.MIN_GBPS, expected=rail.EXPECTED_GBPS)
    assert mtu["status"] == "degraded" and "MTU spark2 1500, not 9000" in mtu["problem"]
    nothing = rail.judge_rail(measured(None, error="Couldn't connect to 192.168.100.12:18515"), floor=46, expected=90)
    assert nothing["status"] == "degraded" and "carried nothing" in nothing["problem"]
    absent = rail.judge_rail(measured(None, tool=False, error="ib_write_bw (perftest) is not installed here"),
                             floor=46, expected=90)
    assert absent["status"] == "unmeasured" and "apt install perftest" in absent["problem"]
    # the lab's floor: the same judgement with other figures
    assert rail.judge_rail(measured(0.19), floor=1.0, expected=2.0)["status"] == "degraded"


def test_nccl_ib_hca_must_name_both_halves_of_a_cabled_port():
    # gb10-outputs.md: one cable in port 1, its two halves Up (rocep1s0f1, roceP2p1s0f1), the f0 twins Down
    devices = fabric_facts.parse_ibdev2netdev(read("ibdev2netdev.txt"))
    assert rail.port_of("rocep1s0f1") == rail.port_of("roceP2p1s0f1") != rail.port_of("rocep1s0f0")
    assert rail.ib_hca_problems(["rocep1s0f1", "roceP2p1s0f1"], devices) == []
    (half,) = rail.ib_hca_problems(["rocep1s0f1"], devices)
    assert "names rocep1s0f1 but not roceP2p1s0f1" in half and "#102" in half
    # a Down twin is not half of a cabled port: naming only the cabled one is whole
    assert rail.ib_hca_problems(["rocep1s0f1", "roceP2p1s0f1", "rocep1s0f0"], devices) == []


# -- the module, on literal facts -------------------------------------------------------------------

RAILS = {"spark1": 11, "spark2": 12}


def fabric(n):
    rails = [{"iface": i, "address": f"192.168.{s}.{n}", "prefix": 24, "subnet": f"192.168.{s}.0/24", "hca": hca,
              "mtu": 9000, "up": True}
             for i, s, hca in (("enp1s0f1np1", 100, "rocep1s0f1"), ("enP2p1s0f1np1", 101, "roceP2p1s0f1"))]
    return {"rails": rails, **fabric_facts.nccl_settings(rails), "converged": True}


BOOT = "0f4e0c64-1f5b-4c39-9b7e-5f0c8d7a2b11"


def state(record=None, boot=BOOT, driver="580.95.05", firmware="28.45.4028"):
    """What the state phase of provision's first play exports for a host (QUAL_STATE)."""
    return {"record": record, "boot_id": boot, "driver": driver, "firmware": firmware}


def ctx(host="spark1", check=False, vars=None, states=None):
    exports = {h: {"fabric": fabric(n)} for h, n in RAILS.items()}
    for h, st in (states or {}).items():
        exports[h]["fabric_qualification_state"] = st
    return HostContext(host, vars or {}, {"user": "nvidia", "home": "/home/nvidia"}, check=check, exports=exports,
                       play_hosts=list(RAILS), become=False)


def plan(host, throughput, record, args=None):
    m = fq.FabricQualifyModule()
    a = m.Args.model_validate(args or {})
    named = m.needs(a, host)
    values = {"bw": throughput, "ib": {"present": True, "devices": fabric_facts.parse_ibdev2netdev(read("ibdev2netdev.txt"))},
              "record": record}
    return m.plan(a, m.view(a, FactView({f.key: values[n] for n, f in named.items()}, {}), host), host)


def recorded(p):
    """The record a plan's change writes, as the record fact reads it back."""
    return {"present": True, **p.changes[0].predicts[0][1]}


def throughput(a, b):
    return {"enp1s0f1np1": measured(a), "enP2p1s0f1np1": measured(b)}


def test_module_measures_to_the_next_host_on_each_rail_and_records_it():
    m = fq.FabricQualifyModule()
    bw = m.needs(m.Args(), ctx("spark2"))["bw"]
    # spark2 sends to spark1 on each rail: its address there, spark1's interface and HCA for the server
    assert bw.rails == (("enp1s0f1np1", "rocep1s0f1", "192.168.100.11", "enp1s0f1np1", "rocep1s0f1"),
                        ("enP2p1s0f1np1", "roceP2p1s0f1", "192.168.101.11", "enP2p1s0f1np1", "roceP2p1s0f1"))
    assert "ssh -n -o BatchMode=yes -o StrictHostKeyChecking=yes" in bw.command(None)
    p = plan(ctx(), throughput(92.57, 97.28), {"present": False})
    assert p.failed is None and p.warnings == []
    (change,) = p.changes
    assert rail.QUAL_PATH in change.summary and "(ok)" in change.summary and change.become is True
    # readable by the login user, whose cluster-up preflight reads it: no 0700 directory on the way
    assert "umask 022" in change.script and "chmod 0644" in change.script and "umask 077" not in change.script
    assert "92.57 Gb/s to spark2" in p.msg and p.exports["fabric_qualification"]["ok"] is True
    # the record says when, why and against what it was measured
    doc = recorded(p)
    assert doc["measured_by"] == "provision" and doc["reason"].startswith("the standing qualification was not read")
    assert doc["key"] == fq.key_of(doc["inputs"]) and doc["inputs"]["rails"][0]["peer"] == "spark2"


def test_a_degraded_rail_is_recorded_then_fails_naming_the_rail_figure_floor_and_fix():
    p = plan(ctx(), throughput(92.57, 13.23), {"present": False})
    (change,) = p.changes
    assert "(degraded)" in change.summary
    # the engine plans again after applying to verify: with the record written, the task fails
    after = plan(ctx(), throughput(92.57, 13.23), {"present": True, **change.predicts[0][1]})
    assert after.changes == [] and "enP2p1s0f1np1" in after.failed and "13.23 Gb/s measured" in after.failed
    assert "floor 46 Gb/s" in after.failed and "enp1s0f1np1 (" not in after.failed
    # check mode says the same, and that it would record it
    check = plan(ctx(check=True), throughput(92.57, 13.23), {"present": False})
    assert "13.23 Gb/s measured" in check.failed and "would record it" in check.failed
    # the lab's floor, an inventory var
    lab = plan(ctx(vars={"rail_min_gbps": 1.0, "rail_expected_gbps": 2.0}), throughput(5.1, 0.19), {"present": False})
    assert "(degraded)" in lab.changes[0].summary and "floor 1, expected 2 Gb/s" in lab.msg
    bad = plan(ctx(vars={"rail_min_gbps": "fast"}), throughput(92.57, 97.28), {"present": False})
    assert bad.failed.startswith("spark1: rail_min_gbps: 'fast' is not a number (fix: give a number above 0")


def test_half_a_port_in_nccl_ib_hca_fails_provision():
    p = plan(ctx(vars={"ib_hcas": "rocep1s0f1"}), throughput(92.57, 97.28), {"present": False})
    after = plan(ctx(vars={"ib_hcas": "rocep1s0f1"}), throughput(92.57, 97.28),
                 {"present": True, **p.changes[0].predicts[0][1]})
    assert "names rocep1s0f1 but not roceP2p1s0f1" in after.failed


def test_record_tolerance():
    doc = {"present": True, "seconds": 3, "qps": 1, "nccl_ib_hca": "a,b", "nccl_problems": [],
           "rails": [rail.judge_rail(measured(92.57), floor=46, expected=90)]}
    near = {**doc, "rails": [rail.judge_rail(measured(92.57 * 0.8), floor=46, expected=30)]}
    assert not fq.same_record(doc, near)   # another expected figure is another verdict
    near = {**doc, "rails": [rail.judge_rail(measured(92.57 * 0.8), floor=46, expected=90)]}
    assert near["rails"][0]["status"] == "slow" and not fq.same_record(doc, near)
    doc2 = {**doc, "rails": [rail.judge_rail(measured(10.0), floor=1, expected=2)]}
    assert fq.same_record(doc2, {**doc, "rails": [rail.judge_rail(measured(7.0), floor=1, expected=2)]})
    assert not fq.same_record(doc2, {**doc, "rails": [rail.judge_rail(measured(4.0), floor=1, expected=2)]})
    assert not fq.same_record({"present": False}, doc2)


# -- cluster-up's preflight ----------------------------------------------------------------------------

DEGRADED = {"present": True, "measured_at": "2026-11-26T14:00:00Z", "rails": [
    {"iface": "enp1s0f1np1", "peer": "spark1", "gbps": 91.2, "floor_gbps": 46.0, "status": "ok"},
    {"iface": "enP2p1s0f1np1", "peer": "spark1", "gbps": 13.23, "floor_gbps": 46.0, "status": "degraded",
     "mtu": 9000, "peer_mtu": 9000}]}


def test_degraded_names_host_rail_figure_and_floor():
    (line,) = rail.degraded("spark2", DEGRADED)
    for part in ("spark2", "enP2p1s0f1np1", "13.23 Gb/s measured", "floor 46 Gb/s", "2026-11-26T14:00:00Z", "ethtool"):
        assert part in line, part
    assert rail.degraded("spark2", {"present": False}) == []
    mtu = {**DEGRADED, "rails": [{**DEGRADED["rails"][1], "gbps": 91.0, "peer_mtu": 1500}]}
    assert "MTU 1500" in rail.degraded("spark2", mtu)[0]
    nccl = {"present": True, "rails": [], "nccl_problems": ["NCCL_IB_HCA=rocep1s0f1 names rocep1s0f1 but not x"]}
    assert rail.degraded("spark1", nccl) == ["spark1: NCCL_IB_HCA=rocep1s0f1 names rocep1s0f1 but not x"]


def test_cluster_up_refuses_a_node_qualified_degraded_unless_forced():
    from tests.unit.test_serving_modules import DEP, ctx as serve_ctx, preflight_values, run

    p = run(serve_preflight.ServePreflight, {"deployment": DEP},
            preflight_values("spark2", qualification=DEGRADED), serve_ctx("spark2"))
    assert "spark2: rail enP2p1s0f1np1" in p.failed and "13.23 Gb/s measured, floor 46 Gb/s" in p.failed
    assert "--force-degraded-fabric" in p.failed
    forced = run(serve_preflight.ServePreflight, {"deployment": DEP, "force_degraded_fabric": True},
                 preflight_values("spark2", qualification=DEGRADED), serve_ctx("spark2"))
    assert forced.failed is None and any("13.23 Gb/s" in w and "started anyway" in w for w in forced.warnings)
    # one node, no fabric between nodes: its record is not read
    single = {**DEP, "hosts": ["spark2"], "tp": 1}
    m = serve_preflight.ServePreflight()
    assert "qualification" not in m.needs(m.Args.model_validate({"deployment": single}), serve_ctx("spark2"))


# -- the guard's /metrics -----------------------------------------------------------------------------

def test_guard_serves_the_recorded_rails_at_metrics():
    import json

    from sparkprov.node import requalify as g
    from sparkprov.node.metrics import render_metrics

    p = plan(ctx("spark2"), throughput(92.57, 13.23), {"present": False})
    text = json.dumps(p.changes[0].predicts[0][1])   # the record as provision writes it
    rails = g.parse_qualification(text)
    assert [(r["iface"], r["gbps"], r["status"]) for r in rails] == [("enp1s0f1np1", 92.57, "ok"),
                                                                   ("enP2p1s0f1np1", 13.23, "degraded")]
    metrics = render_metrics({"sample": {"t": 1.0, "rails": rails}}, {})
    assert 'sparkprov_rail_gbps{iface="enp1s0f1np1",peer="spark1"} 92.57' in metrics
    assert 'sparkprov_rail_ok{iface="enP2p1s0f1np1"} 0' in metrics and 'sparkprov_rail_ok{iface="enp1s0f1np1"} 1' in metrics
    assert 'sparkprov_rail_floor_gbps{iface="enP2p1s0f1np1"} 46' in metrics
    assert g.parse_qualification("not json") == [] and "sparkprov_rail" not in render_metrics({"sample": {}}, {})


# -- measured again only when something it depends on changed ----------------------------------------

def first(host="spark1", **kw):
    """A host's first qualification, measured with the state read (no record yet), and its record."""
    p = plan(ctx(host, states={"spark1": state(), "spark2": state()}), throughput(92.57, 97.28), {"present": False})
    assert "measured: no qualification recorded on this node" in p.changes[0].summary
    return recorded(p)


def test_a_standing_qualification_is_not_measured_again():
    rec = first()
    assert rec["boot_id"] == BOOT and rec["reason"] == "no qualification recorded on this node"
    m = fq.FabricQualifyModule()
    host = ctx(states={"spark1": state(rec), "spark2": state()})
    # nothing to measure: the gather reads ibdev2netdev (NCCL_IB_HCA is a setting) and no rail is loaded
    assert list(m.needs(m.Args(), host)) == ["ib"]
    p = plan(host, None, None)
    assert p.failed is None and p.changes == [] and "not measured again" in p.msg and "92.57 Gb/s to spark2" in p.msg
    assert p.exports["fabric_qualification"]["ok"] is True


@pytest.mark.parametrize("change, reason", [
    ({"spark1": state(None, boot="another-boot")}, "this boot (another-boot) is not qualified"),
    ({"spark2": state(driver="590.44.01")}, "spark2's driver 580.95.05 -> 590.44.01"),
    ({"spark1": state(None, firmware="28.47.1000")}, "spark1's firmware 28.45.4028 -> 28.47.1000"),
])
def test_a_boot_a_driver_or_a_firmware_on_either_end_measures_again(change, reason):
    rec = first()
    states = {"spark1": state(rec), "spark2": state()}
    for h, st in change.items():
        states[h] = {**st, "record": rec} if h == "spark1" else st
    p = plan(ctx(states=states), throughput(92.0, 96.0), rec)
    (c,) = p.changes
    assert reason in c.summary and reason in recorded(p)["reason"]


def test_other_links_an_mtu_an_age_a_failure_or_asking_measure_again():
    rec = first()
    states = {"spark1": state(rec), "spark2": state()}
    moved = ctx(states=states)
    moved.exports["spark2"]["fabric"]["rails"][1]["mtu"] = 1500
    p = plan(moved, throughput(92.0, 96.0), rec)
    assert "the rails (links, addresses, MTU or peers)" in p.changes[0].summary
    old = {**rec, "measured_at": "2026-01-01T00:00:00Z"}
    p = plan(ctx(states={"spark1": state(old), "spark2": state()}), throughput(92.0, 96.0), old)
    assert "h old (fabric_qualify_max_age_hours 168)" in p.changes[0].summary
    p = plan(ctx(vars={"fabric_qualify_max_age_hours": 100000}, states={"spark1": state(old), "spark2": state()}),
             None, None)
    assert p.changes == [] and "not measured again" in p.msg
    p = plan(ctx(vars={"fabric_requalify": True}, states=states), throughput(92.0, 96.0), rec)
    assert "asked (fabric_requalify)" in p.changes[0].summary
    bad = plan(ctx(vars={"fabric_requalify": "yes"}, states=states), None, None)
    assert bad.failed == "spark1: fabric_requalify: 'yes' is not true or false (fix: give true or false)"
    # a rail that failed is measured on every run until it passes (then recorded); failing again alike
    # records nothing new and fails again
    bad = plan(ctx(vars={"fabric_requalify": True}, states=states), throughput(92.57, 13.23), rec)
    failed = recorded(bad)
    assert failed["ok"] is False
    states = {"spark1": state(failed), "spark2": state()}
    again = plan(ctx(states=states), throughput(92.0, 12.9), failed)
    assert again.changes == [] and "13.23" not in again.failed and "12.9 Gb/s measured" in again.failed
    passed = plan(ctx(states=states), throughput(92.57, 97.28), failed)
    assert "the last qualification did not pass" in passed.changes[0].summary and recorded(passed)["ok"] is True


def test_the_guards_rewrite_after_a_boot_qualifies_that_boot():
    """The node guard re-measures after every boot and records the boot: provision then measures
    nothing (the boot is qualified, the key unchanged)."""
    from sparkprov.node.requalify import requalified_record

    rec = first()
    rec = {k: v for k, v in rec.items() if k != "present"}
    after = requalified_record(rec, {"enp1s0f1np1": measured(93.0), "enP2p1s0f1np1": measured(95.5)},
                               now=1.8e9, boot_id="boot-after")
    assert after["boot_id"] == "boot-after" and after["key"] == rec["key"]
    after["measured_at"] = time.strftime(fq.TIME_FORMAT, time.gmtime())
    p = plan(ctx(states={"spark1": state({"present": True, **after}, boot="boot-after"), "spark2": state()}), None, None)
    assert p.changes == [] and "the node guard, after boot boot-after" in p.msg and "93 Gb/s" in p.msg
