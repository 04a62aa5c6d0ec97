"""`invoke monitor`: run the status play (as `invoke status` does) to learn which deployments
sparkprov serves, and write a Prometheus scrape configuration and a Grafana dashboard for them
(rendered by sparkprov/serving/monitor.py) into --out.

Registered in tasks.py:

    from sparkprov.cli import monitor as monitor_cli
    ns.add_task(task(monitor_cli.monitor, help=monitor_cli.HELP))
"""

from __future__ import annotations

import sys

HELP = {
    "out": "Folder to write into (default: ./monitoring): prometheus.yml, targets/*.json, grafana-dashboard.json",
    "node_exporter_port": "Port of node_exporter on every host (default 9100)",
    "check": "Say which files would be written or changed; write nothing",
    "hosts": "Hosts, groups or patterns to monitor, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "limit": "Further limit the hosts (pattern)",
    "forks": "How many hosts to read at once (default 32)",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
}


def monitor(c, out=None, node_exporter_port=None, check=False, hosts=None, inventory=None, limit=None, forks=None,
            accept_new_host_keys=False):
    """Write a Prometheus scrape configuration and a Grafana dashboard for what sparkprov serves.

    The targets (file_sd): every deployment's /metrics (rank 0), node_exporter and dcgm-exporter on every host;
    the deployments are read from the hosts as `status` reads them."""
    from sparkprov.cli.common import engine_options, finish, inventory_path, select_hosts, user_errors
    from sparkprov.cli.options import int_option, parse_forks, text_option
    from sparkprov.data.inventory import load_inventory
    from sparkprov.defaults import host_setting
    from sparkprov.engine.run import DEFAULT_FORKS
    from sparkprov.outputs import check_output_dir
    from sparkprov.plays.serve import read_status
    from sparkprov.serving import monitor as mon

    with user_errors():
        out_dir = check_output_dir("out", text_option("out", out, default="monitoring"))
        port = int_option("node-exporter-port", node_exporter_port, 1, 65535, default=mon.NODE_EXPORTER_PORT)
        forks = parse_forks(forks, DEFAULT_FORKS)
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        st, code = read_status(inv, targets, engine_options(forks=forks, accept_new_host_keys=accept_new_host_keys))
        blind = [(h, st[h]) for h in targets if not st[h]["reachable"] or not st[h]["docker"]]
        for h, s in blind:
            print(f"sparkprov: {h}: {'unreachable' if not s['reachable'] else 'docker'}: {s.get('error')}",
                  file=sys.stderr)
        if blind:
            # a host whose containers could not be read would drop its deployments from the targets,
            # and Prometheus would forget them instead of showing them down
            print(f"sparkprov: nothing written: the deployments on {', '.join(h for h, _ in blind)} are unknown "
                  "(fix: bring the host back, or leave it out with --limit)", file=sys.stderr)
            finish(code or 2)
        monitored = [mon.MonitoredHost(h, inv.hosts[h].address, str(host_setting(inv.hosts[h].vars, "serve_bind")))
                     for h in targets]
        deps = mon.deployments_from_status(st, {m.name: m for m in monitored})
        files = mon.render(deps, monitored, node_exporter_port=port)
        for d in deps:
            note = "" if d.state == "running" else f", {d.state}"
            note += f", API key from {d.host}:{d.api_key_file}" if d.api_key_file else ""
            if mon.loopback(d.address) and inv.hosts[d.host].connection != "local":
                note += f", loopback only: only a Prometheus on {d.host} reaches it"
            print(f"{d.name}: {d.model} at {d.target} (rank 0 on {d.host}{note})")
        if not deps:
            print("no sparkprov deployment on these hosts: the vLLM targets are empty (the exporters' are not)")
        for path, state in write_files(out_dir, files, check=check):
            print(f"{state} {path}")
        if not check and any(d.api_key_file for d in deps):
            print(f"put each rank 0's API key where {out_dir / 'prometheus.yml'} says (in {out_dir / 'keys'}/)")


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
