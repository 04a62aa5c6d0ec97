"""The node guard: a small daemon on every Spark that stops serving before the host wedges.

Shipped as this file, run on the node as ``python3 guard.py CONFIG.json`` (standard library only:
it must run on a bare Spark's python3, like the rank supervisor, serving/supervise.py). Installed
by the `guard` module (sparkprov/modules/guard.py): a systemd unit on a Spark, a process started at
boot on the lab's simulated Sparks. Every `interval_s` it samples:

* MemAvailable, MemTotal, swap (/proc/meminfo): on GB10 the only place free memory can be read;
* the kernel log, read incrementally (/dev/kmsg, or any file given as `kernel_log`): NVRM memory
  errors (NV_ERR_NO_MEMORY, the IOVA mapping failure), Xid, the OOM killer;
* GPU temperature, power and SM clock (nvidia-smi --query-gpu);
* each local deployment's liveness: the status probe of sparkprov/facts/probe.py (one generated
  token per serving container), handed to this program as `probe_program` by the module.

A breach stops the node's serving containers (``docker stop`` of the containers labelled
sparkprov.managed=1, the gateway excepted) and appends the event (time, reading, threshold, action)
to a JSON-lines journal. Once the cause is gone it starts what it stopped, and a crash-loop breaker
stops it restarting (its own restarts, or docker's restart policy) after `breaker_restarts` within
`breaker_window_s`. It serves its last sample and its events at /metrics (Prometheus text format)
on loopback and the fabric addresses.

After a boot it has not seen (boot_is_new) it qualifies the fabric rails again, in a thread so that
sampling goes on: provision's own ib_write_bw measurement (left in the qualification record by the
fabric_qualify module) run as the login user over the mesh SSH, a peer still booting waited for with
backoff; the record rewritten with each rail judged against the same floor, so cluster-up's preflight
refuses a multi-node start over a rail that came back degraded, and a `rail-degraded` event journaled
with the fix.

Everything that decides is a pure function below (parse_*, classify_kernel_line, decide,
render_metrics), tested on literal samples and on real captured failure output.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Where things live on the node (root's). /var/lib persists across reboots (the journal must),
# /run does not (the pid file must not).
PROGRAM_PATH = "/var/lib/sparkprov/guard/guard.py"
PROBE_PATH = "/var/lib/sparkprov/guard/probe.py"
CONFIG_PATH = "/etc/sparkprov/guard.json"
JOURNAL_PATH = "/var/lib/sparkprov/guard/events.jsonl"
STATE_PATH = "/var/lib/sparkprov/guard/state.json"
PIDFILE = "/run/sparkprov-guard.pid"
LOG_PATH = "/var/log/sparkprov-guard.log"
UNIT_NAME = "sparkprov-guard.service"
# The fabric qualification provision records (sparkprov/facts/rail.py QUAL_PATH): served at /metrics.
QUALIFICATION_PATH = "/var/lib/sparkprov/fabric/qualification.json"
BOOT_MARKER = "/run/sparkprov-guard.boot"



def paths() -> dict[str, str]:
    """Where the guard keeps what a reader needs (facts/guard.py GuardState's parameters)."""
    return {"program": PROGRAM_PATH, "pidfile": PIDFILE, "state": STATE_PATH, "journal": JOURNAL_PATH}


# The defaults, each with its source. Every key is an inventory variable `guard_<key>`.
DEFAULTS = {
    # Seconds between samples. The fastest collapse on record took MemAvailable from 34.0 to
    # 12.7 GiB in about 1.5 s (NVIDIA/dgx-spark-playbooks#116), from 29 to 2.5 GiB in 9 s
    # (vllm-project/vllm#54200): a sample every few seconds, and the kernel log for the rest.
    "interval_s": 5,
    # MemAvailable floor, percent of MemTotal (5% of a Spark's 121.7 GiB is 6.1 GiB). A Spark held
    # 7.0 GiB available for minutes with no NV_ERR_NO_MEMORY (MiaAI-Lab PR#54: a guard on MemFree
    # stopped it for nothing), and one near exhaustion showed 2.3 GiB available with swap in use
    # (gb10-failure-outputs.md §3.3). MemAvailable, never MemFree: the page cache holds memory the
    # kernel gives back (seed 001 §6, "OOM with free RAM still showing").
    "mem_floor_pct": 5.0,
    # Samples in a row under the floor before acting: one low reading during a load is normal.
    "mem_samples": 3,
    # Restart only once MemAvailable is this many times the floor, this many samples in a row.
    "mem_clear_factor": 1.5,
    "mem_clear_samples": 3,
    # One generated token (the probe's liveness) must come within this many seconds; this many
    # failures in a row with /health 200 is a hung engine (vllm-project/vllm#31588: /health and
    # /metrics 200 while completions hang). Shorter than the rank supervisor's 2 x 15 s, so the
    # guard, which says why, acts first; a request queued behind a full batch of lab-tiny or a
    # Spark model gets its first token well within it (docs/real-vllm.md).
    "liveness_timeout_s": 10,
    "liveness_failures": 2,
    # Seconds after a stop before the guard starts the containers again (the cause permitting).
    "restart_after_s": 20,
    # The crash-loop breaker: restart_policy looping about 35 times leaked unified memory until
    # sshd died and a power cycle was needed (eugr/spark-vllm-docker#257). After this many
    # restarts within the window (the guard's own, or one container's under docker's policy) the
    # guard stops restarting, stops the container, and says so. 10: well before #257's 35, and
    # above what one recovery of a multi-node group costs (a rank restarts once or twice when its
    # peer goes and comes back, docs/real-vllm.md), so a few recoveries in a row do not trip it.
    "breaker_restarts": 10,
    "breaker_window_s": 1800,
    # Xid codes that mean the GPU needs a reset (NVIDIA's Xid catalog; 119/120/154 before a GB10
    # reboot, gb10-failure-outputs.md §1.3): serving stops. Other Xids are recorded only.
    "fatal_xids": [48, 79, 119, 120, 154],
    # /metrics port, on loopback and on the fabric interfaces' addresses.
    "port": 9410,
    "fabric_ifaces": ["enp1s0f0np0", "enp1s0f1np1", "enP2p1s0f0np0", "enP2p1s0f1np1"],
    "act": True,        # False: record breaches, stop nothing (a dry run on a node)
    "meminfo": "/proc/meminfo",
    "kernel_log": "/dev/kmsg",
    "nvidia_smi": "nvidia-smi",
    "probe_program": PROBE_PATH,
    "qualification": QUALIFICATION_PATH,
    # After a boot the guard measures every rail of the record again (in a thread: sampling goes on).
    # A peer that is still booting does not answer the mesh SSH yet: the guard tries again, waiting
    # `requalify_backoff_s`, doubled each time up to a minute, for at most `requalify_wait_s` (a
    # Spark boots in minutes; a peer still down then is reported, as a rail that carries nothing).
    "requalify_wait_s": 600,
    "requalify_backoff_s": 5,
    # What tells a boot: the kernel's boot id, and a marker in /run (a tmpfs: empty after every
    # boot; the lab's simulated Sparks share one kernel, so the marker alone tells their boots apart).
    "boot_id": "/proc/sys/kernel/random/boot_id",
    "boot_marker": BOOT_MARKER,
    "journal": JOURNAL_PATH,
    "state": STATE_PATH,
}

GIB = 2**30
GPU_QUERY = "temperature.gpu,power.draw,clocks.sm,clocks.max.sm"


# -- pure: parsers ---------------------------------------------------------------------------

def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo in bytes ("MemAvailable:   59063644 kB")."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        words = rest.split()
        if not sep or not words or not words[0].isdigit():
            continue
        out[key.strip()] = int(words[0]) * (1024 if len(words) > 1 and words[1] == "kB" else 1)
    return out


_NVRM_MEMORY = re.compile(r"NV_ERR_NO_MEMORY|_iovaspaceCreateMappingDataFromMemDesc: failed to allocate")
_XID = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")
_OOM = re.compile(r"Out of memory: Killed process (\d+) \(([^)]*)\)")
_KMSG_PREFIX = re.compile(r"^\d+,\d+,\d+,[^;]*;")


def classify_kernel_line(line: str) -> dict | None:
    """One kernel log line (a /dev/kmsg record, dmesg or journalctl -k): what the guard reads in it,
    or None. kinds: nvrm-memory, xid (with its code), oom-kill."""
    msg = _KMSG_PREFIX.sub("", line.strip())
    if _NVRM_MEMORY.search(msg):
        return {"kind": "nvrm-memory", "line": msg[:300]}
    m = _XID.search(msg)
    if m:
        return {"kind": "xid", "xid": int(m.group(2)), "device": m.group(1), "line": msg[:300]}
    m = _OOM.search(msg)
    if m:
        return {"kind": "oom-kill", "pid": int(m.group(1)), "process": m.group(2), "line": msg[:300]}
    return None


def _number(cell: str) -> float | None:
    m = re.match(r"\s*(-?[0-9.]+)", cell)
    return float(m.group(1)) if m else None


def parse_gpu_query(text: str) -> dict[str, float | None]:
    """`nvidia-smi --query-gpu=temperature.gpu,power.draw,clocks.sm,clocks.max.sm --format=csv,noheader`
    (units or not; GB10 prints [N/A] for what it lacks): the first GPU's readings."""
    keys = ("temperature_c", "power_w", "clock_sm_mhz", "clock_max_sm_mhz")
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) >= len(keys) and not line.startswith("temperature"):
            return {k: _number(c) for k, c in zip(keys, cells)}
    return {k: None for k in keys}


# -- pure: the decision ----------------------------------------------------------------------

def new_state() -> dict:
    return {"mem_low": 0, "mem_ok": 0, "hung": {}, "held": {}, "restarts": [], "breaker": None,
            "restart_counts": {}}


def mem_floor_bytes(cfg: dict, mem: dict[str, int]) -> int:
    return int(mem.get("MemTotal", 0) * float(cfg["mem_floor_pct"]) / 100)


def serving_containers(containers: list[dict]) -> list[dict]:
    """The node's serving containers (the gateway routes and Prometheus watches: neither holds a model)."""
    return [c for c in containers if (c.get("labels") or {}).get("sparkprov.role") not in ("gateway", "monitor")]


def _event(now: float, kind: str, reading, threshold, action: str, **extra) -> dict:
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "epoch": round(now, 3), "kind": kind,
            "reading": reading, "threshold": threshold, "action": action, **extra}


def decide(state: dict, sample: dict, cfg: dict) -> tuple[dict, list[tuple[str, list[str]]], list[dict]]:
    """From the guard's state and one sample: the next state, the actions (("stop"|"start", names)),
    and the events to journal. Pure: `sample` holds time `t`, `mem` (meminfo bytes), `kernel`
    (classified lines since the last sample), `containers` (the probe's status containers)."""
    st = json.loads(json.dumps(state))
    now, mem = sample["t"], sample.get("mem") or {}
    containers = serving_containers(sample.get("containers") or [])
    running = [c["name"] for c in containers if c.get("status") == "running"]
    names = {c["name"] for c in containers}
    events: list[dict] = []
    actions: list[tuple[str, list[str]]] = []
    breaches: list[dict] = []
    to_stop: set[str] = set()

    # containers the guard holds stopped that someone removed or started again: not held any more
    for name in list(st["held"]):
        if name not in names or name in running:
            del st["held"][name]
            st["restart_counts"].pop(name, None)   # started by hand: its restarts count from now
    if not st["held"]:
        st["breaker"] = None

    # memory: MemAvailable under the floor N samples in a row
    floor = mem_floor_bytes(cfg, mem)
    avail = mem.get("MemAvailable")
    if avail is not None and floor:
        if avail < floor:
            st["mem_low"], st["mem_ok"] = st["mem_low"] + 1, 0
        else:
            st["mem_low"] = 0
            st["mem_ok"] = st["mem_ok"] + 1 if avail >= floor * float(cfg["mem_clear_factor"]) else 0
        if st["mem_low"] >= int(cfg["mem_samples"]) and (st["mem_low"] == int(cfg["mem_samples"]) or running):
            breaches.append({"kind": "memory", "reading": f"MemAvailable {avail / GIB:.2f} GiB "
                             f"({st['mem_low']} samples in a row)",
                             "threshold": f"{floor / GIB:.2f} GiB ({cfg['mem_floor_pct']:g}% of MemTotal) "
                             f"for {cfg['mem_samples']} samples"})

    # the kernel log: NVRM memory errors and fatal Xids stop serving; the rest is recorded
    for k in sample.get("kernel") or []:
        if k["kind"] == "nvrm-memory":
            breaches.append({"kind": "nvrm", "reading": k["line"], "threshold": "any NVRM memory error"})
        elif k["kind"] == "xid" and k["xid"] in cfg["fatal_xids"]:
            breaches.append({"kind": "xid", "reading": k["line"], "threshold": f"Xid in {cfg['fatal_xids']}"})
        else:
            events.append(_event(now, k["kind"], k["line"], "recorded only", "none"))

    # liveness: /health 200 but no token within the timeout, N times in a row (a hung engine)
    for c in containers:
        live, name = c.get("liveness"), c["name"]
        if c.get("status") == "running" and c.get("health") == 200 and live is not None and live.get("status") is None:
            st["hung"][name] = st["hung"].get(name, 0) + 1
        else:
            st["hung"].pop(name, None)
        if st["hung"].get(name, 0) >= int(cfg["liveness_failures"]):
            breaches.append({"kind": "liveness", "reading": f"{name}: /health 200, no token in "
                             f"{cfg['liveness_timeout_s']}s, {st['hung'][name]} times in a row ({live.get('error') or ''})"[:300],
                             "threshold": f"{cfg['liveness_failures']} x {cfg['liveness_timeout_s']}s"})

    # the crash-loop breaker on docker's restart policy: one container restarted too often
    window, limit = float(cfg["breaker_window_s"]), int(cfg["breaker_restarts"])
    for c in containers:
        seen = [p for p in st["restart_counts"].get(c["name"], []) if now - p[0] <= window]
        count = int(c.get("restarts") or 0)
        if not seen or seen[-1][1] != count:   # only the changes (the state file is written every sample)
            seen.append([now, count])
        st["restart_counts"][c["name"]] = seen
        if seen[-1][1] - seen[0][1] >= limit and c["name"] in running:
            to_stop.add(c["name"])
            st["breaker"] = f"{c['name']} restarted {seen[-1][1] - seen[0][1]} times within {window / 60:g} min"
            st["held"][c["name"]] = {"since": now, "kind": "crash-loop"}
            events.append(_event(now, "crash-loop", f"{c['name']}: {seen[-1][1] - seen[0][1]} restarts",
                                 f"{limit} restarts within {window / 60:g} min",
                                 f"stopped {c['name']}; the guard will not start it again" if cfg["act"] else "none (act: false)"))
    for name in list(st["restart_counts"]):
        if name not in names:
            del st["restart_counts"][name]

    for b in breaches:
        stop = [n for n in running if n not in to_stop]
        if cfg["act"] and stop:
            to_stop.update(stop)
            for n in stop:
                st["held"][n] = {"since": now, "kind": b["kind"]}
            action = "stopped " + ", ".join(stop)
        else:
            action = "none (act: false)" if stop else "none (nothing serving)"
        events.append(_event(now, b["kind"], b["reading"], b["threshold"], action))
        running = [n for n in running if n not in to_stop]
    if to_stop and cfg["act"]:
        actions.append(("stop", sorted(to_stop)))
        for n in to_stop:
            st["hung"].pop(n, None)

    # restart what the guard stopped, once the cause is gone
    held = [n for n in st["held"] if n not in to_stop]
    mem_clear = avail is None or not floor or st["mem_ok"] >= int(cfg["mem_clear_samples"])
    due = [n for n in held if now - st["held"][n]["since"] >= float(cfg["restart_after_s"])]
    if due and not breaches and mem_clear and not st["breaker"]:
        st["restarts"] = [t for t in st["restarts"] if now - t <= window]
        if len(st["restarts"]) >= limit:
            st["breaker"] = f"the guard restarted {len(st['restarts'])} times within {window / 60:g} min"
            events.append(_event(now, "breaker", st["breaker"], f"{limit} restarts within {window / 60:g} min",
                                 "stopped restarting: " + ", ".join(sorted(held)) + " left stopped (fix the cause, "
                                 "then invoke cluster-up)"))
        else:
            st["restarts"].append(now)
            actions.append(("start", sorted(due)))
            events.append(_event(now, "restart", "cause cleared: " + ", ".join(
                sorted({st["held"][n]["kind"] for n in due})), "restart_after_s "
                f"{cfg['restart_after_s']}", "started " + ", ".join(sorted(due))))
            for n in due:
                del st["held"][n]
    return st, actions, events


# -- pure: what /metrics serves ----------------------------------------------------------------

def parse_qualification(text: str) -> list[dict]:
    """The rails of the fabric qualification record (written by provision): iface, peer, the figure
    measured, the floor and its status ("degraded": under the floor or a wrong MTU). [] unreadable."""
    try:
        rails = json.loads(text).get("rails") or []
    except (ValueError, AttributeError):
        return []
    return [{k: r.get(k) for k in ("iface", "peer", "gbps", "floor_gbps", "status")} for r in rails
            if isinstance(r, dict) and r.get("iface")]


# -- pure: the fabric qualified again after a boot ---------------------------------------------
# provision's measurement (facts/rail.py RailThroughput) is rendered into the record by the
# fabric_qualify module (its `remeasure`: user, command, each rail's MTU); the guard runs that text
# and judges its output with the copies below of facts/rail.py's parse_ib_write_bw,
# parse_rail_throughput and judge_rail (this file cannot import sparkprov: it ships alone).
# tests/unit/test_guard_requalify.py holds them to the originals on the same literal inputs.

RAIL_MTU = 9000
RAIL_FIX = ("reseat or replace the QSFP cable; check link speed and FEC on both ends (`ethtool IFACE`: "
            "Speed 200000Mb/s; `ethtool --show-fec IFACE`: a direct cable negotiated FEC None ran NCCL at 2.8 GB/s); "
            "check `dmesg | grep -i mlx5` for the PCIe slot power messages of NVIDIA/dgx-spark-playbooks PR#108")
MTU_FIX = "MTU 9000 on both ends of the rail (invoke provision --tags fabric on both hosts)"
REQUALIFY_ACTION = "reported: multi-node starts refused until it qualifies"
PEER_SILENT = "the server on the peer did not start"
_ROW_RE = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+(?:\.\d+)?)\s+(\d+(?:\.\d+)?)\s+(\d+(?:\.\d+)?)\s*$")


def parse_ib_write_bw(text: str) -> dict:
    """facts/rail.py parse_ib_write_bw: the median BW average of perftest's rows, or why none came."""
    device = re.search(r"Device\s*:\s*(\S+)", text)
    qps = re.search(r"Number of qps\s*:\s*(\d+)", text)
    rows, in_table = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("#bytes"):
            in_table = True
            continue
        m = _ROW_RE.match(line) if in_table else None
        if m:
            rows.append({"bytes": int(m.group(1)), "iterations": int(m.group(2)), "peak_gbps": float(m.group(3)),
                         "avg_gbps": float(m.group(4)), "mpps": float(m.group(5))})
    error = None
    if not rows:
        error = next((ln.strip() for ln in text.splitlines()
                      if re.search(r"couldn'?t|unable|error|fail|refused|timed? ?out|no route|not found", ln, re.I)),
                     None) or (text.strip().splitlines() or ["no output"])[-1].strip()
    return {"device": device.group(1) if device else None, "qps": int(qps.group(1)) if qps else None,
            "rows": rows, "gbps": statistics.median(r["avg_gbps"] for r in rows) if rows else None, "error": error}


def parse_rail_throughput(out: str) -> dict[str, dict]:
    """facts/rail.py parse_rail_throughput: iface -> {mtu, peer_mtu, gbps, error, tool}."""
    rails: dict[str, dict] = {}
    for block in re.split(r"(?m)^(?=@rail )", out):
        head, _, body = block.partition("\n")
        if not head.startswith("@rail "):
            continue
        iface = head.split(None, 1)[1].strip()
        mtu = re.search(r"(?m)^mtu=(\d*)$", body)
        res: dict = {"mtu": int(mtu.group(1)) if mtu and mtu.group(1) else None, "peer_mtu": None,
                     "gbps": None, "error": None, "tool": True, "output": ""}
        if re.search(r"(?m)^@no-tool$", body.partition("@client")[0]):
            where = "here" if "@server" not in body else "on the peer"
            res.update(tool=False, error=f"ib_write_bw (perftest) is not installed {where}")
            rails[iface] = res
            continue
        server, _, client = body.partition("\n@client\n")
        pm = re.search(r"(?m)^peer_mtu=(\d*)$", server)
        res["peer_mtu"] = int(pm.group(1)) if pm and pm.group(1) else None
        crc = re.search(r"(?m)^@crc=(\d+)$", client)
        client = re.sub(r"(?m)^@crc=\d+$", "", client)
        bw = parse_ib_write_bw(client)
        res["output"] = "\n".join(client.strip().splitlines()[-3:])
        if bw["gbps"] is not None and crc and crc.group(1) == "0":
            res["gbps"] = round(bw["gbps"], 2)
        else:
            srv = [ln for ln in server.splitlines() if ln.strip() and not ln.startswith(("@", "peer_mtu="))]
            why = bw["error"] or "no result"
            if srv and (not pm or re.search(r"(?i)denied|host key|refused|timed out|resolve", "\n".join(srv))):
                why = f"{PEER_SILENT}: {srv[-1].strip()}"
            res["error"] = why
        rails[iface] = res
    return rails


def judge_rail(m: dict, *, floor: float, expected: float, mtu: int = RAIL_MTU) -> dict:
    """facts/rail.py judge_rail: status ok, slow, degraded or unmeasured, and the problem with its fix."""
    where = f"{m['iface']} ({m.get('hca') or 'no RoCE device'}) -> {m.get('peer')} {m.get('peer_addr')}"
    out = {**{k: m.get(k) for k in ("iface", "hca", "peer", "peer_addr", "gbps", "mtu", "peer_mtu")},
           "floor_gbps": floor, "expected_gbps": expected, "status": "ok", "problem": None}
    bad_mtu = [f"{who} {v}" for who, v in (("here", m.get("mtu")), (m.get("peer"), m.get("peer_mtu")))
               if v is not None and v < mtu]
    if m.get("tool") is False or not m.get("hca"):
        why = m.get("error") or "no RoCE device on this rail"
        out.update(status="unmeasured", problem=f"{where}: not measured: {why} (fix: apt install perftest on both "
                                                 "hosts, then invoke provision --tags fabric)")
    elif m.get("gbps") is None:
        out.update(status="degraded", problem=f"{where}: carried nothing: {m.get('error')} (floor {floor:g} Gb/s; "
                                               f"fix: {RAIL_FIX})")
    elif m["gbps"] < floor:
        out.update(status="degraded", problem=f"{where}: {m['gbps']:g} Gb/s measured (ib_write_bw), under the floor "
                                               f"{floor:g} Gb/s (fix: {RAIL_FIX})")
    elif m["gbps"] < expected:
        out.update(status="slow", problem=f"{where}: {m['gbps']:g} Gb/s measured (ib_write_bw), under the "
                                           f"{expected:g} Gb/s a healthy rail carries (fix: {RAIL_FIX})")
    if bad_mtu and out["status"] != "degraded":
        out.update(status="degraded", problem=f"{where}: MTU {', '.join(bad_mtu)}, not {mtu} (fix: {MTU_FIX})")
    elif bad_mtu:
        out["problem"] += f"; MTU {', '.join(bad_mtu)}, not {mtu} (fix: {MTU_FIX})"
    return out


def boot_is_new(marker: str | None, boot_id: str) -> bool:
    """Whether the guard starts in a boot it has not seen. `marker`: what was left in /run this boot
    (None: nothing; /run is emptied at boot), holding that boot's id. The guard module leaves one
    before it (re)starts the guard (modules/guard.py same_boot_script): provision's start is not a boot."""
    return marker is None or marker.strip() != boot_id.strip()


def remeasure_spec(record: dict) -> dict | None:
    """The measurement provision left in the record for the guard, or None (no rails, or a record
    written before provision left one: the guard cannot re-measure what it was not told)."""
    spec = record.get("remeasure") if isinstance(record, dict) else None
    if not isinstance(spec, dict) or not spec.get("user") or not spec.get("command") or not record.get("rails"):
        return None
    return spec


def as_user(argv: list[str], user: tuple[str, int, int, str], euid: int) -> list[str]:
    """`argv` run as `user` (name, uid, gid, home) from a guard running as `euid`: setpriv, not runuser
    or sudo (no PAM session: nothing to configure, nothing logged per run), with the login user's
    groups and the environment a login gives those tools (ssh reads ~/.ssh of the uid anyway)."""
    name, uid, gid, home = user
    if uid == euid:
        return argv
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "env", f"HOME={home}", f"USER={name}",
            f"LOGNAME={name}", *argv]


def peer_silent(measured: dict[str, dict]) -> list[str]:
    """The rails whose peer did not answer the mesh SSH (still booting, or down): worth waiting for."""
    return sorted(i for i, m in measured.items() if m.get("gbps") is None and str(m.get("error") or "").startswith(PEER_SILENT))


def requalified_record(record: dict, measured: dict[str, dict], *, now: float, boot_id: str) -> dict:
    """The record rewritten from the guard's measurement after a boot: each rail judged as provision
    judges it (the record's floor and expected figure, the rail's MTU), `ok` again over all of them."""
    mtus = {r.get("iface"): r.get("mtu") for r in (record.get("remeasure") or {}).get("rails") or []}
    floor, expected = float(record["floor_gbps"]), float(record["expected_gbps"])
    rails = []
    for old in record.get("rails") or []:
        m = measured.get(old["iface"]) or {"error": "no measurement came back"}
        rails.append(judge_rail({**m, **{k: old.get(k) for k in ("iface", "hca", "peer", "peer_addr")}},
                                floor=floor, expected=expected, mtu=mtus.get(old["iface"]) or RAIL_MTU))
    return {**record, "rails": rails, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "measured_by": f"the node guard, after boot {boot_id}", "boot_id": boot_id,
            "reason": f"boot {boot_id}: the node guard measures after every boot",
            "ok": not record.get("nccl_problems") and all(r["status"] != "degraded" for r in rails)}


def requalify_events(record: dict, now: float, silent: list[str], waited_s: float) -> list[dict]:
    """One journal event per degraded rail of the re-measured record: the reading, the floor, what
    follows (cluster-up's preflight refuses a multi-node start over it) and the fix."""
    events = []
    for r in record.get("rails") or []:
        if r.get("status") != "degraded":
            continue
        head = f"{r['iface']} -> {r.get('peer')} {r.get('peer_addr')}: "
        if r["iface"] in silent:
            reading = head + f"the peer did not answer the mesh SSH within {waited_s:.0f}s after this boot"
            fix = f"power on or repair {r.get('peer')} and this rail's cable, then invoke provision --tags fabric"
        else:
            reading = head + (f"{r['gbps']:g} Gb/s measured (ib_write_bw)" if r.get("gbps") is not None else "nothing carried")
            mtu = [f"MTU {v}" for v in (r.get("mtu"), r.get("peer_mtu")) if v is not None and v < RAIL_MTU]
            reading += "".join(f", {x}" for x in mtu)
            fix = (MTU_FIX if mtu else RAIL_FIX) + "; then invoke provision --tags fabric to qualify again"
        events.append(_event(now, "rail-degraded", reading, f"floor {r['floor_gbps']:g} Gb/s, MTU {RAIL_MTU}",
                             REQUALIFY_ACTION, fix=fix, problem=r.get("problem")))
    return events



def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(doc: dict, counts: dict[str, int]) -> str:
    """Prometheus text format from the guard's state document and its event counts per kind."""
    s = doc.get("sample") or {}
    mem, gpu = s.get("mem") or {}, s.get("gpu") or {}
    lines: list[str] = []
    described: set[str] = set()

    def gauge(name: str, help_: str, value, labels: dict | None = None, kind: str = "gauge") -> None:
        if value is None:
            return
        if name not in described:
            described.add(name)
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lab = "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in (labels or {}).items()) + "}" if labels else ""
        v = float(value)   # full precision: a timestamp or a byte count must not lose digits to %g
        lines.append(f"{name}{lab} {int(v) if v.is_integer() else repr(v)}")

    gauge("sparkprov_guard_up", "1 while the guard samples", 1)
    gauge("sparkprov_guard_last_sample_timestamp_seconds", "time of the last sample", s.get("t"))
    gauge("sparkprov_guard_mem_available_bytes", "MemAvailable (/proc/meminfo)", mem.get("MemAvailable"))
    gauge("sparkprov_guard_mem_total_bytes", "MemTotal (/proc/meminfo)", mem.get("MemTotal"))
    gauge("sparkprov_guard_mem_floor_bytes", "the MemAvailable floor", doc.get("mem_floor_bytes"))
    gauge("sparkprov_guard_swap_total_bytes", "SwapTotal", mem.get("SwapTotal"))
    if mem.get("SwapTotal") is not None:
        gauge("sparkprov_guard_swap_used_bytes", "SwapTotal - SwapFree", mem["SwapTotal"] - mem.get("SwapFree", 0))
    gauge("sparkprov_guard_gpu_temperature_celsius", "GPU temperature", gpu.get("temperature_c"))
    gauge("sparkprov_guard_gpu_power_watts", "GPU power draw", gpu.get("power_w"))
    gauge("sparkprov_guard_gpu_clock_sm_mhz", "GPU SM clock", gpu.get("clock_sm_mhz"))
    gauge("sparkprov_guard_gpu_clock_max_sm_mhz", "GPU SM clock maximum", gpu.get("clock_max_sm_mhz"))
    for c in s.get("containers") or []:
        live = c.get("liveness")
        if live is not None:
            gauge("sparkprov_guard_liveness_ok", "1 when the container generated its token", 1 if live.get("status") == 200
                  else 0, {"container": c["name"]})
            gauge("sparkprov_guard_liveness_seconds", "seconds to the token", live.get("seconds"), {"container": c["name"]})
    for r in s.get("rails") or []:
        gauge("sparkprov_rail_gbps", "the rail's throughput at its last qualification (ib_write_bw, Gb/s)", r.get("gbps"),
              {"iface": r["iface"], "peer": r.get("peer") or ""})
        gauge("sparkprov_rail_floor_gbps", "the floor the rail was qualified against (Gb/s)", r.get("floor_gbps"),
              {"iface": r["iface"]})
        gauge("sparkprov_rail_ok", "0 when the rail's last qualification found it degraded", 0 if r.get("status") ==
              "degraded" else 1, {"iface": r["iface"]})
    gauge("sparkprov_guard_held_containers", "containers the guard holds stopped", len(doc.get("held") or {}))
    gauge("sparkprov_guard_breaker_open", "1 when the crash-loop breaker stopped restarts", 1 if doc.get("breaker") else 0)
    for kind, n in sorted(counts.items()):
        gauge("sparkprov_guard_events_total", "events journaled, by kind", n, {"kind": kind}, kind="counter")
    return "\n".join(lines) + "\n"


# -- the daemon (impure: files, processes, sockets) ----------------------------------------------

class KernelLog:
    """Lines appended to the kernel log since the last read: /dev/kmsg (one record per read;
    opened at its end) or a file (tailed by offset; a file that shrank is read from its start)."""

    def __init__(self, path: str):
        self.path, self.fd, self.buf = path, None, b""

    def _open(self) -> None:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:
            self.fd = None

    def read(self) -> list[str]:
        if self.fd is None:
            self._open()
            return []
        lines: list[str] = []
        try:
            st = os.fstat(self.fd)
            if st.st_size and os.lseek(self.fd, 0, os.SEEK_CUR) > st.st_size:
                os.lseek(self.fd, 0, os.SEEK_SET)
        except OSError:
            pass
        for _ in range(10000):
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except BrokenPipeError:   # /dev/kmsg: records overwritten before we read them
                continue
            except OSError:
                os.close(self.fd)
                self.fd = None
                break
            if not chunk:
                break
            self.buf += chunk
        *done, self.buf = self.buf.split(b"\n")
        lines.extend(x.decode("utf-8", "replace") for x in done)
        return lines


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def _write_json(path: str, doc: dict) -> None:
    """Atomically, readable by all (the login user's cluster-up preflight reads the record)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _fabric_addresses(ifaces: list[str]) -> list[str]:
    rc, out = _run(["ip", "-4", "-o", "addr", "show"], 5)
    addrs = []
    for line in out.splitlines() if rc == 0 else []:
        w = line.split()
        if len(w) > 3 and w[1] in ifaces and w[2] == "inet":
            addrs.append(w[3].split("/")[0])
    return addrs


class Guard:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.lock = threading.Lock()                      # the journal: the sampler and the re-qualification
        self.kernel = KernelLog(cfg["kernel_log"])
        self.kernel.read()
        self.state = self._load_state()
        self.doc: dict = {}
        self.counts: dict[str, int] = {}
        self.servers: dict[str, ThreadingHTTPServer] = {}
        self.stopping = False
        try:
            with open(cfg["journal"]) as fh:
                for line in fh:
                    kind = json.loads(line).get("kind") if line.strip() else None
                    if kind:
                        self.counts[kind] = self.counts.get(kind, 0) + 1
        except (OSError, ValueError):
            pass

    def _load_state(self) -> dict:
        try:
            with open(self.cfg["state"]) as fh:
                saved = json.load(fh).get("guard") or {}
            return {**new_state(), **saved}
        except (OSError, ValueError):
            return new_state()

    def sample(self) -> dict:
        s: dict = {"t": time.time()}
        try:
            with open(self.cfg["meminfo"]) as fh:
                s["mem"] = parse_meminfo(fh.read())
        except OSError as e:
            s["mem"], s["mem_error"] = {}, str(e)
        s["kernel"] = [k for k in map(classify_kernel_line, self.kernel.read()) if k]
        rc, out = _run([self.cfg["nvidia_smi"], "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits"], 10)
        s["gpu"] = parse_gpu_query(out) if rc == 0 else {}
        try:
            with open(self.cfg["qualification"]) as fh:
                s["rails"] = parse_qualification(fh.read())
        except OSError:
            s["rails"] = []
        rc, out = _run(["python3", self.cfg["probe_program"], "status", "-", "-"],
                       30 + 2 * float(self.cfg["liveness_timeout_s"]))
        s["containers"], s["docker"] = [], False
        for line in reversed(out.strip().splitlines() if rc == 0 else []):
            if line.startswith("{"):
                doc = json.loads(line)
                s["docker"] = bool(doc.get("access"))
                s["containers"] = [{k: c.get(k) for k in ("name", "status", "restarts", "health", "liveness", "labels")}
                                   for c in doc.get("containers") or []]
                break
        return s

    def act(self, actions: list[tuple[str, list[str]]]) -> list[str]:
        errors = []
        for verb, names in actions:
            # stop: the rank supervisor gets SIGTERM and stops vLLM's group within its 10 s grace
            argv = ["docker", "stop", "-t", "20", *names] if verb == "stop" else ["docker", "start", *names]
            rc, out = _run(argv, 120)
            if rc != 0:
                errors.append(f"docker {verb} {' '.join(names)} failed: {out.strip()[:200]}")
        return errors

    def journal(self, events: list[dict]) -> None:
        if not events:
            return
        os.makedirs(os.path.dirname(self.cfg["journal"]), exist_ok=True)
        with self.lock, open(self.cfg["journal"], "a") as fh:
            for e in events:
                fh.write(json.dumps(e) + "\n")
                self.counts[e["kind"]] = self.counts.get(e["kind"], 0) + 1
            fh.flush()
            os.fsync(fh.fileno())

    def requalify_if_booted(self) -> threading.Thread | None:
        """At start: in a boot the guard has not seen, measure the record's rails again, in a thread."""
        boot_id = _read(self.cfg["boot_id"]).strip() or "unknown"
        marker = _read(self.cfg["boot_marker"]) if os.path.exists(self.cfg["boot_marker"]) else None
        try:
            record = json.loads(_read(self.cfg["qualification"]) or "{}")
        except ValueError:
            record = {}
        spec = remeasure_spec(record)
        if not boot_is_new(marker, boot_id) or spec is None:
            self.mark_boot(boot_id)
            return None
        t = threading.Thread(target=self.requalify, args=(record, spec, boot_id), daemon=True, name="requalify")
        t.start()
        return t

    def mark_boot(self, boot_id: str) -> None:
        try:
            with open(self.cfg["boot_marker"], "w") as fh:
                fh.write(boot_id + "\n")
        except OSError:
            pass

    def measure(self, spec: dict) -> dict[str, dict]:
        """provision's measurement, as the login user (its mesh SSH keys and pinned host keys)."""
        try:
            who = pwd.getpwnam(spec["user"])
        except KeyError:
            return {}
        rc, out = _run(as_user(["sh", "-c", spec["command"]], (who.pw_name, who.pw_uid, who.pw_gid, who.pw_dir),
                               os.geteuid()), 120 * max(1, len(spec.get("rails") or [])))
        return parse_rail_throughput(out)

    def requalify(self, record: dict, spec: dict, boot_id: str) -> None:
        started = time.monotonic()
        try:
            delay, wait = float(self.cfg["requalify_backoff_s"]), float(self.cfg["requalify_wait_s"])
            while True:
                measured = self.measure(spec)
                silent = peer_silent(measured)
                if not silent or self.stopping or time.monotonic() - started + delay > wait:
                    break
                time.sleep(delay)
                delay = min(delay * 2, 60.0)
            new = requalified_record(record, measured, now=time.time(), boot_id=boot_id)
            _write_json(self.cfg["qualification"], new)
            self.journal(requalify_events(new, time.time(), silent, time.monotonic() - started))
            self.mark_boot(boot_id)
        except Exception as e:  # noqa: BLE001 - the guard goes on sampling whatever this thread meets
            self.journal([_event(time.time(), "requalify-failed", f"{type(e).__name__}: {e}"[:300], "-", "none")])

    def write_state(self, sample: dict) -> None:
        shown = {k: v for k, v in sample.items() if k != "kernel"}
        self.doc = {"pid": os.getpid(), "interval_s": self.cfg["interval_s"], "sample": shown,
                    "mem_floor_bytes": mem_floor_bytes(self.cfg, sample.get("mem") or {}),
                    "held": self.state["held"], "breaker": self.state["breaker"], "guard": self.state,
                    "port": self.cfg["port"], "listen": sorted(self.servers)}
        tmp = self.cfg["state"] + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.doc, fh)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.cfg["state"])

    def listen(self) -> None:
        guard = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = render_metrics(guard.doc, guard.counts).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        for addr in ["127.0.0.1", *_fabric_addresses(self.cfg["fabric_ifaces"])]:
            if addr in self.servers:
                continue
            try:
                srv = ThreadingHTTPServer((addr, int(self.cfg["port"])), Handler)
            except OSError as e:
                print(f"sparkprov-guard: cannot listen on {addr}:{self.cfg['port']}: {e}", file=sys.stderr, flush=True)
                continue
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self.servers[addr] = srv

    def run(self) -> None:
        self.requalify_if_booted()
        last_listen = 0.0
        while not self.stopping:
            t0 = time.monotonic()
            if t0 - last_listen > 60:   # the fabric comes up after the guard at boot
                self.listen()
                last_listen = t0
            s = self.sample()
            self.state, actions, events = decide(self.state, s, self.cfg)
            # the journal first: if the host wedges while the containers stop, the reason is on disk
            self.journal(events)
            errors = self.act(actions) if actions else []
            if errors:
                self.journal([_event(time.time(), "action-failed", "; ".join(errors), "-", "none")])
            self.write_state(s)
            time.sleep(max(0.2, float(self.cfg["interval_s"]) - (time.monotonic() - t0)))


def load_config(path: str) -> dict:
    with open(path) as fh:
        given = json.load(fh)
    return {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}


def main(argv: list[str]) -> int:
    cfg = load_config(argv[1] if len(argv) > 1 else CONFIG_PATH)
    for key in ("journal", "state"):
        os.makedirs(os.path.dirname(cfg[key]), exist_ok=True)
    try:
        with open(PIDFILE, "w") as fh:
            fh.write(f"{os.getpid()}\n")
    except OSError:
        pass
    guard = Guard(cfg)

    def stop(*_):
        guard.stopping = True
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"sparkprov-guard: sampling every {cfg['interval_s']}s, journal {cfg['journal']}", file=sys.stderr, flush=True)
    guard.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
