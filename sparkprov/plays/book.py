"""Building playbooks in code and running them on the engine: what every command shares."""

from __future__ import annotations

from typing import Any

from sparkprov.data.inventory import Inventory
from sparkprov.engine.playbook import Play, Playbook, Task
from sparkprov.engine.report import Report
from sparkprov.engine.run import DEFAULT_FORKS, Runner, RunOptions


def task(name: str, module: str, args: dict[str, Any], where: tuple, *, become: bool | None = None) -> Task:
    return Task(name=name, module=module, args=args, tags=[], when=None, notify=[], check_mode=None, no_log=False,
                become=become, ignore_errors=False, where=where)


def play(name: str, hosts: list[str], tasks: list[Task], *, become: bool = False, where: tuple = ("", None, None),
         any_errors_fatal: bool = False) -> Play:
    return Play(name, list(hosts), become, {}, tasks, [], where, any_errors_fatal)


def run_book(inventory: Inventory, book: Playbook, hosts: list[str], options: RunOptions, report: Report) -> Runner:
    """Run a built playbook on the engine; the Runner (its exports) is what the command reads after."""
    runner = Runner(inventory, book, hosts, options, report)
    runner.run()
    return runner


def serving_options(*, check: bool = False, accept_new_host_keys: bool = False, forks: int = DEFAULT_FORKS,
                    diff: bool = False) -> RunOptions:
    """The engine's options for the commands' plays: every later play's facts are read with the
    first gather (gather_ahead), so a run with nothing to do costs one call per host."""
    return RunOptions(check=check, diff=diff, accept_new_host_keys=accept_new_host_keys, forks=forks,
                      gather_ahead=True)
