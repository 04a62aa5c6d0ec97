"""What the engine runs: a playbook is a list of plays; a play targets hosts and lists tasks; a task
names one module and its arguments. data/playbook.py loads them from YAML files (with the
file positions every error names); plays/ builds them in code for the commands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkprov.errors import InputError


@dataclass
class Task:
    name: str
    module: str
    args: dict[str, Any]
    tags: list[str]
    when: str | bool | None
    notify: list[str]
    check_mode: bool | None
    no_log: bool
    become: bool | None
    ignore_errors: bool
    where: tuple[str, int | None, int | None]  # file, line, column of the task
    when_where: tuple[str, int | None, int | None] | None = None  # of its `when:` value

    def error(self, message: str, fix: str | None = None) -> InputError:
        file, line, col = self.where
        return InputError(message, file=file, line=line, column=col, fix=fix)


@dataclass
class Play:
    name: str
    hosts: str | list[str]
    become: bool
    vars: dict[str, Any]
    tasks: list[Task]
    handlers: list[Task]
    where: tuple[str, int | None, int | None]
    # a host that fails stops every host of the play (a cluster is all its nodes or nothing)
    any_errors_fatal: bool = False
    # with any_errors_fatal, the hosts that stop together when one of them has failed, where the
    # play runs on some of them only (a cluster's rank 0 or its other ranks); empty: the play's own
    stops_together: tuple[str, ...] = ()
    # what the play acts for, where a command builds it for one thing (cluster-up: a deployment's
    # name): its results carry it (TaskResult.subject), so the command finds them by this value
    subject: str = ""


@dataclass
class Playbook:
    path: str
    plays: list[Play] = field(default_factory=list)
