"""The node guard qualifies the fabric again after a boot (issue #25): the boot decision, the record it
rewrites with provision's own parser and judgement (sparkprov/node/rail.py, one implementation for
both) on the real GB10 ib_write_bw captures (tests/fixtures/gb10/ib_write_bw-*.txt,
gb10-failure-outputs.md §4.5: NVIDIA/dgx-spark-playbooks performance_benchmarking_guide.md,
TrevorSquillario/gb10-training, a RoCE/RDMA setup blog post), which cluster-up's preflight reads, and
the journal event; then the guard's thread run for real against stand-in `ssh` and `ib_write_bw` on
PATH that print those captures."""

from __future__ import annotations

import getpass
import json
import os
import stat
from pathlib import Path

import pytest

from sparkprov.facts import rail
from sparkprov.facts.guard import event_line, guard_summary
from sparkprov.node import guard as g
from sparkprov.node import requalify as rq
from sparkprov.node.settings import DEFAULTS
from tests.unit.test_rail_qualification import GB10, ctx, fact_output, measured, plan, read, throughput

BOOT = "6f1d2c3a-0b4e-4a8e-9d7c-1e2f3a4b5c6d"


def provisioned(a=92.57, b=97.28) -> dict:
    """spark2's record as provision writes it (the fabric_qualify module, planned on literal facts)."""
    p = plan(ctx("spark2"), throughput(a, b), {"present": False})
    return p.changes[0].predicts[0][1]


# -- the boot decision ----------------------------------------------------------------------------

def test_a_boot_is_one_the_guard_left_no_marker_in():
    assert rq.boot_is_new(None, BOOT)                  # /run emptied at boot
    assert not rq.boot_is_new(BOOT + "\n", BOOT)      # restarted in the same boot (by provision, or a crash)
    assert rq.boot_is_new("0b9f2e7c-5d1a-4c3b-8e6f-7a8b9c0d1e2f", BOOT)   # another kernel boot id


def test_provision_leaves_the_guard_its_measurement():
    rec = provisioned()
    spec = rq.remeasure_spec(rec)
    assert spec["user"] == "nvidia" and [r["iface"] for r in spec["rails"]] == ["enp1s0f1np1", "enP2p1s0f1np1"]
    # the very command provision ran on spark2: to spark1 on each rail, over the mesh SSH
    assert "ib_write_bw -d rocep1s0f1 -p 18515" in spec["command"] and "nvidia@192.168.100.11" in spec["command"]
    assert rq.remeasure_spec({**rec, "remeasure": None}) is None and rq.remeasure_spec({**rec, "rails": []}) is None


# -- the record and the event ---------------------------------------------------------------------

def test_a_rail_degraded_after_a_boot_is_recorded_and_journaled_with_the_fix():
    rec = provisioned()
    out = fact_output({"enp1s0f1np1": (read("ib_write_bw-rocep1s0f0-1qp.txt"), "9000", 0),
                       "enP2p1s0f1np1": (read("ib_write_bw-roceP2p1s0f0-1qp.txt"), "9000", 0)})
    # a floor above the first capture's 92.57, under the second's 97.28
    strict = {**rec, "floor_gbps": 95.0, "expected_gbps": 96.0}
    new = rq.requalified_record(strict, rail.parse_rail_throughput(out), now=1_790_000_000.0, boot_id=BOOT)
    assert [(r["iface"], r["gbps"], r["status"]) for r in new["rails"]] == [("enp1s0f1np1", 92.57, "degraded"),
                                                                          ("enP2p1s0f1np1", 97.28, "ok")]
    assert new["ok"] is False and new["measured_at"] == "2026-09-21T14:13:20Z" and BOOT in new["measured_by"] and new["boot_id"] == BOOT
    assert new["remeasure"] == rec["remeasure"]   # the next boot measures the same way
    # cluster-up's preflight reads it as it reads provision's record
    (line,) = rail.degraded("spark2", {"present": True, **new})
    assert "rail enp1s0f1np1 to spark1 was degraded" in line and "92.57 Gb/s measured, floor 95 Gb/s" in line
    (e,) = rq.requalify_events(new, 1_790_000_000.0, [], 12.0)
    assert (e["kind"], e["action"]) == ("rail-degraded", "reported: multi-node starts refused until it qualifies")
    assert e["reading"] == "enp1s0f1np1 -> spark1 192.168.100.11: 92.57 Gb/s measured (ib_write_bw)"
    assert e["threshold"] == "floor 95 Gb/s, MTU 9000" and "QSFP cable" in e["fix"]
    assert "fix: reseat" in event_line({"host": "spark2", **e})
    # healthy again: the record says ok, nothing is journaled
    ok = rq.requalified_record(rec, rail.parse_rail_throughput(out), now=1_790_000_100.0, boot_id=BOOT)
    assert ok["ok"] is True and rq.requalify_events(ok, 1.0, [], 1.0) == []


def test_a_peer_that_never_answered_is_reported_as_such():
    rec = provisioned()
    out = ("@rail enp1s0f1np1\nmtu=9000\n@server\nssh: connect to host 192.168.100.11 port 22: No route to host\n@rc=255\n"
           "@client\n Couldn't connect to 192.168.100.11:18515\n@crc=1\n"
           + fact_output({"enP2p1s0f1np1": (read("ib_write_bw-roceP2p1s0f0-1qp.txt"), "9000", 0)}))
    m = rail.parse_rail_throughput(out)
    new = rq.requalified_record(rec, m, now=0.0, boot_id=BOOT)
    (e,) = rq.requalify_events(new, 0.0, rq.peer_silent(m), 600.0)
    assert "did not answer the mesh SSH within 600s" in e["reading"] and "power on or repair spark1" in e["fix"]
    assert new["rails"][0]["status"] == "degraded" and not new["ok"]


def test_status_names_a_degraded_rail_as_a_standing_problem():
    rails = rq.parse_qualification(json.dumps(rq.requalified_record(
        {**provisioned(), "floor_gbps": 95.0, "expected_gbps": 96.0},
        {"enp1s0f1np1": measured(92.57), "enP2p1s0f1np1": measured(97.28)}, now=0.0, boot_id=BOOT)))
    s = guard_summary({"now": 10.0, "installed": True, "pid": 1, "state": {"sample": {"t": 9.0, "rails": rails}}})
    (p,) = s["problems"]
    assert p.startswith("rail enp1s0f1np1 to spark1 degraded at its last qualification (92.57 Gb/s, floor 95 Gb/s)")


# -- the guard's thread, run for real --------------------------------------------------------------

STANDIN_SSH = """#!/bin/sh
# the mesh SSH: fails (as a peer still booting) while the count file says so, else runs the command here
n=$(cat "$GUARD_T/ssh-fails" 2>/dev/null || echo 0)
if [ "$n" -gt 0 ]; then echo $((n - 1)) > "$GUARD_T/ssh-fails"
  echo "ssh: connect to host peer port 22: Connection timed out" >&2; exit 255; fi
for last; do :; done
exec sh -c "$last"
"""
# the server says it listens (a file per port) and exits; the client connects only to a server that
# listens, and prints the real capture of the HCA it is given
STANDIN_BW = """#!/bin/sh
dev=""; addr=""; port=18515
while [ $# -gt 0 ]; do case "$1" in -d) dev=$2; shift 2;; -p) port=$2; shift 2;; -D|-q) shift 2;; -*) shift;;
  *) addr=$1; shift;; esac; done
if [ -z "$addr" ]; then touch "$GUARD_T/listening-$port"; exit 0; fi
[ -e "$GUARD_T/listening-$port" ] || { echo " Couldn't connect to $addr:$port"; exit 1; }
rm -f "$GUARD_T/listening-$port"
cat "$GUARD_T/$dev.txt"
"""


@pytest.fixture
def node(tmp_path, monkeypatch):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("ssh", STANDIN_SSH), ("ib_write_bw", STANDIN_BW)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(stat.S_IRWXU)
    (tmp_path / "rocep1s0f1.txt").write_text((GB10 / "ib_write_bw-rocep1s0f0-1qp.txt").read_text())
    (tmp_path / "roceP2p1s0f1.txt").write_text((GB10 / "ib_write_bw-roceP2p1s0f0-1qp.txt").read_text())
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("GUARD_T", str(tmp_path))
    rec = provisioned()
    rec = {**rec, "floor_gbps": 95.0, "expected_gbps": 96.0, "remeasure": {**rec["remeasure"], "user": getpass.getuser()}}
    (tmp_path / "qualification.json").write_text(json.dumps(rec))
    (tmp_path / "boot_id").write_text(BOOT + "\n")
    cfg = {**DEFAULTS, **g.INTERNAL, "kernel_log": str(tmp_path / "kmsg"), "qualification": str(tmp_path / "qualification.json"),
           "journal": str(tmp_path / "events.jsonl"), "state": str(tmp_path / "state.json"),
           "boot_id": str(tmp_path / "boot_id"), "boot_marker": str(tmp_path / "boot"), "requalify_backoff_s": 0.01}
    return tmp_path, cfg


def test_after_a_boot_the_guard_measures_again_waiting_for_a_peer_still_booting(node):
    tmp, cfg = node
    (tmp / "ssh-fails").write_text("2")   # both rails of the first try find the peer still booting
    t = g.Guard(cfg).requalify_if_booted()
    assert t is not None
    t.join(120)
    doc = json.loads((tmp / "qualification.json").read_text())
    assert [(r["iface"], r["gbps"], r["status"]) for r in doc["rails"]] == [("enp1s0f1np1", 92.57, "degraded"),
                                                                          ("enP2p1s0f1np1", 97.28, "ok")]
    assert doc["ok"] is False and oct(os.stat(tmp / "qualification.json").st_mode & 0o777) == "0o644"
    (e,) = [json.loads(x) for x in (tmp / "events.jsonl").read_text().splitlines()]
    assert e["kind"] == "rail-degraded" and e["reading"].endswith("92.57 Gb/s measured (ib_write_bw)")
    assert (tmp / "boot").read_text().strip() == BOOT and (tmp / "ssh-fails").read_text().strip() == "0"
    # started again in the same boot: nothing measured
    assert g.Guard(cfg).requalify_if_booted() is None


def test_a_peer_silent_past_the_bound_is_recorded_degraded(node):
    tmp, cfg = node
    (tmp / "ssh-fails").write_text("1000")
    t = g.Guard({**cfg, "requalify_wait_s": 0}).requalify_if_booted()
    t.join(120)
    doc = json.loads((tmp / "qualification.json").read_text())
    assert [r["status"] for r in doc["rails"]] == ["degraded", "degraded"]
    events = [json.loads(x) for x in (tmp / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["rail-degraded", "rail-degraded"]
    assert all("did not answer the mesh SSH" in e["reading"] for e in events)


def test_a_start_in_a_boot_already_seen_does_not_measure(node):
    tmp, cfg = node
    (tmp / "boot").write_text(BOOT + "\n")   # what the guard module leaves before it starts the guard
    assert g.Guard(cfg).requalify_if_booted() is None
    assert not Path(cfg["journal"]).exists()
    assert json.loads((tmp / "qualification.json").read_text())["measured_by"] == "provision"  # not rewritten


def test_the_measurement_runs_as_the_login_user_without_a_pam_session():
    argv = ["sh", "-c", "true"]
    assert rq.as_user(argv, ("nvidia", 1000, 1000, "/home/nvidia"), euid=0) == [
        "setpriv", "--reuid=1000", "--regid=1000", "--init-groups", "env", "HOME=/home/nvidia", "USER=nvidia",
        "LOGNAME=nvidia", "sh", "-c", "true"]
    assert rq.as_user(argv, ("nvidia", 1000, 1000, "/home/nvidia"), euid=1000) == argv


def test_provisions_start_of_the_guard_is_not_a_boot():
    """The module marks the boot seen before it (re)starts the guard, on systemd and without."""
    from tests.unit.test_guard_program import plan as plan_guard

    mark = "cat /proc/sys/kernel/random/boot_id > /run/sparkprov-guard.boot 2>/dev/null || :"
    for systemd, start in ((True, "systemctl restart"), (False, "setsid -f")):
        script = plan_guard({}, {}, systemd=systemd, pid=None).changes[-1].script
        assert mark in script and script.index(mark) < script.index(start)
