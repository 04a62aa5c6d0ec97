"""The node guard's pure logic (sparkprov/serving/guard.py): its parsers on real captured GB10 output
(each source named; /work/shared/reference/gb10-failure-outputs.md holds them), its decisions on
literal samples, its /metrics text; the fact that reads it (facts/guard.py) and the module that
installs it (modules/guard.py), planned from literal facts."""

from __future__ import annotations

import json

import pytest

from sparkprov.facts.files import PathState
from sparkprov.facts.guard import GuardState, describe, event_line, exit_code, fleet_events, guard_summary, parse_guard_state
from sparkprov.facts.hardware import parse_meminfo as fact_parse_meminfo
from sparkprov.modules import guard as guard_module
from sparkprov.modules.base import FactView, HostContext
from sparkprov.serving import guard as g

GIB = 2**30

# -- the kernel log -------------------------------------------------------------------------

# NVIDIA/open-gpu-kernel-modules#1358, comment by fuomag9, 2026-09-13, 2x DGX Spark GB10, from `journalctl -k`
NVRM_1358 = ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from "
             "_memdescAllocInternal(pMemDesc) @ mem_desc.c:1359")
# vllm-project/vllm PR#41834, turn 109 by BokuNoGF: raw dmesg, NVRM lines among journald's
DMESG_41834 = """\
[81033.348590] NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359
[81033.371299] NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359
[81034.207309] systemd-journald[662]: Under memory pressure, flushing caches.
"""
# NVIDIA/dgx-spark-playbooks#116, AuricTW, 2026-08-31, DGX Spark GB10: wrapped as posted, with the IOVA line
WRAPPED_116 = """\
NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY]
(0x00000051) returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359

NVRM: _iovaspaceCreateMappingDataFromMemDesc: failed to allocate
0x176028 bytes for IOVA mapping metadata
"""
# public CHANGELOG.md (repo unresolved), GB10 desktop, PCI 000f:01:00: Xid 119 then 120 before a reboot
XID_GB10 = """\
NVRM: Xid (PCI:000f:01:00): 119, pid=3849, name=KMS thread, Timeout after 45s of waiting for RPC response from GPU0 GSP!
NVRM: Xid (PCI:000f:01:00): 120, pid=9111, name=python, GSP task exception: load access fault
nvidia-modeset: ERROR: GPU:0: Failed detecting connected display devices
"""
# "PRD: CUTLASS NVFP4 SM121 Shared Memory Fix" (repo unresolved), GB10 SGLang: an application's Xid 13
XID_13 = "NVRM: Xid (PCI:000f:01:00): 13, Graphics SM Warp Exception: Illegal Instruction Parameter"
# LMCache/LMCache#4759, sethforprivacy, 2026-08-27, GB10 head node, dmesg -T
OOM_4759 = ("[Thu Aug 27 00:39:44 2026] Out of memory: Killed process 3742074 (lmcache) total-vm:81306880kB, "
            "anon-rss:1058560kB, file-rss:21412kB, shmem-rss:428kB, UID:0 pgtables:28484kB oom_score_adj:0")


def kinds(text: str) -> list[str]:
    return [k["kind"] for k in map(g.classify_kernel_line, text.splitlines()) if k]


def test_nvrm_memory_errors_are_read_in_every_captured_form():
    assert kinds(NVRM_1358) == ["nvrm-memory"]
    assert kinds(NVRM_1358.removeprefix("NVRM: ")) == ["nvrm-memory"]  # vllm#56824 quotes it without the prefix
    assert kinds(DMESG_41834) == ["nvrm-memory", "nvrm-memory"]          # journald's pressure line is not one
    assert kinds(WRAPPED_116) == ["nvrm-memory", "nvrm-memory"]          # the IOVA failure counts too
    # as /dev/kmsg hands it over: "prio,seq,usec,flags;message" (what lab.fault nvrm writes)
    rec = g.classify_kernel_line("3,1764000000,81033194223,-;" + NVRM_1358)
    assert rec == {"kind": "nvrm-memory", "line": NVRM_1358}


def test_xid_and_oom_kill_lines():
    xids = [g.classify_kernel_line(line) for line in XID_GB10.splitlines()]
    assert [(x["xid"], x["device"]) for x in xids if x] == [(119, "PCI:000f:01:00"), (120, "PCI:000f:01:00")]
    assert g.classify_kernel_line(XID_13)["xid"] == 13
    oom = g.classify_kernel_line(OOM_4759)
    assert oom["kind"] == "oom-kill" and oom["pid"] == 3742074 and oom["process"] == "lmcache"
    assert g.classify_kernel_line("[81034.207309] systemd-journald[662]: Under memory pressure, flushing caches.") is None


# -- nvidia-smi and meminfo -----------------------------------------------------------------

def test_gpu_query_with_units_and_without():
    # the gpu_clocks.csv row of the "GB10 clocks cannot be locked" doc (3 GB10 nodes, 580.173.02), its
    # name column dropped as our query has none: temperature, power, SM clock, max SM clock order differs,
    # so the row is rebuilt in the guard's column order from the captured values
    assert g.parse_gpu_query("50, 15.57 W, 2522 MHz, 3003 MHz\n") == {
        "temperature_c": 50.0, "power_w": 15.57, "clock_sm_mhz": 2522.0, "clock_max_sm_mhz": 3003.0}
    # GB10 prints [N/A] for what it lacks (gb10-failure-outputs.md §2.2, power.limit and memory.total)
    assert g.parse_gpu_query("58, [N/A], 695, 3003\n") == {
        "temperature_c": 58.0, "power_w": None, "clock_sm_mhz": 695.0, "clock_max_sm_mhz": 3003.0}
    assert g.parse_gpu_query("") == dict.fromkeys(("temperature_c", "power_w", "clock_sm_mhz", "clock_max_sm_mhz"))


def test_meminfo_parse_agrees_with_the_fact_parser():
    # vllm-project/vllm#48140 (GB10, vLLM 0.24.0): MemFree=27812140 kB, MemAvailable=59063644 kB
    text = "MemTotal:       125369344 kB\nMemFree:        27812140 kB\nMemAvailable:   59063644 kB\nHugePages_Total:       0\n"
    parsed = g.parse_meminfo(text)
    assert parsed["MemAvailable"] == 59063644 * 1024 and parsed["HugePages_Total"] == 0
    assert parsed == fact_parse_meminfo(text)


# -- decisions ------------------------------------------------------------------------------

CFG = {**g.DEFAULTS}
TOTAL = 121 * GIB   # a Spark's MemTotal, about 121.7 GiB (vllm#54200)


def mem(avail_gib: float) -> dict:
    return {"MemTotal": TOTAL, "MemAvailable": int(avail_gib * GIB), "SwapTotal": 16 * GIB, "SwapFree": 15 * GIB}


def rank0(status="running", health=200, live=200, restarts=0, name="sparkprov-nat-rank0"):
    return {"name": name, "status": status, "restarts": restarts, "health": health,
            "liveness": None if live == "none" else {"status": live, "seconds": 0.1, "error": None},
            "labels": {"sparkprov.role": "server", "sparkprov.deployment": "nat"}}


def run(samples, cfg=CFG, state=None):
    state = state or g.new_state()
    out = []
    for s in samples:
        state, actions, events = g.decide(state, s, cfg)
        out.append((actions, events))
    return state, out


def test_memory_under_the_floor_three_samples_in_a_row_stops_then_restarts_once_clear():
    # the floor is 5% of MemTotal, 6.05 GiB: 7.0 GiB held (MiaAI-Lab PR#54's false alarm) is no breach
    held = [{"t": 100 + 5 * i, "mem": mem(7.0), "containers": [rank0()]} for i in range(6)]
    _, out = run(held)
    assert all(a == [] and e == [] for a, e in out)
    # 2.3 GiB available (Surfer11May's Spark near exhaustion): the third sample acts
    low = [{"t": 200 + 5 * i, "mem": mem(2.3), "containers": [rank0()]} for i in range(3)]
    state, out = run(low)
    assert out[0] == ([], []) and out[1] == ([], [])
    actions, events = out[2]
    assert actions == [("stop", ["sparkprov-nat-rank0"])]
    (e,) = events
    assert e["kind"] == "memory" and "2.30 GiB" in e["reading"] and "6.05 GiB" in e["threshold"]
    assert e["action"] == "stopped sparkprov-nat-rank0" and state["held"]["sparkprov-nat-rank0"]["kind"] == "memory"
    # still low, container stopped: nothing more; memory back but only 1.4x the floor: no restart
    stopped = rank0(status="exited", health=None, live="none")
    state, out = run([{"t": 215, "mem": mem(2.0), "containers": [stopped]},
                      {"t": 260, "mem": mem(8.0), "containers": [stopped]}], state=state)
    assert out == [([], []), ([], [])]
    # clear (1.5 x floor) three samples in a row, and restart_after_s passed: started again
    state, out = run([{"t": 270 + 5 * i, "mem": mem(20.0), "containers": [stopped]} for i in range(3)], state=state)
    assert out[2][0] == [("start", ["sparkprov-nat-rank0"])] and out[2][1][0]["kind"] == "restart"
    assert state["held"] == {}


def test_an_nvrm_line_stops_at_once_and_a_non_fatal_xid_is_only_recorded():
    nv = g.classify_kernel_line(NVRM_1358)
    state, out = run([{"t": 10, "mem": mem(22.5), "kernel": [nv], "containers": [rank0()]}])
    (actions, events), = out
    assert actions == [("stop", ["sparkprov-nat-rank0"])] and events[0]["kind"] == "nvrm"
    assert events[0]["reading"] == NVRM_1358 and events[0]["threshold"] == "any NVRM memory error"
    x13 = g.classify_kernel_line(XID_13)
    _, out = run([{"t": 10, "mem": mem(50), "kernel": [x13], "containers": [rank0()]}])
    assert out[0][0] == [] and out[0][1][0]["kind"] == "xid" and out[0][1][0]["action"] == "none"
    x119 = g.classify_kernel_line(XID_GB10.splitlines()[0])
    _, out = run([{"t": 10, "mem": mem(50), "kernel": [x119], "containers": [rank0()]}])
    assert out[0][0] == [("stop", ["sparkprov-nat-rank0"])]


def test_liveness_only_a_hang_counts_and_only_twice_in_a_row():
    hung = rank0(live=None)          # /health 200, no answer within the timeout
    failing = rank0(live=500)        # answers, with an error: the supervisor's case, not a hang
    starting = rank0(health=503, live="none")
    _, out = run([{"t": t, "mem": mem(50), "containers": [c]} for t, c in
                  ((0, failing), (5, failing), (10, starting), (15, hung), (30, rank0()), (35, hung))])
    assert all(a == [] for a, _ in out)
    _, out = run([{"t": 0, "mem": mem(50), "containers": [hung]}, {"t": 15, "mem": mem(50), "containers": [hung]}])
    assert out[1][0] == [("stop", ["sparkprov-nat-rank0"])] and out[1][1][0]["kind"] == "liveness"


def test_the_gateway_is_never_stopped_and_act_false_records_only():
    gw = {**rank0(name="sparkprov-gateway"), "labels": {"sparkprov.role": "gateway"}}
    nv = g.classify_kernel_line(NVRM_1358)
    _, out = run([{"t": 0, "mem": mem(50), "kernel": [nv], "containers": [gw, rank0()]}])
    assert out[0][0] == [("stop", ["sparkprov-nat-rank0"])]
    state, out = run([{"t": 0, "mem": mem(50), "kernel": [nv], "containers": [rank0()]}], cfg={**CFG, "act": False})
    assert out[0][0] == [] and out[0][1][0]["action"] == "none (act: false)" and state["held"] == {}


def test_crash_loop_breaker_on_dockers_restarts_and_on_its_own():
    # docker's policy restarting one container 5 times within 15 min (eugr/spark-vllm-docker#257 looped 35)
    cfg = {**CFG, "breaker_restarts": 5, "breaker_window_s": 900}
    samples = [{"t": 60 * i, "mem": mem(50), "containers": [rank0(restarts=i)]} for i in range(6)]
    state, out = run(samples, cfg)
    assert out[4][0] == [] and out[5][0] == [("stop", ["sparkprov-nat-rank0"])]
    assert out[5][1][0]["kind"] == "crash-loop" and "will not start it again" in out[5][1][0]["action"]
    assert state["breaker"] and "5 times" in state["breaker"]
    stopped = rank0(status="exited", health=None, live="none", restarts=5)
    state, out = run([{"t": 400 + 5 * i, "mem": mem(50), "containers": [stopped]} for i in range(10)], cfg, state)
    assert all(a == [] for a, _ in out)   # held, breaker open: never started
    # the user starts it again (cluster-up): no longer held, the breaker closes
    state, _ = run([{"t": 500, "mem": mem(50), "containers": [rank0(restarts=5)]}], cfg, state)
    assert state["held"] == {} and state["breaker"] is None
    # the guard's own restarts: an NVRM line after every restart; the sixth time it stops restarting
    nv = g.classify_kernel_line(NVRM_1358)
    state, t, starts = g.new_state(), 1000, 0
    breaker = None
    for _ in range(6):
        state, actions, _ = g.decide(state, {"t": t, "mem": mem(50), "kernel": [nv], "containers": [rank0()]}, cfg)
        assert actions == [("stop", ["sparkprov-nat-rank0"])]
        for _ in range(3):
            t += 10
            state, actions, events = g.decide(state, {"t": t, "mem": mem(50), "containers": [rank0(status="exited")]}, cfg)
            starts += actions == [("start", ["sparkprov-nat-rank0"])]
            breaker = next((e for e in events if e["kind"] == "breaker"), breaker)
        t += 10
    assert starts == 5 and breaker and "stopped restarting" in breaker["action"]


def test_metrics_text():
    doc = {"sample": {"t": 1700000000.0, "mem": mem(7.0), "gpu": {"temperature_c": 58.0, "power_w": None},
                      "containers": [rank0()]}, "mem_floor_bytes": int(TOTAL * 0.05), "held": {}, "breaker": None}
    text = g.render_metrics(doc, {"memory": 2, "restart": 1})
    assert f"sparkprov_guard_mem_available_bytes {7 * GIB}" in text
    assert "sparkprov_guard_last_sample_timestamp_seconds 1700000000\n" in text
    assert "sparkprov_guard_gpu_temperature_celsius 58" in text and "power_watts" not in text
    assert 'sparkprov_guard_liveness_ok{container="sparkprov-nat-rank0"} 1' in text
    assert 'sparkprov_guard_events_total{kind="memory"} 2' in text
    assert text.count("# TYPE sparkprov_guard_events_total counter") == 1
    assert f"sparkprov_guard_swap_used_bytes {GIB}" in text


# -- the fact and the summary status prints -------------------------------------------------

def test_guard_state_fact_and_summary():
    state = {"pid": 4242, "sample": {"t": 1000.0, "mem": mem(2.3), "gpu": {"temperature_c": 40.0}},
             "mem_floor_bytes": int(TOTAL * 0.05), "held": {"sparkprov-nat-rank0": {"since": 990, "kind": "memory"}},
             "breaker": None}
    ev = {"time": "2026-11-25T17:00:00Z", "epoch": 990, "kind": "memory", "reading": "MemAvailable 2.30 GiB",
          "threshold": "6.05 GiB", "action": "stopped sparkprov-nat-rank0"}
    out = f"now=1010\ninstalled=1\nsystemd=0\nrunning=4242\n@state\n{json.dumps(state)}\n@events\n{json.dumps(ev)}\n"
    fact = parse_guard_state(out)
    s = guard_summary(fact)
    assert s["running"] and s["acted"] and s["last_sample_age_s"] == 10 and s["started_by"] == "boot"
    assert s["problems"] == ["the guard stopped sparkprov-nat-rank0 (memory): MemAvailable 2.30 GiB (threshold 6.05 GiB)"]
    assert exit_code({"spark2": s}, 0) == 2 and exit_code({"spark2": s}, 4) == 4
    assert "guard on spark2: running (pid 4242, boot)" in describe("spark2", s)
    assert event_line(fleet_events({"spark2": s})[0]).endswith("-> stopped sparkprov-nat-rank0")
    # installed, but its pid gone and its last sample old: not running, exit 2
    dead = guard_summary(parse_guard_state(out.replace("running=4242", "running=").replace("now=1010", "now=2000")))
    assert not dead["running"] and "not running" in dead["problems"][0]
    # never installed: shown, not failed; a half-written state file reads as none
    none = guard_summary(parse_guard_state("now=5\ninstalled=0\nsystemd=1\nrunning=\n@state\n{\"pid\n@events\n"))
    assert none["problems"] == [] and exit_code({"h": none}, 0) == 0
    assert "not installed" in describe("h", none)
    assert "guard.py" in GuardState(**g.paths()).command(None)


# -- the module -----------------------------------------------------------------------------

def ctx(vars=None, check=False):
    return HostContext("spark1", vars or {}, {"user": "nvidia", "home": "/home/nvidia"}, check=check,
                       exports={"spark1": {}}, play_hosts=["spark1"], become=True)


def absent():
    return {"exists": False}


def present(data: bytes, mode: int) -> dict:
    import hashlib
    return {"exists": True, "type": "file", "mode": mode, "owner": "root", "group": "root", "size": len(data),
            "content": data, "sha256": hashlib.sha256(data).hexdigest()}


def plan(args, files, *, systemd, pid, vars=None):
    m = guard_module.GuardModule()
    a = m.Args.model_validate(args)
    guard_fact = {"now": 0, "installed": bool(pid), "systemd": systemd, "pid": pid, "state": None, "events": []}
    values = {GuardState(**g.paths()).key: guard_fact}
    for key, path in (("program", g.PROGRAM_PATH), ("probe", g.PROBE_PATH), ("config", g.CONFIG_PATH),
                      ("unit", guard_module.UNIT_PATH)):
        values[PathState(path, with_content=True).key] = files.get(key, absent())
    return m.plan(a, m.view(a, FactView(values, {}), ctx(vars)), ctx(vars))


def test_module_installs_a_unit_on_systemd_and_is_a_noop_when_converged():
    p = plan({}, {}, systemd=True, pid=None)
    summaries = [c.summary for c in p.changes]
    assert summaries[:4] == [f"write {g.PROGRAM_PATH}", f"write {g.PROBE_PATH}", f"write {g.CONFIG_PATH}",
                             f"write {guard_module.UNIT_PATH}"]
    assert summaries[4].startswith("start sparkprov-guard.service") and "systemctl" in p.changes[4].script
    config = json.loads(p.changes[2].diff.after)
    assert config["mem_floor_pct"] == 5.0 and config["interval_s"] == 5
    assert "ExecStart=/usr/bin/python3 /var/lib/sparkprov/guard/guard.py /etc/sparkprov/guard.json" in p.changes[3].diff.after
    s = guard_module.settings(guard_module.Args(), {})
    files = {"program": present(guard_module.program_text().encode(), 0o755),
             "probe": present(guard_module.probe.program(s["liveness_timeout_s"]).encode(), 0o644),
             "config": present(guard_module.config_text(s).encode(), 0o644),
             "unit": present(guard_module.unit_text().encode(), 0o644)}
    done = plan({}, files, systemd=True, pid=77)
    assert done.changes == [] and "pid 77" in done.msg
    # an inventory var changes the config only, then a restart; the diff shows the value
    p = plan({}, files, systemd=True, pid=77, vars={"guard_mem_floor_pct": 8})
    assert [c.summary for c in p.changes] == [f"update {g.CONFIG_PATH}", "restart sparkprov-guard.service (enabled at boot)"]
    assert '"mem_floor_pct": 8' in p.changes[0].diff.after and '"mem_floor_pct": 5.0' in p.changes[0].diff.before


def test_module_without_systemd_starts_a_process_and_bad_settings_name_their_var():
    p = plan({}, {}, systemd=False, pid=None)
    assert guard_module.UNIT_PATH not in " ".join(c.summary for c in p.changes)
    assert p.changes[-1].summary.startswith("start the guard (no systemd")
    assert "setsid -f /usr/bin/python3 /var/lib/sparkprov/guard/guard.py /etc/sparkprov/guard.json" in p.changes[-1].script
    bad = plan({}, {}, systemd=False, pid=None, vars={"guard_mem_floor_pct": 150})
    assert bad.failed and "inventory var guard_mem_floor_pct" in bad.failed and "150" in bad.failed
    assert "guard argument port" in plan({"port": 0}, {}, systemd=False, pid=None).failed


@pytest.mark.parametrize("systemd", [True, False])
def test_module_absent(systemd):
    data = b"x"
    p = plan({"state": "absent"}, {"program": present(data, 0o755), "config": present(data, 0o644)}, systemd=systemd,
             pid=5)
    (c,) = p.changes
    assert g.PROGRAM_PATH in c.script and ("systemctl disable" in c.script) == systemd
    assert plan({"state": "absent"}, {}, systemd=systemd, pid=None).changes == []


# -- the kernel log reader and the lab's memory-pressure view ---------------------------------

def test_kernel_log_reads_only_what_was_appended_after_it_opened(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("[81033.194223] " + NVRM_1358 + "\n")     # before the guard started: not its business
    reader = g.KernelLog(str(log))
    assert reader.read() == []
    with log.open("a") as fh:
        fh.write("3,1764000000,81033194223,-;" + NVRM_1358 + "\n3,2,3,-;NVRM: Xid (PCI:000f:01:00): 1")
    lines = reader.read()
    assert [g.classify_kernel_line(x)["kind"] for x in lines] == ["nvrm-memory"]   # the half line waits
    with log.open("a") as fh:
        fh.write("19, pid=1, name=x\n")
    assert g.classify_kernel_line(reader.read()[0])["xid"] == 119
    log.write_text("")                                          # rotated: read from the start again
    log.write_text(OOM_4759 + "\n")
    assert [g.classify_kernel_line(x)["kind"] for x in reader.read()] == ["oom-kill"]
    assert g.KernelLog(str(tmp_path / "absent")).read() == []


def test_lab_memory_pressure_meminfo_is_a_spark_near_exhaustion():
    from sparklab.faults import pressure_meminfo

    real = "MemTotal:       24683308 kB\nMemFree:        22000000 kB\nMemAvailable:   23000000 kB\nCached:  1 kB\n"
    fake = g.parse_meminfo(pressure_meminfo(real))
    assert fake["MemTotal"] == 24683308 * 1024 and fake["Cached"] == 1024
    # 2.3 of 119 GiB available (Surfer11May's Spark, gb10-failure-outputs.md §3.3): under the 5% floor
    assert round(fake["MemAvailable"] / fake["MemTotal"], 3) == round(2.3 / 119, 3)
    assert fake["MemAvailable"] < g.mem_floor_bytes(CFG, fake)
