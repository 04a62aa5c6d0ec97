"""`invoke guard`: the node guards of the fleet (sparkprov/node/guard.py), read as `status` reads
them: each host's guard, or with --events every event of their journals, oldest first; --resume: a
guard that stood down guards and restarts again (a play: --check, --json, the recap). Parses and
prints; sparkprov/plays/guard.py runs the plays.

data, plays and facts load inside the task, not at the top: tasks.py imports every cli module, and
`invoke --list` stays fast.
"""

from __future__ import annotations

import json as _json
import sys

from invoke import task

from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors

HELP = {
    "hosts": "Hosts, groups or patterns to read, comma-separated (default: all in the inventory)",
    "inventory": "Inventory file (default: $SPARKPROV_INVENTORY, ./inventory.yaml, or the repo's)",
    "limit": "Further limit the hosts (pattern)",
    "forks": "How many hosts to work on at once (default 32)",
    "events": "List the events of every guard's journal (time, host, kind, reading, threshold, action)",
    "resume": "A guard that stood down (its restart budget spent, or a crash loop) guards and restarts again, "
              "counting restarts from now; fix the cause first",
    "check": "With --resume: say which guards would resume, change nothing",
    "json": "Print one JSON document instead of the text",
    "accept_new_host_keys": "Record host keys of hosts never seen before (a changed key is still refused)",
}


@task(help=HELP)
def guard(c, hosts=None, inventory=None, limit=None, forks=None, events=False, resume=False, check=False, json=False,
          accept_new_host_keys=False):
    """Each node's guard: running, last sample, what it holds stopped; --events: every event, fleet-wide;
    --resume: guards that stood down restart again. Exit 2 when a guard acted (its action stands) or is
    not running, 4 when a host is unreachable."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.facts import guard as guard_facts
    from sparkprov.plays.guard import read_guards
    from sparkprov.plays.guard import resume as resume_guards

    with user_errors():
        inv = load_inventory(inventory_path(inventory))
        targets = select_hosts(inv, hosts, limit)
        if resume:
            report = Report(sys.stderr if json else sys.stdout, quiet=json)
            resume_guards(inv, targets, engine_options(check=check, forks=forks,
                                                       accept_new_host_keys=accept_new_host_keys), report)
        guards, code = read_guards(inv, targets, engine_options(forks=forks, accept_new_host_keys=accept_new_host_keys))
    if resume:
        if json:
            print_report(report, True, guards=guards)
        else:
            for h in targets:
                print(guard_facts.describe(h, guards[h]) if h in guards else f"guard on {h}: UNREACHABLE")
            report.recap()
        finish(report.exit_code())
        return
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
