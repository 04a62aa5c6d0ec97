"""`invoke guard` on the engine: the node guards (node/guard.py) as the status play reads them, and
`--resume`: the guard_resume play on each host (facts, plan, apply, read again)."""

from __future__ import annotations

from sparkprov.data.inventory import Inventory
from sparkprov.data.playbook import Playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import RunOptions
from sparkprov.facts import guard as guard_facts
from sparkprov.facts.guard import GuardSummary
from sparkprov.plays.serve import HostStatus, read_status
from sparkprov.plays.book import play, run_book, task


def guards_of(st: dict[str, HostStatus]) -> dict[str, GuardSummary]:
    """Each host's guard summary as the status play read it, where one is set up."""
    return {h: d["host"]["guard"] for h, d in st.items() if d["host"].get("guard")}


def read_guards(inv: Inventory, targets: list[str], options: RunOptions) -> tuple[dict[str, GuardSummary], int]:
    """Each reachable host's guard summary (facts/guard.py), and the exit code: 4 when a host is
    unreachable, else 2 where a guard acted (its action stands) or is not running, else 0."""
    st, _ = read_status(inv, targets, options)
    code = 4 if any(not d["reachable"] for d in st.values()) else 0
    guards = guards_of(st)
    return guards, guard_facts.exit_code(guards, code)


def resume_book(hosts: list[str]) -> Playbook:
    return Playbook("guard --resume", [play("resume the guard", hosts, [
        task("resume", "guard_resume", {}, ("guard --resume", None, None))])])


def resume(inv: Inventory, targets: list[str], options: RunOptions, report: Report) -> None:
    run_book(inv, resume_book(targets), targets, options, report)
