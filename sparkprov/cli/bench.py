"""`invoke bench DEPLOYMENT`: vLLM's benchmark client against a running deployment. Parses and
prints; sparkprov/plays/bench.py runs the play (so it has --check, --json, --limit, --forks, the
recap and the exit codes of every command) and stores, plots and compares the runs.

data, plays, outputs (tempfile) and rich load inside the functions, not at the top (sparkprov/cli/command.py says
why); serving/bench.py (the results folder, the profiles) is light.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkprov.cli.command import command
from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.errors import SparkprovError
from sparkprov.options import Choice, Flag, Form, Int, Ints, Number, Pattern, Text, common, option
from sparkprov.serving import bench as sb

if TYPE_CHECKING:  # annotations only: the plays load inside the task
    from sparkprov.plays.bench import BenchResult

DEPLOYMENT_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"


@dataclass
class BenchOptions:
    deployment: str = option("The deployment to measure (its name, as `invoke status` shows it)",
                             Pattern(DEPLOYMENT_PATTERN, "a deployment name (letters, digits, . _ -)", "qwen3.5-122b"),
                             positional=True)
    concurrency: list[int] | None = option("Concurrency levels, comma-separated (default 1,4,16,64; each 1 to 4096)",
                                           Ints(1, 4096))
    input_len: int | None = option("Prompt length in tokens (default 1024)", Int(1, 1_048_576))
    output_len: int | None = option("Output length in tokens, generated to the end (--ignore-eos; default 128)",
                                    Int(1, 1_048_576))
    prompts: int | None = option("Requests per level (default: 4 x the concurrency, at least 8)", Int(1, 1_000_000))
    results: str = option("Folder for the results (default ~/.local/share/sparkprov/bench): "
                          "DEPLOYMENT/RECIPE_HASH/*.json and *.png", Text(), default=sb.RESULTS_DIR)
    compare: bool = option("Show the change against the last stored run of the same recipe, host and parameters",
                           Flag())
    timeout: float = option("Seconds one level may take (default 3600)", Number(0, 86400, unit="seconds"),
                            default=3600.0)
    check: bool = option("Say where the client would run; run nothing (with --export: what would be written)",
                         Flag())
    json: bool = common("json")
    hosts: str | None = common("hosts", "Hosts, groups or patterns to look on, comma-separated (default: all in "
                                        "the inventory)")
    inventory: str | None = common("inventory")
    limit: str | None = common("limit")
    forks: int = common("forks")
    accept_new_host_keys: bool = common("accept_new_host_keys")
    profile: str | None = option("A named workload: arena (the community leaderboard's: input 2048, output 128, "
                                 "concurrency 1,2,5,10); --concurrency, --input-len and --output-len still override "
                                 "it", Choice(tuple(sorted(sb.PROFILES))))
    export: str | None = option("Write the deployment's newest stored run (under --results) as NVIDIA's "
                                "performance.yaml to this file; runs nothing, contacts no host", Text())

    # --export writes a stored run: nothing is measured, no host is read
    RULES = (Form("bench --export", lambda o: o.export is not None,
                  frozenset({"deployment", "results", "check", "export"})),)

    def serve_bench_args(self) -> dict[str, Any]:
        """The serve_bench arguments: a named profile's values, unless an option gives its own."""
        preset = sb.PROFILES.get(self.profile or "", {})
        return {"deployment": self.deployment, "concurrency": self.concurrency or preset.get("concurrency",
                                                                                               [1, 4, 16, 64]),
                "input_len": self.input_len or preset.get("input_len", 1024),
                "output_len": self.output_len or preset.get("output_len", 128),
                "prompts": self.prompts, "timeout": self.timeout, "profile": self.profile}


@command(BenchOptions)
def bench(c, o: BenchOptions):
    """Throughput and latency of a deployment at each concurrency (vllm bench serve in its container):
    stored as JSON under its recipe hash and image with its provenance (image digest, model commit,
    driver, kernel, layout), plotted (PNG), compared with --compare; --export writes a stored run
    as NVIDIA's performance.yaml."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.outputs import check_output_dir, check_output_file
    from sparkprov.plays.bench import run_bench

    out = sys.stderr if o.json else sys.stdout
    deployment, check = o.deployment, o.check
    with user_errors():
        # checked before any host: a FIFO, /dev/full or a file here would fail the run at its end
        store_at = check_output_dir("results", o.results)
        if o.export is not None:
            return export_run(deployment, store_at, check_output_file("export", o.export), check)
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        report = Report(out, quiet=o.json)
        found = run_bench(inv, targets, o.serve_bench_args(), engine_options(o), report, results=store_at,
                          compare=o.compare)
    if not found.served and report.exit_code() == 0:
        print(f"sparkprov: no host of {', '.join(targets)} serves {deployment} "
              "(fix: invoke status shows what runs; invoke cluster-up starts it)", file=sys.stderr)
        finish(2)
    for line in found.skipped:
        print(f"sparkprov: skipped {line}", file=sys.stderr)
    if o.json:
        print_report(report, True, bench={"deployment": deployment, "check": bool(check), "runs": found.runs,
                                          "served_on": found.served})
    else:
        for r in found.runs:
            print_run(r)
        if check and found.served:
            print(f"would run vllm bench serve for {deployment} on {', '.join(found.served)}; nothing ran")
        report.recap()
    finish(report.exit_code())


def export_run(deployment: str, results, out, check: bool) -> None:
    """The newest stored run of the deployment, as NVIDIA's performance.yaml (written atomically,
    never over a stored run). A stored file that is not a run is refused: it may be the newest."""
    from sparkprov.outputs import check_output_file, write_text_atomic

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
