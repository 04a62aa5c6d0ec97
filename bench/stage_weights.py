"""Benchmark: stage a model of a few hundred MB from a throttled lab hub to N receivers.

    sudo .venv/bin/python bench/stage_weights.py [--size-mb 300] [--throttle-mbps 40] [--hosts 2,4,8] [--json]

Needs the lab up (`invoke lab.up`, two Sparks). Starts its own hub on the lab bridge (10.77.0.1, a
free port) serving one generated repo, throttled as a home internet link would be (the limit is
shared by every connection, like one uplink).

For N receivers it measures, in the same run:

  cold        `stage-weights`: the control machine (a Spark, connection: local) downloads once
              with huggingface_hub and sends each file on to the N receivers as soon as it is
              verified (pipelined fan-out over SSH), each receiver hashing it as it lands.
  warm        the same command again: a no-op (changed=0, one remote call per host).
  one         one `hf download REPO` to one host: what a single download of the repo costs.
  each        N concurrent `hf download REPO` (huggingface_hub's CLI, each with its own HF_HOME),
              all against the same throttled hub: what each Spark downloading for itself costs.

The lab has two simulated Sparks; N > 2 puts several stores on one Spark (inventory hosts
spark1a, spark1b, ...: same address, different model_store), so every receiver still gets its
bytes over its own SSH stream and hashes them itself.

--json prints one document: {"rows": [{"hosts": N, "cold_s": ..., "one_download_s": ...,
"warm_s": ..., ...}, ...], ...}.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MiB = 1024 * 1024
LAB_STATE = Path("/run/sparkprov-lab")
HUB_IP = "10.77.0.1"


def lab_hosts() -> dict[str, str]:
    from sparklab.state import LabRecord

    rec = LabRecord.load()
    return {n: h.address for n, h in sorted(rec.hosts.items(), key=lambda kv: kv[1].index)}


def inventory(tmp: Path, n: int, url: str) -> Path:
    sparks = lab_hosts()
    if not sparks:
        sys.exit("the lab is not up: run `invoke lab.up` first")
    receivers = []
    names = list(sparks)
    for k in range(n):
        spark = names[k % len(names)]
        receivers.append((f"{spark}{'abcdefgh'[k // len(names)]}", sparks[spark], f"~/bench-stage-{k // len(names)}"))
    lines = ["defaults:", "  user: nvidia", f"  ssh_key: {LAB_STATE / 'id_ed25519'}",
             f"  known_hosts: {LAB_STATE / 'known_hosts'}", f"  become_password_file: {LAB_STATE / 'become_password'}",
             "hosts:", f"  localhost: {{connection: local, vars: {{model_store: {tmp / 'control-store'}}}}}"]
    lines += [f"  {name}: {{address: {addr}, vars: {{model_store: '{store}'}}}}" for name, addr, store in receivers]
    lines += ["vars:", f"  hf_endpoint: {url}"]
    path = tmp / f"inventory-{n}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def clean(tmp: Path, inv: Path) -> None:
    from sparkprov.data.inventory import load_inventory

    shutil.rmtree(tmp / "control-store", ignore_errors=True)
    key = LAB_STATE / "id_ed25519"
    for h in load_inventory(inv).hosts.values():
        if h.connection == "local":
            continue
        store = h.vars["model_store"].replace("~/", "")
        subprocess.run(["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={LAB_STATE / 'known_hosts'}",
                        f"nvidia@{h.address}", f"rm -rf {store}"], check=True, capture_output=True)


def stage(inv: Path, model: str, streams: int) -> tuple[float, dict, dict]:
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.plays.stage import StageOptions, run_stage

    i = load_inventory(inv)
    report = Report(io.StringIO())
    t = time.monotonic()
    summary = run_stage(i, list(i.hosts), model, StageOptions(streams=streams), report)
    secs = time.monotonic() - t
    if report.exit_code() != 0:
        sys.exit("stage failed:\n" + report.stream.getvalue())
    return secs, summary, report.as_dict()


def hf_download_each(n: int, model: str, url: str, tmp: Path) -> float:
    hf = Path(sys.executable).with_name("hf")
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop("HF_TOKEN", None)
    homes = [tmp / f"hf-home-{k}" for k in range(n)]
    for h in homes:
        shutil.rmtree(h, ignore_errors=True)

    def one(home: Path) -> None:
        subprocess.run([str(hf), "download", model], env={**env, "HF_HOME": str(home)}, check=True,
                       capture_output=True)

    t = time.monotonic()
    with ThreadPoolExecutor(max_workers=n) as pool:
        list(pool.map(one, homes))
    secs = time.monotonic() - t
    for h in homes:
        shutil.rmtree(h, ignore_errors=True)
    return secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=300, help="model size in MiB (default 300)")
    ap.add_argument("--shards", type=int, default=4, help="safetensors shards (default 4)")
    ap.add_argument("--throttle-mbps", type=float, default=40.0, help="hub limit, MB/s for all clients together (default 40)")
    ap.add_argument("--hosts", default="2,4,8", help="receiver counts to run, comma-separated (default 2,4,8)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--streams", type=int, default=4, help="stage-weights --streams (default 4)")
    args = ap.parse_args()

    from sparklab.hub import RepoSpec, default_root, ensure_generated, start_in_thread

    spec = RepoSpec("bench/stage-weights", num_shards=args.shards, total_size=args.size_mb * MiB)
    repo = ensure_generated(spec, default_root())
    size = sum(f.size for f in repo.files.values() if f.path != ".gitattributes")
    bps = int(args.throttle_mbps * 1e6)
    server = start_in_thread([repo], bind=HUB_IP, port=0, throttle_bps=bps)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-stage-") as d:
            tmp = Path(d)
            for n in [int(x) for x in args.hosts.split(",")]:
                inv = inventory(tmp, n, server.url)
                clean(tmp, inv)
                cold, _, doc = stage(inv, spec.repo_id, args.streams)
                warm, _, warm_doc = stage(inv, spec.repo_id, args.streams)
                warm_calls = max(h["remote_calls"] for h in warm_doc["hosts"].values())
                warm_changed = sum(h["changed"] for h in warm_doc["hosts"].values())
                clean(tmp, inv)
                one = hf_download_each(1, spec.repo_id, server.url, tmp)
                each = hf_download_each(n, spec.repo_id, server.url, tmp)
                rows.append({"hosts": n, "cold_s": round(cold, 2), "one_download_s": round(one, 2),
                             "warm_s": round(warm, 3), "cold_over_one": round(cold / one, 3),
                             "warm_changed": warm_changed, "warm_max_calls_per_host": warm_calls,
                             "each_host_hf_download_s": round(each, 2), "speedup_vs_each": round(each / cold, 2)})
    finally:
        server.shutdown()
        server.server_close()
    meta = {"model": spec.repo_id, "bytes": size, "files": len(repo.files) - 1,
            "throttle_mb_s": args.throttle_mbps, "streams": args.streams}
    if args.json:
        print(json.dumps({**meta, "rows": rows}, indent=2))
        return 0
    print(f"\nmodel {spec.repo_id}: {size / 1e6:.1f} MB in {len(repo.files) - 1} files; hub throttled to "
          f"{args.throttle_mbps:g} MB/s (shared); streams={args.streams}\n")
    print("| receivers | sparkprov cold (s) | one `hf download` (s) | cold / one | sparkprov warm (s) "
          "| warm changed / max calls per host | each host `hf download` (s) | speed-up vs each |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['hosts']} | {r['cold_s']:.1f} | {r['one_download_s']:.1f} | {r['cold_over_one']:.2f}x "
              f"| {r['warm_s']:.2f} | {r['warm_changed']} / {r['warm_max_calls_per_host']} "
              f"| {r['each_host_hf_download_s']:.1f} | {r['speedup_vs_each']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
