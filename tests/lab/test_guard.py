"""The node guard (issue 25) on the lab: one TP 2 native deployment of lab-tiny on the real vLLM
across spark1 and spark2 (as `make demo`), shared by three faults, each as a Spark shows it
(sparklab/faults.py): memory pressure (the host's /proc/meminfo reads 1.9% available),
an NVRM NV_ERR_NO_MEMORY line in the host's kernel log (verbatim from a GB10), and a hung engine
(its EngineCore SIGSTOPped: /health stays 200); the first two at once, on different hosts. For
each: the guard of that host, and no other, journals the event and stops the host's serving
container within ACT_BOUND_S; `invoke status` exits 2 naming it and `invoke guard --events` lists it; once the fault is cleared the deployment
answers the smoke question again with no sparkprov command, within SERVE_BOUND_S.
Engine: real vLLM in every test of this module."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from sparkprov.serving.guard import JOURNAL_PATH
from tests.lab import test_real_vllm as real
from tests.lab.test_cluster import cli
from tests.lab.conftest import NAT
from tests.lab.test_real_vllm import INVOKE, REPO_ROOT, RECOVERY_BOUND_S, ask, smoke_within, up

# the real-engine modules' fixtures: the provisioned lab (provision starts the guard) with lab-tiny
# staged; every deployment but the ones a passing test keeps removed after each test
env = real.env
nothing_left_running = real.nothing_left_running

# From the fault to the guard's event: memory needs 3 samples under the floor (5 s apart), a hang
# 2 tokens not generated in 10 s; a sample also waits for the probe and for docker stop (20 s).
ACT_BOUND_S = 90
SERVE_BOUND_S = RECOVERY_BOUND_S   # the group re-forms as after a rank's loss (docs/real-vllm.md)


def journal(lab, host: str) -> list[dict]:
    r = lab.exec(host, ["sh", "-c", f"cat {JOURNAL_PATH} 2>/dev/null || true"])
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def event_within(lab, host: str, kind: str, seen: int, bound: float) -> tuple[float | None, dict | None]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        new = journal(lab, host)[seen:]
        hit = next((e for e in new if e["kind"] == kind), None)
        if hit:
            return time.monotonic() - t0, hit
        time.sleep(1)
    return None, None


def guard_cost(lab, host: str) -> str:
    """The guard's own cost so far: CPU seconds (its samplers included: probe, nvidia-smi, docker) per
    second alive, and its resident memory. Printed, not asserted (no timed assertions in tests)."""
    from pathlib import Path

    pid = lab.exec(host, ["cat", "/run/sparkprov-guard.pid"]).stdout.strip()
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = sum(int(x) for x in stat[11:15]) / tick
    alive = float(Path("/proc/uptime").read_text().split()[0]) - int(stat[19]) / tick
    rss = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return f"{host} guard: {100 * cpu / alive:.1f}% of a core over {alive:.0f}s, RSS {int(rss) / 1024:.0f} MiB"


def fault(action: str, host: str) -> str:
    r = subprocess.run([INVOKE, "lab.fault", action, host], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    return r.stdout.strip()


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
def test_guard_acts_on_each_fault_on_that_host_only_and_serving_resumes(env, nat):
    lab = env["lab"]
    rc, st, out = cli(env, "status")
    assert rc == 0, out
    for h in lab.names:   # provision (env) started the guard: a process started at boot in the lab
        gd = st["hosts"][h]["host"]["guard"]
        assert gd["installed"] and gd["running"] and gd["started_by"] == "boot", gd
    d, key = nat, nat["key"]
    assert "204" in ask(d["endpoint"], d["model"], key)

    timings = []
    # Two rounds: memory pressure on spark2 and an NVRM error on spark1 at once (two guards, each
    # acting on its own host; one recovery of the group for both), then the hang on spark1.
    rounds = ([("memory-pressure", "spark2", "memory", nat["ranks"]["spark2"]),
               ("nvrm", "spark1", "nvrm", nat["ranks"]["spark1"])],
              [("hang", "spark1", "liveness", nat["ranks"]["spark1"])])
    for faults in rounds:
        before = {h: len(journal(lab, h)) for h in lab.names}
        t0 = time.monotonic()
        said = {action: fault(action, host) for action, host, _, _ in faults}
        for action, host, kind, container in faults:
            secs, ev = event_within(lab, host, kind, before[host], ACT_BOUND_S)
            assert ev is not None, (f"{action} on {host} ({said[action]}): no {kind} event within {ACT_BOUND_S}s: "
                                    f"{journal(lab, host)}")
            assert ev["action"] == f"stopped {container}" and ev["reading"] and ev["threshold"], ev
            timings.append(f"{action} {host}: guard acted after {secs:.1f}s")
            rc, st, out = cli(env, "status")
            assert rc == 2, out   # the guard holds the container stopped, or (restarted already) the group re-forms
            gd = st["hosts"][host]["host"]["guard"]
            assert any(e["epoch"] == ev["epoch"] for e in gd["events"]), gd
            assert not gd["held"] or any(f"the guard stopped {container} ({kind})" in p for p in gd["problems"]), gd
            rc, gdoc, out = cli(env, "guard", "--events")
            assert rc in (0, 2), out
            assert any(e["host"] == host and e["kind"] == kind and e["epoch"] == ev["epoch"] for e in gdoc["events"]), gdoc
        cleared = [fault(f"clear-{action}", host) for action, host, _, _ in faults]
        back = smoke_within(d["endpoint"], d["model"], key, SERVE_BOUND_S)
        assert back is not None, f"{[f[0] for f in faults]}: no smoke answer within {SERVE_BOUND_S}s after the clear ({cleared})"
        timings.append(f"serving again {time.monotonic() - t0:.1f}s after {' and '.join(f[0] for f in faults)}")
        for action, host, kind, container in faults:
            restarted = [e for e in journal(lab, host)[before[host]:] if e["kind"] == "restart"]
            assert restarted and container in restarted[0]["action"], journal(lab, host)
        for h in lab.names:  # each guard acted on its own host's fault only, and on no host without one
            own = {kind for _, host, kind, _ in faults if host == h}
            acted = {e["kind"] for e in journal(lab, h)[before[h]:]} - {"restart"}
            assert acted == own, f"the guard of {h} journaled {acted} for faults {own} on it: {journal(lab, h)}"
    rc, st, out = cli(env, "status")
    assert rc == 0, out
    print("\n[guard, real vLLM native tp2] " + "; ".join(timings + [guard_cost(lab, h) for h in lab.names]))
