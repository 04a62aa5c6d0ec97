"""`invoke monitor write|up|down`: run the status play (as `invoke status` does) to learn which
deployments sparkprov serves, and the fabric play to learn where each node guard answers, then

- write: write a Prometheus scrape configuration and a Grafana dashboard for them (rendered by
  sparkprov/serving/monitor.py) into --out, for a Prometheus and a Grafana of your own;
- up: run Prometheus with that configuration on --host (modules/prometheus.py, a play on the
  engine: --check, --json, the recap and exit codes);
- down: remove that Prometheus and its files.

Registered in tasks.py:

    from sparkprov.cli import monitor as monitor_cli
    ns.add_task(task(monitor_cli.monitor, help=monitor_cli.HELP))
"""

from __future__ import annotations

import sys

HELP = {
    "action": "write (the files into --out), up (run Prometheus on --host) or down (remove it)",
    "out": "write: folder to write into (default: ./monitoring): prometheus.yml, targets/*.json, grafana-dashboard.json",
    "host": "up, down: the host Prometheus runs on (default: where it runs now, else the inventory's "
            "monitor_host, else the first host; down without it: wherever it runs)",
    "port": "up: its port (default: its current one, else prometheus_port, else 9090)",
    "image": "up: the Prometheus image (default: prometheus_image in the inventory, else prom/prometheus:v3.5.0)",
    "bind": "up: the address it listens on (default: the host's first fabric address, which only the host and "
            "its fabric peers reach; else 127.0.0.1)",
    "scrape_interval": "How often Prometheus scrapes, e.g. 15s (default: prometheus_scrape_interval, else 15s)",
    "timeout": "up: seconds to wait for Prometheus to be ready (default 120)",
    "node_exporter_port": "Port of node_exporter on every host (default 9100)",
    "check": "Say what would be written or changed; change nothing",
    "json": "up, down: print one JSON document ({ok, hosts, results, monitor}) instead of the recap",
    "hosts": "Hosts, groups or patterns to monitor, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "limit": "Further limit the hosts (pattern)",
    "forks": "How many hosts to read at once (default 32)",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
}


def monitor(c, action, out=None, host=None, port=None, image=None, bind=None, scrape_interval=None, timeout=None,
            node_exporter_port=None, check=False, json=False, hosts=None, inventory=None, limit=None, forks=None,
            accept_new_host_keys=False):
    """Monitor what sparkprov serves: write Prometheus's configuration and a Grafana dashboard, or run Prometheus.

    The targets (file_sd): every deployment's /metrics (rank 0), every node guard's /metrics, node_exporter
    and dcgm-exporter on every host; the deployments are read from the hosts as `status` reads them."""
    import re

    from sparkprov.cli.common import finish, inventory_path, print_report, select_hosts, user_errors
    from sparkprov.cli.options import (OptionError, address_option, choice_option, float_option, image_option,
                                       int_option, inventory_host_option, parse_forks, positional, text_option)
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.run import DEFAULT_FORKS
    from sparkprov.outputs import check_output_dir
    from sparkprov.serving import monitor as mon

    printed = sys.stderr if json else sys.stdout
    with user_errors():
        action = choice_option("action", positional("monitor", "action", action), ("write", "up", "down"))
        out_dir = check_output_dir("out", text_option("out", out, default="monitoring")) if action == "write" else None
        exporter_port = int_option("node-exporter-port", node_exporter_port, 1, 65535, default=mon.NODE_EXPORTER_PORT)
        port = int_option("port", port, 1, 65535)
        image = image_option("image", image, example="prom/prometheus:v3.5.0")
        bind = address_option("bind", bind, example="127.0.0.1")
        interval = text_option("scrape-interval", scrape_interval, max_len=16)
        if interval is not None and not re.fullmatch(r"[1-9][0-9]*(ms|s|m)", interval):
            raise OptionError(f"--scrape-interval {interval!r} is not a duration", fix="e.g. --scrape-interval 15s")
        timeout = float_option("timeout", timeout, 0, 3600, default=120.0, unit="seconds")
        forks = parse_forks(forks, DEFAULT_FORKS)
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        host = inventory_host_option("host", host, inv)
        options = {"forks": forks, "accept_new_host_keys": accept_new_host_keys}
        if action == "write":
            write(inv, targets, out_dir, exporter_port=exporter_port, scrape_interval=interval, check=check, **options)
            return
        if action == "down":
            report, doc = down(inv, targets, host=host, check=check, out=printed, quiet=json, **options)
        else:
            report, doc = up(inv, targets, host=host, port=port, image=image, bind=bind, scrape_interval=interval,
                             timeout=timeout, exporter_port=exporter_port, check=check, out=printed, quiet=json,
                             **options)
    if json:
        print_report(report, True, monitor=doc)
    else:
        if report.exit_code() != 0:  # a failed play never reads as a Prometheus that runs
            bad = next((r.msg for r in report.results if r.status in ("failed", "unreachable")), "")
            print(f"monitor {action} failed: {bad}", file=sys.stderr)
        else:
            print(doc["message"])
        report.recap()
    finish(report.exit_code())


def _read_fleet(inv, targets, forks, accept_new_host_keys, extra=(), consequence="nothing was changed"):
    """The status play on the targets (and `extra` hosts): (status, deployments, hosts). Raises when
    a host's containers could not be read: its deployments would vanish from the targets, and
    Prometheus would forget them instead of showing them down."""
    from sparkprov.cli.common import engine_options
    from sparkprov.defaults import host_setting
    from sparkprov.errors import SparkprovError
    from sparkprov.plays.serve import read_status
    from sparkprov.serving import monitor as mon

    everyone = list(dict.fromkeys(list(targets) + list(extra)))
    st, _ = read_status(inv, everyone, engine_options(forks=forks, accept_new_host_keys=accept_new_host_keys))
    blind = [h for h in everyone if not st[h]["reachable"] or not st[h]["docker"]]
    if blind:
        err = SparkprovError(f"the deployments on {', '.join(blind)} are unknown ("
                             + "; ".join(f"{h}: {'unreachable' if not st[h]['reachable'] else 'docker'}: "
                                         f"{st[h].get('error') or 'docker not reachable'}" for h in blind)
                             + f"): {consequence}", fix="bring the host back, or leave it out with --limit")
        err.exit_code = 4 if any(not st[h]["reachable"] for h in blind) else 2  # the engine's codes
        raise err
    monitored = {h: mon.MonitoredHost(h, inv.hosts[h].address, str(host_setting(inv.hosts[h].vars, "serve_bind")))
                 for h in targets}
    return st, mon.deployments_from_status({h: st[h] for h in targets}, monitored), monitored


def _guard_port(inv, h: str) -> int:
    from sparkprov.serving.guard import DEFAULTS

    return int(inv.hosts[h].vars.get("guard_port") or DEFAULTS["port"])


def write(inv, targets, out_dir, *, exporter_port, scrape_interval=None, check=False, forks=None,
          accept_new_host_keys=False) -> None:
    """The files for a Prometheus and a Grafana of the user's own, each guard at its first fabric address."""
    import dataclasses
    import io

    from sparkprov.cli.common import engine_options
    from sparkprov.engine.report import Report
    from sparkprov.errors import SparkprovError
    from sparkprov.modules.fabric_rails import EXPORT
    from sparkprov.plays import monitor as plays
    from sparkprov.plays.book import run_book
    from sparkprov.serving import monitor as mon

    _, deps, monitored = _read_fleet(inv, targets, forks, accept_new_host_keys, consequence="nothing written")
    report = Report(io.StringIO(), quiet=True)
    runner = run_book(inv, plays.rails_book(targets), targets, engine_options(forks=forks), report)
    if report.exit_code():
        bad = next((r.msg for r in report.results if r.status in ("failed", "unreachable")), "")
        raise SparkprovError(f"the fabric of the hosts could not be read: {bad}: nothing written",
                             fix="bring the host back, or leave it out with --limit")
    rails = {h: (runner.exports.get(h) or {}).get(EXPORT) or [] for h in targets}
    hosts = []
    for h in targets:
        addr, note = mon.guard_address(h, rails, None)
        if note:
            print(f"sparkprov: {note}: no guard target", file=sys.stderr)
        hosts.append(dataclasses.replace(monitored[h], guard=mon.host_port(addr, _guard_port(inv, h)) if addr else None))
    files = mon.render(deps, hosts, node_exporter_port=exporter_port, scrape_interval=scrape_interval or _interval(inv, targets))
    for d in deps:
        note = "" if d.state == "running" else f", {d.state}"
        note += f", API key from {d.host}:{d.api_key_file}" if d.api_key_file else ""
        if mon.loopback(d.address) and inv.hosts[d.host].connection != "local":
            note += f", loopback only: only a Prometheus on {d.host} reaches it"
        print(f"{d.name}: {d.model} at {d.target} (rank 0 on {d.host}{note})")
    for h in hosts:
        if h.guard:
            print(f"guard of {h.name} at {h.guard} (its fabric address: a Prometheus on a fabric peer reaches it)")
    if not deps:
        print("no sparkprov deployment on these hosts: the vLLM targets are empty (the guards' and exporters' are not)")
    for path, state in write_files(out_dir, files, check=check):
        print(f"{state} {path}")
    if not check and any(d.api_key_file for d in deps):
        print(f"put each rank 0's API key where {out_dir / 'prometheus.yml'} says (in {out_dir / 'keys'}/)")


def _interval(inv, targets) -> str:
    return str(inv.hosts[targets[0]].vars.get("prometheus_scrape_interval") or "15s") if targets else "15s"


def up(inv, targets, *, host=None, port=None, image=None, bind=None, scrape_interval=None, timeout=120.0,
       exporter_port=None, check=False, forks=None, accept_new_host_keys=False, out=None, quiet=False):
    """The status play, then the monitor plays: (report, summary)."""
    from sparkprov.cli.common import engine_options
    from sparkprov.engine.report import Report
    from sparkprov.errors import SparkprovError
    from sparkprov.plays import monitor as plays
    from sparkprov.plays.book import run_book
    from sparkprov.serving import monitor as mon
    from sparkprov.serving import prometheus as prom

    st, deps, _ = _read_fleet(inv, targets, forks, accept_new_host_keys, extra=[host] if host else [])
    current = prom.running_monitor(st)
    where = host or (current or {}).get("host") or inv.hosts[targets[0]].vars.get("monitor_host") or targets[0]
    if where not in inv.hosts:
        raise SparkprovError(f"monitor_host {where!r} is not a host of {inv.path}", fix="name a host of the inventory")
    if current and current["host"] != where:
        raise SparkprovError(f"Prometheus runs on {current['host']}, not {where}",
                             fix="invoke monitor down first, or leave out --host")
    hv = inv.hosts[where].vars
    args = {"image": image or hv.get("prometheus_image") or (current or {}).get("image") or prom.IMAGE,
            "port": port or (current or {}).get("port") or int(hv.get("prometheus_port") or prom.PORT),
            "bind": bind or hv.get("prometheus_bind") or None, "timeout": timeout,
            "scrape_interval": scrape_interval or _interval(inv, targets),
            "node_exporter_port": exporter_port or mon.NODE_EXPORTER_PORT}
    served = [{"name": d.name, "model": d.model, "host": d.host, "address": d.address, "port": d.port,
               "api_key_file": d.api_key_file, "state": d.state} for d in deps]
    hosts = [{"name": h, "address": inv.hosts[h].address, "guard_port": _guard_port(inv, h)} for h in targets]
    report = Report(out if out is not None else sys.stdout, quiet=quiet)
    runner = run_book(inv, plays.up_book(where, hosts, served, **args),
                      list(dict.fromkeys(list(targets) + [where])),
                      engine_options(check=check, forks=forks, accept_new_host_keys=accept_new_host_keys), report)
    doc = dict((runner.exports.get(where) or {}).get("monitor") or {"host": where}, check=bool(check))
    doc["message"] = (f"Prometheus {'would run' if check else 'runs'} on {where} at {doc.get('url', '?')} "
                      f"(deployments: {', '.join(doc.get('deployments') or []) or 'none yet'}; guards: "
                      + ", ".join(f"{h} {a or 'unreachable'}" for h, a in (doc.get("guards") or {}).items()) + ")")
    return report, doc


def down(inv, targets, *, host=None, check=False, forks=None, accept_new_host_keys=False, out=None, quiet=False):
    """The prometheus task, absent, on --host or on every target: (report, summary)."""
    from sparkprov.cli.common import engine_options
    from sparkprov.engine.report import Report
    from sparkprov.plays import monitor as plays
    from sparkprov.plays.book import run_book

    where = [host] if host else list(targets)
    report = Report(out if out is not None else sys.stdout, quiet=quiet)
    run_book(inv, plays.down_book(where), where,
             engine_options(check=check, forks=forks, accept_new_host_keys=accept_new_host_keys), report)
    removed = sorted({r.host for r in report.results if r.module == "prometheus" and r.status == "changed"})
    verb = "would be removed" if check else "removed"
    return report, {"removed": removed, "check": bool(check),
                    "message": f"Prometheus {verb} on {', '.join(removed)}" if removed
                    else f"no Prometheus on {', '.join(where)}"}


def write_files(out_dir, files: dict[str, str], *, check: bool = False) -> list[tuple[str, str]]:
    """Write each file atomically (a temporary file beside it, renamed over it); one left as it
    is when its content is the same. Returns (path, 'wrote' | 'unchanged' | 'would write' |
    'would change'), in order; with check, writes nothing."""
    from sparkprov.errors import SparkprovError
    from sparkprov.outputs import write_text_atomic

    done = []
    for rel, text in files.items():
        path = out_dir / rel
        try:
            old = path.read_text(encoding="utf-8") if path.is_file() else None
        except (OSError, UnicodeDecodeError):
            old = None
        if old == text:
            done.append((str(path), "unchanged"))
            continue
        if check:
            done.append((str(path), "would write" if old is None else "would change"))
            continue
        try:
            write_text_atomic(path, text)  # configuration, not a secret: 0644, Prometheus and Grafana read it
        except OSError as exc:
            raise SparkprovError(f"cannot write {path}: {exc.strerror or exc}",
                                 fix="give --out a folder you can write to") from None
        done.append((str(path), "wrote"))
    return done
