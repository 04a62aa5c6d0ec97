"""`invoke cluster-up`, `cluster-down`, `status`, `nccl-check`: parse options, run the plays
(sparkprov/plays/cluster.py, serve.py), print what they return.

cluster-up's options are one object, plays/options.py UpOptions, from the command line to the plays.
"""

from __future__ import annotations

import json as _json
import sys
from dataclasses import dataclass

from sparkprov.cli.command import command
from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.options import (DEPLOYMENT, Choice, Excludes, Flag, Image, Int, Needs, Number, Size, Text, Words, common,
                               option)
from sparkprov.plays.options import UpOptions


def _playbook_path(playbook, tp):
    from sparkprov.cli.common import playbook_path

    return playbook_path(playbook, "serve.yaml" if tp == 1 else "cluster.yaml")


@command(UpOptions)
def cluster_up(c, o: UpOptions):
    """Start models (single-node servers, or clusters across Sparks) and prove they serve."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.plays import cluster as plays

    with user_errors():
        inv = load_inventory(inventory_path(o.inventory))
        deps = plays.up_deployments(inv, o, _playbook_path(o.playbook, o.tp))
        if o.image is not None:
            apply_image_option(o.image, deps)
        if o.pin:
            apply_pin_option(deps)
        targets = plays.up_targets(inv, deps, select_hosts(inv, None, o.limit) if o.limit else None)
        report = Report(sys.stderr if o.json else sys.stdout, quiet=o.json)
        summary = plays.cluster_up(inv, deps, o, targets, report).summary()
    print_report(report, o.json, cluster=summary)
    if not o.json:
        print_summary(summary)
    finish(report.exit_code())


def apply_image_option(image, deps) -> None:
    """--image: one valid image reference, for one deployment; refused before any host."""
    from sparkprov.imageref import IMAGE_RE
    from sparkprov.options import OptionError, text_option

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
    from sparkprov.options import OptionError
    from sparkprov.serving import node

    for d in deps:
        refusal = node.pin_refusal(d)
        if refusal:
            raise OptionError(refusal, fix="leave out --pin, or --executor native (the image's own multi-node, "
                                           "no Ray to add)")
        d.pin = True


def print_summary(summary) -> None:
    """cluster-up's summary (plays/cluster.py UpSummary) in words."""
    for name, d in summary["deployments"].items():
        size = f"TP {d['tp']}" + (f" x PP {d['pp']}" if d["pp"] > 1 else "") + \
            (f" x DP {d['dp']}" if d["dp"] > 1 else "") + (" +EP" if d["ep"] else "") + \
            (f", {d['executor']}" if d["executor"] else "")
        print(f"\n{name}: {d['alias']} ({size}) on {', '.join(d['hosts'])}: {d['state']}")
        if not d["state"].startswith(("failed", "would")):
            print(f"  endpoint:     {d['endpoint']}")
            print(f"  model:        {d['model']}")
            print(f"  API key file: {d['api_key_file'] or 'none (bound to loopback)'}")
            for h, c in d["containers"].items():
                if c:
                    print(f"  {h}: {c['name']} ({c['role']}, recipe {c['hash']})")
        gate = d.get("gate")
        if gate and gate["passed"]:
            print(f"  {gate['line']} (start #{gate['against_start']})")
    for line in summary.get("upgrade", []):  # a failed upgrade: what failed, and what serves again
        print(f"\n{line}")
    for line in summary.get("replaced", []):  # --replace: what made room, and whether it came back
        print(f"\n{line}")
    if summary.get("gateway"):
        print(f"\n{summary['gateway']}")
    calls = ", ".join(f"{h}={n}" for h, n in summary["remote_calls"].items())
    print(f"\ncluster-up {'(check) ' if summary['check'] else ''}took {summary['seconds']:.1f}s; remote calls: {calls}")


@dataclass
class DownOptions:
    hosts: str | None = common("hosts", "Hosts, groups or patterns to clean, comma-separated (default: all in the "
                                        "inventory)")
    inventory: str | None = common("inventory")
    deployments: list[str] | None = option("Only the containers of these deployments (comma-separated; default: "
                                           "every sparkprov container)", Words())
    model: str | None = option("Remove the deployment cluster-up --model started (its name: --name, else the alias)",
                               Text(max_len=256))
    name: str | None = option("Deployment name given to cluster-up --model --name", DEPLOYMENT)
    check: bool = option("Say what would be removed, remove nothing", Flag())
    json: bool = common("json")
    limit: str | None = common("limit")
    forks: int = common("forks")
    accept_new_host_keys: bool = common("accept_new_host_keys")


@command(DownOptions)
def cluster_down(c, o: DownOptions):
    """Remove exactly the containers (and so the Ray processes) sparkprov started, by label, on every host."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.plays import cluster as plays
    from sparkprov.serving.deployment import default_name

    with user_errors():
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        names = o.deployments
        if o.model or o.name:
            names = (names or []) + [o.name or default_name(str(o.model))]
        report = Report(sys.stderr if o.json else sys.stdout, quiet=o.json)
        down = plays.cluster_down(inv, targets, names, engine_options(o), report)
    print_report(report, o.json, removed=down.removed, gateway=down.gateway)
    if down.gateway and not o.json:
        print(down.gateway)
    finish(report.exit_code())


@dataclass
class StatusOptions:
    hosts: str | None = common("hosts", "Hosts, groups or patterns to show, comma-separated (default: all in the "
                                        "inventory)")
    inventory: str | None = common("inventory")
    json: bool = common("json")
    limit: str | None = common("limit")
    forks: int = common("forks")
    watch: float | None = option("Refresh every this many seconds until interrupted (Ctrl-C)",
                                 Number(0, 86400, unit="seconds"))
    count: int | None = option("With --watch: stop after this many refreshes", Int(1, 10**6))
    accept_new_host_keys: bool = common("accept_new_host_keys")
    ports: bool = option("Also every listening TCP/UDP port per host: process, deployment, and from where it can be "
                         "reached (loopback, fabric peers, everyone); exit 2 when one open to everyone is neither an "
                         "API port with a key nor sshd (reads as root)", Flag())

    RULES = (Needs("count", lambda o: o.watch is not None, "--watch",
                   fix="give --watch SECONDS --count N, or leave out --count"),)


@command(StatusOptions)
def status(c, o: StatusOptions):
    """Per host: sparkprov containers, Ray nodes and GPUs, health, models, KV cache, requests, spec-decode
    acceptance, unified memory, GPU temperature and power; per deployment: expected vs joined nodes.
    Exit 2 when a deployment is degraded or a node guard acted (its action stands) or is not running,
    4 when a host is unreachable."""
    import time

    from sparkprov.data.inventory import load_inventory
    from sparkprov.facts import guard as guard_facts
    from sparkprov.plays.cluster import fleet_status

    watch, count = o.watch, o.count
    with user_errors():
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        shown = 0
        while True:
            fleet = fleet_status(inv, targets, engine_options(o), ports=o.ports)
            if o.json:
                print(_json.dumps({"ok": fleet.code == 0, "hosts": fleet.hosts}, indent=2, default=str), flush=True)
            else:
                if watch is not None and sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")
                print_status(fleet.hosts)
                for h, g in fleet.guards.items():
                    print(guard_facts.describe(h, g))
                if o.ports:
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


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h {s % 3600 // 60}m" if s >= 3600 else f"{s // 60}m {s % 60}s" if s >= 60 else f"{s}s"


def print_status(st) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False, width=160)
    hosts = Table(title="hosts")
    for col in ("host", "MemAvailable", "swap used", "GPU temp", "GPU power", "fabric"):
        hosts.add_column(col, overflow="fold")
    for host, h in st.items():
        m = h["host"]
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
                      (f"{c['on_demand']} (on demand" + (f", idle {_duration(c['idle_for_s'])}"
                                                         if c.get("idle_for_s") is not None else "") + ")"
                       if c.get("on_demand") else c["status"])
                      + (f" (restarts {c['restarts']})" if c["restarts"] else ""),
                      f"{ray['nodes']} nodes, {ray['gpus']:g} GPUs" if ray else "",
                      _health_cell(c) if c.get("port") else "",
                      ", ".join(c.get("served_models") or []),
                      f"{100 * m['kv_cache_usage']:.1f}%" if "kv_cache_usage" in m else "",
                      f"{m['running']:g} running, {m['waiting']:g} waiting" if "running" in m and "waiting" in m else "",
                      f"{100 * acc:.1f}%" if acc is not None else ("" if "spec_acceptance" not in m else "no drafts yet"))
    con.print(t)
    for host, h in st.items():
        for dep, r in h["deployments"].items():
            state = "DEGRADED: " + "; ".join(r["problems"]) if r["problems"] else "healthy"
            con.print(f"{dep} (rank 0 on {host}): {r['joined_nodes']}/{r['expected_nodes']} nodes, "
                      f"{r['gpus']:g} GPUs: {state}")


@dataclass
class NcclOptions:
    hosts: str | None = common("hosts", "The hosts to test, comma-separated; the first is rank 0 (default: all in "
                                        "the inventory)")
    inventory: str | None = common("inventory")
    image: str | None = option("Image to run the benchmark in (default: --playbook's; else the image a deployment "
                               "runs on every host; else the first deployment of playbooks/cluster.yaml's)", Image())
    playbook: str | None = option("Serve playbook whose first deployment names the image")
    backend: str = option("nccl (default: on the GPU; a container without the GPU fails) or gloo (CPU, e.g. the "
                          "lab)", Choice(("nccl", "gloo")), default="nccl")
    threshold: float = option("Bus bandwidth in GB/s below which the check fails (default 21.875, NVIDIA's "
                              "two-Spark minimum)", Number(0, 10000), default=21.875)
    max_bytes: int = option("Largest all-reduce message (default 2G, as in the published two-Spark figures)",
                            Size(1, 2**40), default=2 * 2**30)
    iters: int = option("Timed iterations per size (default 20)", Int(1, 10000), default=20)
    json: bool = common("json")
    limit: str | None = common("limit")
    forks: int = common("forks")
    check: bool = option("Check the hosts (fabric, image) and say what would run; run nothing", Flag())
    accept_new_host_keys: bool = common("accept_new_host_keys")

    # the playbook is read only to find the image
    RULES = (Excludes("image", "playbook", "both say which image: the playbook is read only to find one"),)


@command(NcclOptions)
def nccl_check(c, o: NcclOptions):
    """All-reduce bus bandwidth across the hosts over the fabric, in the serving image, against a threshold."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.errors import SparkprovError
    from sparkprov.plays import cluster as plays

    with user_errors():
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        if len(targets) < 2:
            raise SparkprovError("nccl-check needs at least two hosts", fix="--hosts spark1,spark2")
        out = sys.stderr if o.json else sys.stdout
        options = engine_options(o)
        chosen = plays.nccl_image(inv, targets, options, image=o.image,
                                  playbook=o.playbook and _playbook_path(o.playbook, 2),
                                  default_playbook=_playbook_path(None, 2))
        print(f"nccl-check in {chosen.image} ({chosen.why})", file=out)
        report = Report(out, quiet=o.json)
        result = plays.nccl_check(inv, targets, chosen.image, options, report, backend=o.backend,
                                  threshold=o.threshold, max_bytes=o.max_bytes, iters=o.iters)
    print_report(report, o.json, nccl={"image": chosen.image, "image_from": chosen.why, "backend": o.backend,
                                       "threshold_gbs": o.threshold, "hosts": targets, "result": result})
    finish(report.exit_code())
