"""Benchmark: stage-weights lab-tiny on the lab's 4-Spark ring against one download (issue 34).

    sudo .venv/bin/python bench/stage_ring.py [--runs 3] [--json] [--keep]

Brings up the 4-ring (`lab.up --hosts 4 --topology ring`, with dockerd: the download runs in the
serving image), provisions it once (the per-link addressing and the SSH mesh between nodes the relay
uses), pulls the downloader's image on spark1 once (in neither figure), then, `--runs` times:

  one    `invoke stage-weights lab-tiny --hosts spark1 --json`, spark1's store wiped: one download
  ring   the same to all four, every store wiped: spark1 downloads and relays along the ring

each timed as a command (what a user waits for, Python's start included). Per run: every host's
remote calls (the engine's count, the JSON's `remote_calls`) and every SSH session each host's
sshd accepted (LogLevel VERBOSE logs: the plays' own and the relay's node-to-node hops alike).
Then one ring run in-process with a report that stamps each play's start and each host's result,
for where the time goes. The lab is taken down at the end (--keep leaves it up).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from _common import REPO, SshdLogs, in_hosts, lab_bench_args, lab_down, machine, median, stamped_report, write_result

INVOKE = str(REPO / ".venv" / "bin" / "invoke")
MODEL = "lab-tiny"
WIPE = "rm -rf ~nvidia/vllm/hub/models--sparkprov-lab--lab-tiny ~nvidia/vllm/.sparkprov/staging"


def provision(inv: Path, names: list[str]) -> None:
    from sparkprov.data.inventory import load_inventory
    from sparkprov.data.playbook import load_playbook
    from sparkprov.engine.report import Report
    from sparkprov.engine.run import Runner, RunOptions

    report = Report(io.StringIO())
    Runner(load_inventory(inv), load_playbook(REPO / "playbooks" / "provision.yaml"), names, RunOptions(),
           report).run()
    bad = [f"{r.host} {r.task}: {r.msg}" for r in report.results if r.status in ("failed", "unreachable")]
    if bad:
        sys.exit("provision failed: " + "; ".join(bad[:5]))


def stage_cli(inv: Path, hosts: list[str]) -> tuple[float, dict]:
    t0 = time.monotonic()
    r = subprocess.run([INVOKE, "stage-weights", MODEL, "--inventory", str(inv), "--hosts", ",".join(hosts), "--json"],
                       capture_output=True, text=True, cwd=REPO, timeout=900)
    took = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"stage-weights failed ({r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return took, json.loads(r.stdout)


def timed_run(inv: Path, names: list[str]) -> dict:
    """One ring stage in-process: each play's start and each host's result, seconds from the start."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.plays import stage as plays

    report = stamped_report()
    plays.run_stage(load_inventory(inv), names, MODEL, plays.StageOptions(), report)
    took = time.monotonic() - report.t0
    return {"seconds": round(took, 3), "events": report.events,
            "remote_calls": {h: t.remote_calls for h, t in report.hosts.items()}}


def main() -> None:
    a = lab_bench_args(__doc__, "stage-ring")
    from sparklab import up as labup

    t0 = time.monotonic()
    res = labup.up(4, topology="ring", light=False, images=True, quiet=True)
    names = sorted(res.hosts, key=lambda h: int(h[5:]))
    from sparklab import state

    inv = state.inventory_path()  # the lab's own inventory (sparklab/up.py inventory_text)
    provision(inv, names)
    print(f"lab up and provisioned in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    try:
        in_hosts(names, WIPE)
        stage_cli(inv, names[:1])  # the downloader's image pulled once: in neither figure
        logs = SshdLogs(names)
        rows = []
        for k in range(a.runs):
            in_hosts(names[:1], WIPE)
            one, _ = stage_cli(inv, names[:1])
            in_hosts(names, WIPE)
            logs.mark()
            ring, doc = stage_cli(inv, names)
            sessions = {h: c["sessions"] for h, c in logs.counts().items()}
            calls = {h: v["remote_calls"] for h, v in doc["hosts"].items()}
            rows.append({"one_download_s": round(one, 3), "ring_s": round(ring, 3), "ratio": round(ring / one, 3),
                         "remote_calls": calls, "sshd_sessions": sessions})
            print(f"run {k + 1}: one {one:.2f} s, ring {ring:.2f} s ({ring / one:.2f}x); remote calls {calls}; "
                  f"sshd sessions {sessions}", file=sys.stderr)
        in_hosts(names, WIPE)
        timed = timed_run(inv, names)
        print("\n".join(timed["events"]), file=sys.stderr)
        in_hosts(names[:1], WIPE)
        timed_one = timed_run(inv, names[:1])
        print("\n".join(timed_one["events"]), file=sys.stderr)
        out = {"date": date.today().isoformat(), "machine": machine(), "model": MODEL, "hosts": names,
               "topology": "ring", "runs": rows,
               "one_download_median_s": round(median([r["one_download_s"] for r in rows]), 3),
               "ring_median_s": round(median([r["ring_s"] for r in rows]), 3),
               "timed_ring_run": timed, "timed_one_download": timed_one}
        out["ratio_of_medians"] = round(out["ring_median_s"] / out["one_download_median_s"], 3)
        print(json.dumps({k: v for k, v in out.items() if k not in ("timed_ring_run", "timed_one_download", "machine")}, indent=1))
        if a.json:
            write_result("stage-ring", out)
    finally:
        if not a.keep:
            lab_down()


if __name__ == "__main__":
    main()
