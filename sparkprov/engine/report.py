"""Results: per-task lines as they happen (prefixed by host), the PLAY RECAP, and the JSON document."""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, TextIO

STATUSES = ("ok", "changed", "failed", "skipped", "unreachable")
CENSORED = "output hidden: no_log is set for this task"


@dataclass
class TaskResult:
    host: str
    play: str
    task: str
    module: str
    status: str  # ok | changed | failed | skipped | unreachable
    msg: str = ""
    diff: list[dict[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    subject: str = ""  # its play's subject (Play.subject): not in the JSON document

    def as_dict(self) -> dict[str, Any]:
        d = {"host": self.host, "play": self.play, "task": self.task, "module": self.module,
             "status": self.status, "msg": self.msg, "diff": self.diff}
        if self.warnings:
            d["warnings"] = self.warnings
        return d


@dataclass
class HostTally:
    ok: int = 0
    changed: int = 0
    failed: int = 0
    skipped: int = 0
    unreachable: bool = False
    remote_calls: int = 0


class Report:
    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False, show_diff: bool = False,
                 color: bool | None = None):
        self.stream = stream or sys.stdout
        self.quiet = quiet
        self.show_diff = show_diff
        self.color = self.stream.isatty() if color is None else color
        self.results: list[TaskResult] = []
        self.hosts: dict[str, HostTally] = {}
        self._lock = threading.Lock()
        self._width = 8

    _COLORS = {"ok": "32", "changed": "33", "failed": "31", "skipped": "36", "unreachable": "35", "warning": "35"}

    def _paint(self, text: str, status: str) -> str:
        return f"\x1b[{self._COLORS[status]}m{text}\x1b[0m" if self.color and status in self._COLORS else text

    def set_hosts(self, names: list[str]) -> None:
        for n in names:
            self.hosts.setdefault(n, HostTally())
        self._width = max([self._width] + [len(n) for n in names])

    def play(self, name: str, hosts: list[str]) -> None:
        if not self.quiet:
            self._print(f"\nPLAY [{name}] on {', '.join(hosts) if hosts else 'no hosts'}")

    def _print(self, text: str) -> None:
        with self._lock:
            if self.stream is None:
                return
            try:
                print(text, file=self.stream, flush=True)
            except BrokenPipeError:
                # `invoke provision | head`: the reader left. The run goes on to its end (a play
                # stopped halfway through its changes is worse than output nobody reads), quietly.
                self.stream = None
                _quiet_stdout()

    def record(self, result: TaskResult) -> None:
        with self._lock:
            self.results.append(result)
            tally = self.hosts.setdefault(result.host, HostTally())
            if result.status == "unreachable":
                tally.unreachable = True
            else:
                setattr(tally, result.status, getattr(tally, result.status) + 1)
        if self.quiet:
            return
        head = f"{result.host:<{self._width}} | {self._paint(f'{result.status:<8}', result.status)} | {result.task}"
        lines = [head + (f": {result.msg}" if result.msg else "")]
        for w in result.warnings:
            lines.append(f"{result.host:<{self._width}} | {self._paint('warning ', 'warning')} | {w}")
        if self.show_diff:
            from sparkprov.modules.base import Diff

            for d in result.diff:
                text = Diff(d["label"], d["before"], d["after"]).unified()
                lines.extend(f"{result.host:<{self._width}} |   {ln}" for ln in text.rstrip("\n").splitlines())
        self._print("\n".join(lines))

    def note(self, host: str, text: str) -> None:
        if not self.quiet:
            self._print(f"{host:<{self._width}} | {text}")

    # -- the end ------------------------------------------------------------------------
    def exit_code(self) -> int:
        if any(t.failed for t in self.hosts.values()):
            return 2
        if any(t.unreachable for t in self.hosts.values()):
            return 4
        return 0

    def first_failure(self) -> str:
        """The message of the run's first failed or unreachable task ("" when none): the one line a
        command prints when its plays did not get where it wanted."""
        return next((r.msg for r in self.results if r.status in ("failed", "unreachable")), "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.exit_code() == 0,
            "hosts": {name: {"ok": t.ok, "changed": t.changed, "failed": t.failed, "skipped": t.skipped,
                             "unreachable": t.unreachable, "remote_calls": t.remote_calls}
                      for name, t in self.hosts.items()},
            "results": [r.as_dict() for r in self.results],
        }

    def json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def recap(self) -> None:
        lines = ["", "PLAY RECAP"]
        for name, t in self.hosts.items():
            status = "unreachable" if t.unreachable else "failed" if t.failed else "changed" if t.changed else "ok"
            lines.append(
                f"{self._paint(f'{name:<{self._width}}', status)} : ok={t.ok:<4} changed={t.changed:<4} "
                f"failed={t.failed:<4} skipped={t.skipped:<4} unreachable={int(t.unreachable)}  "
                f"remote_calls={t.remote_calls}")
        self._print("\n".join(lines))


def _quiet_stdout() -> None:
    """Point fd 1 at /dev/null, so that nothing printed later (nor Python's flush at exit)
    fails on the closed pipe."""
    import os
    import sys

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
