"""The node guard's own cost, and its false stops, under load: on the lab with a deployment serving
(`make demo` leaves lab-tiny TP 2 native on the real engine, or name one with --deployment).

    sudo .venv/bin/python bench/guard_cost.py [--minutes 10] [--idle-seconds 120] [--deployment NAME]

- idle: the deployment serving, no requests, for --idle-seconds;
- load: `invoke bench DEPLOYMENT --concurrency 1,4,16,64` (its default lengths: input 1024, output 128),
  run again and again until --minutes have passed.
For each window and each host: the guard's CPU (utime+stime of the guard process and of the
processes it ran and waited for, /proc/PID/stat fields 14-17, in seconds per second: a share of one
core) and its resident memory (VmRSS at the end; VmHWM, its peak); every event its journal gained.
During the load, rank 0's engine counters (/metrics, the names the guard reads) every 0.2 s: the
longest stretch they stood still with requests running, which the guard's stall_s must exceed on a
healthy engine. Prints one JSON document; --save writes it to bench/results/guard-cost-DATE.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
INVOKE = str(REPO / ".venv" / "bin" / "invoke")
JOURNAL = "/var/lib/sparkprov/guard/events.jsonl"


def guard_pid(host: str) -> int:
    from sparklab.replay import in_host
    return int(in_host(host, "/run/sparkprov-guard.pid").read_text().strip())


def cpu_and_memory(pid: int) -> dict:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"t": time.monotonic(), "self_s": (int(stat[11]) + int(stat[12])) / tick,
            "children_s": (int(stat[13]) + int(stat[14])) / tick,
            "rss_mib": int(status["VmRSS"].split()[0]) / 1024, "hwm_mib": int(status["VmHWM"].split()[0]) / 1024}


def journal_len(host: str) -> int:
    from sparklab.hosts import nsexec
    return len(nsexec(host, ["sh", "-c", f"cat {JOURNAL} 2>/dev/null || true"]).stdout.splitlines())


def journal_since(host: str, n: int) -> list[dict]:
    from sparklab.hosts import nsexec
    lines = nsexec(host, ["sh", "-c", f"cat {JOURNAL} 2>/dev/null || true"]).stdout.splitlines()[n:]
    return [json.loads(x) for x in lines if x.strip()]


def window(hosts: list[str], run) -> dict:
    pids = {h: guard_pid(h) for h in hosts}
    seen = {h: journal_len(h) for h in hosts}
    a = {h: cpu_and_memory(p) for h, p in pids.items()}
    extra = run()
    b = {h: cpu_and_memory(p) for h, p in pids.items()}
    out = {"hosts": {}}
    for h in hosts:
        wall = b[h]["t"] - a[h]["t"]
        own, kids = b[h]["self_s"] - a[h]["self_s"], b[h]["children_s"] - a[h]["children_s"]
        out["hosts"][h] = {"seconds": round(wall, 1), "cpu_percent_of_a_core": round(100 * (own + kids) / wall, 3),
                           "cpu_self_s": round(own, 2), "cpu_children_s": round(kids, 2),
                           "rss_mib": round(b[h]["rss_mib"], 1), "peak_rss_mib": round(b[h]["hwm_mib"], 1),
                           "events": journal_since(h, seen[h])}
    out.update(extra or {})
    return out


class Stillness:
    """Rank 0's engine counters every `every` s: the longest stretch they stood still with requests running."""

    def __init__(self, api, every: float = 0.2):
        from sparkprov.node.supervise import ENGINE_METRICS_PATH
        self.api, self.every, self.path = api, every, ENGINE_METRICS_PATH
        self.stop = threading.Event()
        self.longest, self.samples, self.running_max = 0.0, 0, 0.0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        from sparklab.replay import _request
        from sparkprov.node.supervise import parse_engine, worked
        last, since = None, None
        while not self.stop.wait(self.every):
            st, body = _request(self.api, "GET", self.path, timeout=5)
            now = parse_engine(body.decode()) if st == 200 else None
            t = time.monotonic()
            if now is None:
                continue
            self.samples += 1
            self.running_max = max(self.running_max, now["running"])
            if last is None or worked(last, now) or now["running"] <= 0:
                since = t
            else:
                self.longest = max(self.longest, t - since)
            last = now


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--idle-seconds", type=float, default=120)
    ap.add_argument("--deployment", default="lab-tiny")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--inventory", default=None)
    ap.add_argument("--save", action="store_true")
    a = ap.parse_args()
    from sparklab import state
    from sparklab.replay import serving_api

    inventory = a.inventory or str(state.inventory_path())
    hosts = ["spark1", "spark2"]
    api = serving_api("spark1")
    if api is None:
        print("no deployment serves on spark1 (make demo first)", file=sys.stderr)
        return 1
    doc = {"date": dt.datetime.now().isoformat(timespec="seconds"), "deployment": a.deployment,
           "concurrency": a.concurrency}
    doc["idle"] = window(hosts, lambda: time.sleep(a.idle_seconds))

    def load() -> dict:
        still = Stillness(api)
        still.thread.start()
        runs, t0 = [], time.monotonic()
        while time.monotonic() - t0 < a.minutes * 60:
            p = subprocess.run([INVOKE, "bench", a.deployment, "--concurrency", a.concurrency, "--inventory", inventory,
                                "--json"], cwd=REPO, capture_output=True, text=True)
            try:
                b = json.loads(p.stdout)["bench"]["runs"]
            except (ValueError, KeyError, TypeError):
                b = []
            runs.append({"exit": p.returncode, "seconds": round(time.monotonic() - t0, 1),
                         "rows": [{k: r.get(k) for k in ("concurrency", "completed", "failed", "output_throughput",
                                                         "ttft_p50_ms")} for run in b for r in run.get("rows") or []],
                         **({"error": (p.stderr or p.stdout)[-600:]} if p.returncode else {})})
            print(f"bench run {len(runs)}: exit {p.returncode} at {runs[-1]['seconds']}s", file=sys.stderr, flush=True)
        still.stop.set()
        still.thread.join()
        return {"bench_runs": runs, "engine": {"longest_still_with_requests_running_s": round(still.longest, 2),
                                               "samples": still.samples, "max_running": still.running_max}}

    doc["load"] = window(hosts, load)
    text = json.dumps(doc, indent=1)
    print(text)
    if a.save:
        out = REPO / "bench" / "results" / f"guard-cost-{dt.date.today().isoformat()}.json"
        out.write_text(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
