"""The node guard's readings (sparkprov/node/readings.py, docker.py) on real captured GB10 output (each
source named; /work/shared/reference/gb10-failure-outputs.md holds them), its /metrics text, the fact
that reads it (facts/guard.py) and the modules that install and resume it (modules/guard.py,
guard_resume.py), planned from literal facts. Its decisions: tests/unit/test_guard_decide.py."""

from __future__ import annotations

import json

import pytest

from sparkprov.facts.files import PathState
from sparkprov.facts.guard import GuardState, describe, event_line, exit_code, fleet_events, guard_summary, parse_guard_state
from sparkprov.facts.hardware import parse_meminfo as fact_parse_meminfo
from sparkprov.modules import guard as guard_module
from sparkprov.modules import guard_resume
from sparkprov.modules.base import FactView, HostContext
from sparkprov.node import guard as g
from sparkprov.node import readings as r
from sparkprov.node.docker import epoch, summarize
from sparkprov.node.metrics import render_metrics
from sparkprov.node.settings import DEFAULTS

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
    return [k["kind"] for k in map(r.classify_kernel_line, text.splitlines()) if k]


def test_nvrm_memory_errors_are_read_in_every_captured_form():
    assert kinds(NVRM_1358) == ["nvrm-memory"]
    assert kinds(NVRM_1358.removeprefix("NVRM: ")) == ["nvrm-memory"]  # vllm#56824 quotes it without the prefix
    assert kinds(DMESG_41834) == ["nvrm-memory", "nvrm-memory"]          # journald's pressure line is not one
    assert kinds(WRAPPED_116) == ["nvrm-memory", "nvrm-memory"]          # the IOVA failure counts too
    # as /dev/kmsg hands it over: "prio,seq,usec,flags;message" (what lab.fault nvrm writes)
    rec = r.classify_kernel_line("3,1764000000,81033194223,-;" + NVRM_1358)
    assert rec == {"kind": "nvrm-memory", "line": NVRM_1358, "at_us": 81033194223}


def test_xid_and_oom_kill_lines():
    xids = [r.classify_kernel_line(line) for line in XID_GB10.splitlines()]
    assert [(x["xid"], x["device"]) for x in xids if x] == [(119, "PCI:000f:01:00"), (120, "PCI:000f:01:00")]
    assert r.classify_kernel_line(XID_13)["xid"] == 13
    oom = r.classify_kernel_line(OOM_4759)
    assert oom["kind"] == "oom-kill" and oom["pid"] == 3742074 and oom["process"] == "lmcache"
    assert r.classify_kernel_line("[81034.207309] systemd-journald[662]: Under memory pressure, flushing caches.") is None


# -- nvidia-smi and meminfo -----------------------------------------------------------------

def test_gpu_query_with_units_and_without():
    # the gpu_clocks.csv row of the "GB10 clocks cannot be locked" doc (3 GB10 nodes, 580.173.02), its
    # name column dropped as our query has none: temperature, power, SM clock, max SM clock order differs,
    # so the row is rebuilt in the guard's column order from the captured values
    assert r.parse_gpu_query("50, 15.57 W, 2522 MHz, 3003 MHz\n") == {
        "temperature_c": 50.0, "power_w": 15.57, "clock_sm_mhz": 2522.0, "clock_max_sm_mhz": 3003.0}
    # GB10 prints [N/A] for what it lacks (gb10-failure-outputs.md §2.2, power.limit and memory.total)
    assert r.parse_gpu_query("58, [N/A], 695, 3003\n") == {
        "temperature_c": 58.0, "power_w": None, "clock_sm_mhz": 695.0, "clock_max_sm_mhz": 3003.0}
    assert r.parse_gpu_query("") == dict.fromkeys(("temperature_c", "power_w", "clock_sm_mhz", "clock_max_sm_mhz"))


def test_meminfo_parse_agrees_with_the_fact_parser():
    # vllm-project/vllm#48140 (GB10, vLLM 0.24.0): MemFree=27812140 kB, MemAvailable=59063644 kB
    text = "MemTotal:       125369344 kB\nMemFree:        27812140 kB\nMemAvailable:   59063644 kB\nHugePages_Total:       0\n"
    parsed = r.parse_meminfo(text)
    assert parsed["MemAvailable"] == 59063644 * 1024 and parsed["HugePages_Total"] == 0
    assert parsed == fact_parse_meminfo(text)


# -- buddyinfo, compute processes, containers --------------------------------------------------

# /proc/buddyinfo of this lab machine (x86_64, Debian 12, 4 KiB pages), captured 2026-11-28
BUDDY_LAB = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3 
Node 0, zone    DMA32      1      1      4      2      5      4      3      3      4      2    752 
Node 0, zone   Normal   4561   4616  20001  17139   8506   9464   7623   4041   1868    847    878 
"""


def test_buddyinfo_free_blocks_of_4_mib_or_more():
    zones = r.parse_buddyinfo(BUDDY_LAB)
    assert [z["zone"] for z in zones] == ["DMA", "DMA32", "Normal"] and zones[2]["free"][0] == 4561
    order = r.order_of(4 * r.MIB, 4096)
    assert order == 10 and r.free_blocks_at_least(zones, order) == 3 + 752 + 878
    # with 64 KiB pages a 4 MiB block is order 6
    assert r.order_of(4 * r.MIB, 65536) == 6
    assert r.parse_buddyinfo("") == []


def test_compute_apps_and_the_container_of_a_pid():
    # nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits as GB10 prints it
    # (vllm-project/vllm PR#55828: the per-process figure is there while memory.total is [N/A])
    assert r.parse_compute_apps("4242, 78806\n977, [N/A]\n") == [
        {"pid": 4242, "used_bytes": 78806 * r.MIB}, {"pid": 977, "used_bytes": None}]
    cid = "8f2d1c9e0b7a6f5e4d3c2b1a09f8e7d6c5b4a3928170f6e5d4c3b2a190817263"
    # /proc/PID/cgroup: cgroup v1 (cgroupfs driver: this lab's docker 20.10), v2 with the systemd driver (a Spark)
    assert r.container_of(f"12:memory:/docker/{cid}\n0::/\n") == cid
    assert r.container_of(f"0::/system.slice/docker-{cid}.scope\n") == cid
    assert r.container_of("0::/user.slice/user-1000.slice/session-1.scope\n") is None


def test_nvml_loads_only_where_the_library_is():
    assert r.Nvml.load("libnvidia-ml-absent.so.1") is None


def test_nvml_and_nvidia_smi_agree_on_a_real_driver():
    """tests/fixtures/nvml/h200-nvml.json: the guard's NVML binding run on an H200 (its README): the
    per-process device memory it read equals what nvidia-smi printed, parsed by the guard's fallback,
    and 512 MiB allocated moved it by exactly 512 MiB. No docker cgroup there: no container."""
    from pathlib import Path

    cap = json.loads((Path(__file__).parents[1] / "fixtures" / "nvml" / "h200-nvml.json").read_text())
    assert [p for p in r.parse_compute_apps(cap["nvidia_smi_apps"]) if p["pid"] == cap["pid"]] == cap["after_512_mib"]
    assert cap["after_512_mib"][0]["used_bytes"] - cap["with_context"][0]["used_bytes"] == 512 * r.MIB
    assert r.container_of(cap["cgroup"]) is None and cap["sensors"]["clock_max_sm_mhz"] == 1980.0


def test_docker_inspect_summarized():
    # GET /containers/ID/json of docker 20.10 (the lab's), the fields the guard keeps
    doc = {"Id": "ab" * 32, "Name": "/sparkprov-nat-rank0", "RestartCount": 2,
           "State": {"Status": "running", "Pid": 4242, "StartedAt": "2026-11-28T13:01:02.123456789Z"},
           "Config": {"Labels": {"sparkprov.managed": "1", "sparkprov.port": "8000", "sparkprov.role": "rank0"}}}
    c = summarize(doc)
    assert (c["name"], c["status"], c["restarts"], c["port"], c["pid"]) == ("sparkprov-nat-rank0", "running", 2, 8000, 4242)
    assert abs(c["started"] - 1795870862.123457) < 1e-3
    assert epoch("0001-01-01T00:00:00Z") is None and epoch("2026-11-28T13:01:02+01:00") == 1795867262.0
    assert summarize({**doc, "Config": {"Labels": {"sparkprov.role": "rank"}}})["port"] is None


# -- /metrics ---------------------------------------------------------------------------------

GIB = 2**30
TOTAL = int(121.69 * GIB)


def mem(free_gib: float, avail_gib: float | None = None) -> dict:
    return {"MemTotal": TOTAL, "MemFree": int(free_gib * GIB), "MemAvailable": int((avail_gib or free_gib) * GIB),
            "SwapTotal": 16 * GIB, "SwapFree": 15 * GIB}


def test_metrics_text():
    doc = {"sample": {"t": 1700000000.0, "mem": mem(7.0, 22.5), "gpu": {"temperature_c": 58.0, "power_w": None},
                      "hugeblocks": 0, "containers": [{"name": "sparkprov-nat-rank0"}],
                      "gpu_procs": [{"pid": 4242, "used_bytes": 30 * GIB, "container_name": "sparkprov-nat-rank0"}]},
           "mem_floor_bytes": 8 * GIB, "mem_critical_bytes": 2 * GIB, "held": {}, "stood_down": {"why": "x"},
           "guard": {"engines": {"sparkprov-nat-rank0": {"quiet_s": 1.5, "last": {"running": 8.0}}},
                     "restarts": [1, 2, 3], "nvrm_lines": 16}}
    text = render_metrics(doc, {"stall": 2, "restart": 1})
    assert f"sparkprov_guard_mem_free_bytes {7 * GIB}" in text and f"sparkprov_guard_mem_floor_bytes {8 * GIB}" in text
    assert "sparkprov_guard_last_sample_timestamp_seconds 1700000000\n" in text
    assert "sparkprov_guard_gpu_temperature_celsius 58" in text and "power_watts" not in text
    assert 'sparkprov_guard_engine_quiet_seconds{container="sparkprov-nat-rank0"} 1.5' in text
    assert 'sparkprov_guard_engine_requests_running{container="sparkprov-nat-rank0"} 8' in text
    assert f'sparkprov_guard_gpu_process_memory_bytes{{pid="4242",container="sparkprov-nat-rank0"}} {30 * GIB}' in text
    assert "sparkprov_guard_stood_down 1" in text and "sparkprov_guard_restarts_in_window 3" in text
    assert "sparkprov_guard_nvrm_lines_total 16" in text and "sparkprov_guard_free_hugeblocks 0" in text
    assert 'sparkprov_guard_events_total{kind="stall"} 2' in text
    assert text.count("# TYPE sparkprov_guard_events_total counter") == 1
    assert f"sparkprov_guard_swap_used_bytes {GIB}" in text


# -- the fact and the summary status prints -------------------------------------------------

def test_guard_state_fact_and_summary():
    state = {"pid": 4242, "sample": {"t": 1000.0, "mem": mem(0.97, 2.3), "gpu": {"temperature_c": 40.0}},
             "mem_floor_bytes": 8 * GIB, "held": {"sparkprov-nat-rank0": {"since": 990, "kind": "memory"}},
             "stood_down": None, "budget": {"restarts": 3, "window_h": 6.0},
             "guard": {"restarts": [-30000, 900, 995]}}   # the first one 8.4 h ago: out of the window
    ev = {"time": "2026-11-25T17:00:00Z", "epoch": 990, "kind": "memory", "reading": "MemFree 0.97 GiB",
          "threshold": "MemFree 2 GiB for 3 samples", "action": "stopped sparkprov-nat-rank0"}
    nv = {"time": "2026-11-25T16:00:00Z", "epoch": 900, "kind": "nvrm-memory", "reading": "16 NVRM...",
          "threshold": "recorded only", "action": "none", "count": 16}
    out = (f"now=1010\ninstalled=1\nsystemd=0\nrunning=4242\n@state\n{json.dumps(state)}\n@events\n{json.dumps(nv)}\n"
           f"{json.dumps(ev)}\n")
    fact = parse_guard_state(out)
    s = guard_summary(fact)
    assert s["running"] and s["acted"] and s["last_sample_age_s"] == 10 and s["started_by"] == "boot"
    assert s["problems"] == ["the guard stopped sparkprov-nat-rank0 (memory): MemFree 0.97 GiB (threshold MemFree 2 "
                             "GiB for 3 samples)"]
    assert s["nvrm_lines"] == 16 and s["mem_free"] == int(0.97 * GIB)
    assert exit_code({"spark2": s}, 0) == 2 and exit_code({"spark2": s}, 4) == 4
    line = describe("spark2", s)
    assert "guard on spark2: running (pid 4242, boot)" in line and "MemFree 1.0 GiB (floor 8.0 GiB)" in line
    assert "16 NVRM memory line(s) recorded (not acted on); 2 of 3 restarts in 6 h" in line
    assert event_line(fleet_events({"spark2": s})[-1]).endswith("-> stopped sparkprov-nat-rank0")
    # stood down: a standing problem (exit 2) that names --resume
    down = guard_summary(parse_guard_state(out.replace('"stood_down": null', '"stood_down": {"since": 1, "why": '
                                                                                 '"3 restarts within 6 h"}')))
    assert down["problems"][-1].startswith("the guard stood down: 3 restarts within 6 h; it restarts nothing until "
                                           "`invoke guard --resume`")
    # installed, but its pid gone and its last sample old: not running, exit 2
    dead = guard_summary(parse_guard_state(out.replace("running=4242", "running=").replace("now=1010", "now=2000")))
    assert not dead["running"] and "not running" in dead["problems"][0]
    # never installed: shown, not failed; a half-written state file reads as none
    none = guard_summary(parse_guard_state("now=5\ninstalled=0\nsystemd=1\nrunning=\n@state\n{\"pid\n@events\n"))
    assert none["problems"] == [] and exit_code({"h": none}, 0) == 0
    assert "not installed" in describe("h", none)
    command = GuardState(**g.paths()).command(None)
    assert "-e guard.py -e sparkprov_node.guard" in command and g.PROGRAM_PATH in command


# -- the modules ----------------------------------------------------------------------------

def ctx(vars=None, check=False):
    return HostContext("spark1", vars or {}, {"user": "nvidia", "home": "/home/nvidia"}, check=check,
                       exports={"spark1": {}}, play_hosts=["spark1"], become=True)


def absent():
    return {"exists": False}


def present(data: bytes, mode: int = 0o644) -> dict:
    import hashlib
    return {"exists": True, "type": "file", "mode": mode, "owner": "root", "group": "root", "size": len(data),
            "content": data, "sha256": hashlib.sha256(data).hexdigest()}


def plan(args, files, *, systemd, pid, vars=None, old=()):
    """files: config, unit, and "package" (True: every file of the package as it is here)."""
    m = guard_module.GuardModule()
    a = m.Args.model_validate(args)
    guard_fact = {"now": 0, "installed": bool(pid), "systemd": systemd, "pid": pid, "state": None, "events": []}
    values = {GuardState(**g.paths()).key: guard_fact}
    for key, path in (("config", g.CONFIG_PATH), ("unit", guard_module.UNIT_PATH)):
        values[PathState(path, with_content=True).key] = files.get(key, absent())
    for path, data in guard_module.package_files().items():
        values[PathState(path).key] = present(data) if files.get("package") else absent()
    for path in g.OLD_PROGRAM_PATHS:
        values[PathState(path).key] = present(b"old") if path in old else absent()
    return m.plan(a, m.view(a, FactView(values, {}), ctx(vars)), ctx(vars))


def converged() -> dict:
    s = guard_module.settings(guard_module.Args(), {})
    return {"package": True, "config": present(guard_module.config_text(s).encode()),
            "unit": present(guard_module.unit_text().encode())}


def test_module_installs_the_package_and_a_unit_on_systemd_and_is_a_noop_when_converged():
    p = plan({}, {}, systemd=True, pid=None, old=g.OLD_PROGRAM_PATHS)
    summaries = [c.summary for c in p.changes]
    n = len(guard_module.package_files())
    assert summaries == [f"write the node package in /var/lib/sparkprov/lib/sparkprov_node ({n} file(s))",
                         f"write {g.CONFIG_PATH}", f"write {guard_module.UNIT_PATH}",
                         "remove the single-file guard of before (/var/lib/sparkprov/guard/guard.py, "
                         "/var/lib/sparkprov/guard/probe.py)", "start sparkprov-guard.service (enabled at boot)"]
    assert "/var/lib/sparkprov/lib/sparkprov_node/decide.py" in p.changes[0].script
    config = json.loads(p.changes[1].diff.after)
    assert config == DEFAULTS
    unit = p.changes[2].diff.after
    assert "Environment=PYTHONPATH=/var/lib/sparkprov/lib" in unit
    assert "ExecStart=/usr/bin/python3 -m sparkprov_node.guard /etc/sparkprov/guard.json" in unit
    done = plan({}, converged(), systemd=True, pid=77)
    assert done.changes == [] and "pid 77" in done.msg
    # an inventory var changes the config only, then a restart; the diff shows the value
    p = plan({}, converged(), systemd=True, pid=77, vars={"guard_mem_free_floor_gib": 6})
    assert [c.summary for c in p.changes] == [f"update {g.CONFIG_PATH}", "restart sparkprov-guard.service (enabled at boot)"]
    assert '"mem_free_floor_gib": 6.0' in p.changes[0].diff.after and '"mem_free_floor_gib": 8.0' in p.changes[0].diff.before


def test_module_without_systemd_starts_a_process_and_bad_settings_name_their_var():
    p = plan({}, {}, systemd=False, pid=None)
    assert guard_module.UNIT_PATH not in " ".join(c.summary for c in p.changes)
    assert p.changes[-1].summary.startswith("start the guard (no systemd")
    assert ("PYTHONPATH=/var/lib/sparkprov/lib setsid -f /usr/bin/python3 -m sparkprov_node.guard "
            "/etc/sparkprov/guard.json") in p.changes[-1].script
    bad = plan({}, {}, systemd=False, pid=None, vars={"guard_mem_free_floor_gib": 150})
    assert bad.failed == "spark1: inventory var guard_mem_free_floor_gib: 150 is out of range (fix: give a number from 0.25 to 64 (GiB))"
    assert "guard argument port" in plan({"port": 0}, {}, systemd=False, pid=None).failed
    assert "guard_restart_budget: 2.5 is not a whole number" in plan({}, {}, systemd=False, pid=None,
                                                                    vars={"guard_restart_budget": 2.5}).failed


@pytest.mark.parametrize("systemd", [True, False])
def test_module_absent(systemd):
    p = plan({"state": "absent"}, converged(), systemd=systemd, pid=5)
    (c,) = p.changes
    assert g.PROGRAM_PATH in c.script and ("systemctl disable" in c.script) == systemd
    assert plan({"state": "absent"}, {}, systemd=systemd, pid=None).changes == []


def resume_plan(state: dict | None, *, pid=77, installed=True):
    m = guard_resume.GuardResume()
    a = m.Args()
    fact = {"now": 100.0, "installed": installed, "systemd": True, "pid": pid, "state": state, "events": []}
    values = {GuardState(**g.paths()).key: fact, PathState(g.RESUME_PATH).key: absent()}
    return m.plan(a, m.view(a, FactView(values, {}), ctx()), ctx())


def test_resume_only_a_guard_that_stood_down():
    down = {"sample": {"t": 99.0}, "held": {"sparkprov-nat-rank0": {"since": 1, "kind": "stall"}},
            "stood_down": {"since": 50, "why": "3 restarts within 6 h"}}
    (c,) = resume_plan(down).changes
    assert c.summary == "resume the guard (stood down: 3 restarts within 6 h; it holds sparkprov-nat-rank0 stopped)"
    assert c.become and f"date +%s > {g.RESUME_PATH}" in c.script and "seq 60" in c.script
    assert c.diff.before == "stood down: 3 restarts within 6 h\n"
    up = resume_plan({"sample": {"t": 99.0}, "held": {}, "stood_down": None})
    assert up.changes == [] and up.msg == "the guard has not stood down: nothing to resume"
    assert "is not running" in resume_plan({**down, "sample": {"t": 1.0}}, pid=None).failed
    assert resume_plan(None, pid=None, installed=False).msg.startswith("no guard")


# -- the kernel log reader and the lab's memory-pressure view ---------------------------------

def test_kernel_log_reads_only_what_was_appended_after_it_opened(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("[81033.194223] " + NVRM_1358 + "\n")     # before the guard started: not its business
    reader = g.KernelLog(str(log))
    assert reader.read() == []
    with log.open("a") as fh:
        fh.write("3,1764000000,81033194223,-;" + NVRM_1358 + "\n3,2,3,-;NVRM: Xid (PCI:000f:01:00): 1")
    lines = reader.read()
    assert [r.classify_kernel_line(x)["kind"] for x in lines] == ["nvrm-memory"]   # the half line waits
    with log.open("a") as fh:
        fh.write("19, pid=1, name=x\n")
    assert r.classify_kernel_line(reader.read()[0])["xid"] == 119
    log.write_text("")                                          # rotated: read from the start again
    log.write_text(OOM_4759 + "\n")
    assert [r.classify_kernel_line(x)["kind"] for x in reader.read()] == ["oom-kill"]
    assert g.KernelLog(str(tmp_path / "absent")).read() == []


def test_the_lab_stand_ins_read_to_the_guard_as_the_sparks_they_replay():
    """sparklab/replay.py: what the lab's hosts read (a healthy Spark at rest), a load's page-cache
    flood at its bottom (vllm#54200: MemFree 2.5 GiB, MemAvailable over 22 GiB), and exhaustion
    (memory-pressure): the guard's own decisions on each."""
    from sparklab import faults, replay
    from sparkprov.node import decide as d

    def decide(meminfo: str, buddy: str, n: int = 1):
        state, out = d.new_state(), []
        for t in range(n):
            state, actions, events = d.decide(state, {"t": t, "mem": r.parse_meminfo(meminfo), "page_size": 4096,
                                                      "buddy": r.parse_buddyinfo(buddy), "containers": [
                                                          {"name": "x", "status": "running", "port": None,
                                                           "started": 0, "labels": {}}]}, {**DEFAULTS})
            out.append(actions)
        return out

    base = r.parse_meminfo(replay.BASELINE[replay.MEMINFO])
    assert round(base["MemTotal"] / 2**30, 2) == 121.69 and round(base["MemFree"] / 2**30, 1) == 112.0
    assert decide(replay.BASELINE[replay.MEMINFO], replay.BASELINE[replay.BUDDYINFO], 5) == [[]] * 5
    flood = replay.meminfo_text(2.5, 19.8)
    assert decide(flood, replay.BUDDY_FLOODED)[0] == [{"do": "reclaim", "drop": True, "compact": True}]
    assert decide(replay.BASELINE[replay.MEMINFO], replay.BUDDY_FRAGMENTED)[0] == [
        {"do": "reclaim", "drop": False, "compact": True}]
    pressed = faults.pressure_meminfo(replay.BASELINE[replay.MEMINFO])
    out = decide(pressed, replay.BUDDY_FRESH, 3)
    assert out[2][-1] == {"do": "stop", "names": ["x"], "grace_s": 20}
    assert "mount --bind /run/sparklab/proc-meminfo /proc/meminfo" in replay.stand_in_lines()


def test_lab_memory_pressure_meminfo_is_a_spark_near_exhaustion():
    from sparklab.faults import pressure_meminfo

    real = "MemTotal:       24683308 kB\nMemFree:        22000000 kB\nMemAvailable:   23000000 kB\nCached:  1 kB\n"
    fake = r.parse_meminfo(pressure_meminfo(real))
    assert fake["MemTotal"] == 24683308 * 1024 and fake["Cached"] == 1024
    # 2.3 of 119 GiB available (Surfer11May's Spark, gb10-failure-outputs.md §3.3)
    assert round(fake["MemAvailable"] / fake["MemTotal"], 3) == round(2.3 / 119, 3)
