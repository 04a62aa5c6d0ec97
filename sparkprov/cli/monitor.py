"""`invoke monitor write|up|down`: run the status play (as `invoke status` does) to learn which
deployments sparkprov serves, and the fabric play to learn where each node guard answers, then

- write: write a Prometheus scrape configuration and a Grafana dashboard for them (rendered by
  sparkprov/serving/monitor.py) into --out, for a Prometheus and a Grafana of your own;
- up: run Prometheus with that configuration on --host (modules/prometheus.py, a play on the
  engine: --check, --json, the recap and exit codes);
- down: remove that Prometheus and its files.

Parses and prints (and writes the files of `write`); sparkprov/plays/monitor.py runs the plays.
data, plays, serving and outputs (tempfile) load inside the functions, not at the top (sparkprov/cli/command.py
says why).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from sparkprov.cli.command import command
from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.errors import SparkprovError
from sparkprov.options import (Address, Choice, Flag, Form, Image, Int, Number, Pattern, Text, common,
                               inventory_host_option, option)

ON_HOSTS = frozenset({"action", "check", "hosts", "inventory", "limit", "forks", "accept_new_host_keys"})


@dataclass
class MonitorOptions:
    action: str = option("write (the files into --out), up (run Prometheus on --host) or down (remove it)",
                         Choice(("write", "up", "down")), positional=True)
    out: str = option("write: folder to write into (default: ./monitoring): prometheus.yml, targets/*.json, "
                      "grafana-dashboard.json", Text(), default="monitoring")
    host: str | None = option("up, down: the host Prometheus runs on (default: where it runs now, else the "
                              "inventory's monitor_host, else the first host; down without it: wherever it runs)",
                              Text(max_len=256))
    port: int | None = option("up: its port (default: its current one, else prometheus_port, else 9090)",
                              Int(1, 65535))
    image: str | None = option("up: the Prometheus image (default: prometheus_image in the inventory, else "
                               "prom/prometheus:v3.5.0)", Image(example="prom/prometheus:v3.5.0"))
    bind: str | None = option("up: the address it listens on (default: the host's first fabric address, which "
                              "only the host and its fabric peers reach; else 127.0.0.1)", Address())
    scrape_interval: str | None = option("write, up: how often Prometheus scrapes, e.g. 15s (default: "
                                         "prometheus_scrape_interval, else 15s)",
                                         Pattern(r"[1-9][0-9]*(ms|s|m)", "a duration", "15s", max_len=16))
    timeout: float = option("up: seconds to wait for Prometheus to be ready (default 120)",
                            Number(0, 3600, unit="seconds"), default=120.0)
    node_exporter_port: int | None = option("write, up: port of node_exporter on every host (default 9100)",
                                            Int(1, 65535))
    check: bool = option("Say what would be written or changed; change nothing", Flag())
    json: bool = common("json", "up, down: print one JSON document ({ok, hosts, results, monitor}) instead of the "
                                "recap")
    hosts: str | None = common("hosts", "Hosts, groups or patterns to monitor, comma-separated (default: all in "
                                        "the inventory)")
    inventory: str | None = common("inventory")
    limit: str | None = common("limit")
    forks: int = common("forks")
    accept_new_host_keys: bool = common("accept_new_host_keys")

    RULES = (Form("monitor write", lambda o: o.action == "write",
                  ON_HOSTS | {"out", "scrape_interval", "node_exporter_port"}),
             Form("monitor up", lambda o: o.action == "up",
                  ON_HOSTS | {"host", "port", "image", "bind", "scrape_interval", "timeout", "node_exporter_port",
                              "json"}),
             Form("monitor down", lambda o: o.action == "down", ON_HOSTS | {"host", "json"}))


@command(MonitorOptions)
def monitor(c, o: MonitorOptions):
    """Monitor what sparkprov serves: write Prometheus's configuration and a Grafana dashboard, or run Prometheus.

    The targets (file_sd): every deployment's /metrics (rank 0), every node guard's /metrics, node_exporter
    and dcgm-exporter on every host; the deployments are read from the hosts as `status` reads them."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.outputs import check_output_dir
    from sparkprov.plays import monitor as plays

    printed = sys.stderr if o.json else sys.stdout
    action = o.action
    with user_errors():
        out_dir = check_output_dir("out", o.out) if action == "write" else None
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        host = inventory_host_option("host", o.host, inv)
        options = engine_options(o)
        if action == "write":
            print_files(inv, plays.monitor_files(inv, targets, options, exporter_port=o.node_exporter_port,
                                                 scrape_interval=o.scrape_interval), out_dir, check=o.check)
            return
        if action == "down":
            report, doc = plays.down(inv, targets, options, host=host, out=printed, quiet=o.json)
        else:
            report, doc = plays.up(inv, targets, options, host=host, port=o.port, image=o.image, bind=o.bind,
                                   scrape_interval=o.scrape_interval, timeout=o.timeout,
                                   exporter_port=o.node_exporter_port, out=printed, quiet=o.json)
    if o.json:
        print_report(report, True, monitor=doc)
    else:
        if report.exit_code() != 0:  # a failed play never reads as a Prometheus that runs
            print(f"monitor {action} failed: {report.first_failure()}", file=sys.stderr)
        else:
            print(doc["message"])
        report.recap()
    finish(report.exit_code())


def print_files(inv, found, out_dir, *, check: bool = False) -> None:
    """`write`: what the files hold, one line a target, then the files written (or that would be)."""
    from sparkprov.serving.monitor import loopback

    for note in found.notes:
        print(f"sparkprov: {note}", file=sys.stderr)
    for d in found.deployments:
        note = "" if d.state == "running" else f", {d.state}"
        note += f", API key from {d.host}:{d.api_key_file}" if d.api_key_file else ""
        if loopback(d.address) and inv.hosts[d.host].connection != "local":
            note += f", loopback only: only a Prometheus on {d.host} reaches it"
        print(f"{d.name}: {d.model} at {d.target} (rank 0 on {d.host}{note})")
    for h in found.hosts:
        if h.guard:
            print(f"guard of {h.name} at {h.guard} (its fabric address: a Prometheus on a fabric peer reaches it)")
    if not found.deployments:
        print("no sparkprov deployment on these hosts: the vLLM targets are empty (the guards' and exporters' are not)")
    for path, state in write_files(out_dir, found.files, check=check):
        print(f"{state} {path}")
    if not check and any(d.api_key_file for d in found.deployments):
        print(f"put each rank 0's API key where {out_dir / 'prometheus.yml'} says (in {out_dir / 'keys'}/)")


def write_files(out_dir, files: dict[str, str], *, check: bool = False) -> list[tuple[str, str]]:
    """Write each file atomically (a temporary file beside it, renamed over it); one left as it
    is when its content is the same. Returns (path, 'wrote' | 'unchanged' | 'would write' |
    'would change'), in order; with check, writes nothing."""
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
