"""The node guard: a daemon on every Spark that keeps memory over the floor through loads, stops a
stalled engine before the host freezes, and says what it saw (docs/guard.md).

Run on the node as root: `python3 -m sparkprov_node.guard CONFIG.json` (the `guard` module,
sparkprov/modules/guard.py, installs this package and starts it: a systemd unit on a Spark, a
process started at boot on the lab's simulated Sparks). Every `interval_s` it reads, with no process
spawned: /proc/meminfo, /proc/buddyinfo, the kernel log (/dev/kmsg, from its end), each serving
container's engine counters (vLLM's /metrics, the names it needs only); every `docker_every_s` the
containers (docker's API over its socket); every `gpu_every_s` the GPU and each compute process's
device memory (NVML, or nvidia-smi where NVML will not load). decide.py decides; this file reads,
acts (docker stop/start, a cache drop and compaction, a token), journals (events.jsonl) and serves
/metrics. After a boot it has not seen it qualifies the fabric rails again, in a thread.
"""

from __future__ import annotations

import http.client
import json
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import NODE_LIB, NODE_PACKAGE
from . import decide as d
from . import ondemand as od
from . import requalify as rq
from .docker import Docker, DockerError
from .metrics import render_metrics
from .probe import one_token, read_key
from .rail import parse_rail_throughput
from .readings import (APPS_QUERY, GPU_QUERY, Nvml, classify_kernel_line, container_of, free_blocks_at_least,
                       parse_buddyinfo, parse_compute_apps, parse_gpu_query, parse_meminfo)
from .settings import DEFAULTS, resolve
from .supervise import ENGINE_METRICS_PATH, parse_engine

# Where things live on the node (root's). /var/lib persists across reboots (the journal must),
# /run does not (the pid file must not).
CONFIG_PATH = "/etc/sparkprov/guard.json"
JOURNAL_PATH = "/var/lib/sparkprov/guard/events.jsonl"
STATE_PATH = "/var/lib/sparkprov/guard/state.json"
# `invoke guard --resume` leaves this file; the guard reads it at its next sample and removes it.
RESUME_PATH = "/var/lib/sparkprov/guard/resume"
PIDFILE = "/run/sparkprov-guard.pid"
LOG_PATH = "/var/log/sparkprov-guard.log"
UNIT_NAME = "sparkprov-guard.service"
BOOT_MARKER = "/run/sparkprov-guard.boot"
# The package on the node, and what the process's command line holds (facts/guard.py tells the
# guard's pid from others by it; `guard.py`: the single-file guard sparkprov installed before).
PROGRAM_PATH = f"{NODE_LIB}/{NODE_PACKAGE}/guard.py"
COMMAND_MARK = f"{NODE_PACKAGE}.guard"
OLD_PROGRAM_PATHS = ("/var/lib/sparkprov/guard/guard.py", "/var/lib/sparkprov/guard/probe.py")

# Not user settings: where it reads and writes (tests point them at temporary files).
INTERNAL = {
    "journal": JOURNAL_PATH, "state": STATE_PATH, "resume": RESUME_PATH,
    "qualification": rq.QUALIFICATION_PATH,
    "drop_caches": "/proc/sys/vm/drop_caches", "compact_memory": "/proc/sys/vm/compact_memory",
    # After a boot the guard measures every rail of the record again (in a thread: sampling goes on).
    # A peer that is still booting does not answer the mesh SSH yet: the guard tries again, waiting
    # `requalify_backoff_s`, doubled each time up to a minute, for at most `requalify_wait_s` (a
    # Spark boots in minutes; a peer still down then is reported, as a rail that carries nothing).
    "requalify_wait_s": 600, "requalify_backoff_s": 5,
    # What tells a boot: the kernel's boot id, and a marker in /run (a tmpfs: empty after every
    # boot; the lab's simulated Sparks share one kernel, so the marker alone tells their boots apart).
    "boot_id": "/proc/sys/kernel/random/boot_id", "boot_marker": BOOT_MARKER,
    # the key of the on-demand requests (node/ondemand.py): written 0600 by `gateway up`, read at each
    # request (a key written after the guard started counts at once)
    "ondemand_key": "/etc/sparkprov/ondemand.key",
}
STATE_EVERY_S = 5          # the state file (what `invoke status` reads) at least this often
# Without NVML each GPU reading is two nvidia-smi processes: at most this often (a Spark's driver has
# NVML; the lab's stand-in nvidia-smi is a Python script, about 40 ms of CPU each).
NVIDIA_SMI_EVERY_S = 60
RAILS_EVERY_S = 30         # the qualification record, for /metrics


def paths() -> dict[str, str]:
    """Where the guard keeps what a reader needs (facts/guard.py GuardState's parameters)."""
    return {"program": PROGRAM_PATH, "pidfile": PIDFILE, "state": STATE_PATH, "journal": JOURNAL_PATH}


def load_config(path: str) -> dict:
    with open(path) as fh:
        given = json.load(fh)
    return {**INTERNAL, **{k: v for k, v in given.items() if k in INTERNAL and v is not None},
            **resolve({k: v for k, v in given.items() if k in DEFAULTS})}


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
        return [x.decode("utf-8", "replace") for x in done]


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


def _write_json(path: str, doc: dict, indent: int | None = 2) -> None:
    """Atomically, readable by all (the login user's cluster-up preflight reads the record)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=indent, sort_keys=indent is not None)
        fh.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _get(port: int, path: str, timeout: float) -> tuple[int | None, bytes]:
    """One GET to a local engine (http.client: the cheapest request the standard library makes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException):
        return None, b""
    finally:
        conn.close()


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
        self.lock = threading.Lock()                      # the journal: the sampler and its threads
        self.act_lock = threading.Lock()                  # docker stops and starts: the sampler's, requests'
        self.nonces = od.NonceCache()                     # the on-demand requests' nonces, within their window
        self.kernel = KernelLog(cfg["kernel_log"])
        self.kernel.read()
        self.docker = Docker(cfg["docker_socket"])
        self.nvml = Nvml.load()
        self.page_size = os.sysconf("SC_PAGE_SIZE")
        self.state = self._load_state()
        self.doc: dict = {}
        self.counts: dict[str, int] = {}
        self.servers: dict[str, ThreadingHTTPServer] = {}
        self.stopping = False
        self.containers: list[dict] = []
        self.docker_t = self.gpu_t = self.rails_t = self.state_t = -1e9
        self.gpu: dict = {}
        self.gpu_procs: list[dict] | None = None
        self.rails: list[dict] = []
        self.docker_error: str | None = None
        self.tokens: dict[str, dict] = {}                 # token results the sampler has not taken yet
        self.liveness: dict[str, dict] = {}               # each container's last token result
        self.reclaim_error: str | None = None
        self.reclaiming = False
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
            return {**d.new_state(), **{k: v for k, v in saved.items() if k in d.new_state()}}
        except (OSError, ValueError):
            return d.new_state()

    # -- reading ------------------------------------------------------------------------------

    def _refresh_docker(self, now: float) -> None:
        try:
            self.containers = self.docker.containers()
            self.docker_error = None
        except (DockerError, ValueError) as e:
            self.docker_error = str(e)[:300]
        self.docker_t = now

    def _refresh_gpu(self, now: float) -> None:
        self.gpu_t = now
        if self.nvml is not None:
            try:
                self.gpu, procs = self.nvml.sensors(), self.nvml.compute_processes()
            except Exception:  # noqa: BLE001 - a driver error leaves the readings unknown, sampling goes on
                self.gpu, procs = {}, None
        else:
            rc, out = _run([self.cfg["nvidia_smi"], "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits"], 10)
            self.gpu = parse_gpu_query(out) if rc == 0 else {}
            rc, out = _run([self.cfg["nvidia_smi"], "--query-compute-apps=" + APPS_QUERY,
                            "--format=csv,noheader,nounits"], 10)
            procs = parse_compute_apps(out) if rc == 0 else None
        names = {c.get("id"): c["name"] for c in self.containers}
        for p in procs or []:
            p["container"] = container_of(_read(f"/proc/{p['pid']}/cgroup"))
            p["container_name"] = names.get(p["container"])
        self.gpu_procs = procs

    def sample(self) -> dict:
        now = time.time()
        cfg = self.cfg
        if now - self.docker_t >= float(cfg["docker_every_s"]):
            self._refresh_docker(now)
        gpu_every = float(cfg["gpu_every_s"]) if self.nvml else max(float(cfg["gpu_every_s"]), NVIDIA_SMI_EVERY_S)
        if now - self.gpu_t >= gpu_every:
            self._refresh_gpu(now)
        if now - self.rails_t >= RAILS_EVERY_S:
            rails = rq.parse_qualification(_read(cfg["qualification"]))
            if rails != self.rails:
                self.state_t = -1e9   # a new record is in the state file (what `invoke status` reads) at once
            self.rails, self.rails_t = rails, now
        s: dict = {"t": now, "page_size": self.page_size, "gpu": self.gpu, "gpu_procs": self.gpu_procs,
                   "rails": self.rails, "docker_error": self.docker_error}
        text = _read(cfg["meminfo"])
        s["mem"] = parse_meminfo(text) if text else {}
        s["buddy"] = parse_buddyinfo(_read(cfg["buddyinfo"])) or None
        s["kernel"] = [k for k in map(classify_kernel_line, self.kernel.read()) if k]
        engines = self.state.get("engines") or {}
        containers = []
        for c in self.containers:
            c = dict(c)
            if c.get("status") == "running" and c.get("port"):
                st, body = _get(c["port"], ENGINE_METRICS_PATH, 2)
                c["engine"] = parse_engine(body.decode("utf-8", "replace")) if st == 200 else None
                e = engines.get(c["name"]) or {}
                # /health only where a stall is suspected: the counters still near stall_s with requests running
                if c["engine"] and c["engine"]["running"] > 0 and e.get("last") == c["engine"] and \
                        now - float(e.get("moved_t") or now) >= float(cfg["stall_s"]) - 1.5 * float(cfg["interval_s"]):
                    c["health"] = _get(c["port"], "/health", 2)[0]
            containers.append(c)
        s["containers"] = containers
        with self.lock:
            s["tokens"], self.tokens = self.tokens, {}
        # each container's last token (the probe's result), kept while the container is there: what
        # /metrics serves as sparkprov_guard_liveness_* (the dashboard's liveness panel)
        self.liveness.update(s["tokens"])
        names = {c["name"] for c in containers}
        self.liveness = {n: r for n, r in self.liveness.items() if n in names}
        for c in containers:
            if c["name"] in self.liveness:
                c["liveness"] = self.liveness[c["name"]]
        with self.lock:
            s["reclaim_error"], self.reclaim_error = self.reclaim_error, None
        s["resume"] = os.path.exists(cfg["resume"])
        zones = s["buddy"]
        if zones:
            m = d.memory_view(s, cfg)
            s["hugeblocks"] = free_blocks_at_least(zones, m["order"])
        return s

    # -- acting -------------------------------------------------------------------------------

    def act(self, actions: list[dict]) -> list[str]:
        with self.act_lock:
            return self._act(actions)

    def _act(self, actions: list[dict]) -> list[str]:
        errors = []
        ids = {c["name"]: c.get("id") for c in self.containers}
        for a in actions:
            if a["do"] in ("stop", "start"):
                for name in a["names"]:
                    try:
                        if a["do"] == "stop":   # the rank supervisor stops vLLM's group on the SIGTERM
                            self.docker.stop(ids.get(name) or name, a["grace_s"])
                        else:
                            self.docker.start(ids.get(name) or name)
                    except DockerError as e:
                        errors.append(f"docker {a['do']} {name} failed: {e}")
                self.docker_t = -1e9   # read the containers again at the next sample
            elif a["do"] == "reclaim" and not self.reclaiming:
                self.reclaiming = True
                threading.Thread(target=self.reclaim, args=(a["drop"], a["compact"]), daemon=True).start()
            elif a["do"] == "token":
                for name in a["names"]:
                    c = next((c for c in self.containers if c["name"] == name), None)
                    if c and c.get("port"):
                        threading.Thread(target=self.token, args=(c,), daemon=True).start()
        return errors

    def reclaim(self, drop: bool, compact: bool) -> None:
        """`sync; echo 3 > drop_caches` and `echo 1 > compact_memory`, off the sampler's thread (a
        sync can take a while)."""
        error = None
        try:
            if drop:
                os.sync()
                with open(self.cfg["drop_caches"], "w") as fh:
                    fh.write("3\n")
            if compact:
                with open(self.cfg["compact_memory"], "w") as fh:
                    fh.write("1\n")
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
        with self.lock:
            self.reclaim_error, self.reclaiming = error, False

    def token(self, c: dict) -> None:
        labels = c.get("labels") or {}
        res = one_token(f"http://127.0.0.1:{c['port']}", labels.get("sparkprov.model") or "?",
                        read_key(labels.get("sparkprov.api_key_file")), float(self.cfg["liveness_timeout_s"]))
        with self.lock:
            self.tokens[c["name"]] = res

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

    # -- on demand: a signed start or stop of a deployment this node holds (node/ondemand.py) ----

    def _health(self, containers: list[dict]) -> dict[str, int | None]:
        return {c["name"]: _get(c["port"], "/health", 2)[0] for c in containers
                if od.is_on_demand(c) and c.get("status") == "running" and c.get("port")}

    def on_demand(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, dict]:
        """A request of the gateway: (HTTP status, answer). Authenticated first (HMAC, time, nonce);
        then only the named deployment's containers, labelled on-demand, are started or stopped. A
        start is a load to the guard (its API not answering yet: the load-time memory watch); a stop is
        intended: journaled with its reason, never held, restarted or counted against the budget."""
        m = od.PATH_RE.fullmatch(path)
        if path != od.LIST_PATH and m is None:
            return 404, {"error": "no such endpoint"}
        if method != ("POST" if m and m.group(2) != "state" else "GET"):
            return 405, {"error": f"{method} is not how {path} is asked"}
        why = od.verify(od.parse_key(_read(self.cfg["ondemand_key"])), method, path, headers, body, time.time(),
                        self.nonces)
        if why:
            return 401, {"error": why}
        with self.act_lock:
            try:
                containers = self.docker.containers()
            except (DockerError, ValueError) as e:
                return 502, {"error": f"docker: {e}"[:300]}
            if m is None:
                return 200, {"deployments": od.describe(containers, self._health(containers))}
            name, action = m.groups()
            names, refused = od.plan(containers, name, action)
            if refused is None and action == "start":
                held = od.held_by_guard(names, self.state["held"], self.state["stood_down"])
                refused = (409, held) if held else None
            if refused:
                return refused[0], {"error": refused[1]}
            ids = {c["name"]: c.get("id") or c["name"] for c in containers}
            errors = []
            for n in names:
                try:
                    self.docker.start(ids[n]) if action == "start" else self.docker.stop(ids[n], d.STOP_GRACE_S)
                except DockerError as e:
                    errors.append(f"docker {action} {n} failed: {e}")
            if names:
                self.docker_t = -1e9   # the next sample reads them: a start is judged as a load from then on
                reason = od.request_reason(body) or "a request"
                done = ("started " if action == "start" else "stopped ") + ", ".join(names)
                self.journal([d.event(time.time(), f"on-demand-{action}", f"{name}: {reason}", "a signed request",
                                      "; ".join(errors) or done)])
            if errors:
                return 502, {"error": "; ".join(errors)}
            try:
                after = [c for c in self.docker.containers()
                         if (c.get("labels") or {}).get("sparkprov.deployment") == name]
            except (DockerError, ValueError) as e:
                return 502, {"error": f"docker: {e}"[:300]}
        return 200, {"deployment": name, "acted": names, "containers": od.describe(after, self._health(after))}

    # -- the fabric, after a boot -------------------------------------------------------------

    def requalify_if_booted(self) -> threading.Thread | None:
        """At start: in a boot the guard has not seen, measure the record's rails again, in a thread."""
        boot_id = _read(self.cfg["boot_id"]).strip() or "unknown"
        marker = _read(self.cfg["boot_marker"]) if os.path.exists(self.cfg["boot_marker"]) else None
        try:
            record = json.loads(_read(self.cfg["qualification"]) or "{}")
        except ValueError:
            record = {}
        spec = rq.remeasure_spec(record)
        if not rq.boot_is_new(marker, boot_id) or spec is None:
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
        rc, out = _run(rq.as_user(["sh", "-c", spec["command"]], (who.pw_name, who.pw_uid, who.pw_gid, who.pw_dir),
                                  os.geteuid()), 120 * max(1, len(spec.get("rails") or [])))
        return parse_rail_throughput(out)

    def requalify(self, record: dict, spec: dict, boot_id: str) -> None:
        started = time.monotonic()
        try:
            delay, wait = float(self.cfg["requalify_backoff_s"]), float(self.cfg["requalify_wait_s"])
            while True:
                measured = self.measure(spec)
                silent = rq.peer_silent(measured)
                if not silent or self.stopping or time.monotonic() - started + delay > wait:
                    break
                time.sleep(delay)
                delay = min(delay * 2, 60.0)
            new = rq.requalified_record(record, measured, now=time.time(), boot_id=boot_id)
            _write_json(self.cfg["qualification"], new)
            # the next sample reads the new record (status and /metrics show it at once, not up to
            # RAILS_EVERY_S later: the lab's power-cycle test saw status read the old rails)
            self.rails_t = -1e9
            self.journal(rq.requalify_events(new, time.time(), silent, time.monotonic() - started))
            self.mark_boot(boot_id)
        except Exception as e:  # noqa: BLE001 - the guard goes on sampling whatever this thread meets
            self.journal([d.event(time.time(), "requalify-failed", f"{type(e).__name__}: {e}"[:300], "-", "none")])

    # -- state, /metrics, the loop ------------------------------------------------------------

    def write_state(self, sample: dict) -> None:
        shown = {k: v for k, v in sample.items() if k not in ("kernel", "buddy", "tokens")}
        shown["containers"] = [{k: v for k, v in c.items() if k != "labels" or v} for c in sample["containers"]]
        cfg = self.cfg
        self.doc = {"pid": os.getpid(), "interval_s": cfg["interval_s"], "sample": shown,
                    "mem_floor_bytes": int(float(cfg["mem_free_floor_gib"]) * d.GIB),
                    "mem_critical_bytes": int(float(cfg["mem_critical_gib"]) * d.GIB),
                    "held": self.state["held"], "stood_down": self.state["stood_down"], "guard": self.state,
                    "budget": {"restarts": int(cfg["restart_budget"]), "window_h": float(cfg["restart_window_h"])},
                    "nvml": self.nvml is not None, "port": cfg["port"], "listen": sorted(self.servers)}
        _write_json(cfg["state"], self.doc, indent=None)

    def listen(self) -> None:
        guard = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.startswith(od.LIST_PATH):
                    return self._on_demand(b"")
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = render_metrics(guard.doc, guard.counts).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                try:
                    size = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    size = -1
                if not 0 <= size <= od.MAX_BODY:
                    self.send_error(413)
                    return
                self._on_demand(self.rfile.read(size) if size else b"")

            def _on_demand(self, body: bytes) -> None:
                code, doc = guard.on_demand(self.command, self.path, dict(self.headers.items()), body)
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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

    def step(self) -> dict:
        """One sample, decided and acted on; the journal first: if the host wedges while the
        containers stop, the reason is on disk."""
        s = self.sample()
        self.state, actions, events = d.decide(self.state, s, self.cfg)
        self.journal(events)
        errors = self.act(actions) if actions else []
        if errors:
            self.journal([d.event(time.time(), "action-failed", "; ".join(errors), "-", "none")])
        if s["resume"]:
            try:
                os.unlink(self.cfg["resume"])
            except OSError:
                pass
        if events or actions or s["t"] - self.state_t >= STATE_EVERY_S:
            self.write_state(s)
            self.state_t = s["t"]
        return s

    def run(self) -> None:
        self.requalify_if_booted()
        last_listen = -1e9
        while not self.stopping:
            t0 = time.monotonic()
            if t0 - last_listen > 60:   # the fabric comes up after the guard at boot
                self.listen()
                last_listen = t0
            self.step()
            time.sleep(max(0.05, float(self.cfg["interval_s"]) - (time.monotonic() - t0)))


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
    print(f"sparkprov-guard: sampling every {cfg['interval_s']}s, journal {cfg['journal']}"
          f"{', NVML' if guard.nvml else ', no NVML (nvidia-smi)'}", file=sys.stderr, flush=True)
    guard.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
