"""`invoke cluster-up`, `cluster-down`, `status`, `nccl-check`: parse options, run the plays
(sparkprov/plays/cluster.py, serve.py), print what they return.

Registered in tasks.py, each with its help: cluster_up (UP_HELP), cluster_down (DOWN_HELP), status
(STATUS_HELP), nccl_check (NCCL_HELP).
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
    "tp": "Tensor-parallel size (with --model: of the new deployment; else start the playbook's deployments of this "
          "size). Without --model or --playbook, 1 reads playbooks/serve.yaml and N > 1 playbooks/cluster.yaml",
    "playbook": "Serve playbook (deployments: model, hosts, tp, overrides). Default: playbooks/cluster.yaml "
                "(playbooks/serve.yaml with --tp 1)",
    "deployments": "Only these deployments of the playbook (comma-separated names)",
    "check": "Preflight and plan only: say what would start or be replaced, change nothing",
    "recipes": "A user recipe file merged over the catalog (repeatable)",
    "stage": "Stage the weights first, as stage-weights does, in the same run (with --check: says what it would stage)",
    "unload_ollama": "Unload models an Ollama server holds in unified memory before the load (G14)",
    "drop_caches": "Drop the page cache as root before a load (G15; default on, --no-drop-caches to skip)",
    "image_source": "Where a node missing the image gets it: auto (registry, then a peer over the fabric), "
                    "registry, or peer",
    "ray_timeout": "Seconds to wait for every Ray node and GPU to join (default 300)",
    "health_timeout": "Seconds to wait for /health (default: the recipe's startup.health_timeout_s)",
    "verify": "Also warm up and smoke-test deployments that are already up and unchanged",
    "force_degraded_fabric": "Start a multi-node deployment even over a node whose last fabric qualification "
                             "(invoke provision) recorded a degraded rail (refused without it, naming the rail)",
    "image": "Run this image instead of the recipe's (one deployment: how a new build is tried); if its start fails "
             "its smoke test, every node goes back to the deployment's last good start (invoke history)",
    "gate": "What an upgrade (a start replacing a running one) must pass to be kept: smoke (default: its smoke "
            "test) or bench (also invoke bench at the parameters of the last good start's stored run, keeping "
            "--gate-ratio of its output tok/s); a start that fails goes back to the last good start",
    "gate_ratio": "With --gate bench: the share of the last good start's output tok/s to keep (default 0.9)",
    "replace": "Make room on the deployment's hosts: the other deployments serving there are removed first (on every "
               "host they run on) and, if the new one fails, started again from their last good start",
    "results": "With --gate bench: the folder invoke bench stores its runs in, where the last good start's run is "
               "found and the gate's run is stored (default ~/.local/share/sparkprov/bench)",
    "pin": "Run each deployment by the registry digest its nodes' docker holds for its image (REPO@sha256:..., "
           "after the image play): a restart or a later tag move cannot change what runs. Refused before any "
           "container starts when a node's image has no registry digest (built or copied there) or the nodes "
           "hold different digests; a pinned deployment started again with --pin is left running",
}
DOWN_HELP = {
    **COMMON,
    "limit": "Further limit the hosts (pattern)",
    "forks": "How many hosts to work on at once (default 32)",
    "hosts": "Hosts, groups or patterns to clean, comma-separated (default: all in the inventory)",
    "deployments": "Only the containers of these deployments (comma-separated; default: every sparkprov container)",
    "check": "Say what would be removed, remove nothing",
}
STATUS_HELP = {**COMMON, "hosts": "Hosts, groups or patterns to show, comma-separated (default: all in the inventory)",
               "limit": "Further limit the hosts (pattern)", "forks": "How many hosts to work on at once (default 32)",
               "watch": "Refresh every this many seconds until interrupted (Ctrl-C)",
               "count": "With --watch: stop after this many refreshes",
               "ports": "Also every listening TCP/UDP port per host: process, deployment, and from where it can be "
                        "reached (loopback, fabric peers, everyone); exit 2 when one open to everyone is neither an "
                        "API port with a key nor sshd (reads as root)"}
NCCL_HELP = {
    **COMMON,
    "check": "Check the hosts (fabric, image) and say what would run; run nothing",
    "limit": "Further limit the hosts (pattern)",
    "forks": "How many hosts to work on at once (default 32)",
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


UP_HELP.update({
    "model": "Serve this catalog model without a playbook (invoke models lists them); with --tp, --hosts, --name",
    "name": "Deployment name for --model (default: the model alias)",
    "executor": "Multi-node executor: ray (default: a Ray cluster) or native (vLLM's own --nnodes/--node-rank)",
    "pp": "Pipeline-parallel size (default 1): a cluster spans tp x pp Sparks",
    "dp": "With --model: data-parallel replicas (default 1), one Spark each, behind rank 0's API (executor native): "
          "the deployment spans tp x pp x dp Sparks",
    "ep": "With --model: --enable-expert-parallel (MoE recipes; experts split over tp x dp)",
    "limit": "Further limit the hosts (pattern)",
    "forks": "How many hosts to work on at once (default 32)",
})
DOWN_HELP["model"] = "Remove the deployment cluster-up --model started (its name: --name, else the alias)"
DOWN_HELP["name"] = "Deployment name given to cluster-up --model --name"
NCCL_HELP["backend"] = "nccl (default: on the GPU; a container without the GPU fails) or gloo (CPU, e.g. the lab)"


def cluster_up(c, model=None, tp=None, pp=None, dp=None, ep=False, hosts=None, name=None, executor=None, playbook=None, inventory=None,
               check=False, json=False, deployments=None, recipes=None, stage=False, unload_ollama=False,
               drop_caches=True, image_source=None, ray_timeout=None, health_timeout=None, verify=False,
               limit=None, forks=None, accept_new_host_keys=False, image=None,
               force_degraded_fabric=False, gate=None, gate_ratio=None, results=None, replace=False, pin=False):
    """Start models (single-node servers, or clusters across Sparks) and prove they serve."""
    from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
    from sparkprov.cli.options import (OptionError, choice_option, csv_option, float_option, hosts_option, int_option,
                                       parse_forks, text_option)
    from sparkprov.data.inventory import load_inventory
    from sparkprov.defaults import DEFAULT_FORKS
    from sparkprov.outputs import check_output_dir
    from sparkprov.serving.bench import DEFAULT_GATE_RATIO, RESULTS_DIR
    from sparkprov.engine.report import Report
    from sparkprov.plays import cluster as plays
    from sparkprov.plays.serve import UpOptions

    out = sys.stderr if json else sys.stdout
    with user_errors():
        tp = int_option("tp", tp, 1, 64)
        pp = int_option("pp", pp, 1, 64, default=1)
        dp = int_option("dp", dp, 1, 64, default=1)
        executor = choice_option("executor", executor, ("ray", "native"))
        image_source = choice_option("image-source", image_source, ("auto", "registry", "peer"), default="auto")
        ray_timeout = float_option("ray-timeout", ray_timeout, 0, 86400, default=300.0, unit="seconds")
        health_timeout = float_option("health-timeout", health_timeout, 0, 86400, unit="seconds")
        hosts = hosts_option("hosts", hosts)
        deployments = ",".join(csv_option("deployments", deployments) or []) or None
        gate = choice_option("gate", gate, ("smoke", "bench"), default="smoke")
        if gate_ratio is not None and gate != "bench":
            raise OptionError("--gate-ratio needs --gate bench", fix="give --gate bench --gate-ratio R, or leave it out")
        gate_ratio = float_option("gate-ratio", gate_ratio, 0.01, 10, default=DEFAULT_GATE_RATIO)
        if results is not None and gate != "bench":
            raise OptionError("--results needs --gate bench", fix="give --gate bench --results DIR, or leave it out")
        results_dir = check_output_dir("results", text_option("results", results, default=RESULTS_DIR)) \
            if gate == "bench" else None
        if name is not None and model is None:  # it names the deployment --model makes; a playbook names its own
            raise OptionError("--name needs --model", fix="give --model ALIAS --name NAME, or leave out --name")
        if not model and (dp > 1 or ep):
            raise OptionError("--dp and --ep need --model", fix="a playbook sets dp: and ep: per deployment")
        inv = load_inventory(inventory_path(inventory))
        deps = plays.up_deployments(inv, model=model, playbook=_playbook_path(playbook, tp), tp=tp, pp=pp, dp=dp,
                                    ep=bool(ep), executor=executor, hosts=hosts, name=name, names=_csv(deployments),
                                    recipe_files=list(recipes or []))
        if image is not None:
            apply_image_option(image, deps)
        if pin:
            apply_pin_option(deps)
        targets = plays.up_targets(inv, deps, select_hosts(inv, None, limit) if limit else None)
        opts = UpOptions(drop_caches=drop_caches, unload_ollama=unload_ollama, image_source=image_source,
                         ray_timeout=ray_timeout, health_timeout=health_timeout, verify=verify,
                         force_degraded_fabric=bool(force_degraded_fabric))
        bench_gate = None
        if gate == "bench":
            from sparkprov.plays.upgrade import bench_gate as find_gate

            bench_gate = find_gate(inv, deps, gate_ratio, results_dir,
                                   forks=parse_forks(forks, DEFAULT_FORKS), accept_new_host_keys=accept_new_host_keys)
        report = Report(out, quiet=json)
        result = plays.cluster_up(inv, deps, opts, targets, stage=stage, report=report, gate=bench_gate,
                                  replace_others=bool(replace),
                                  options=engine_options(check=check, accept_new_host_keys=accept_new_host_keys,
                                                         forks=forks))
        summary = result.summary()
        if result.serving_changed:
            # a running gateway routes to what serves now (a run that changed nothing leaves it be)
            from sparkprov.plays.gateway import refresh
            summary["gateway"] = refresh(inv, forks=forks, accept_new_host_keys=accept_new_host_keys)
    print_report(report, json, cluster=summary)
    if not json:
        print_summary(summary)
    finish(report.exit_code())


def apply_image_option(image, deps) -> None:
    """--image: one valid image reference, for one deployment; refused before any host."""
    from sparkprov.catalog.load import IMAGE_RE
    from sparkprov.cli.options import OptionError, text_option

    image = text_option("image", image, max_len=512)
    if not IMAGE_RE.match(image):
        raise OptionError(f"--image {image!r} is not an image reference",
                          fix="give REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST] in lowercase, e.g. vllm/vllm-openai:v0.19.1")
    if len(deps) != 1:
        raise OptionError(f"--image names the image of one deployment; this run starts {len(deps)}: "
                          + ", ".join(d.name for d in deps), fix="add --deployments NAME, or --model ALIAS")
    deps[0].image_override = image


def apply_pin_option(deps) -> None:
    """--pin: every deployment runs by its nodes' registry digest; one that cannot (its image is one
    cluster-up builds) is refused before any host."""
    from sparkprov.cli.options import OptionError
    from sparkprov.serving import node

    for d in deps:
        refusal = node.pin_refusal(d)
        if refusal:
            raise OptionError(refusal, fix="leave out --pin, or --executor native (the image's own multi-node, "
                                           "no Ray to add)")
        d.pin = True


def print_summary(summary) -> None:
    for name, d in summary.get("deployments", {}).items():
        size = f"TP {d['tp']}" + (f" x PP {d['pp']}" if d.get("pp", 1) > 1 else "") + \
            (f" x DP {d['dp']}" if d.get("dp", 1) > 1 else "") + (" +EP" if d.get("ep") else "") + \
            (f", {d['executor']}" if d.get("executor") else "")
        print(f"\n{name}: {d['alias']} ({size}) on {', '.join(d['hosts'])}: {d['state']}")
        if not d["state"].startswith(("failed", "would")):
            print(f"  endpoint:     {d['endpoint']}")
            print(f"  model:        {d['model']}")
            print(f"  API key file: {d['api_key_file'] or 'none (bound to loopback)'}")
            for h, c in (d.get("containers") or {}).items():
                if c:
                    print(f"  {h}: {c['name']} ({c['role']}, recipe {c['hash']})")
        if d.get("gate") and d["gate"].get("passed"):
            print(f"  {d['gate']['line']} (start #{d['gate']['against_start']})")
    for line in summary.get("upgrade") or []:  # a failed upgrade: what failed, and what serves again
        print(f"\n{line}")
    for line in summary.get("replaced") or []:  # --replace: what made room, and whether it came back
        print(f"\n{line}")
    if summary.get("gateway"):
        print(f"\n{summary['gateway']}")
    calls = ", ".join(f"{h}={n}" for h, n in summary.get("remote_calls", {}).items())
    print(f"\ncluster-up {'(check) ' if summary.get('check') else ''}took {summary['seconds']:.1f}s; remote calls: {calls}")


def cluster_down(c, hosts=None, inventory=None, deployments=None, model=None, name=None, check=False, json=False,
                 limit=None, forks=None, accept_new_host_keys=False):
    """Remove exactly the containers (and so the Ray processes) sparkprov started, by label, on every host."""
    from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
    from sparkprov.cli.options import csv_option
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.plays import cluster as plays
    from sparkprov.serving.deployment import default_name

    out = sys.stderr if json else sys.stdout
    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        names = csv_option("deployments", deployments)
        if model or name:
            names = (names or []) + [name or default_name(str(model))]
        report = Report(out, quiet=json)
        removed = plays.cluster_down(inv, targets, names, engine_options(check=check, accept_new_host_keys=accept_new_host_keys,
                                                                         forks=forks), report)
        gateway = None
        if not check and any(removed.values()):
            from sparkprov.plays.gateway import refresh
            gateway = refresh(inv, forks=forks, accept_new_host_keys=accept_new_host_keys)
    print_report(report, json, removed=removed, gateway=gateway)
    if gateway and not json:
        print(gateway)
    finish(report.exit_code())


def status(c, hosts=None, inventory=None, json=False, limit=None, forks=None, watch=None, count=None,
           accept_new_host_keys=False, ports=False):
    """Per host: sparkprov containers, Ray nodes and GPUs, health, models, KV cache, requests, spec-decode
    acceptance, unified memory, GPU temperature and power; per deployment: expected vs joined nodes.
    Exit 2 when a deployment is degraded or a node guard acted (its action stands) or is not running,
    4 when a host is unreachable."""
    import time

    from sparkprov.cli.common import engine_options, finish, inventory_path, select_hosts, user_errors
    from sparkprov.cli.options import float_option, int_option
    from sparkprov.data.inventory import load_inventory
    from sparkprov.facts import guard as guard_facts
    from sparkprov.plays.cluster import fleet_status

    with user_errors():
        watch = float_option("watch", watch, 0, 86400, unit="seconds")
        count = int_option("count", count, 1, 10**6)
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        shown = 0
        while True:
            fleet = fleet_status(inv, targets, engine_options(forks=forks, accept_new_host_keys=accept_new_host_keys),
                                 ports=ports)
            if json:
                print(_json.dumps({"ok": fleet.code == 0, "hosts": fleet.hosts}, indent=2, default=str), flush=True)
            else:
                if watch is not None and sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")
                print_status(fleet.hosts)
                for h, g in fleet.guards.items():
                    print(guard_facts.describe(h, g))
                if ports:
                    print_ports(fleet.hosts)
                if watch is not None:
                    print(f"refreshed {time.strftime('%H:%M:%S')}, every {watch:g}s (Ctrl-C stops)", flush=True)
            shown += 1
            if watch is None or (count is not None and shown >= count):
                break
            time.sleep(watch)
    finish(fleet.code)


def print_ports(st) -> None:
    """Per host, every listening port and who can reach it; the flagged ones first, marked."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="listening ports (reach: loopback, fabric peers, everyone)")
    for col in ("host", "proto", "address:port", "process", "deployment", "reach", "why", ""):
        t.add_column(col)
    for h, doc in st.items():
        for r in doc.get("ports") or []:
            t.add_row(h, r["proto"], f"{r['address']}:{r['port']}", ",".join(r["processes"]) or "?",
                      r["deployment"] or "-", r["reach"], r["why"], "OPEN, NO KEY" if r["flag"] else "")
        if doc.get("ports") is None:
            t.add_row(h, "-", "-", "-", "-", "-", doc.get("problem") or doc.get("error") or "not read", "")
    Console().print(t)


def _health_cell(c: dict) -> str:
    """/health and the liveness token: "200, token in 0.04s" or "200, NO TOKEN (HTTP 500)"."""
    live = c.get("liveness")
    if live is None:
        return str(c.get("health", ""))
    if live.get("status") == 200:
        return f"{c.get('health')}, token in {live.get('seconds', 0):.2f}s"
    return f"{c.get('health')}, NO TOKEN ({'HTTP ' + str(live['status']) if live.get('status') else live.get('error')})"


def print_status(st) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False, width=160)
    hosts = Table(title="hosts")
    for col in ("host", "MemAvailable", "swap used", "GPU temp", "GPU power", "fabric"):
        hosts.add_column(col, overflow="fold")
    for host, h in st.items():
        m = h.get("host") or {}
        gib = lambda n: f"{n / 2**30:.1f} GiB" if n is not None else ""  # noqa: E731
        topo = m.get("fabric_topology") or {}
        hosts.add_row(host, (gib(m.get("mem_available")) + f" of {gib(m.get('mem_total'))}") if m.get("mem_total") else "",
                      gib(m.get("swap_used")) if m.get("swap_total") else "no swap",
                      f"{m['temperature_c']:g} C" if m.get("temperature_c") is not None else "n/a",
                      f"{m['power_w']:g} W" if m.get("power_w") is not None else "n/a",
                      (f"{topo['kind']}: " + ", ".join(f"{i} -> {p}" for i, p in topo.get("links", {}).items())
                       if topo else ""))
    con.print(hosts)
    t = Table(title="sparkprov serving status")
    for col in ("host", "container", "deployment", "role", "state", "ray", "health", "models", "KV cache", "requests",
                "spec accept"):
        t.add_column(col, overflow="fold")
    for host, h in st.items():
        if not h.get("reachable"):
            t.add_row(host, "-", "-", "-", "UNREACHABLE", "", "", "", "", "", h.get("error") or "")
            continue
        if not h["containers"]:
            t.add_row(host, "(none)", "", "", "docker ok" if h["docker"] else f"docker: {h['error']}", "", "", "", "", "", "")
        for c in h["containers"]:
            ray = c.get("ray")
            m = c.get("metrics") or {}
            acc = m.get("spec_acceptance")
            labels = c.get("labels") or {}
            t.add_row(host, c["name"], labels.get("sparkprov.deployment") or "", labels.get("sparkprov.role") or "",
                      c["status"] + (f" (restarts {c['restarts']})" if c["restarts"] else ""),
                      f"{ray['nodes']} nodes, {ray['gpus']:g} GPUs" if ray else "",
                      _health_cell(c) if c.get("port") else "",
                      ", ".join(c.get("served_models") or []),
                      f"{100 * m['kv_cache_usage']:.1f}%" if "kv_cache_usage" in m else "",
                      f"{m['running']:g} running, {m['waiting']:g} waiting" if "running" in m and "waiting" in m else "",
                      f"{100 * acc:.1f}%" if acc is not None else ("" if "spec_acceptance" not in m else "no drafts yet"))
    con.print(t)
    for host, h in st.items():
        for dep, r in (h.get("deployments") or {}).items():
            state = "DEGRADED: " + "; ".join(r["problems"]) if r["problems"] else "healthy"
            con.print(f"{dep} (rank 0 on {host}): {r['joined_nodes']}/{r['expected_nodes']} nodes, "
                      f"{r['gpus']:g} GPUs: {state}")


def nccl_check(c, hosts=None, inventory=None, image=None, playbook=None, backend=None, threshold=None,
               max_bytes=None, iters=None, json=False, limit=None, forks=None, check=False, accept_new_host_keys=False):
    """All-reduce bus bandwidth across the hosts over the fabric, in the serving image, against a threshold."""

    from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
    from sparkprov.cli.options import choice_option, float_option, int_option, size_option
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.errors import SparkprovError
    from sparkprov.plays import cluster as plays

    out = sys.stderr if json else sys.stdout
    with user_errors():
        backend = choice_option("backend", backend, ("nccl", "gloo"), default="nccl")
        threshold = float_option("threshold", threshold, 0, 10000, default=21.875)
        iters = int_option("iters", iters, 1, 10000, default=20)
        max_bytes = size_option("max-bytes", max_bytes, 1, 2**40, default=2 * 2**30)
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        if len(targets) < 2:
            raise SparkprovError("nccl-check needs at least two hosts", fix="--hosts spark1,spark2")
        image = image or plays.serving_image(inv, _playbook_path(playbook, 2))
        report = Report(out, quiet=json)
        result = plays.nccl_check(inv, targets, image, engine_options(check=check, accept_new_host_keys=accept_new_host_keys,
                                                                      forks=forks), report,
                                  backend=backend, threshold=threshold, max_bytes=max_bytes, iters=iters)
    print_report(report, json, nccl={"image": image, "backend": backend, "threshold_gbs": threshold, "hosts": targets,
                                     "result": result})
    finish(report.exit_code())
