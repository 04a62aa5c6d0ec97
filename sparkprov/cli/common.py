"""What every command-line task shares: finding the inventory, choosing hosts, running a
playbook, printing the recap or the JSON, and turning errors into one line and an exit code."""

from __future__ import annotations

import difflib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from invoke.exceptions import Exit

from sparkprov.defaults import DEFAULT_FORKS
from sparkprov.errors import InputError, SparkprovError
from sparkprov.options import hosts_option

if TYPE_CHECKING:
    from sparkprov.engine.run import RunOptions

REPO = Path(__file__).resolve().parents[2]

def inventory_path(option: str | None) -> str:
    """--inventory, else $SPARKPROV_INVENTORY, else ./inventory.yaml, else the repo's. An empty
    --inventory is an error, not "the default": it is a script's unset variable."""
    if option is not None:
        if not isinstance(option, str) or not option.strip():
            raise InputError(f"--inventory {option!r} names no file", fix="give an inventory file or leave out --inventory")
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
    """--hosts chooses the targets (not given: all); --limit narrows them further. A pattern that
    is given but empty, or selects no host, is an error: `--hosts "$UNSET"` must never mean
    "every host in the inventory"."""
    from sparkprov.data.inventory import check_host_files, implicit_localhost

    hosts = hosts_option("hosts", hosts)
    limit = hosts_option("limit", limit)
    names = split_csv(hosts)
    if names == ["localhost"] and "localhost" not in inventory.hosts:
        inventory.hosts["localhost"] = implicit_localhost()
    chosen = inventory.resolve(names or "all", where=("--hosts", None, None), what="--hosts")
    if hosts is not None and not chosen:
        raise SparkprovError(f"--hosts {hosts!r} selects no host of {inventory.path}",
                             fix=f"hosts there: {_some(inventory.hosts)}")
    if not chosen:
        raise SparkprovError(f"{inventory.path} defines no hosts", fix="add hosts: to the inventory")
    if limit is not None:
        allowed = set(inventory.resolve(limit, where=("--limit", None, None), what="--limit"))
        chosen = [h for h in chosen if h in allowed]
        if not chosen:
            raise SparkprovError(f"--limit {limit!r} leaves no host of those selected",
                                 fix=f"selected: {_some(inventory.resolve(names or 'all'))}")
    check_host_files(inventory, chosen)
    return chosen


def _some(names, n: int = 8) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "") if names else "none"


def run_playbook(*, playbook: str, inventory: str | None, hosts: str | None, limit: str | None = None,
                 check: bool = False, diff: bool = False, as_json: bool = False, tags: list[str] = (),
                 skip_tags: list[str] = (), forks: int = DEFAULT_FORKS, accept_new_host_keys: bool = False,
                 extra_vars: dict | None = None, verbose: bool = False) -> int:
    """A YAML playbook on the engine (provision, play), its options parsed already."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.data.playbook import load_playbook
    from sparkprov.engine.report import Report
    from sparkprov.engine.run import RunOptions
    from sparkprov.plays.book import run_book

    with user_errors():
        if not isinstance(playbook, str) or not playbook.strip():
            raise InputError(f"playbook {playbook!r}: no file named", fix="give a playbook file, e.g. playbooks/provision.yaml")
        inv = load_inventory(inventory_path(inventory))
        book = load_playbook(playbook)
        targets = select_hosts(inv, hosts, limit)
        _check_tags(book, "--tags", tags)
        _check_tags(book, "--skip-tags", skip_tags)
        options = RunOptions(check=check, diff=diff, tags=set(tags), skip_tags=set(skip_tags),
                             forks=forks, accept_new_host_keys=accept_new_host_keys, verbose=verbose,
                             extra_vars=extra_vars or {})
        report = Report(sys.stderr if as_json else sys.stdout, quiet=as_json, show_diff=diff)
        run_book(inv, book, targets, options, report)
    if as_json:
        print(report.json())
    else:
        report.recap()
    return report.exit_code()


def _check_tags(book, option: str, tags: list[str]) -> None:
    """A tag no task of the playbook carries is a typo: --tags would run nothing, --skip-tags
    would skip nothing, and both would look like success."""
    known = {t for play in book.plays for task in play.tasks + play.handlers for t in task.tags} | {"always"}
    for tag in tags:
        if tag not in known:
            close = difflib.get_close_matches(tag, sorted(known), n=1)
            raise InputError(f"{option} {tag!r}: no task of {book.path} has this tag",
                             fix=f"did you mean {close[0]!r}?" if close else f"tags there: {', '.join(sorted(known))}")


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


def engine_options(o) -> RunOptions:
    """The engine's options for the serving commands' plays (plays/book.py serving_options) from a
    command's parsed options: check (where it has one), forks, accept_new_host_keys."""
    from sparkprov.plays.book import serving_options

    return serving_options(check=getattr(o, "check", False), accept_new_host_keys=o.accept_new_host_keys,
                           forks=o.forks)
