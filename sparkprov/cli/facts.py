"""`invoke facts`: what each host looks like, as a table or JSON. Parses and prints;
sparkprov/plays/facts.py gathers them.

data, plays and rich load inside the functions, not at the top (sparkprov/cli/command.py says why).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from sparkprov.cli.command import command
from sparkprov.cli.common import finish, inventory_path, print_json, select_hosts, user_errors
from sparkprov.options import common


@dataclass
class FactsOptions:
    hosts: str | None = common("hosts")
    inventory: str | None = common("inventory")
    json: bool = common("json")
    limit: str | None = common("limit")
    forks: int = common("forks")
    accept_new_host_keys: bool = common("accept_new_host_keys")


@command(FactsOptions)
def facts(c, o: FactsOptions):
    """Show each host's facts: identity, GPU, driver, CUDA, memory, fabric, docker."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.plays.facts import read_facts

    with user_errors():
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        result, code = read_facts(inv, targets, forks=o.forks, accept_new_host_keys=o.accept_new_host_keys)
    if o.json:
        print_json(result)
    else:
        _print_tables(result)
    finish(code)


def _flatten(value, prefix=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}{k}." if not isinstance(v, dict) or v else f"{prefix}{k}")
    elif isinstance(value, list):
        yield prefix.rstrip("."), ", ".join(str(v) if not isinstance(v, dict) else
                                            " ".join(f"{a}={b}" for a, b in v.items()) for v in value)
    else:
        yield prefix.rstrip("."), "" if value is None else str(value)


# The table shows what an owner looks at; --json carries every value.
_TABLE_KEYS = {
    "memory": ("MemTotal", "MemAvailable", "Cached"),
    "kernel": ("modeset",),
}


def _summary(section: str, value):
    keys = _TABLE_KEYS.get(section)
    if keys is None or not isinstance(value, dict):
        return value
    out = {k: value.get(k) for k in keys if k in value}
    if section == "memory":
        out = {k: f"{v / 2**30:.1f} GiB" if isinstance(v, int) else v for k, v in out.items()}
    return out


def _print_tables(result) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout)
    for host, r in result.items():
        table = Table(title=host, show_header=True, header_style="bold")
        table.add_column("fact")
        table.add_column("value")
        for section, value in r["facts"].items():
            for key, text in _flatten(_summary(section, value), f"{section}."):
                table.add_row(key, text)
        for section, msg in r["errors"].items():
            table.add_row(f"{section} (error)", msg)
        console.print(table)
