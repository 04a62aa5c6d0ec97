"""`invoke guard`: the node guards of the fleet (sparkprov/serving/guard.py), read as `status` reads
them: each host's guard, or with --events every event of their journals, oldest first.

Registered in tasks.py: ns.add_task(task(guard_cli.guard, help=guard_cli.HELP))
"""

from __future__ import annotations

import json as _json

HELP = {
    "hosts": "Hosts, groups or patterns to read, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "limit": "Further limit the hosts (pattern)",
    "forks": "How many hosts to work on at once (default 32)",
    "events": "List the events of every guard's journal (time, host, kind, reading, threshold, action)",
    "json": "Print one JSON document instead of the text",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
}


def guard(c, hosts=None, inventory=None, limit=None, forks=None, events=False, json=False,
          accept_new_host_keys=False):
    """Each node's guard: running, last sample, what it holds stopped; --events: every event, fleet-wide.
    Exit 2 when a guard acted (its action stands) or is not running, 4 when a host is unreachable."""
    from sparkprov.cli.common import engine_options, finish, inventory_path, select_hosts, user_errors
    from sparkprov.data.inventory import load_inventory
    from sparkprov.facts import guard as guard_facts
    from sparkprov.plays import serve as plays

    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        st, code = plays.read_status(inv, targets, engine_options(forks=forks, accept_new_host_keys=accept_new_host_keys))
    code = 4 if any(not d.get("reachable") for d in st.values()) else 0
    guards = {h: d["host"]["guard"] for h, d in st.items() if (d.get("host") or {}).get("guard")}
    code = guard_facts.exit_code(guards, code)
    listed = guard_facts.fleet_events(guards)
    if json:
        print(_json.dumps({"ok": code == 0, "guards": guards, **({"events": listed} if events else {})}, indent=2,
                          default=str))
    elif events:
        for e in listed:
            print(guard_facts.event_line(e))
        if not listed:
            print("no guard events")
    else:
        for h in targets:
            print(guard_facts.describe(h, guards[h]) if h in guards else f"guard on {h}: UNREACHABLE")
    finish(code)
