"""Fabric qualification on the 2-host lab (issue 25): provision measures every rail with ib_write_bw (the
lab's stand-in moves real bytes over the rail's veth, so a throttled rail measures throttled), records
it on the node, and a throttled rail (`lab.fault rail-slow`) fails qualification for exactly that
rail on exactly that host, with the figure and the floor named; `cluster-up` of a TP 2 deployment
over it is refused before anything starts (naming host, rail, figure and floor) unless
--force-degraded-fabric; cleared, the rail qualifies again. Then the node guard: after a power cycle
of a host whose rail degraded, it qualifies the rails again by itself, records the rail degraded and
journals why; mended and power-cycled, the record is ok again. The record is read back with plain
commands inside the hosts."""
# Engine: none: no model is served in this module (cluster-up is refused at its preflight).

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from sparkprov.data.inventory import load_inventory
from sparkprov.data.playbook import load_playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import Runner, RunOptions
from sparkprov.facts.rail import QUAL_PATH
from sparkprov.node.guard import JOURNAL_PATH
from sparkprov.node.requalify import REQUALIFY_ACTION
from sparklab import faults
from sparklab.state import LAB_RAIL_VARS, RAIL_IFACES

pytestmark = pytest.mark.lab

REPO_ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = REPO_ROOT / "playbooks" / "provision.yaml"
INVOKE = str(REPO_ROOT / ".venv" / "bin" / "invoke")
TASK = "rail throughput, MTU and NCCL_IB_HCA (fabric qualification, recorded on the node)"
SLOW_HOST, SLOW_RAIL = "spark2", RAIL_IFACES[2]
FLOOR = LAB_RAIL_VARS["rail_min_gbps"]


def provision(inv: Path) -> Report:
    """The rails and the SSH mesh they are measured over (tags fabric, ssh), then the qualification."""
    report = Report(open(os.devnull, "w"))
    inventory = load_inventory(inv)
    Runner(inventory, load_playbook(PLAYBOOK), list(inventory.hosts), RunOptions(tags={"fabric", "ssh"}), report).run()
    return report


def preflight(inv: Path, hosts: list[str]) -> dict[str, dict]:
    """cluster-up --check of a TP 2 deployment over the rails: each host's preflight result."""
    p = subprocess.run([INVOKE, "cluster-up", "--inventory", str(inv), "--model", "lab-tiny", "--tp", "2", "--executor",
                        "native", "--hosts", ",".join(hosts), "--check", "--json"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300)
    return {x["host"]: x for x in json.loads(p.stdout)["results"] if x["module"] == "serve_preflight"}


def qual(report: Report, host: str):
    return next(r for r in report.results if r.host == host and r.task == TASK)


def record(lab, host: str) -> dict:
    return json.loads(lab.sh(host, f"cat {QUAL_PATH}").stdout)


def journal(lab, host: str) -> list[dict]:
    r = lab.sh(host, f"cat {JOURNAL_PATH} 2>/dev/null || true")
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def inv(lab, tmp_path_factory):
    path = lab.write_inventory(tmp_path_factory.mktemp("qualify") / "inventory.yaml")
    yield path
    for h in lab.names:
        for iface in RAIL_IFACES.values():
            faults.clear_rail_slow(h, iface)
        # no record left behind: a later module's cluster-up must not read this module's verdicts
        lab.sh(h, f"rm -f {QUAL_PATH}")


def test_rails_qualify_then_a_throttled_rail_fails_and_a_multinode_start_is_refused(lab, inv):
    healthy = provision(inv)
    for h in lab.names:
        r = qual(healthy, h)
        assert r.status in ("ok", "changed") and not r.warnings, (h, r.status, r.msg, r.warnings)
        doc = record(lab, h)
        assert doc["ok"] and [x["iface"] for x in doc["rails"]] == list(RAIL_IFACES.values())
        for x in doc["rails"]:
            assert x["status"] == "ok" and x["gbps"] >= LAB_RAIL_VARS["rail_expected_gbps"], x
            assert x["mtu"] == x["peer_mtu"] == 9000 and x["peer"] != h
        print(f"{h}: " + ", ".join(f"{x['iface']} {x['gbps']} Gb/s" for x in doc["rails"]))

    # nothing provision can see changed (a throttle is no recabling, no MTU, driver or boot): a
    # standing record is not measured again unless asked (docs/fabric.md); the owner asks
    again = provision(inv)
    assert "not measured again" in qual(again, SLOW_HOST).msg, qual(again, SLOW_HOST).msg
    print(faults.rail_slow(SLOW_HOST, SLOW_RAIL))
    # the owner asks the host whose rail is suspect to measure again (a host var). Not both at once:
    # spark1 measuring the same rail at the same moment gets its ACKs queued behind spark2's
    # throttled bulk (tbf's 400 ms), and measured that rail degraded too (seen once in the lab)
    asked = lab.write_inventory(inv.parent / "requalify.yaml")
    doc = yaml.safe_load(asked.read_text())
    doc["hosts"][SLOW_HOST]["vars"] = {"fabric_requalify": True}
    asked.write_text(yaml.safe_dump(doc, sort_keys=False))
    slow = provision(asked)
    r = qual(slow, SLOW_HOST)
    assert r.status == "failed", (r.status, r.msg)
    other = [i for i in RAIL_IFACES.values() if i != SLOW_RAIL]
    assert f"{SLOW_RAIL} (" in r.msg and f"floor {FLOOR:g} Gb/s" in r.msg and all(f"{i} (" not in r.msg for i in other)
    doc = record(lab, SLOW_HOST)
    (bad,) = [x for x in doc["rails"] if x["status"] != "ok"]
    assert bad["iface"] == SLOW_RAIL and bad["status"] == "degraded" and bad["gbps"] < FLOOR
    assert f"{bad['gbps']:g} Gb/s measured" in r.msg
    print(f"{SLOW_HOST} {SLOW_RAIL} throttled: {bad['gbps']} Gb/s; {r.msg[:300]}")
    # the peer was not asked: its record, measured before the throttle, stands
    assert "not measured again" in qual(slow, "spark1").msg and record(lab, "spark1")["ok"]

    # a TP 2 start over it: refused at the preflight, host, rail, figure and floor named; nothing starts
    base = [INVOKE, "cluster-up", "--inventory", str(inv), "--model", "lab-tiny", "--tp", "2", "--executor", "native",
            "--hosts", ",".join(lab.names), "--check", "--json"]
    for force in (False, True):
        p = subprocess.run(base + (["--force-degraded-fabric"] if force else []), cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=300)
        results = json.loads(p.stdout)["results"]
        pre = {x["host"]: x for x in results if x["module"] == "serve_preflight"}
        line = f"{SLOW_HOST}: rail {SLOW_RAIL} to spark1 was degraded at its last qualification"
        if force:
            assert line not in pre[SLOW_HOST]["msg"] and any(line in w for w in pre[SLOW_HOST].get("warnings", []))
        else:
            assert p.returncode != 0 and pre[SLOW_HOST]["status"] == "failed"
            assert line in pre[SLOW_HOST]["msg"] and f"{bad['gbps']:g} Gb/s measured, floor {FLOOR:g} Gb/s" in pre[SLOW_HOST]["msg"]
            assert "degraded" not in pre["spark1"]["msg"]
            assert not [x for x in results if x["module"] == "vllm_container" and x["status"] == "changed"]
            print(f"cluster-up refused: {pre[SLOW_HOST]['msg'][:400]}")

    print(faults.clear_rail_slow(SLOW_HOST, SLOW_RAIL))
    cleared = provision(inv)
    assert qual(cleared, SLOW_HOST).status in ("ok", "changed"), qual(cleared, SLOW_HOST).msg
    assert record(lab, SLOW_HOST)["ok"]


# From the power cycle's end to the guard's record: the guard starts last at boot, its thread finds the
# peer answering at once (spark1 stayed up), then ib_write_bw runs `seconds` (3) per rail.
REQUALIFY_BOUND_S = 120


def guard_record_within(lab, host: str, after: str | None, bound: float) -> dict | None:
    """The record once the node guard has rewritten it (measured after `after`), or None past the bound."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        r = lab.sh(host, f"cat {QUAL_PATH} 2>/dev/null || true")
        doc = json.loads(r.stdout) if r.stdout.strip() else {}
        if str(doc.get("measured_by") or "").startswith("the node guard") and doc.get("measured_at") != after:
            return doc
        time.sleep(1)
    return None


def test_after_a_power_cycle_the_guard_qualifies_the_rails_again(lab, inv):
    """The previous test left every rail qualified ok by provision; the guard installed, a rail's cable
    degrades and the host is power-cycled: its guard measures again, records the rail degraded (what
    cluster-up's preflight refuses a multi-node start over) and journals why with the fix; mended and
    power-cycled again, the record is ok."""
    inventory = load_inventory(inv)
    # the guard, and the docker group `invoke status` reads containers through (the module runs
    # alone as well as after the lab's other tests)
    Runner(inventory, load_playbook(PLAYBOOK), list(inventory.hosts), RunOptions(tags={"guard", "docker"}),
           Report(open(os.devnull, "w"))).run()
    before = record(lab, SLOW_HOST)
    assert before["ok"] and before["remeasure"]["rails"], before
    seen = len(journal(lab, SLOW_HOST))

    print(faults.rail_slow(SLOW_HOST, SLOW_RAIL))
    print(faults.reboot(SLOW_HOST))
    t0 = time.monotonic()
    doc = guard_record_within(lab, SLOW_HOST, before.get("measured_at"), REQUALIFY_BOUND_S)
    took = time.monotonic() - t0
    assert doc is not None, f"{SLOW_HOST}'s guard did not qualify the rails within {REQUALIFY_BOUND_S}s of its boot"
    (bad,) = [x for x in doc["rails"] if x["status"] != "ok"]
    assert bad["iface"] == SLOW_RAIL and bad["status"] == "degraded" and bad["gbps"] < FLOOR and not doc["ok"]
    # what the guard rewrote is what cluster-up's preflight and `invoke status` read: the start refused
    # naming the rail, status exiting 2 with it as a standing problem
    line = f"{SLOW_HOST}: rail {SLOW_RAIL} to spark1 was degraded at its last qualification"
    pre = preflight(inv, lab.names)
    assert line in pre[SLOW_HOST]["msg"] and pre[SLOW_HOST]["status"] == "failed", pre[SLOW_HOST]
    assert "degraded" not in pre["spark1"]["msg"], pre["spark1"]
    p = subprocess.run([INVOKE, "status", "--inventory", str(inv), "--json"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and SLOW_RAIL in json.dumps(json.loads(p.stdout)["hosts"][SLOW_HOST]), p.stdout[-3000:]
    (e,) = [x for x in journal(lab, SLOW_HOST)[seen:] if x["kind"] == "rail-degraded"]
    assert e["reading"].startswith(f"{SLOW_RAIL} -> spark1") and e["action"] == REQUALIFY_ACTION and e["fix"]
    print(f"{SLOW_HOST} {took:.1f}s after its boot: {e['reading']} (threshold {e['threshold']})")

    print(faults.clear_rail_slow(SLOW_HOST, SLOW_RAIL))
    print(faults.reboot(SLOW_HOST))
    t0 = time.monotonic()
    again = guard_record_within(lab, SLOW_HOST, doc["measured_at"], REQUALIFY_BOUND_S)
    assert again is not None and again["ok"], again
    assert "degraded" not in preflight(inv, lab.names)[SLOW_HOST]["msg"]
    print(f"{SLOW_HOST} mended, {time.monotonic() - t0:.1f}s after its boot: "
          + ", ".join(f"{x['iface']} {x['gbps']} Gb/s" for x in again["rails"]))
