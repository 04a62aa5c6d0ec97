"""`invoke guard`: the node guards of the fleet (sparkprov/node/guard.py), read as `status` reads
them: each host's guard, or with --events every event of their journals, oldest first; --resume: a
guard that stood down guards and restarts again (a play: --check, --json, the recap). Parses and
prints; sparkprov/plays/guard.py runs the plays.

data, plays and facts load inside the task, not at the top (sparkprov/cli/command.py says why).
"""

from __future__ import annotations

import json as _json
import sys
from dataclasses import dataclass

from sparkprov.cli.command import command
from sparkprov.cli.common import engine_options, finish, inventory_path, print_report, select_hosts, user_errors
from sparkprov.options import Excludes, Flag, Needs, common, option


@dataclass
class GuardOptions:
    hosts: str | None = common("hosts", "Hosts, groups or patterns to read, comma-separated (default: all in the "
                                        "inventory)")
    inventory: str | None = common("inventory")
    limit: str | None = common("limit")
    forks: int = common("forks")
    events: bool = option("List the events of every guard's journal (time, host, kind, reading, threshold, action)",
                          Flag())
    resume: bool = option("A guard that stood down (its restart budget spent, or a crash loop) guards and restarts "
                          "again, counting restarts from now; fix the cause first", Flag())
    check: bool = option("With --resume: say which guards would resume, change nothing", Flag())
    json: bool = common("json")
    accept_new_host_keys: bool = common("accept_new_host_keys")

    RULES = (Needs("check", lambda o: o.resume, "--resume", "reading the guards changes nothing already"),
             Excludes("events", "resume", "both choose what is printed"))


@command(GuardOptions)
def guard(c, o: GuardOptions):
    """Each node's guard: running, last sample, what it holds stopped; --events: every event, fleet-wide;
    --resume: guards that stood down restart again. Exit 2 when a guard acted (its action stands) or is
    not running, 4 when a host is unreachable."""
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.facts import guard as guard_facts
    from sparkprov.plays.guard import read_guards
    from sparkprov.plays.guard import resume as resume_guards

    with user_errors():
        inv = load_inventory(inventory_path(o.inventory))
        targets = select_hosts(inv, o.hosts, o.limit)
        if o.resume:
            report = Report(sys.stderr if o.json else sys.stdout, quiet=o.json)
            resume_guards(inv, targets, engine_options(o), report)
        guards, code = read_guards(inv, targets, engine_options(o))
    if o.resume:
        if o.json:
            print_report(report, True, guards=guards)
        else:
            for h in targets:
                print(guard_facts.describe(h, guards[h]) if h in guards else f"guard on {h}: UNREACHABLE")
            report.recap()
        finish(report.exit_code())
        return
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
