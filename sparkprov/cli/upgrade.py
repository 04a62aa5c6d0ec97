"""`invoke history DEPLOYMENT`, `invoke rollback DEPLOYMENT [--to N]`: parse options, print what
sparkprov/plays/upgrade.py found and did (it records each start on rank 0, reads the history and
rolls a deployment back).

Registered in tasks.py, each with its help: history (HISTORY_HELP), rollback (ROLLBACK_HELP).
"""

from __future__ import annotations

import json as _json
import sys

_COMMON = {
    "hosts": "Hosts to look for the deployment's rank 0 on, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "json": "Print one JSON document instead of the text",
    "forks": "How many hosts to read at once (default 32)",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
}
HISTORY_HELP = {**_COMMON}
ROLLBACK_HELP = {**_COMMON, "to": "The start to go back to (its number in invoke history; default: the last good "
                                  "start with another spec than the newest)",
                 "health_timeout": "Seconds to wait for /health (default: the recipe's startup.health_timeout_s)"}


def _history(task, inventory, hosts, name, forks, accept_new_host_keys):
    """The deployment's recorded starts on its rank 0 (the host whose history of it is the newest)."""
    from sparkprov.cli.common import inventory_path, select_hosts
    from sparkprov.cli.options import parse_forks, positional
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.run import DEFAULT_FORKS
    from sparkprov.errors import SparkprovError
    from sparkprov.plays.upgrade import find_history
    from sparkprov.serving.deployment import NAME_RE

    name = positional(task, "deployment", name)
    if not NAME_RE.match(name):
        raise SparkprovError(f"{name!r} is not a deployment name", fix="lowercase letters, digits, '.', '_', '-'")
    inv = load_inventory(inventory_path(inventory))
    targets = select_hosts(inv, hosts, None)
    return inv, find_history(inv, targets, name, forks=parse_forks(forks, DEFAULT_FORKS),
                             accept_new_host_keys=accept_new_host_keys)


def history(c, deployment, hosts=None, inventory=None, json=False, forks=None, accept_new_host_keys=False):
    """Every recorded start of a deployment (on its rank 0): per node the image and its digest, the
    recipe hash, the model commit, the layout and overrides, and the smoke result; the last good marked."""
    from sparkprov.cli.common import user_errors
    from sparkprov.serving import history as hist

    with user_errors():
        _, found = _history("history", inventory, hosts, deployment, forks, accept_new_host_keys)
    name, head, records = found.name, found.host, found.records
    for line in found.skipped:
        print(f"sparkprov: {head}:{hist.history_file(name)}: skipped {line}", file=sys.stderr)
    good = hist.last_good(records)
    if json:
        print(_json.dumps({"ok": True, "deployment": name, "host": head, "last_good": good["n"] if good else None,
                           "records": records}, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"history of {name} (on {head})")
    cols = ("n", "time", "start", "result", "host", "image", "digest", "recipe", "model", "layout", "overrides")
    for col in cols:
        t.add_column(col, overflow="fold")
    for row in hist.rows(records):
        t.add_row(*(row[c] for c in cols))
    Console(width=200).print(t)
    for r in records:
        if r.get("problem"):
            print(f"#{r['n']}: {r['problem']}")
    print(f"last good: #{good['n']}" if good else "no start has passed its smoke test")


def rollback(c, deployment, to=None, hosts=None, inventory=None, json=False, forks=None, health_timeout=None,
             accept_new_host_keys=False):
    """Start a recorded good start of a deployment again on every node; exit 2 when it fails its smoke test."""
    from sparkprov.cli.common import engine_options, finish, print_report, user_errors
    from sparkprov.cli.options import float_option, int_option
    from sparkprov.engine.report import Report
    from sparkprov.plays.serve import UpOptions
    from sparkprov.plays.upgrade import rollback_deployment, rollback_target

    out = sys.stderr if json else sys.stdout
    with user_errors():
        to = int_option("to", to, 1, 10**9)
        health_timeout = float_option("health-timeout", health_timeout, 0, 86400, unit="seconds")
        inv, found = _history("rollback", inventory, hosts, deployment, forks, accept_new_host_keys)
        good = rollback_target(found, to)
        report = Report(out, quiet=json)
        done = rollback_deployment(inv, found, good, UpOptions(health_timeout=health_timeout),
                                   lambda: engine_options(forks=forks, accept_new_host_keys=accept_new_host_keys),
                                   report)
    print_report(report, json, rollback={**done.result, "deployment": found.name, "message": done.message})
    if not json:
        print("\n" + done.message)
    finish(report.exit_code() or (0 if done.serving else 2))
