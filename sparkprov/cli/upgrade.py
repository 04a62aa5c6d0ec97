"""`invoke history DEPLOYMENT`, `invoke rollback DEPLOYMENT [--to N]`, and cluster-up's `--image`
(sparkprov/plays/upgrade.py records each start on rank 0 and rolls a failed upgrade back).

Registered in tasks.py:

    from sparkprov.cli import upgrade as upgrade_cli
    ns.add_task(task(upgrade_cli.history, help=upgrade_cli.HISTORY_HELP))
    ns.add_task(task(upgrade_cli.rollback, help=upgrade_cli.ROLLBACK_HELP))
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


def add_to_summary(summary: dict, settled) -> None:
    """cluster-up's summary: each start's record number and result, each rollback and what it found."""
    from sparkprov.plays.upgrade import describe

    for name, d in summary.get("deployments", {}).items():
        rec = settled.recorded.get(name)
        if rec:
            d["history"] = {"start": rec["n"], "result": rec["result"]}
        r = settled.rolled_back.get(name)
        if r:
            d["rollback"] = r
            d["state"] = (f"failed; rolled back to start #{r['to']}, serving again" if r["serving"]
                          else "failed; rollback failed too (removed again)")
            summary.setdefault("upgrade", []).append(describe(name, r))


def _read(task, inventory, hosts, name, forks, accept_new_host_keys):
    """(rank 0 host, its records) of a deployment: the host whose history of it is the newest."""
    from sparkprov.cli.common import select_hosts
    from sparkprov.cli.options import parse_forks, positional
    from sparkprov.engine.run import DEFAULT_FORKS
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.gather import gather_facts
    from sparkprov.errors import SparkprovError
    from sparkprov.facts.history import HistoryFile
    from sparkprov.serving import history
    from sparkprov.serving.deployment import NAME_RE

    from sparkprov.cli.common import inventory_path

    name = positional(task, "deployment", name)
    if not NAME_RE.match(name):
        raise SparkprovError(f"{name!r} is not a deployment name", fix="lowercase letters, digits, '.', '_', '-'")
    inv = load_inventory(inventory_path(inventory))
    targets = select_hosts(inv, hosts, None)
    got = gather_facts(inv, targets, {"history": HistoryFile(history.history_file(name))},
                       forks=parse_forks(forks, DEFAULT_FORKS), accept_new_host_keys=accept_new_host_keys)
    found = {h: history.parse(r["facts"]["history"]["text"]) for h, r in got.items()
             if r["ok"] and r["facts"]["history"]["exists"]}
    found = {h: recs for h, recs in found.items() if recs}
    if not found:
        unread = [f"{h} ({next(iter(r['errors'].values()), 'unreadable')})" for h, r in got.items() if not r["ok"]]
        raise SparkprovError(f"no history of deployment {name!r} on {', '.join(targets)}"
                             + (f"; not read: {', '.join(unread)}" if unread else ""),
                             fix="check the name (invoke status lists deployments); a start is recorded on its rank 0 "
                                 "from this version of sparkprov on")
    head = max(found, key=lambda h: (found[h][-1].get("time") or "", len(found[h])))
    return inv, name, head, found[head]


def history(c, deployment, hosts=None, inventory=None, json=False, forks=None, accept_new_host_keys=False):
    """Every recorded start of a deployment (on its rank 0): per node the image and its digest, the
    recipe hash, the model commit, the layout and overrides, and the smoke result; the last good marked."""
    from sparkprov.cli.common import user_errors
    from sparkprov.serving import history as hist

    with user_errors():
        _, name, head, records = _read("history", inventory, hosts, deployment, forks, accept_new_host_keys)
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
    from sparkprov.cli.options import OptionError, float_option, int_option
    from sparkprov.engine.report import Report
    from sparkprov.plays import upgrade
    from sparkprov.plays.serve import UpOptions, down_book, run_book
    from sparkprov.serving import history as hist

    out = sys.stderr if json else sys.stdout
    with user_errors():
        to = int_option("to", to, 1, 10**9)
        health_timeout = float_option("health-timeout", health_timeout, 0, 86400, unit="seconds")
        inv, name, head, records = _read("rollback", inventory, hosts, deployment, forks, accept_new_host_keys)
        newest = records[-1]
        if to is not None:
            good = hist.find(records, to)
            if good is None or good.get("result") != hist.PASSED:
                ok = ", ".join(f"#{r['n']}" for r in records if r.get("result") == hist.PASSED) or "none"
                raise OptionError(f"--to {to}: start #{to} of {name} " + ("is not recorded" if good is None else
                                                                          "did not pass its smoke test"),
                                  fix=f"give a start that passed ({ok}): invoke history {name}")
        else:
            good = hist.last_good(records, unlike=newest.get("spec"))
            if good is None:
                raise OptionError(f"{name}: no start that passed with another spec than start #{newest['n']}",
                                  fix=f"invoke history {name}, then --to N")
        current = upgrade.deployment_from(newest["spec"])
        report = Report(out, quiet=json)
        options = lambda: engine_options(forks=forks, accept_new_host_keys=accept_new_host_keys)  # noqa: E731
        live = sorted(set(current.hosts) | set(good["spec"]["hosts"]))
        result = upgrade.rollback(inv, current, good, UpOptions(health_timeout=health_timeout), live, options, report)
        if not result["serving"]:  # nothing half-up holds the GPUs
            back = upgrade.deployment_from(good["spec"])
            run_book(inv, down_book(back.hosts, [name], reason="rollback failed"), back.hosts, options(), report)
    line = (f"{name}: start #{good['n']} runs again on every node and passed its smoke test (recorded as "
            f"#{result['record']}, {result['seconds']:.0f}s)" if result["serving"] else
            f"{name}: start #{good['n']} failed again ({result['rollback_failure'] or 'its smoke test'}): removed")
    line += "".join(f"; {n}" for n in result["notes"])
    print_report(report, json, rollback={**result, "deployment": name, "message": line})
    if not json:
        print("\n" + line)
    finish(report.exit_code() or (0 if result["serving"] else 2))
