"""`invoke history DEPLOYMENT`, `invoke rollback DEPLOYMENT [--to N]`: parse options, print what
sparkprov/plays/upgrade.py found and did (it records each start on rank 0, reads the history and
rolls a deployment back).
"""

from __future__ import annotations

import json as _json
import sys
from dataclasses import dataclass

from sparkprov.cli.command import command
from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.options import DEPLOYMENT, Int, Number, common, option


@dataclass
class HistoryOptions:
    deployment: str = option("The deployment (its name, as `invoke status` shows it)", DEPLOYMENT, positional=True)
    hosts: str | None = common("hosts", "Hosts to look for the deployment's rank 0 on, comma-separated (default: "
                                        "all in the inventory)")
    inventory: str | None = common("inventory")
    json: bool = common("json")
    forks: int = common("forks")
    accept_new_host_keys: bool = common("accept_new_host_keys")


@dataclass
class RollbackOptions(HistoryOptions):
    to: int | None = option("The start to go back to (its number in invoke history; default: the last good start "
                            "with another spec than the newest)", Int(1, 10**9))
    health_timeout: float | None = option("Seconds to wait for /health (default: the recipe's "
                                          "startup.health_timeout_s)", Number(0, 86400, unit="seconds"))


def _history(o: HistoryOptions):
    """The deployment's recorded starts on its rank 0 (the host whose history of it is the newest)."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.plays.upgrade import find_history

    inv = load_inventory(inventory_path(o.inventory))
    targets = select_hosts(inv, o.hosts, None)
    return inv, find_history(inv, targets, o.deployment, forks=o.forks, accept_new_host_keys=o.accept_new_host_keys)


@command(HistoryOptions)
def history(c, o: HistoryOptions):
    """Every recorded start of a deployment (on its rank 0): per node the image and its digest, the
    recipe hash, the model commit, the layout and overrides, and the smoke result; the last good marked."""
    from sparkprov.serving import history as hist

    with user_errors():
        _, found = _history(o)
    name, head, records = found.name, found.host, found.records
    for line in found.skipped:
        print(f"sparkprov: {head}:{hist.history_file(name)}: skipped {line}", file=sys.stderr)
    good = hist.last_good(records)
    if o.json:
        print(_json.dumps({"ok": True, "deployment": name, "host": head, "last_good": good["n"] if good else None,
                           "records": records, "on_demand": found.on_demand}, indent=2, default=str))
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
    if found.on_demand:
        od = Table(title=f"on-demand starts and stops of {name} (the guards' journals)")
        for col in ("time", "host", "action", "reason", "result"):
            od.add_column(col, overflow="fold")
        for e in found.on_demand:
            od.add_row(e["time"], e["host"], e["action"], e["reason"], e["result"])
        Console(width=200).print(od)


@command(RollbackOptions)
def rollback(c, o: RollbackOptions):
    """Start a recorded good start of a deployment again on every node; exit 2 when it fails its smoke test."""
    from sparkprov.engine.report import Report
    from sparkprov.plays.options import UpOptions
    from sparkprov.plays.upgrade import rollback_deployment, rollback_target

    with user_errors():
        inv, found = _history(o)
        good = rollback_target(found, o.to)
        report = Report(sys.stderr if o.json else sys.stdout, quiet=o.json)
        done = rollback_deployment(inv, found, good, UpOptions(health_timeout=o.health_timeout),
                                   lambda: engine_options(o), report)
    print_report(report, o.json, rollback={**done.result, "deployment": found.name, "message": done.message})
    if not o.json:
        print("\n" + done.message)
    finish(report.exit_code() or (0 if done.serving else 2))
