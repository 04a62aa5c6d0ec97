"""The node guard (issue 32) on the lab's real engine: one pinned TP 2 native deployment of lab-tiny
(spark1 rank 0, spark2 rank 1: fixture `nat` of tests/lab/conftest.py, shared, left serving) and the replays of what
Spark owners measured (sparklab/replay.py, sparklab/faults.py; gb10-field-timelines.md), read by
the guard as it reads a Spark's: its /dev/kmsg, /proc/meminfo, /proc/buddyinfo (stand-ins of each
host's own) and vLLM's /metrics.

- Healthy (nothing may stop): NVRM lines at rest (16 in one second, vllm#56824) and through a start
  (75, #54200); a load's page-cache flood (MemFree 29 -> 2.5 GiB in 9 s with MemAvailable over 22
  GiB, #54200), which only a cache drop saves (left alone, the host wedges); no free 4 MiB block
  (MiaAI-Lab #23), which compaction mends. Each ends serving, the journal saying what it saw and
  why it did not act.
- Failures (that host's guard acts, and no other): the engine stalled with requests running (its
  core SIGSTOPped; #1358: the host froze ~5 s later unless something stopped it), stopped within
  the bound; memory exhausted (MemFree 0.8% after a cache drop) at the same time on the other host;
  each in `invoke status` (exit 2) and `invoke guard --events`, serving again once cleared; a
  restart storm (eugr/spark-vllm-docker#257), which ends in a stand-down after the budget and
  serves again after `invoke guard --resume`.
Engine: real vLLM in every test of this module."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from sparkprov.node.guard import JOURNAL_PATH
from tests.lab import test_real_vllm as real
from tests.lab.conftest import NAT
from tests.lab.test_cluster import cli
from tests.lab.test_real_vllm import INVOKE, REPO_ROOT, RECOVERY_BOUND_S, smoke_within, up

env = real.env
nothing_left_running = real.nothing_left_running

# The guard's stop of a stalled engine, from the SIGSTOP to its core gone: under the ~5 s after which
# the host froze (open-gpu-kernel-modules#1358; the replay freezes the host then). stall_s 3 s, a
# sample a second, docker stop -t 0.
STALL_BOUND_S = 5.0
# From a fault to the guard's event: memory needs mem_samples (3) samples under the critical level
# after a reclaim, a second apart.
ACT_BOUND_S = 30
SERVE_BOUND_S = RECOVERY_BOUND_S   # the group re-forms as after a rank's loss (docs/real-vllm.md)
STOPS = {"stall", "liveness", "memory", "xid", "crash-loop"}


@pytest.fixture
def native_tp2(nat):
    """The shared pinned native TP 2 deployment `nat` of lab-tiny (tests/lab/conftest.py: spark1 rank 0,
    spark2 rank 1), serving; the tests leave it serving."""
    assert smoke_within(nat["endpoint"], nat["model"], nat["key"], 60) is not None
    return {**nat, "rank0": nat["ranks"]["spark1"], "rank1": nat["ranks"]["spark2"]}


def journal(lab, host: str) -> list[dict]:
    r = lab.exec(host, ["sh", "-c", f"cat {JOURNAL_PATH} 2>/dev/null || true"])
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def new_events(lab, before: dict[str, int]) -> dict[str, list[dict]]:
    return {h: journal(lab, h)[n:] for h, n in before.items()}


def event_within(lab, host: str, kind: str, seen: int, bound: float) -> tuple[float | None, dict | None]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        hit = next((e for e in journal(lab, host)[seen:] if e["kind"] == kind), None)
        if hit:
            return time.monotonic() - t0, hit
        time.sleep(0.5)
    return None, None


def fault(action: str, host: str, *args: str) -> str:
    r = subprocess.run([INVOKE, "lab.fault", action, host, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr + r.stdout
    return r.stdout.strip()


def replay_record(host: str, kind: str) -> dict:
    from sparklab.replay import read_record
    return read_record(host, kind)


def stalls_settled(host: str, kind: str, n: int, bound: float = 20) -> dict:
    """The replay's record once its first n stalls ended: the stalled core gone, or the host frozen."""
    t0 = time.monotonic()
    while True:
        rec = replay_record(host, kind)
        stalls = rec.get("stalls") or []
        if rec.get("froze") or (len(stalls) >= n and all("engine_gone_after_s" in s for s in stalls[:n])) \
                or time.monotonic() - t0 > bound:
            return rec
        time.sleep(0.2)


def guard_cost(lab, host: str) -> str:
    """The guard's own cost so far: CPU seconds (itself and what it ran) per second alive, and its
    resident memory. Printed, not asserted (no timed assertions in tests; bench/guard_cost.py measures)."""
    pid = lab.exec(host, ["cat", "/run/sparkprov-guard.pid"]).stdout.strip()
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = sum(int(x) for x in stat[11:15]) / tick
    alive = float(Path("/proc/uptime").read_text().split()[0]) - int(stat[19]) / tick
    rss = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return f"{host} guard: {100 * cpu / alive:.2f}% of a core over {alive:.0f}s, RSS {int(rss) / 1024:.0f} MiB"


def assert_no_stop(events: dict[str, list[dict]]) -> None:
    stops = {h: [e for e in evs if e["kind"] in STOPS | {"stand-down"}] for h, evs in events.items()}
    assert not any(stops.values()), f"the guard stopped something: {stops}"


def test_a_changed_kernel_on_one_host_is_drift_at_provision_and_refused_at_cluster_up(env):
    """The drift gate (modules/drift.py): spark2 alone reports the kernel an NVIDIA system update
    brought (7.0.0-1019-nvidia, eugr/spark-vllm-docker#392): provision records and reports it (the
    drift between the nodes, and the known-bad row), cluster-up of a TP 2 deployment is refused
    before anything is pulled or started, naming both kernels."""
    lab = env["lab"]
    try:
        said = fault("kernel-update", "spark2")
        assert said == "spark2: kernel 7.0.0-1019-nvidia", said
        good = lab.exec("spark1", ["cat", "/proc/sys/kernel/osrelease"]).stdout.strip()
        rc, doc, out = cli(env, "provision")
        assert rc == 0, out
        warnings = [w for r in doc["results"] for w in r.get("warnings") or []]
        assert f"drift: kernel differs: spark1 {good}, spark2 7.0.0-1019-nvidia" in warnings, warnings
        assert any("eugr/spark-vllm-docker#392" in w for w in warnings), warnings
        rc, doc, out = up(env, "--tp", "2", "--hosts", "spark1,spark2", "--executor", "native", "--name", "drift")
        assert rc != 0, out
        failed = " ".join(r["msg"] for r in doc["results"] if r["status"] == "failed")
        assert f"kernel differs: spark1 {good}, spark2 7.0.0-1019-nvidia" in failed, failed
        for h in lab.names:
            assert lab.exec(h, ["docker", "ps", "-aq", "--filter", "label=sparkprov.deployment=drift"]).stdout == ""
    finally:
        fault("clear-kernel-update", "spark2")


@pytest.mark.keeps_serving(NAT)
def test_benign_signals_are_recorded_and_nothing_stops(env, native_tp2):
    """NVRM lines at rest on spark2 (16 in one second) and no free 4 MiB block on spark1, at once:
    each guard journals what it saw and why it did not act; nothing stops; status exits 0."""
    lab, d = env["lab"], native_tp2
    before = {h: len(journal(lab, h)) for h in lab.names}
    said = [fault("nvrm-noise", "spark2"), fault("no-hugeblocks", "spark1")]
    _, nv = event_within(lab, "spark2", "nvrm-memory", before["spark2"], 30)
    _, rc_ = event_within(lab, "spark1", "reclaim", before["spark1"], 30)
    cleared = fault("clear-no-hugeblocks", "spark1")
    assert nv is not None and nv["count"] == 16 and nv["max_per_s"] == 16 and nv["action"] == "none", (said, nv)
    assert "vllm-project/vllm#56824" in nv["threshold"], nv
    assert rc_ is not None and rc_["action"].startswith("compacted:") and "memory came back, nothing stopped" in \
        rc_["action"], (rc_, cleared)
    assert replay_record("spark1", "no-hugeblocks")["compactions"] >= 1
    assert smoke_within(d["endpoint"], d["model"], d["key"], 30) is not None
    events = new_events(lab, before)
    assert_no_stop(events)
    rc, st, out = cli(env, "status")
    assert rc == 0, out
    assert st["hosts"]["spark2"]["host"]["guard"]["nvrm_lines"] >= 16
    print(f"\n[guard, benign] spark2: {nv['reading'][:90]}...; spark1: {rc_['action'][:90]}...")


@pytest.mark.keeps_serving(NAT)
def test_a_stall_and_exhausted_memory_stop_their_hosts_and_the_restart_survives_a_flood(env, native_tp2):
    """spark1's engine stalls with requests running (its core SIGSTOPped) while spark2's memory is
    exhausted: each guard stops its own host's rank, the stall within STALL_BOUND_S (the host did not
    freeze); both in status (exit 2) and guard --events. Cleared, the guards start the ranks again,
    and through that load spark1 replays a page-cache flood (its guard drops caches: no stop, no
    wedge) and spark2 logs 75 NVRM lines (recorded). The deployment serves again."""
    lab, d = env["lab"], native_tp2
    before = {h: len(journal(lab, h)) for h in lab.names}
    timings = []
    said = fault("stall", "spark1")
    said += " | " + fault("memory-pressure", "spark2")
    secs, stall = event_within(lab, "spark1", "stall", before["spark1"], ACT_BOUND_S)
    msecs, mem = event_within(lab, "spark2", "memory", before["spark2"], ACT_BOUND_S)
    rec = stalls_settled("spark1", "stall", 1)
    assert stall is not None and stall["action"] == f"stopped {d['rank0']}", (said, journal(lab, "spark1"))
    assert "with requests running" in stall["threshold"] and "request(s) running" in stall["reading"], stall
    assert mem is not None and mem["action"] == f"stopped {d['rank1']}", (said, journal(lab, "spark2"))
    (cycle,) = rec["stalls"]
    assert not rec.get("froze"), f"spark1 froze: the guard did not stop the engine within {STALL_BOUND_S}s: {rec}"
    assert cycle["engine_gone_after_s"] <= STALL_BOUND_S, cycle
    timings.append(f"stall: engine core gone {cycle['engine_gone_after_s']:.2f}s after the SIGSTOP")
    timings.append(f"memory: event {msecs:.1f}s after the fault")
    rc, st, out = cli(env, "status")
    assert rc == 2, out
    for host, ev, rank in (("spark1", stall, d["rank0"]), ("spark2", mem, d["rank1"])):
        gd = st["hosts"][host]["host"]["guard"]
        assert any(e["epoch"] == ev["epoch"] for e in gd["events"]), gd
        # held stopped, unless memory was back and restart_after_s had passed (then restarted already)
        assert rank not in gd["held"] or any(p.startswith(f"the guard stopped {rank} ({ev['kind']})")
                                             for p in gd["problems"]), gd
    rc, gdoc, out = cli(env, "guard", "--events")
    assert rc in (0, 2), out
    assert {(e["host"], e["kind"]) for e in gdoc["events"]} >= {("spark1", "stall"), ("spark2", "memory")}

    t0 = time.monotonic()
    fault("clear-memory-pressure", "spark2")
    fault("clear-stall", "spark1")
    # the restart: a load, through which spark1's page cache floods and spark2 logs NVRM lines
    _, restarted = event_within(lab, "spark1", "restart", before["spark1"], 90)
    assert restarted is not None and d["rank0"] in restarted["action"], journal(lab, "spark1")
    fault("page-cache-flood", "spark1", "--seconds", "40")
    noise = threading.Thread(target=fault, args=("nvrm-noise", "spark2", "--count", "75", "--seconds", "15"))
    noise.start()
    back = smoke_within(d["endpoint"], d["model"], d["key"], SERVE_BOUND_S)
    noise.join()
    flood = fault("clear-page-cache-flood", "spark1")
    assert back is not None, f"no smoke answer within {SERVE_BOUND_S}s after the clear ({flood})"
    timings.append(f"serving again {time.monotonic() - t0:.1f}s after the clear")
    frec = replay_record("spark1", "page-cache-flood")
    assert not frec.get("froze") and frec["drops"] >= 1 and frec["lowest_free_gib"] >= 2.6, frec
    events = new_events(lab, before)
    for h, own in (("spark1", {"stall"}), ("spark2", {"memory"})):   # each acted on its own host only
        assert {e["kind"] for e in events[h] if e["kind"] in STOPS} == own, events[h]
        assert [e for e in events[h] if e["kind"] == "restart"], events[h]
    reclaim = next(e for e in events["spark1"] if e["kind"] == "reclaim")
    assert "while loading" in reclaim["reading"] and "nothing stopped" in reclaim["action"], reclaim
    nv = [e for e in events["spark2"] if e["kind"] == "nvrm-memory"]
    assert sum(e["count"] for e in nv) == 75 and all(e["action"] == "none" for e in nv), nv
    rc, st, out = cli(env, "status")
    assert rc == 0, out
    print("\n[guard, real vLLM native tp2] " + "; ".join(timings + [f"flood: {flood}"]
                                                          + [guard_cost(lab, h) for h in lab.names]))


@pytest.mark.keeps_serving(NAT)
def test_a_restart_storm_ends_in_a_stand_down_and_resumes(env, native_tp2, tmp_path):
    """spark1's engine stalls each time it serves again. The budget (inventory var guard_restart_budget;
    the default is 3 in 6 h) is set to the restarts the guard already made in its window (the stall
    test's, before this one; at least one), so that the storm fits CI: each stall is stopped, restarted
    while the budget lasts, and the stall that finds it spent ends in a stand-down: status exits 2 and
    says so, /metrics says so. Cleared, `invoke guard --resume` starts it again."""
    lab, d = env["lab"], native_tp2
    rc, st, out = cli(env, "status")
    made = st["hosts"]["spark1"]["host"]["guard"]["restarts"]
    budget = max(made, 1)
    stalls = budget - made + 1  # the storm's restarts, then the stall that finds the budget spent
    one = {**env, "inv": tmp_path / "inventory.yaml"}
    doc = yaml.safe_load(Path(env["inv"]).read_text())
    doc["vars"]["guard_restart_budget"] = budget
    one["inv"].write_text(yaml.safe_dump(doc, sort_keys=False))
    rc, _, out = cli(one, "provision", "--tags", "guard", "--limit", "spark1")
    assert rc == 0, out
    before = {h: len(journal(lab, h)) for h in lab.names}
    try:
        fault("restart-storm", "spark1")
        t0 = time.monotonic()
        secs, down = event_within(lab, "spark1", "stand-down", before["spark1"], stalls * SERVE_BOUND_S)
        rec = stalls_settled("spark1", "restart-storm", stalls)
        assert down is not None, (rec, journal(lab, "spark1"))
        assert down["reading"].startswith(f"{budget} restarts within 6 h") and "invoke guard --resume" in down["action"], down
        assert not rec.get("froze") and len(rec["stalls"]) == stalls, rec
        assert all(s["engine_gone_after_s"] <= STALL_BOUND_S for s in rec["stalls"]), rec
        rc, st, out = cli(env, "status")
        assert rc == 2, out
        gd = st["hosts"]["spark1"]["host"]["guard"]
        assert gd["stood_down"] and any(p.startswith(f"the guard stood down: {budget} restarts within 6 h")
                                        for p in gd["problems"]), gd
        metrics = lab.exec("spark1", ["sh", "-c", "python3 -c \"import urllib.request; print(urllib.request.urlopen("
                                                  "'http://127.0.0.1:9410/metrics').read().decode())\""]).stdout
        assert "sparkprov_guard_stood_down 1" in metrics, metrics[-2000:]
        assert [e["kind"] for e in journal(lab, "spark1")[before["spark1"]:]].count("restart") == stalls - 1
        storm = fault("clear-restart-storm", "spark1")
        rc, doc, out = cli(env, "guard", "--resume", "--hosts", "spark1")
        assert rc == 0, out
        assert [r["status"] for r in doc["results"] if r["host"] == "spark1"] == ["changed"], doc["results"]
        back = smoke_within(d["endpoint"], d["model"], d["key"], SERVE_BOUND_S)
        assert back is not None, journal(lab, "spark1")
        kinds = [e["kind"] for e in journal(lab, "spark1")[before["spark1"]:]]
        assert kinds.count("stall") == stalls and "resume" in kinds and kinds.count("restart") == stalls, kinds
        print(f"\n[guard, restart storm] budget {budget} ({made} made before): stand-down {secs:.0f}s after the storm "
              f"began; {storm}; serving again {time.monotonic() - t0:.0f}s after it began")
    finally:
        subprocess.run([INVOKE, "lab.fault", "clear-restart-storm", "spark1"], cwd=REPO_ROOT, capture_output=True)
        rc, _, out = cli(env, "provision", "--tags", "guard", "--limit", "spark1")
        assert rc == 0, out
