"""`invoke facts`: what each host looks like, as a table or JSON."""

from __future__ import annotations

import sys

from sparkprov.cli.common import finish, inventory_path, print_json, select_hosts, user_errors


def show_facts(*, hosts, inventory, as_json, limit, forks, accept_new_host_keys) -> None:
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.gather import gather_facts
    from sparkprov.facts.profile import host_profile

    from sparkprov.cli.options import parse_forks
    from sparkprov.engine.run import DEFAULT_FORKS

    with user_errors():
        forks = parse_forks(forks, DEFAULT_FORKS)
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        result = gather_facts(inv, targets, host_profile(), forks=forks,
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
