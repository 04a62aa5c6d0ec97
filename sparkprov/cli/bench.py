"""`invoke bench DEPLOYMENT`: vLLM's benchmark client against a running deployment. Parses and
prints; sparkprov/plays/bench.py runs the play (so it has --check, --json, --limit, --forks, the
recap and the exit codes of every command) and stores, plots and compares the runs.

data, plays, serving, outputs (tempfile) and rich load inside the functions, not at the top: tasks.py imports every cli
module, and `invoke --list` stays fast.
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING

from invoke import task

from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.cli.options import (OptionError, choice_option, csv_option, float_option, int_option, parse_forks,
                                   positional, text_option)
from sparkprov.defaults import DEFAULT_FORKS
from sparkprov.errors import SparkprovError

if TYPE_CHECKING:  # annotations only: the plays load inside the task
    from sparkprov.plays.bench import BenchResult

HELP = {
    "deployment": "The deployment to measure (its name, as `invoke status` shows it)",
    "concurrency": "Concurrency levels, comma-separated (default 1,4,16,64; each 1 to 4096)",
    "input_len": "Prompt length in tokens (default 1024)",
    "output_len": "Output length in tokens, generated to the end (--ignore-eos; default 128)",
    "profile": "A named workload: arena (the community leaderboard's: input 2048, output 128, concurrency "
               "1,2,5,10); --concurrency, --input-len and --output-len still override it",
    "export": "Write the deployment's newest stored run (under --results) as NVIDIA's performance.yaml to this "
              "file; runs nothing, contacts no host",
    "prompts": "Requests per level (default: 4 x the concurrency, at least 8)",
    "results": "Folder for the results (default ~/.local/share/sparkprov/bench): DEPLOYMENT/RECIPE_HASH/*.json and *.png",
    "compare": "Show the change against the last stored run of the same recipe, host and parameters",
    "timeout": "Seconds one level may take (default 3600)",
    "check": "Say where the client would run; run nothing",
    "json": "Print one JSON document ({ok, hosts, results, bench}) instead of the tables and recap",
    "hosts": "Hosts, groups or patterns to look on, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "limit": "Further limit the hosts (pattern)",
    "forks": "How many hosts to read at once (default 32)",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
}

DEPLOYMENT_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"


@task(help=HELP)
def bench(c, deployment, concurrency=None, input_len=None, output_len=None, prompts=None, results=None,
          compare=False, timeout=None, check=False, json=False, hosts=None, inventory=None, limit=None, forks=None,
          accept_new_host_keys=False, profile=None, export=None):
    """Throughput and latency of a deployment at each concurrency (vllm bench serve in its container):
    stored as JSON under its recipe hash and image with its provenance (image digest, model commit,
    driver, kernel, layout), plotted (PNG), compared with --compare; --export writes a stored run
    as NVIDIA's performance.yaml."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.outputs import check_output_dir, check_output_file
    from sparkprov.plays.bench import run_bench
    from sparkprov.serving import bench as sb

    out = sys.stderr if json else sys.stdout
    with user_errors():
        deployment = positional("bench", "deployment", deployment)
        if not re.fullmatch(DEPLOYMENT_PATTERN, deployment):
            raise OptionError(f"bench: {deployment!r} is not a deployment name",
                              fix="give the name `invoke status` shows (letters, digits, . _ -)")
        args = bench_args(deployment, concurrency=concurrency, input_len=input_len, output_len=output_len,
                          prompts=prompts, timeout=timeout, profile=profile)
        # checked before any host: a FIFO, /dev/full or a file here would fail the run at its end
        store_at = check_output_dir("results", text_option("results", results, default=sb.RESULTS_DIR))
        if export is not None:
            return export_run(deployment, store_at, check_output_file("export", text_option("export", export)), check)
        forks = parse_forks(forks, DEFAULT_FORKS)
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        report = Report(out, quiet=json)
        found = run_bench(inv, targets, args, engine_options(check=check, forks=forks,
                                                             accept_new_host_keys=accept_new_host_keys),
                          report, results=store_at, compare=compare)
    if not found.served and report.exit_code() == 0:
        print(f"sparkprov: no host of {', '.join(targets)} serves {deployment} "
              "(fix: invoke status shows what runs; invoke cluster-up starts it)", file=sys.stderr)
        finish(2)
    for line in found.skipped:
        print(f"sparkprov: skipped {line}", file=sys.stderr)
    if json:
        print_report(report, True, bench={"deployment": deployment, "check": bool(check), "runs": found.runs,
                                          "served_on": found.served})
    else:
        for r in found.runs:
            print_run(r)
        if check and found.served:
            print(f"would run vllm bench serve for {deployment} on {', '.join(found.served)}; nothing ran")
        report.recap()
    finish(report.exit_code())


def bench_args(deployment: str, *, concurrency=None, input_len=None, output_len=None, prompts=None, timeout=None,
               profile=None) -> dict:
    """The serve_bench arguments from the options: a named profile's values, unless an option gives its own."""
    from sparkprov.serving import bench as sb

    profile = choice_option("profile", profile, sorted(sb.PROFILES))
    preset = sb.PROFILES.get(profile or "", {})
    levels = [int_option("concurrency", w, 1, 4096)
              for w in csv_option("concurrency", concurrency, pattern=r"[0-9]+", allowed_text="whole numbers",
                                  default=[str(x) for x in preset.get("concurrency", [1, 4, 16, 64])])]
    return {"deployment": deployment, "concurrency": sorted(set(levels)),
            "input_len": int_option("input-len", input_len, 1, 1_048_576, default=preset.get("input_len", 1024)),
            "output_len": int_option("output-len", output_len, 1, 1_048_576, default=preset.get("output_len", 128)),
            "prompts": int_option("prompts", prompts, 1, 1_000_000),
            "timeout": float_option("timeout", timeout, 0, 86400, default=3600.0, unit="seconds"),
            "profile": profile}


def export_run(deployment: str, results, out, check: bool) -> None:
    """The newest stored run of the deployment, as NVIDIA's performance.yaml (written atomically,
    never over a stored run). A stored file that is not a run is refused: it may be the newest."""
    from sparkprov.outputs import check_output_file, write_text_atomic
    from sparkprov.serving import bench as sb

    runs, skipped = sb.stored_runs(results, deployment)
    if skipped:
        raise skipped[0]
    if not runs:
        raise SparkprovError(f"bench --export: no stored run of {deployment} under {results}",
                             fix=f"run invoke bench {deployment} first, or give --results the folder it stored into")
    check_output_file("export", str(out), inputs=[r["path"] for r in runs])
    rec = runs[-1]
    if check:
        print(f"would write {out} from {rec['path']}; nothing written")
        return
    write_text_atomic(out, sb.performance_yaml(rec))
    print(f"{rec['path']} -> {out} (NVIDIA performance.yaml, {len(rec.get('rows') or [])} profile(s))")


def print_run(run: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False, width=160)
    t = Table(title=f"{run['deployment']} on {run['host']} ({run.get('recipe')}, recipe {run.get('recipe_hash')}, "
                    f"image {(run.get('image_id') or '?').split(':')[-1][:12]})")
    cmp = (run.get("compare") or {}).get("levels") or {}
    cols = [("concurrency", None), ("output tok/s", "output_throughput"), ("total tok/s", "total_token_throughput"),
            ("TTFT mean/p50/p99 ms", "ttft"), ("ITL mean/p50/p99 ms", "itl"), ("E2E p50/p99 s", "e2el"),
            ("failed", "failed")]
    for name, _ in cols:
        t.add_column(name, justify="right")
    for r in run["rows"]:
        d = cmp.get(str(r["concurrency"])) or {}

        def val(key, fmt="{:.1f}"):
            v = r.get(key)
            s = fmt.format(v) if isinstance(v, (int, float)) else "-"
            return s + (f" ({d[key]:+.1f}%)" if d.get(key) is not None else "")

        def lat(m):
            return "/".join(f"{r[k]:.1f}" if isinstance(r.get(k), (int, float)) else "-"
                            for k in (f"{m}_mean_ms", f"{m}_p50_ms", f"{m}_p99_ms"))

        e2e = "/".join(f"{r[k] / 1000:.2f}" if isinstance(r.get(k), (int, float)) else "-"
                       for k in ("e2el_p50_ms", "e2el_p99_ms"))
        t.add_row(str(r["concurrency"]), val("output_throughput"), val("total_token_throughput"), lat("ttft"),
                  lat("itl"), e2e, str(r.get("failed") if r.get("failed") is not None else "-"))
    con.print(t)
    prov = run.get("provenance") or {}
    lay = prov.get("layout") or {}
    con.print(f"image {prov.get('image_digest') or prov.get('image') or '?'}; model {prov.get('model_repo') or '?'}@"
              f"{(prov.get('model_commit') or prov.get('model_revision') or '?')[:12]}; vLLM {prov.get('vllm_version') or '?'}; "
              f"driver {prov.get('driver_version') or '?'}; kernel {prov.get('kernel') or '?'}; "
              f"tp {lay.get('tp', '?')} x pp {lay.get('pp', '?')} on {', '.join(lay.get('hosts') or []) or run['host']}")
    c = run.get("compare")
    if c:
        con.print(f"compared with {c['against']} ({c['time']})"
                  + ("" if c["same_image"] else ": ANOTHER IMAGE than this run's"))
        for k, (before, now) in (c.get("changed") or {}).items():
            con.print(f"  {k} changed: {before} -> {now}")
    elif run.get("compared"):
        con.print("no earlier run of this recipe, host and parameters to compare with")
    con.print(f"stored {run['path']}\nplot   {run['plot']}")
