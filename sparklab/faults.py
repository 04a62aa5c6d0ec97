"""Faults to inject into the lab (and to clear again). The node guard's are replays of what Spark
owners measured (gb10-field-timelines.md), each with its source in its docstring, the benign ones
(NVRM noise, a page-cache flood a cache drop saves, fragmentation compaction mends) beside the
failures (memory exhausted, a stalled engine that freezes its host, a restart storm)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from . import dockerd, net, sshd
from .hosts import LabError, _record, nsexec, write_file
from .state import FABRIC_IFACES, RAIL_IFACES, STATE_DIR, host_dir


def _check_iface(iface: str) -> None:
    if iface not in FABRIC_IFACES:
        raise LabError(f"{iface!r} is not a fabric interface ({', '.join(FABRIC_IFACES)})")


def stop_sshd(host: str) -> str:
    return f"{host}: sshd " + ("stopped" if sshd.stop_sshd(host) else "was not running")


def start_sshd(host: str) -> str:
    return f"{host}: sshd " + ("started" if sshd.start_sshd(host) else "already running")


def cut_link(host: str, iface: str = "enp1s0f1np1") -> str:
    """`ip link set IFACE down` on this host's end: both ends lose carrier."""
    _check_iface(iface)
    _record(host)
    net.ip("link", "set", iface, "down", ns=host)
    return f"{host}: {iface} down"


def restore_link(host: str, iface: str = "enp1s0f1np1") -> str:
    _check_iface(iface)
    _record(host)
    net.ip("link", "set", iface, "up", ns=host)
    return f"{host}: {iface} up"


def netem_available() -> bool:
    r = subprocess.run(["modprobe", "-n", "sch_netem"], capture_output=True)
    if r.returncode == 0:
        return True
    return False


def slow_link(host: str, iface: str = "enp1s0f1np1", rate: str = "100mbit",
              delay: str | None = None) -> str:
    """Shape egress of this host's end: tbf (rate) always; netem (delay) if the kernel has it."""
    _check_iface(iface)
    _record(host)
    if delay:
        net.ip("link", "show", iface, ns=host)  # raises if the interface is missing
        p = subprocess.run(["ip", "netns", "exec", host, "tc", "qdisc", "replace", "dev", iface,
                            "root", "netem", "delay", delay, "rate", rate],
                           capture_output=True, text=True)
        if p.returncode == 0:
            return f"{host}: {iface} slowed to {rate}, +{delay} (netem)"
        raise LabError(f"netem is not available in this kernel ({p.stderr.strip()}); "
                       "use a rate limit only")
    # the bucket must hold a whole frame: tbf drops every packet larger than its burst, and the
    # rails carry 9000-byte jumbo frames (a 4 KB burst let nothing but small packets through)
    mtu = int(subprocess.run(["ip", "netns", "exec", host, "cat", f"/sys/class/net/{iface}/mtu"],
                             capture_output=True, text=True).stdout.strip() or 9000)
    p = subprocess.run(["ip", "netns", "exec", host, "tc", "qdisc", "replace", "dev", iface,
                        "root", "tbf", "rate", rate, "burst", str(max(32 * 1024, 4 * (mtu + 100))),
                        "latency", "400ms"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise LabError(f"tc tbf failed: {p.stderr.strip()}")
    return f"{host}: {iface} slowed to {rate} (tbf)"


def unslow_link(host: str, iface: str = "enp1s0f1np1") -> str:
    _check_iface(iface)
    _record(host)
    subprocess.run(["ip", "netns", "exec", host, "tc", "qdisc", "del", "dev", iface, "root"],
                   capture_output=True)
    return f"{host}: {iface} shaping removed"


# One rail throttled, as a degraded ConnectX-7 link looks to a measurement: the link up, its MTU and
# addresses as provisioned, far less carried than a healthy rail (13.23 Gb/s on a 200G link whose
# healthy twins carry 92-97: NVIDIA/dgx-spark-playbooks PR#108, gb10-failure-outputs.md §4.5, §4.8):
# tbf on the host's egress of that rail, at 100 Mbit/s, a tenth of the lab's floor (LAB_RAIL_VARS) as
# PR#108's figure is under a Spark's. The peer's direction of the rail stays as it was.
RAIL_SLOW_RATE = "100mbit"


def rail_slow(host: str, iface: str = RAIL_IFACES[1]) -> str:
    if iface not in RAIL_IFACES.values():
        raise LabError(f"{iface!r} is not a cabled rail ({', '.join(RAIL_IFACES.values())})")
    out = slow_link(host, iface, RAIL_SLOW_RATE)
    _save_slow_rails(host, {**slow_rails(host), iface: RAIL_SLOW_RATE})
    return out


def clear_rail_slow(host: str, iface: str = RAIL_IFACES[1]) -> str:
    _save_slow_rails(host, {k: v for k, v in slow_rails(host).items() if k != iface})
    return unslow_link(host, iface)


# A degraded link is the cable's or the port's: a power cycle does not mend it. The lab keeps the
# throttled rails outside the host (its state dir) and the boot throttles them again once the
# fabric is configured, before the node guard starts (sparklab/boot.py), as the link would come back.
def _slow_rails_path(host: str) -> Path:
    return host_dir(host) / "slow-rails.json"


def slow_rails(host: str) -> dict[str, str]:
    try:
        return json.loads(_slow_rails_path(host).read_text())
    except (OSError, ValueError):
        return {}


def _save_slow_rails(host: str, rails: dict[str, str]) -> None:
    path = _slow_rails_path(host)
    if rails:
        path.write_text(json.dumps(rails))
    else:
        path.unlink(missing_ok=True)


def slow_rails_again(host: str) -> list[str]:
    """At boot: the rails `rail-slow` throttled, throttled again (tc's qdisc went with the power)."""
    return [slow_link(host, iface, rate) for iface, rate in sorted(slow_rails(host).items())]


def kill_dockerd(host: str) -> str:
    """SIGKILL the host's dockerd (as a crash would); `lab.up` or start_dockerd restarts it.

    Not a reboot: the containers live on under their shims, and a dockerd started again (no
    live-restore) shuts them down (Exited (137)) and does not restart them, whatever their
    restart policy (docker 20.10's restore). Use `reboot` for a power cycle."""
    return f"{host}: dockerd " + ("killed" if dockerd.stop_dockerd(host, sig="KILL", wait=5)
                                  else "was not running")


def start_dockerd(host: str) -> str:
    return f"{host}: dockerd " + ("started" if dockerd.start_dockerd(host)
                                  else "already running")


def reset_mtu(host: str, iface: str = "enp1s0f1np1", mtu: int = 1500) -> str:
    _check_iface(iface)
    _record(host)
    net.ip("link", "set", iface, "mtu", str(mtu), ns=host)
    return f"{host}: {iface} mtu {mtu}"


# -- the node guard's faults (sparkprov/node/guard.py), each as a Spark shows it ------------------

# What a Spark near exhaustion showed: 2.3 GiB available of 119 GiB (1.9%), 965 MiB free, swap in
# use (gb10-failure-outputs.md §3.3, Surfer11May/DwemerA4Skyrim3_AI_Spark latest_errors.md).
PRESSURE_AVAILABLE = 2.3 / 119
PRESSURE_FREE = 0.965 / 119
# The line the kernel printed on a GB10 under unified-memory pressure, verbatim
# (gb10-failure-outputs.md §1.1: vllm-project/vllm PR#41834, dmesg at [81033.194223]; the same
# line in NVIDIA/open-gpu-kernel-modules#1358 and NVIDIA/dgx-spark-playbooks#97), written as the
# /dev/kmsg record the kernel makes of it (priority 3, its timestamp in microseconds).
NVRM_LINE = ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) "
             "returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359")
NVRM_RECORD = "3,{seq},81033194223,-;" + NVRM_LINE


def parse_meminfo_text(text: str) -> dict[str, int]:
    from sparkprov.node.readings import parse_meminfo
    return parse_meminfo(text)


def pressure_meminfo(real: str) -> str:
    """The host's /proc/meminfo with MemAvailable and MemFree at what a Spark near exhaustion showed."""
    total = parse_meminfo_text(real)["MemTotal"] // 1024
    want = {"MemAvailable": int(total * PRESSURE_AVAILABLE), "MemFree": int(total * PRESSURE_FREE)}
    out = []
    for line in real.splitlines():
        key = line.split(":", 1)[0]
        out.append(f"{key + ':':<16}{want[key]:>8} kB" if key in want else line)
    return "\n".join(out) + "\n"


def memory_pressure(host: str) -> str:
    """Memory exhausted, as a Spark near exhaustion showed it: the host's /proc/meminfo (its stand-in,
    sparklab/replay.py; containers keep theirs: the engine is not starved, only the host reads low)
    reads MemAvailable 1.9% and MemFree 0.8% of MemTotal, with nothing a cache drop could give back."""
    from . import replay
    _record(host)
    replay.mount_over(host, replay.MEMINFO, pressure_meminfo(replay.BASELINE[replay.MEMINFO]))
    m = parse_meminfo_text(nsexec(host, ["cat", "/proc/meminfo"]).stdout)
    return f"{host}: /proc/meminfo reads MemFree {m['MemFree'] / 2**30:.2f} GiB, MemAvailable {m['MemAvailable'] / 2**30:.2f} GiB"


def clear_memory_pressure(host: str) -> str:
    from . import replay
    _record(host)
    replay.restore(host, replay.MEMINFO)
    return f"{host}: /proc/meminfo reads a healthy Spark's again"


def nvrm(host: str) -> str:
    """An NVRM memory error in the host's kernel log (its /dev/kmsg: lab/hosts.py), as a GB10 printed it."""
    _record(host)
    seq = int(time.time())
    nsexec(host, ["sh", "-c", "cat >> /dev/kmsg"], input=NVRM_RECORD.format(seq=seq) + "\n")
    return f"{host}: kernel log: {NVRM_LINE}"


def nvrm_noise(host: str, count: int = 16, seconds: float = 1.0) -> str:
    """NV_ERR_NO_MEMORY lines as healthy Sparks log them (the guard records them, stops nothing):
    vllm-project/vllm#56824: 16 lines in one second at rest on a host that served on (the default),
    and one per engine start that reached KV sizing; vllm#54200: 75 lines within one start that went
    on (count 75 over a start's seconds). The line is the one owners logged, verbatim."""
    _record(host)
    from .replay import NVRM_LINE, write_kmsg
    write_kmsg(host, [NVRM_LINE] * count, seconds)
    return f"{host}: kernel log: {count} x {NVRM_LINE[:40]}... over {seconds:g}s"


def clear_nvrm(host: str) -> str:
    _record(host)
    return (f"{host}: nothing to clear: a kernel log keeps its lines; the guard reads each once and "
            "starts serving again when memory allows")


def _hang_file(host: str) -> Path:
    return STATE_DIR / f"hang-{host}.json"


def _engine_cores(host: str) -> list[int]:
    ids = nsexec(host, ["docker", "ps", "-q", "--filter", "label=sparkprov.managed=1"]).stdout.split()
    if not ids:
        return []
    roots = {int(p) for p in nsexec(host, ["docker", "inspect", "-f", "{{.State.Pid}}", *ids]).stdout.split()
             if p.isdigit() and p != "0"}
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) if d.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(d))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            title = ""
        if "EngineCore" in title:
            found.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(found)


def hang(host: str) -> str:
    """The engine's generation stalls while /health stays 200: SIGSTOP of the real vLLM's EngineCore
    process(es) in the host's serving containers (the API server keeps answering /health)."""
    _record(host)
    pids = _engine_cores(host)
    if not pids:
        raise LabError(f"{host}: no VLLM::EngineCore process in a sparkprov container (the engine core "
                       "runs on rank 0's node)")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    _hang_file(host).write_text(json.dumps(pids))
    return f"{host}: EngineCore stopped (SIGSTOP): pid {', '.join(map(str, pids))}"


def clear_hang(host: str) -> str:
    _record(host)
    f = _hang_file(host)
    pids = json.loads(f.read_text()) if f.exists() else []
    resumed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
            resumed.append(pid)
        except ProcessLookupError:
            pass
    f.unlink(missing_ok=True)
    return (f"{host}: EngineCore resumed (SIGCONT): pid {', '.join(map(str, resumed))}" if resumed else
            f"{host}: no stopped EngineCore left (the guard's docker stop ended it)")


def _replay_said(doc: dict) -> str:
    said = [f"{doc.get('drops', 0)} cache drop(s) and {doc.get('compactions', 0)} compaction(s) answered"]
    if doc.get("lowest_free_gib") is not None:
        said.append(f"lowest MemFree {doc['lowest_free_gib']:g} GiB")
    for s in doc.get("stalls") or []:
        gone = s.get("engine_gone_after_s")
        said.append(f"engine core {', '.join(map(str, s['stopped']))} stopped with {s.get('running') or 0:g} running: "
                    + (f"gone {gone:g}s later" if gone is not None else "still there"))
    if doc.get("froze"):
        said.append(f"FROZE: {doc['froze']['why']}")
    return "; ".join(said)


def page_cache_flood(host: str, seconds: float = 60.0) -> str:
    """A load's page-cache flood, as a Spark shows it (sparklab/replay.py page_cache_flood: vllm#54200's
    collapse, MemAvailable over 22 GiB throughout); a cache drop saves it, nothing else does."""
    from . import replay
    replay.start("page-cache-flood", host, seconds=seconds)
    return f"{host}: /proc/meminfo and /proc/buddyinfo replay a load's page-cache flood for {seconds:g}s"


def clear_page_cache_flood(host: str) -> str:
    from . import replay
    doc = replay.stop("page-cache-flood", host, restore_files=(replay.MEMINFO, replay.BUDDYINFO))
    return f"{host}: page-cache flood cleared ({_replay_said(doc)})"


def no_hugeblocks(host: str, stuck: bool = False) -> str:
    """No free block of 4 MiB or more (MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks#23's serving nodes); a
    compaction brings them back, unless `stuck` (FujitsuPolycom/sparkring#173)."""
    from . import replay
    replay.start("no-hugeblocks", host, stuck=stuck)
    return f"{host}: /proc/buddyinfo shows no free block of 4 MiB or more" + (" (compaction will not help)" if stuck else "")


def clear_no_hugeblocks(host: str) -> str:
    from . import replay
    doc = replay.stop("no-hugeblocks", host, restore_files=(replay.BUDDYINFO,))
    return f"{host}: buddyinfo is the kernel's again ({_replay_said(doc)})"


def stall(host: str) -> str:
    """The engine stalls while requests run (NVIDIA/open-gpu-kernel-modules#1358): requests kept
    running against the host's real engine, its core SIGSTOPped (its counters on /metrics stop,
    /health stays 200); 5 s later, unless something stopped the engine, the host freezes (its sshd
    and its guard stopped) until `clear-stall`."""
    from . import replay
    replay.start("stall", host)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        doc = replay.read_record(host, "stall")
        if doc.get("stalls"):
            s = doc["stalls"][0]
            return (f"{host}: EngineCore stopped (SIGSTOP) with {s.get('running') or 0:g} request(s) running: "
                    f"pid {', '.join(map(str, s['stopped']))}")
        if doc.get("ended"):
            break
        time.sleep(0.2)
    replay.stop("stall", host)
    raise LabError(f"{host}: no engine serving requests to stall (is a deployment serving on {host}?)")


def _continue_stalled(doc: dict) -> None:
    """SIGCONT every engine process a stall replay stopped (one the guard removed is gone already)."""
    for s in doc.get("stalls") or []:
        for pid in s["stopped"]:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def clear_stall(host: str) -> str:
    from . import replay
    doc = replay.stop("stall", host)
    _continue_stalled(doc)
    return f"{host}: stall cleared ({_replay_said(doc)})"


def restart_storm(host: str) -> str:
    """eugr/spark-vllm-docker#257: an engine that fails again after every restart: the stall above,
    each time the host's engine serves again, until `clear-restart-storm`."""
    from . import replay
    replay.start("restart-storm", host)
    return f"{host}: the engine stalls each time it serves again"


def clear_restart_storm(host: str) -> str:
    from . import replay
    doc = replay.stop("restart-storm", host)
    _continue_stalled(doc)
    return f"{host}: restart storm cleared after {len(doc.get('stalls') or [])} stall(s) ({_replay_said(doc)})"


# The kernel an NVIDIA system update brought, after which NCCL failed at start on two Sparks
# (eugr/spark-vllm-docker#392; sparkprov/modules/drift.py KNOWN_BAD); the host reports it from
# /proc/sys/kernel/osrelease (what `uname -r` says), a file bind-mounted over it in its mount namespace.
UPDATED_KERNEL = "7.0.0-1019-nvidia"
OSRELEASE = "/proc/sys/kernel/osrelease"
OSRELEASE_FILE = "/var/lib/sparklab/osrelease"


def _mounted(host: str, path: str) -> bool:
    r = nsexec(host, ["sh", "-c", f"grep -c ' {path} ' /proc/self/mounts || true"], check=False)
    return (r.stdout.strip() or "0") != "0"


def kernel_update(host: str) -> str:
    """One host reports another kernel, as after an OS update on that node alone."""
    _record(host)
    if not _mounted(host, OSRELEASE):
        write_file(host, OSRELEASE_FILE, UPDATED_KERNEL + "\n")
        nsexec(host, ["mount", "--bind", OSRELEASE_FILE, OSRELEASE])
    return f"{host}: kernel {nsexec(host, ['cat', OSRELEASE]).stdout.strip()}"


def clear_kernel_update(host: str) -> str:
    _record(host)
    while _mounted(host, OSRELEASE):
        nsexec(host, ["umount", OSRELEASE])
    return f"{host}: kernel {nsexec(host, ['cat', OSRELEASE]).stdout.strip()} (the machine's)"


ACTIONS = {
    "stop-sshd": lambda h, **k: stop_sshd(h),
    "start-sshd": lambda h, **k: start_sshd(h),
    "cut-link": lambda h, iface, **k: cut_link(h, iface),
    "restore-link": lambda h, iface, **k: restore_link(h, iface),
    "slow-link": lambda h, iface, rate, delay, **k: slow_link(h, iface, rate, delay),
    "unslow-link": lambda h, iface, **k: unslow_link(h, iface),
    "kill-dockerd": lambda h, **k: kill_dockerd(h),
    "start-dockerd": lambda h, **k: start_dockerd(h),
    "reset-mtu": lambda h, iface, mtu, **k: reset_mtu(h, iface, mtu),
    "reboot": lambda h, **k: reboot(h),
    "memory-pressure": lambda h, **k: memory_pressure(h),
    "clear-memory-pressure": lambda h, **k: clear_memory_pressure(h),
    "nvrm": lambda h, **k: nvrm(h),
    "clear-nvrm": lambda h, **k: clear_nvrm(h),
    "hang": lambda h, **k: hang(h),
    "clear-hang": lambda h, **k: clear_hang(h),
    "nvrm-noise": lambda h, count=16, seconds=1.0, **k: nvrm_noise(h, count, seconds),
    "page-cache-flood": lambda h, seconds=60.0, **k: page_cache_flood(h, seconds),
    "clear-page-cache-flood": lambda h, **k: clear_page_cache_flood(h),
    "no-hugeblocks": lambda h, stuck=False, **k: no_hugeblocks(h, stuck),
    "clear-no-hugeblocks": lambda h, **k: clear_no_hugeblocks(h),
    "stall": lambda h, **k: stall(h),
    "clear-stall": lambda h, **k: clear_stall(h),
    "restart-storm": lambda h, **k: restart_storm(h),
    "clear-restart-storm": lambda h, **k: clear_restart_storm(h),
    "rail-slow": lambda h, iface, **k: rail_slow(h, iface),
    "clear-rail-slow": lambda h, iface, **k: clear_rail_slow(h, iface),
    "kernel-update": lambda h, **k: kernel_update(h),
    "clear-kernel-update": lambda h, **k: clear_kernel_update(h),
}


def reboot(host: str, down_seconds: float = 2.0) -> str:
    """Power-cycle the host: every process killed, live network settings reset, then booted
    from what is persisted (netplan, sshd, dockerd; containers by their restart policy).
    See sparklab.boot."""
    from . import boot
    return boot.describe(host, boot.reboot(host, down_seconds))


def apply(action: str, host: str, *, iface: str = "enp1s0f1np1", rate: str = "100mbit",
          delay: str | None = None, mtu: int = 1500, **more) -> str:
    """Run one fault action by name (see ACTIONS); returns what it did. `more`: count, seconds,
    stuck (the replays')."""
    if action not in ACTIONS:
        raise LabError(f"unknown fault {action!r}; one of {', '.join(sorted(ACTIONS))}")
    return ACTIONS[action](host, iface=iface, rate=rate, delay=delay, mtu=mtu,
                           **{k: v for k, v in more.items() if v is not None})
