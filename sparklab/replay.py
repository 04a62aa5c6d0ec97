"""Replays of what Spark owners measured before and during trouble (gb10-field-timelines.md), as
stand-in processes the node guard reads the way it reads a Spark: the host's /proc/meminfo and
/proc/buddyinfo are files bind-mounted over them in the host's mount namespace (its containers keep
the real ones), its /dev/kmsg a file (hosts.py), and its /proc/sys/vm/drop_caches and
compact_memory files too (hosts.py binds them at boot: a guard in the lab never drops the shared
machine's caches); a replay watches those two and answers as the kernel would. The real engine is
stalled for real (SIGSTOP of its core while requests run). Each replay runs as a detached process
(`python -m sparklab.replay KIND HOST OPTS`), its record in STATE_DIR/replay-HOST-KIND.json, until
its clear stops it. Where the guard does nothing in time, the host "freezes" as the field's did:
its sshd and its guard are stopped (SIGSTOP: SSH times out, as MiaAI-Lab #23's did), until cleared.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .hosts import LabError, _record, nsexec
from .state import STATE_DIR, host_dir

GIB_KB = 1024 * 1024
# Inside the host: /run is its own directory (hosts.py BINDS), reachable from here at host_dir/fs/run.
RUN_DIR = "/run/sparklab"
VM_FILES = {"drop_caches": "/proc/sys/vm/drop_caches", "compact_memory": "/proc/sys/vm/compact_memory"}
MEMINFO, BUDDYINFO = "/proc/meminfo", "/proc/buddyinfo"
# What a GB10 shows (MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks#47: MemTotal 121.69 GiB).
SPARK_TOTAL_GIB = 121.69
# open-gpu-kernel-modules#1358: userspace froze about 5 s after the engine stalled with a request Running.
FREEZE_AFTER_S = 5.0
# tonyd2wild PR#19: with the guard MemFree never fell under 2.6 GiB; nodes left under it without a
# cache drop failed an allocation in the profile run and spun (the wedge of MiaAI-Lab #23).
WEDGE_FREE_GIB, WEDGE_AFTER_S = 2.6, 10.0
NVRM_LINE = ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) "
             "returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359")


def in_host(host: str, path: str) -> Path:
    """The control machine's path of a file under the host's /run."""
    assert path.startswith("/run/")
    return host_dir(host) / "fs" / "run" / path[len("/run/"):]


def _file_of(target: str) -> str:
    return f"{RUN_DIR}/{target.strip('/').replace('/', '-')}"


def stand_in_lines() -> list[str]:
    """Anchor-script lines (hosts.py, after /run is bound): the host's /proc/meminfo and
    /proc/buddyinfo read a healthy Spark's (BASELINE: what replays change and clears give back), its
    drop_caches and compact_memory are files a replay watches. The lab's hosts share one machine's
    memory; none has a unified memory of its own to read, as none has a GPU (gb10.py's stand-ins)."""
    lines = [f"mkdir -p {RUN_DIR}"]
    for target, text in BASELINE.items():
        lines += [f"cat > {_file_of(target)} <<'SPARKLAB_EOF'\n{text}SPARKLAB_EOF",
                  f"mount --bind {_file_of(target)} {target}"]
    for target in VM_FILES.values():
        lines += [f": > {_file_of(target)}", f"mount --bind {_file_of(target)} {target}"]
    return lines


def _record_path(host: str, kind: str) -> Path:
    return STATE_DIR / f"replay-{host}-{kind}.json"


def read_record(host: str, kind: str) -> dict:
    try:
        return json.loads(_record_path(host, kind).read_text())
    except (OSError, ValueError):
        return {}


def _write_record(host: str, kind: str, doc: dict) -> None:
    p = _record_path(host, kind)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(p)


def _put(path: Path, text: str) -> None:
    """Rewrite a bind-mounted file in place (its inode is the mount's): never empty for a reader."""
    data = text.encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _mounted(host: str, target: str) -> bool:
    r = nsexec(host, ["sh", "-c", f"grep -c ' {target} ' /proc/self/mounts || true"], check=False)
    return (r.stdout.strip() or "0") != "0"


def mount_over(host: str, target: str, text: str) -> None:
    """`target` reads `text` in the host (its stand-in file under /run, bind-mounted over it at boot)."""
    _put(in_host(host, _file_of(target)), text)
    if not _mounted(host, target):   # a host booted before the stand-ins were bound
        nsexec(host, ["mount", "--bind", _file_of(target), target])


def restore(host: str, target: str) -> None:
    """The healthy Spark's figures again."""
    mount_over(host, target, BASELINE[target])


class VmWrites:
    """The guard's writes to the host's drop_caches and compact_memory stand-ins, taken as they come."""

    def __init__(self, host: str):
        self.paths = {k: in_host(host, _file_of(t)) for k, t in VM_FILES.items()}

    def take(self) -> dict[str, bool]:
        out = {}
        for k, p in self.paths.items():
            try:
                written = p.stat().st_size > 0
            except OSError:
                written = False
            if written:
                _put(p, "")
            out[k] = written
        return out


def meminfo_text(free_gib: float, cached_gib: float, total_gib: float = SPARK_TOTAL_GIB) -> str:
    """A Spark's /proc/meminfo: MemAvailable is what is free plus the page cache the kernel can give back."""
    kb = lambda g: int(g * GIB_KB)  # noqa: E731
    rows = [("MemTotal", kb(total_gib)), ("MemFree", kb(free_gib)), ("MemAvailable", kb(free_gib + cached_gib)),
            ("Buffers", 0), ("Cached", kb(cached_gib)), ("SwapCached", 0), ("Shmem", kb(0.1)),
            ("SwapTotal", 0), ("SwapFree", 0), ("HugePages_Total", 0)]
    return "".join(f"{k + ':':<16}{v:>9} kB\n" if k != "HugePages_Total" else f"{k + ':':<16}{v:>9}\n"
                   for k, v in rows)


# MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks#23: the head node, zone Normal 138 MB free, no free block of
# 1 MiB or more (orders 0-7 laid out to add up to it); a fresh boot had 3,909 free blocks of 1 MiB or
# more (order 8+), 24 of them of 4 MiB or more (order 10).
BUDDY_FRAGMENTED = "Node 0, zone   Normal  11234   5120   2048    800    200     40      8      1      0      0      0\n"
BUDDY_FRESH = "Node 0, zone   Normal   4561   4616  20001  17139   8506   9464   7623   4041   3800     85     24\n"
# tonyd2wild PR#19: the page-cache flood leaves no free 2 MiB block (order 9 and up, 4 KiB pages)
BUDDY_FLOODED = "Node 0, zone   Normal   9012   6100   3010   1500    700    260     90     20      6      0      0\n"
# A Spark at rest, with the headroom cluster-up's preflight asks of the lab's recipes (lab-tiny's
# --gpu-memory-utilization 0.90 of 121.69 GiB: 109.5 GiB available; a fresh boot had 101.3-102.2 GiB
# free, MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks#47, whose owners ran at 0.82), a fresh boot's free
# blocks (#23 above).
BASELINE = {MEMINFO: meminfo_text(112.0, 2.5), BUDDYINFO: BUDDY_FRESH}


# -- the replays --------------------------------------------------------------------------------

def page_cache_flood(host: str, doc: dict, stop: threading.Event, seconds: float) -> None:
    """vllm-project/vllm#54200 during an engine start: MemFree fell from 29 to 2.5 GiB in 9 s while
    MemAvailable stayed over 22 GiB (Cached 19.8 GiB); tonyd2wild PR#19: the flood of page cache
    from the streamed checkpoint leaves no free 2 MiB block. A cache drop gives the cache back; a
    compaction gives free blocks back; the load streams on for `seconds`, then MemFree holds. Left
    under 2.6 GiB without a drop for 10 s, the node wedges (an NVRM line, then the freeze)."""
    fall = (29.0 - 2.5) / 9
    free, cached, fragmented = 29.0, 0.0, False
    low_since = None
    vm = VmWrites(host)
    t0 = time.monotonic()
    while not stop.wait(0.2):
        loading = time.monotonic() - t0 < seconds
        w = vm.take()
        if w["drop_caches"]:
            free, cached = free + cached, 0.0
            doc["drops"] += 1
        if w["compact_memory"]:
            fragmented = False
            doc["compactions"] += 1
        if loading:
            step = min(fall * 0.2, max(free - 2.5, 0.0))
            free -= step
            cached = min(cached + step, 19.8)
            fragmented = fragmented or free < 8.0
        mount_over(host, MEMINFO, meminfo_text(free, cached))
        mount_over(host, BUDDYINFO, BUDDY_FLOODED if fragmented else BUDDY_FRESH)
        doc["lowest_free_gib"] = round(min(doc.get("lowest_free_gib", free), free), 2)
        doc["free_gib"] = round(free, 2)
        low_since = (low_since or time.monotonic()) if free < WEDGE_FREE_GIB else None
        if low_since and time.monotonic() - low_since > WEDGE_AFTER_S and not doc.get("froze"):
            write_kmsg(host, [NVRM_LINE])
            freeze(host, doc, "MemFree stayed under 2.6 GiB with no cache drop: the driver failed an allocation")
        _write_record(host, "page-cache-flood", doc)


def no_hugeblocks(host: str, doc: dict, stop: threading.Event, stuck: bool) -> None:
    """MiaAI-Lab #23: a serving node with no free block of 4 MiB or more; a compaction brings blocks
    back, or (stuck: FujitsuPolycom/sparkring#173, compact_memory recovered almost nothing) not."""
    vm = VmWrites(host)
    fragmented = True
    mount_over(host, BUDDYINFO, BUDDY_FRAGMENTED)
    while not stop.wait(0.2):
        w = vm.take()
        doc["drops"] += w["drop_caches"]
        if w["compact_memory"]:
            doc["compactions"] += 1
            fragmented = stuck
        mount_over(host, BUDDYINFO, BUDDY_FRAGMENTED if fragmented else BUDDY_FRESH)
        _write_record(host, "no-hugeblocks", doc)


def engine_cores(host: str) -> list[int]:
    from .faults import _engine_cores
    return _engine_cores(host)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def serving_api(host: str) -> tuple[str, int, str, str] | None:
    """(address, port, model, key) of the host's container that serves the API, or None."""
    rec = _record(host)
    out = nsexec(host, ["docker", "ps", "--filter", "label=sparkprov.managed=1", "--format",
                        '{{.Label "sparkprov.port"}} {{.Label "sparkprov.model"}} {{.Label "sparkprov.api_key_file"}}'],
                 check=False).stdout.split("\n")
    for line in out:
        w = line.split()
        if len(w) >= 2 and w[0].isdigit():
            key = nsexec(host, ["cat", w[2]], check=False).stdout.strip() if len(w) > 2 else ""
            return rec.address, int(w[0]), w[1], key
    return None


def _request(api: tuple[str, int, str, str], method: str, path: str, body: dict | None = None,
             timeout: float = 5) -> tuple[int | None, bytes]:
    addr, port, _, key = api
    conn = http.client.HTTPConnection(addr, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException):
        return None, b""
    finally:
        conn.close()


def running_requests(api) -> float | None:
    st, body = _request(api, "GET", "/metrics?name[]=vllm:num_requests_running")
    if st != 200:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("vllm:num_requests_running"))


def load(api, stop: threading.Event, n: int = 8) -> list[threading.Thread]:
    """n requests running at all times (each re-sent when it ends), until `stop`."""
    def one():
        while not stop.is_set():
            st, _ = _request(api, "POST", "/v1/completions", {"model": api[2], "prompt": "Count: 1 2 3",
                                                              "max_tokens": 512, "temperature": 1.0,
                                                              "ignore_eos": True}, timeout=120)
            if st != 200:
                stop.wait(1)
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def stall_once(host: str, doc: dict, stop: threading.Event) -> None:
    """NVIDIA/open-gpu-kernel-modules#1358: the engine stops stepping with requests Running (its
    prompt throughput 0), /health stays 200; userspace froze about 5 s later. Here: requests kept
    running against the real engine, its core SIGSTOPped; if it is still there 5 s later (nothing
    stopped it), the host freezes. Records when the core was gone (the guard's time to act)."""
    api = None
    while not stop.is_set() and api is None:
        api = serving_api(host)
        if api is None or running_requests(api) is None or not engine_cores(host):
            api = None
            stop.wait(1)
    if stop.is_set():
        return
    load_stop = threading.Event()
    load(api, load_stop)
    try:
        deadline = time.monotonic() + 120
        while not stop.is_set() and (running_requests(api) or 0) <= 0 and time.monotonic() < deadline:
            stop.wait(0.2)
        stop.wait(1.0)   # a second of steady work first
        pids = engine_cores(host)
        if stop.is_set() or not pids:
            return
        t0 = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        cycle = {"stopped": pids, "at": time.time(), "running": running_requests(api)}
        doc["stalls"].append(cycle)
        _write_record(host, doc["kind"], doc)
        while not stop.is_set():
            if not any(_alive(p) for p in pids):
                cycle["engine_gone_after_s"] = round(time.monotonic() - t0, 2)
                break
            if time.monotonic() - t0 >= FREEZE_AFTER_S and not doc.get("froze"):
                freeze(host, doc, f"the stalled engine (pid {', '.join(map(str, pids))}) was still there "
                                  f"{FREEZE_AFTER_S:g}s after it stopped")
            stop.wait(0.05)
        _write_record(host, doc["kind"], doc)
    finally:
        load_stop.set()


def stall(host: str, doc: dict, stop: threading.Event) -> None:
    stall_once(host, doc, stop)
    stop.wait()


def restart_storm(host: str, doc: dict, stop: threading.Event) -> None:
    """eugr/spark-vllm-docker#257: an engine that fails again after every restart (here: stalls, as
    #1358's did, every time it serves again), restarted over and over."""
    while not stop.is_set():
        before = set(doc["stalls"][-1]["stopped"]) if doc["stalls"] else set()
        while not stop.is_set() and (not engine_cores(host) or set(engine_cores(host)) & before):
            stop.wait(1)
        stall_once(host, doc, stop)


def write_kmsg(host: str, lines: list[str], seconds: float = 0.0) -> None:
    """Kernel records (priority 3, stamped with the kernel's microseconds since boot) in the host's
    /dev/kmsg: within one second of the kernel's clock (seconds <= 1), else spread over `seconds`."""
    def record(usec: int, line: str) -> str:
        return f"3,{usec},{usec},-;{line}\n"
    now = time.clock_gettime(time.CLOCK_BOOTTIME)
    if seconds <= 1:
        start = int(now) * 1_000_000 + 1
        step = 999_999 // max(len(lines), 1)
        nsexec(host, ["sh", "-c", "cat >> /dev/kmsg"], input="".join(record(start + i * step, ln)
                                                                     for i, ln in enumerate(lines)))
        return
    for i, line in enumerate(lines):
        usec = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1e6)
        nsexec(host, ["sh", "-c", "cat >> /dev/kmsg"], input=record(usec, line))
        if i < len(lines) - 1:
            time.sleep(seconds / len(lines))


def freeze(host: str, doc: dict, why: str) -> None:
    """The host stops answering (its sshd) and nothing of its userspace acts any more (its guard)."""
    from .sshd import sshd_pid

    pids = [p for p in (sshd_pid(host), _guard_pid(host)) if p]
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    doc["froze"] = {"at": time.time(), "why": why, "pids": pids}
    _write_record(host, doc["kind"], doc)


def _guard_pid(host: str) -> int | None:
    try:
        pid = int(in_host(host, "/run/sparkprov-guard.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def thaw(doc: dict) -> None:
    for p in (doc.get("froze") or {}).get("pids") or []:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass


KINDS = {"page-cache-flood": lambda h, d, s, o: page_cache_flood(h, d, s, float(o.get("seconds") or 60)),
         "no-hugeblocks": lambda h, d, s, o: no_hugeblocks(h, d, s, bool(o.get("stuck"))),
         "stall": lambda h, d, s, o: stall(h, d, s),
         "restart-storm": lambda h, d, s, o: restart_storm(h, d, s)}


def main(argv: list[str]) -> None:
    kind, host, opts = argv[0], argv[1], json.loads(argv[2]) if len(argv) > 2 else {}
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    doc = {"kind": kind, "host": host, "pid": os.getpid(), "started": time.time(), "drops": 0, "compactions": 0,
           "stalls": [], "options": opts}
    _write_record(host, kind, doc)
    KINDS[kind](host, doc, stop, opts)
    doc["ended"] = time.time()
    _write_record(host, kind, doc)


def start(kind: str, host: str, **opts) -> dict:
    """Start a replay (one of each kind per host), detached; its record once it runs."""
    _record(host)
    old = read_record(host, kind)
    if old.get("pid") and _alive(old["pid"]) and not old.get("ended"):
        raise LabError(f"{host}: a {kind} replay runs already (pid {old['pid']}); clear it first")
    _record_path(host, kind).unlink(missing_ok=True)
    log = open(STATE_DIR / f"replay-{host}-{kind}.log", "a")
    subprocess.Popen([sys.executable, "-m", "sparklab.replay", kind, host, json.dumps(opts)], stdin=subprocess.DEVNULL,
                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                     cwd=str(Path(__file__).resolve().parents[1]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        doc = read_record(host, kind)
        if doc.get("pid"):
            return doc
        time.sleep(0.1)
    raise LabError(f"{host}: the {kind} replay did not start (see {log.name})")


def stop(kind: str, host: str, *, restore_files: tuple[str, ...] = ()) -> dict:
    """Stop a replay, thaw a host it froze, give the host its healthy figures back; its record."""
    doc = read_record(host, kind)
    pid = doc.get("pid")
    if pid and _alive(pid):
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.1)
    doc = read_record(host, kind) or doc
    thaw(doc)
    for target in restore_files:
        restore(host, target)
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
