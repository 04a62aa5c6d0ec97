"""`invoke monitor` as playbooks for the engine, and their orchestration (after the status play that
finds the deployments, plays/fleet.py):

    monitor: fabric       every host        fabric_rails: where each node guard answers (read only)
    monitor: keys on H    each keyed rank 0 gateway_keys (no_log): the API keys its scrape presents
    monitor               the chosen host   prometheus: the files and the container

`write` runs the first play only (the files are rendered and written on this machine); `down` runs
the prometheus task with state absent on the hosts it may be on."""

from __future__ import annotations

import dataclasses
import io
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from sparkprov.data.inventory import Inventory
from sparkprov.engine.playbook import Playbook
from sparkprov.defaults import host_setting
from sparkprov.engine.report import Report
from sparkprov.engine.run import RunOptions
from sparkprov.errors import SparkprovError
from sparkprov.modules.fabric_rails import FABRIC_RAILS
from sparkprov.modules.prometheus import MONITOR
from sparkprov.plays.book import play, run_book, task
from sparkprov.plays.fleet import read_fleet
from sparkprov.serving import monitor as mon
from sparkprov.serving import prometheus as prom
from sparkprov.node.settings import DEFAULTS as GUARD_DEFAULTS

WHERE = ("monitor", None, None)


def rails_play(hosts: list[str]):
    return play("monitor: fabric", hosts, [task("fabric rails", "fabric_rails", {}, WHERE)], where=WHERE)


def rails_book(hosts: list[str]) -> Playbook:
    return Playbook("monitor", [rails_play(hosts)])


def up_book(prometheus_host: str, targets: list[dict[str, Any]], deployments: list[dict[str, Any]],
            **prometheus: Any) -> Playbook:
    """`targets`, `deployments`: modules/prometheus.py Target's and Served's fields. The hosts' rails
    and the rank 0s' keys first."""
    names = [t["name"] for t in targets]
    plays = [rails_play(list(dict.fromkeys(names + [prometheus_host])))]
    keyed: dict[str, list[str]] = {}
    for d in deployments:
        if d.get("api_key_file") and d["api_key_file"] not in keyed.setdefault(d["host"], []):
            keyed[d["host"]].append(d["api_key_file"])
    for host, files in keyed.items():
        t = task("API keys", "gateway_keys", {"key_files": files}, WHERE)
        t.no_log = True
        plays.append(play(f"monitor: keys on {host}", [host], [t], where=WHERE))
    plays.append(play("monitor", [prometheus_host], [task("prometheus", "prometheus", {
        **prometheus, "hosts": targets, "deployments": deployments}, WHERE)], where=WHERE))
    return Playbook("monitor", plays)


def down_book(hosts: list[str]) -> Playbook:
    return Playbook("monitor", [play("monitor", hosts, [task("prometheus", "prometheus", {"state": "absent"}, WHERE)],
                                     where=WHERE)])


def read_deployments(inv: Inventory, targets: list[str], options: RunOptions, *, extra: list[str] | tuple = (),
                     consequence: str = "nothing was changed"):
    """The status play on the targets (and `extra` hosts), every host's containers read (plays/fleet.py):
    (status, deployments, hosts as serving/monitor.py takes them)."""
    everyone = list(dict.fromkeys(list(targets) + list(extra)))
    st = read_fleet(inv, everyone, dataclasses.replace(options, check=False), consequence=consequence)
    monitored = {h: mon.MonitoredHost(h, inv.hosts[h].address, str(host_setting(inv.hosts[h].vars, "serve_bind")))
                 for h in targets}
    return st, mon.deployments_from_status({h: st[h] for h in targets}, monitored), monitored


def guard_port(inv: Inventory, h: str) -> int:
    return int(inv.hosts[h].vars.get("guard_port") or GUARD_DEFAULTS["port"])


def scrape_interval_of(inv: Inventory, targets: list[str]) -> str:
    return str(inv.hosts[targets[0]].vars.get("prometheus_scrape_interval") or "15s") if targets else "15s"


@dataclass
class MonitorFiles:
    deployments: list[Any]      # serving/monitor.py Deployment: what the vLLM targets are
    hosts: list[Any]            # serving/monitor.py MonitoredHost, each with its guard's address (or None)
    files: dict[str, str]       # path under the output folder -> its text
    notes: list[str]            # a guard without a target, and why


def monitor_files(inv: Inventory, targets: list[str], options: RunOptions, *, exporter_port: int,
                  scrape_interval: str | None = None) -> MonitorFiles:
    """The files for a Prometheus and a Grafana of the user's own, each guard at its first fabric address
    (the fabric play reads the rails; nothing on the hosts changes)."""
    _, deps, monitored = read_deployments(inv, targets, options, consequence="nothing written")
    report = Report(io.StringIO(), quiet=True)
    runner = run_book(inv, rails_book(targets), targets, dataclasses.replace(options, check=False), report)
    if report.exit_code():
        raise SparkprovError(f"the fabric of the hosts could not be read: {report.first_failure()}: nothing written",
                             fix="bring the host back, or leave it out with --limit")
    rails = {h: FABRIC_RAILS.read(runner.exports, h) or [] for h in targets}
    hosts, notes = [], []
    for h in targets:
        addr, note = mon.guard_address(h, rails, None)
        if note:
            notes.append(f"{note}: no guard target")
        hosts.append(dataclasses.replace(monitored[h], guard=mon.host_port(addr, guard_port(inv, h)) if addr else None))
    files = mon.render(deps, hosts, node_exporter_port=exporter_port,
                       scrape_interval=scrape_interval or scrape_interval_of(inv, targets))
    return MonitorFiles(deps, hosts, files, notes)


def up(inv: Inventory, targets: list[str], options: RunOptions, *, host: str | None = None, port: int | None = None,
       image: str | None = None, bind: str | None = None, scrape_interval: str | None = None, timeout: float = 120.0,
       exporter_port: int | None = None, out: TextIO | None = None, quiet: bool = False) -> tuple[Report, dict]:
    """The status play, then the monitor plays: (report, summary)."""
    st, deps, _ = read_deployments(inv, targets, options, extra=[host] if host else [])
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
            "scrape_interval": scrape_interval or scrape_interval_of(inv, targets),
            "node_exporter_port": exporter_port or mon.NODE_EXPORTER_PORT}
    served = [{"name": d.name, "model": d.model, "host": d.host, "address": d.address, "port": d.port,
               "api_key_file": d.api_key_file, "state": d.state} for d in deps]
    hosts = [{"name": h, "address": inv.hosts[h].address, "guard_port": guard_port(inv, h)} for h in targets]
    report = Report(out if out is not None else sys.stdout, quiet=quiet)
    runner = run_book(inv, up_book(where, hosts, served, **args), list(dict.fromkeys(list(targets) + [where])),
                      options, report)
    check = options.check
    doc = dict(MONITOR.read(runner.exports, where) or {"host": where}, check=bool(check))
    doc["message"] = (f"Prometheus {'would run' if check else 'runs'} on {where} at {doc.get('url', '?')} "
                      f"(deployments: {', '.join(doc.get('deployments') or []) or 'none yet'}; guards: "
                      + ", ".join(f"{h} {a or 'unreachable'}" for h, a in (doc.get("guards") or {}).items()) + ")")
    return report, doc


def down(inv: Inventory, targets: list[str], options: RunOptions, *, host: str | None = None,
         out: TextIO | None = None, quiet: bool = False) -> tuple[Report, dict]:
    """The prometheus task, absent, on --host or on every target: (report, summary)."""
    where = [host] if host else list(targets)
    report = Report(out if out is not None else sys.stdout, quiet=quiet)
    run_book(inv, down_book(where), where, options, report)
    removed = sorted({r.host for r in report.results if r.module == "prometheus" and r.status == "changed"})
    verb = "would be removed" if options.check else "removed"
    return report, {"removed": removed, "check": bool(options.check),
                    "message": f"Prometheus {verb} on {', '.join(removed)}" if removed
                    else f"no Prometheus on {', '.join(where)}"}
