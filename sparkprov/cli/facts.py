"""`invoke facts`: what each host looks like, as a table or JSON."""

from __future__ import annotations

import sys

from sparkprov.cli.common import finish, inventory_path, print_json, select_hosts, user_errors


def show_facts(*, hosts, inventory, as_json, limit, forks, accept_new_host_keys) -> None:
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.gather import gather_facts
    from sparkprov.facts.profile import host_profile

    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        result = gather_facts(inv, targets, host_profile(), forks=forks or 32,
                              accept_new_host_keys=accept_new_host_keys)
    if as_json:
        print_json(result)
    else:
        _print_tables(result)
    finish(0 if all(r["ok"] for r in result.values()) else 4 if any(r.get("unreachable") for r in result.values()) else 2)


def _flatten(value, prefix=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}{k}." if not isinstance(v, dict) or v else f"{prefix}{k}")
    elif isinstance(value, list):
        yield prefix.rstrip("."), ", ".join(str(v) if not isinstance(v, dict) else
                                            " ".join(f"{a}={b}" for a, b in v.items()) for v in value)
    else:
        yield prefix.rstrip("."), "" if value is None else str(value)


def _print_tables(result) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout)
    for host, r in result.items():
        table = Table(title=host, show_header=True, header_style="bold")
        table.add_column("fact")
        table.add_column("value")
        for section, value in r["facts"].items():
            for key, text in _flatten(value, f"{section}."):
                table.add_row(key, text)
        for section, msg in r["errors"].items():
            table.add_row(f"{section} (error)", msg)
        console.print(table)
