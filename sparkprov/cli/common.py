"""What every command-line task shares: finding the inventory, choosing hosts, running a
playbook, printing the recap or the JSON, and turning errors into one line and an exit code."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from invoke.exceptions import Exit

from sparkprov.errors import SparkprovError

REPO = Path(__file__).resolve().parents[2]


def inventory_path(option: str | None) -> str:
    """--inventory, else $SPARKPROV_INVENTORY, else ./inventory.yaml, else the repo's."""
    if option:
        return option
    if os.environ.get("SPARKPROV_INVENTORY"):
        return os.environ["SPARKPROV_INVENTORY"]
    if Path("inventory.yaml").exists():
        return "inventory.yaml"
    return str(REPO / "inventory.yaml")


def playbook_path(option: str | None, default: str) -> str:
    if option:
        return option
    local = Path("playbooks") / default
    return str(local if local.exists() else REPO / "playbooks" / default)


def split_csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


@contextmanager
def user_errors():
    """Bad input -> one line on stderr, exit 1; never a traceback."""
    try:
        yield
    except SparkprovError as exc:
        raise Exit(f"sparkprov: {exc.line()}", code=exc.exit_code) from None
    except KeyboardInterrupt:
        raise Exit("sparkprov: interrupted", code=130) from None


def select_hosts(inventory, hosts: str | None, limit: str | None) -> list[str]:
    """--hosts chooses the targets (default: all); --limit narrows them further."""
    from sparkprov.data.inventory import implicit_localhost

    names = split_csv(hosts)
    if names == ["localhost"] and "localhost" not in inventory.hosts:
        inventory.hosts["localhost"] = implicit_localhost()
    chosen = inventory.resolve(names or "all", where=("--hosts", None, None), what="--hosts")
    if limit:
        allowed = set(inventory.resolve(limit, where=("--limit", None, None), what="--limit"))
        chosen = [h for h in chosen if h in allowed]
    if not chosen:
        raise SparkprovError("no hosts selected", fix="check --hosts and --limit against the inventory")
    return chosen


def run_playbook(*, playbook: str, inventory: str | None, hosts: str | None, limit: str | None = None,
                 check: bool = False, diff: bool = False, as_json: bool = False, tags: str | None = None,
                 skip_tags: str | None = None, forks: int | None = None, accept_new_host_keys: bool = False,
                 extra_vars: dict | None = None) -> int:
    from sparkprov.data.inventory import load_inventory
    from sparkprov.data.playbook import load_playbook
    from sparkprov.engine.report import Report
    from sparkprov.engine.run import DEFAULT_FORKS, Runner, RunOptions

    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        book = load_playbook(playbook)
        targets = select_hosts(inv, hosts, limit)
        options = RunOptions(check=check, diff=diff, tags=set(split_csv(tags)), skip_tags=set(split_csv(skip_tags)),
                             forks=forks or DEFAULT_FORKS, accept_new_host_keys=accept_new_host_keys,
                             extra_vars=extra_vars or {})
        report = Report(sys.stderr if as_json else sys.stdout, quiet=as_json, show_diff=diff)
        Runner(inv, book, targets, options, report).run()
    if as_json:
        print(report.json())
    else:
        report.recap()
    return report.exit_code()


def print_report(report, as_json: bool, **extra) -> None:
    """The end of a command: one JSON document ({ok, hosts, results} plus the command's own
    sections) or the PLAY RECAP."""
    if as_json:
        doc = report.as_dict()
        doc.update(extra)
        print(json.dumps(doc, indent=2, default=str))
    else:
        report.recap()


def finish(code: int) -> None:
    if code:
        raise Exit(code=code)


def print_json(data) -> None:
    print(json.dumps(data, indent=2, default=str))
