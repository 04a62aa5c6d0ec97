"""`invoke guard`: the node guards of the fleet (sparkprov/serving/guard.py), read as `status` reads
them: each host's guard, or with --events every event of their journals, oldest first. Parses and
prints; sparkprov/plays/guard.py reads them.

data, plays and facts load inside the task, not at the top (sparkprov/cli/command.py says why).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

from sparkprov.cli.command import command
from sparkprov.cli.common import engine_options, finish, inventory_path, select_hosts, user_errors
from sparkprov.options import Flag, common, option


@dataclass
class GuardOptions:
    hosts: str | None = common("hosts", "Hosts, groups or patterns to read, comma-separated (default: all in the "
                                        "inventory)")
    inventory: str | None = common("inventory")
    limit: str | None = common("limit")
    forks: int = common("forks")
    events: bool = option("List the events of every guard's journal (time, host, kind, reading, threshold, action)",
                          Flag())
    json: bool = common("json")
    accept_new_host_keys: bool = common("accept_new_host_keys")


@command(GuardOptions)
def guard(c, o: GuardOptions):
    """Each node's guard: running, last sample, what it holds stopped; --events: every event, fleet-wide.
    Exit 2 when a guard acted (its action stands) or is not running, 4 when a host is unreachable."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.facts import guard as guard_facts
    from sparkprov.plays.guard import read_guards

    with user_errors():
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        guards, code = read_guards(inv, targets, engine_options(o))
    listed = guard_facts.fleet_events(guards)
    if o.json:
        print(_json.dumps({"ok": code == 0, "guards": guards, **({"events": listed} if o.events else {})}, indent=2,
                          default=str))
    elif o.events:
        for e in listed:
            print(guard_facts.event_line(e))
        if not listed:
            print("no guard events")
    else:
        for h in targets:
            print(guard_facts.describe(h, guards[h]) if h in guards else f"guard on {h}: UNREACHABLE")
    finish(code)
