"""`invoke cluster-up`, `cluster-down`, `status`, `nccl-check` (thin: parse options, call sparkprov.cluster).

The lead registers them in tasks.py:

    from sparkprov.cli import cluster as cluster_cli
    ns.add_task(task(cluster_cli.cluster_up, name="cluster-up", help=cluster_cli.UP_HELP, iterable=["recipes"]))
    ... (cluster_down / DOWN_HELP, status / STATUS_HELP, nccl_check / NCCL_HELP)
"""

from __future__ import annotations

import json as _json
import sys

COMMON = {
    "hosts": "Hosts, groups or patterns to act on, comma-separated (default: every host the playbook names)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "json": "Print one JSON document ({ok, hosts, results, ...}) instead of the recap",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
}
UP_HELP = {
    **COMMON,
    "tp": "Tensor-parallel size: start the deployments of this size (2: one model across two Sparks with Ray). "
          "Without --playbook, 1 reads playbooks/serve.yaml and N > 1 playbooks/cluster.yaml",
    "playbook": "Serve playbook (deployments: model, hosts, tp, overrides). Default: playbooks/cluster.yaml "
                "(playbooks/serve.yaml with --tp 1)",
    "deployments": "Only these deployments of the playbook (comma-separated names)",
    "check": "Preflight and plan only: say what would start or be replaced, change nothing",
    "recipes": "A user recipe file merged over the catalog (repeatable)",
    "stage": "Stage missing weights with stage-weights before starting (without it: ask on a terminal, else fail naming the fix)",
    "unload_ollama": "Unload models an Ollama server holds in unified memory before the load (G14)",
    "drop_caches": "Drop the page cache as root before a load (G15; default on, --no-drop-caches to skip)",
    "image_source": "Where a node missing the image gets it: auto (registry, then a peer over the fabric), "
                    "registry, or peer",
    "ray_timeout": "Seconds to wait for every Ray node and GPU to join (default 300)",
    "health_timeout": "Seconds to wait for /health (default: the recipe's startup.health_timeout_s)",
    "verify": "Also warm up and smoke-test deployments that are already up and unchanged",
    "prune": "Remove sparkprov containers on these hosts whose deployment is not in the playbook",
}
DOWN_HELP = {
    **COMMON,
    "hosts": "Hosts, groups or patterns to clean, comma-separated (default: all in the inventory)",
    "deployments": "Only the containers of these deployments (comma-separated; default: every sparkprov container)",
    "check": "Say what would be removed, remove nothing",
}
STATUS_HELP = {**COMMON, "hosts": "Hosts, groups or patterns to show, comma-separated (default: all in the inventory)"}
NCCL_HELP = {
    **COMMON,
    "hosts": "The hosts to test, comma-separated; the first is rank 0 (default: all in the inventory)",
    "image": "Image to run the benchmark in (default: the image of the playbook's first TP deployment)",
    "playbook": "Serve playbook whose first TP deployment names the image (default: playbooks/cluster.yaml)",
    "threshold": "Bus bandwidth in GB/s below which the check fails (default 21.875, NVIDIA's two-Spark minimum)",
    "max_bytes": "Largest all-reduce message (default 2G, as in the published two-Spark figures)",
    "iters": "Timed iterations per size (default 20)",
}


def _csv(v):
    from sparkprov.cli.common import split_csv

    return split_csv(v) or None


def _playbook_path(playbook, tp):
    from sparkprov.cli.common import playbook_path

    return playbook_path(playbook, "serve.yaml" if tp == 1 else "cluster.yaml")


def cluster_up(c, tp=None, playbook=None, hosts=None, inventory=None, check=False, json=False, deployments=None,
               recipes=None, stage=False, unload_ollama=False, drop_caches=True, image_source="auto", ray_timeout=300,
               health_timeout=None, verify=False, prune=False, accept_new_host_keys=False):
    """Start the playbook's models (single-node servers, or Ray TP clusters) and prove they serve."""
    from invoke.exceptions import Exit

    from sparkprov.cli.common import finish, inventory_path, print_report, user_errors
    from sparkprov.cluster.bringup import UpOptions, cluster_up as run
    from sparkprov.cluster.playbook import load_serve_playbook, select
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report

    if image_source not in ("auto", "registry", "peer"):
        raise Exit("sparkprov: --image-source is auto, registry or peer", code=1)
    try:
        tp = int(tp) if tp is not None else None
        ray_timeout = float(ray_timeout)
        health_timeout = float(health_timeout) if health_timeout is not None else None
    except ValueError:
        raise Exit("sparkprov: --tp is a whole number; --ray-timeout and --health-timeout are seconds", code=1) from None
    out = sys.stderr if json else sys.stdout
    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        pb = load_serve_playbook(_playbook_path(playbook, tp), inv)
        chosen_hosts = inv.resolve(hosts, what="--hosts") if hosts else None
        deps = select(pb, tp=tp, hosts=chosen_hosts, names=_csv(deployments))
        report = Report(out, quiet=json)
        opts = UpOptions(check=check, recipes=list(recipes or []), accept_new_host_keys=accept_new_host_keys,
                         stage=True if stage else None, unload_ollama=unload_ollama, drop_caches=drop_caches,
                         image_source=image_source, ray_timeout=ray_timeout, health_timeout=health_timeout,
                         verify=verify, prune=prune, progress_stream=out, quiet=False)
        summary = run(inv, pb, deps, opts, report)
    print_report(report, json, cluster=summary)
    if not json:
        print_summary(summary, report.exit_code() == 0)
    finish(report.exit_code())


def print_summary(summary, ok: bool) -> None:
    for name, d in summary.get("deployments", {}).items():
        state = d.get("action")
        print(f"\n{name}: {d['alias']} (TP {d['tp']}) on {', '.join(d['hosts'])}: "
              + {"ok": "already up, unchanged", "start": "started", "replace": "replaced", "wait": "up",
                 "failed": "FAILED (nothing left running)"}.get(state, state))
        if state != "failed" and ok:
            print(f"  endpoint:     {d['endpoint']}")
            print(f"  model:        {d['model']}")
            print(f"  API key file: {d['api_key_file'] or 'none (bound to loopback)'}")
            for h, n in (d.get("nodes") or {}).items():
                print(f"  {h}: {n['container']} ({n['role']}, recipe {n['recipe_hash']}"
                      + (f", fabric {n['node_ip']}" if n.get("node_ip") else "") + ")")
    if "seconds" in summary:
        calls = ", ".join(f"{h}={n}" for h, n in summary.get("remote_calls", {}).items())
        print(f"\ncluster-up took {summary['seconds']:.1f}s; remote calls: {calls}")


def cluster_down(c, hosts=None, inventory=None, deployments=None, check=False, json=False, accept_new_host_keys=False):
    """Remove exactly the containers (and so the Ray processes) sparkprov started, by label, on every host."""
    from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
    from sparkprov.cluster.manage import down
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report

    out = sys.stderr if json else sys.stdout
    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, None)
        report = Report(out, quiet=json)
        removed = down(inv, targets, report, deployments=_csv(deployments), check=check,
                       accept_new_host_keys=accept_new_host_keys)
    print_report(report, json, removed=removed)
    finish(report.exit_code())


def status(c, hosts=None, inventory=None, json=False, accept_new_host_keys=False):
    """Per host: sparkprov containers, Ray nodes and GPUs, health, served models, KV-cache use, spec-decode acceptance."""
    from sparkprov.cli.common import finish, inventory_path, select_hosts, user_errors
    from sparkprov.cluster.manage import status as run
    from sparkprov.data.inventory import load_inventory

    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, None)
        st = run(inv, targets, accept_new_host_keys=accept_new_host_keys)
    if json:
        print(_json.dumps(st, indent=2, default=str))
    else:
        print_status(st)
    bad = any(not h.get("reachable") for h in st.values())
    finish(4 if bad else 0)


def print_status(st) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False, width=160)
    t = Table(title="sparkprov serving status")
    for col in ("host", "container", "deployment", "role", "state", "ray", "health", "models", "KV cache", "spec accept"):
        t.add_column(col, overflow="fold")
    for host, h in st.items():
        if not h.get("reachable"):
            t.add_row(host, "-", "-", "-", "UNREACHABLE", "", "", "", "", h.get("error") or "")
            continue
        if not h["containers"]:
            t.add_row(host, "(none)", "", "", "docker ok" if h["docker"] else f"docker: {h['error']}", "", "", "", "", "")
        for c in h["containers"]:
            ray = c.get("ray")
            m = c.get("metrics") or {}
            acc = m.get("spec_acceptance")
            t.add_row(host, c["name"], c["deployment"] or "", c["role"] or "",
                      c["status"] + (f" (restarts {c['restarts']})" if c["restarts"] else ""),
                      f"{ray['nodes']} nodes, {ray['gpus']:g} GPUs" if ray else "",
                      str(c.get("health", "")) if c.get("port") else "",
                      ", ".join(c.get("served_models") or []),
                      f"{100 * m['kv_cache_usage']:.1f}%" if "kv_cache_usage" in m else "",
                      f"{100 * acc:.1f}%" if acc is not None else ("" if "spec_acceptance" not in m else "no drafts yet"))
    con.print(t)


def nccl_check(c, hosts=None, inventory=None, image=None, playbook=None, threshold=21.875, max_bytes="2G", iters=20,
               json=False, accept_new_host_keys=False):
    """All-reduce bus bandwidth across the hosts over the fabric, in the serving image, against a threshold."""
    from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
    from sparkprov.cluster.nccl import nccl_check as run
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.errors import SparkprovError

    out = sys.stderr if json else sys.stdout
    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, None)
        if len(targets) < 2:
            raise SparkprovError("nccl-check needs at least two hosts", fix="--hosts spark1,spark2")
        if not image:
            from sparkprov.catalog.load import load_catalog
            from sparkprov.cluster.playbook import load_serve_playbook

            pb = load_serve_playbook(_playbook_path(playbook, 2), inv)
            dep = next((d for d in pb.deployments if d.cluster), None) or pb.deployments[0]
            cat = load_catalog(pb.recipe_files)
            r = cat.get(dep.model)
            info = cat.image(r.image)
            image = r.image if ("@" in r.image or info is None) else info.pinned
        report = Report(out, quiet=json)
        res = run(inv, targets, image, report, threshold=float(threshold), max_bytes=str(max_bytes), iters=int(iters),
                  accept_new_host_keys=accept_new_host_keys)
    print_report(report, json, nccl=res)
    finish(report.exit_code())
