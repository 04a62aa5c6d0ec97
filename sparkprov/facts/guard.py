"""The node guard as a host shows it (read-only): installed, running, its last sample, what it
holds stopped, whether it stood down, its latest events (sparkprov/node/guard.py writes them; this
reads them); and `guard_summary`, the pure judgement `status` and `invoke guard` print and exit on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypedDict

from pydantic import ValidationError

from sparkprov.facts.base import SYSTEMD_IS_INIT, Fact, FactError, ShellCtx
from sparkprov.inputfiles import Stored, shape_problem
from sparkprov.node.guard import COMMAND_MARK
from sparkprov.transport.shell import quote

EVENTS_READ = 50   # the journal's last lines a gather brings back
# What a gather brings back of each file at most (the guard's state is a few KiB, an event a few
# hundred bytes): a file grown or replaced by something else never comes back whole.
STATE_BYTES = 1 * 2**20
EVENTS_BYTES = 256 * 2**10


# What the guard program writes (node/guard.py write_state, its journal), as it must read back.


class RailReading(Stored):
    iface: str | None = None
    peer: str | None = None
    status: str | None = None
    gbps: float | None = None
    floor_gbps: float | None = None


class GpuReading(Stored):
    temperature_c: float | None = None


class Sample(Stored):
    t: float | None = None
    mem: dict[str, float] = {}
    hugeblocks: int | None = None
    gpu: GpuReading = GpuReading()
    rails: list[RailReading] = []


class HeldContainer(Stored):
    kind: str | None = None


class StandDown(Stored):
    why: str | None = None


class Budget(Stored):
    restarts: int | None = None
    window_h: float | None = None


class GuardPhase(Stored):
    phase: str | None = None
    restarts: list[float] = []


class StateFile(Stored):
    sample: Sample | None = None
    mem_floor_bytes: float | None = None
    held: dict[str, HeldContainer] = {}
    stood_down: StandDown | None = None
    guard: GuardPhase = GuardPhase()
    budget: Budget = Budget()


class Event(Stored):
    time: str | None = None
    epoch: float | None = None
    kind: str | None = None
    action: str | None = None
    fix: str | None = None
# A guard whose last sample is older than this is not running, whatever its pid says: it writes its
# state every few seconds, and one sample waits at most for a docker stop (20 s).
STALE_AFTER_S = 120


@dataclass(frozen=True)
class GuardState(Fact):
    """The guard's pid (alive or not), how it is started (systemd or at boot), its state file and
    the end of its journal, and the node's clock (ages are the node's, not the control machine's).
    The paths are the guard program's (sparkprov/node/guard.py: `GuardState(**guard.paths())`)."""

    program: str
    pidfile: str
    state: str
    journal: str

    def command(self, sh: ShellCtx) -> str:
        return "\n".join([
            "printf 'now=%s\\n' \"$(date +%s)\"",
            f"[ -f {quote(self.program)} ] && echo installed=1 || echo installed=0",
            f"if {SYSTEMD_IS_INIT}; then echo systemd=1; else echo systemd=0; fi",
            f"pid=$(cat {quote(self.pidfile)} 2>/dev/null || true)",
            'if [ -n "$pid" ] && tr "\\000" " " < "/proc/$pid/cmdline" 2>/dev/null | grep -q -e guard.py -e '
            f'{quote(COMMAND_MARK)}; then echo "running=$pid"; else echo running=; fi',
            "echo @state",
            f"[ -f {quote(self.state)} ] && head -c {STATE_BYTES} {quote(self.state)} 2>/dev/null; echo",
            "echo @events",
            f"[ -f {quote(self.journal)} ] && tail -c {EVENTS_BYTES} {quote(self.journal)} 2>/dev/null "
            f"| tail -n {EVENTS_READ}; :",
        ])

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_guard_state(out)


def parse_guard_state(out: str) -> dict[str, Any]:
    head, sep, rest = out.partition("@state\n")
    if not sep:
        raise FactError(f"no guard state in {out[:200]!r}")
    state_text, _, events_text = rest.partition("@events\n")
    kv = dict(line.split("=", 1) for line in head.splitlines() if "=" in line)
    unread: list[str] = []
    try:
        state = json.loads(state_text) if state_text.strip() else None
        if state is not None:
            StateFile.model_validate(state)
    except (ValueError, RecursionError) as exc:
        # a state file caught half-written by a reader is replaced atomically, so this is another writer's
        state = None
        unread.append(f"the guard's state file does not fit: {_first(exc)}")
    events, junk = [], 0
    for line in events_text.splitlines():
        try:
            doc = json.loads(line)
            Event.model_validate(doc)
        except (ValueError, RecursionError):  # a line cut at the front by the byte bound, or not an event
            junk += 1
            continue
        events.append(doc)
    if junk:
        unread.append(f"{junk} line(s) of the guard's journal are no event (skipped)")
    try:
        now = float(kv.get("now") or 0)
    except ValueError:
        now = 0.0
    return {"now": now, "installed": kv.get("installed") == "1",
            "systemd": kv.get("systemd") == "1", "pid": int(kv["running"]) if kv.get("running", "").isdigit() else None,
            "state": state, "events": events, "unread": unread}


def _first(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return shape_problem(exc)
    return "not JSON" if isinstance(exc, ValueError) else "nested too deeply"


class GuardSummary(TypedDict):
    """One host's guard as `status` and `invoke guard` show it (guard_summary)."""
    installed: bool
    running: bool
    pid: int | None
    started_by: str                 # systemd | boot
    last_sample_age_s: float | None
    mem_free: int | None
    mem_available: int | None
    mem_total: int | None
    mem_floor: int | None           # the MemFree floor under which it drops caches and compacts
    hugeblocks: int | None          # free blocks of hugeblock_mib or more
    gpu: dict[str, Any]             # its last GPU readings
    phase: str | None               # what it watches for now (a load, serving)
    nvrm_lines: int                 # NVRM memory lines in its journal's end (recorded, never acted on)
    restarts: int                   # its restarts within restart_window_h
    restart_budget: int | None
    restart_window_h: float | None
    held: dict[str, Any]            # container -> why the guard holds it stopped
    stood_down: dict[str, Any] | None  # why it restarts nothing until --resume
    events: list[dict[str, Any]]    # the end of its journal
    acted: bool                     # an action of it stands (held, or stood down)
    problems: list[str]             # what makes status exit 2
    unread: list[str]               # what of its files did not fit (skipped, named)
    listen: list[str]               # the addresses its HTTP port listens on (/metrics, on-demand requests)


def guard_summary(fact: dict[str, Any]) -> GuardSummary:
    """One host's guard, judged: running, its last readings, what it holds, whether it stood down, its
    events, and the problems that make `status` exit 2 (installed but not running, or an action that
    stands: containers held stopped, the guard stood down, a degraded rail). A host without the
    guard is shown, not failed."""
    state = fact.get("state") or {}
    sample = state.get("sample") or {}
    age = fact["now"] - sample["t"] if sample.get("t") else None
    running = fact.get("pid") is not None and age is not None and age <= STALE_AFTER_S
    mem = sample.get("mem") or {}
    events = fact.get("events") or []
    problems: list[str] = []
    if fact.get("installed") and not running:
        problems.append("the guard is not running" + (f" (last sample {age:.0f}s ago)" if age is not None else "")
                        + ": invoke provision starts it")
    held = state.get("held") or {}
    for name, h in sorted(held.items()):
        cause = next((e for e in reversed(events) if name in (e.get("action") or "")
                      and e.get("kind") not in ("restart", "stand-down")), None)
        problems.append(f"the guard stopped {name} ({h.get('kind')})"
                        + (f": {cause['reading']} (threshold {cause['threshold']})" if cause else ""))
    for r in sample.get("rails") or []:
        if r.get("status") == "degraded":
            fig = f"{r['gbps']:g} Gb/s" if r.get("gbps") is not None else "nothing carried"
            problems.append(f"rail {r.get('iface')} to {r.get('peer')} degraded at its last qualification ({fig}, floor "
                            f"{r.get('floor_gbps') or 0:g} Gb/s): multi-node starts refused until it qualifies "
                            "(invoke guard --events says why and the fix)")
    down = state.get("stood_down")
    if down:
        problems.append(f"the guard stood down: {down.get('why')}; it restarts nothing until `invoke guard --resume` "
                        "(or cluster-up), once the cause is fixed")
    nvrm = [e for e in events if e.get("kind") == "nvrm-memory"]
    budget = state.get("budget") or {}
    window_s = float(budget.get("window_h") or 0) * 3600
    restarts = [t for t in (state.get("guard") or {}).get("restarts") or [] if not window_s or fact["now"] - t <= window_s]
    return {"installed": bool(fact.get("installed")), "running": running, "pid": fact.get("pid"),
            "started_by": "systemd" if fact.get("systemd") else "boot",
            "last_sample_age_s": round(age, 1) if age is not None else None,
            "mem_free": mem.get("MemFree"), "mem_available": mem.get("MemAvailable"), "mem_total": mem.get("MemTotal"),
            "mem_floor": state.get("mem_floor_bytes"), "hugeblocks": sample.get("hugeblocks"),
            "gpu": sample.get("gpu") or {}, "phase": (state.get("guard") or {}).get("phase"),
            "nvrm_lines": sum(int(e.get("count") or 1) for e in nvrm),
            "restarts": len(restarts), "restart_budget": budget.get("restarts"), "restart_window_h": budget.get("window_h"),
            "held": held, "stood_down": down, "events": events,
            "acted": bool(held or down), "problems": problems, "unread": fact.get("unread") or [],
            "listen": [a for a in state.get("listen") or [] if isinstance(a, str)]}


def describe(host: str, s: GuardSummary) -> str:
    """One line per host for `status`: the guard's state, its last readings, its standing problems."""
    if not s.get("installed"):
        return f"guard on {host}: not installed (invoke provision installs it)"
    gib = lambda n: f"{n / 2**30:.1f} GiB" if n is not None else "?"  # noqa: E731
    head = (f"guard on {host}: " + (f"running (pid {s['pid']}, {s['started_by']}), last sample "
                                    f"{s['last_sample_age_s']:.0f}s ago" if s["running"] else "NOT RUNNING")
            + f"; MemFree {gib(s.get('mem_free'))} (floor {gib(s.get('mem_floor'))}), MemAvailable "
            f"{gib(s.get('mem_available'))}")
    temp = (s.get("gpu") or {}).get("temperature_c")
    head += f", GPU {temp:g} C" if temp is not None else ""
    if s.get("nvrm_lines"):
        head += f"; {s['nvrm_lines']} NVRM memory line(s) recorded (not acted on)"
    if s.get("restarts"):
        head += f"; {s['restarts']} of {s.get('restart_budget')} restarts in {s.get('restart_window_h'):g} h"
    head += f"; {len(s.get('events') or [])} event(s) in its journal"
    return head + "".join(f"\n  {p}" for p in s["problems"] + (s.get("unread") or []))


def exit_code(summaries: dict[str, GuardSummary], code: int) -> int:
    """status's exit code with the guards': 2 where a guard acted (and its action stands) or is not
    running, unless the code already says worse (4: a host unreachable)."""
    if code == 0 and any(s.get("problems") for s in summaries.values()):
        return 2
    return code


def fleet_events(summaries: dict[str, GuardSummary]) -> list[dict[str, Any]]:
    """Every host's journaled events with the host named, oldest first."""
    return sorted(({"host": h, **e} for h, s in summaries.items() for e in s.get("events") or []),
                  key=lambda e: (e.get("epoch") or 0, e["host"]))


def event_line(e: dict[str, Any]) -> str:
    return (f"{e.get('time')} {e['host']} {e.get('kind')}: {e.get('reading')} "
            f"(threshold {e.get('threshold')}) -> {e.get('action')}" + (f"; fix: {e['fix']}" if e.get("fix") else ""))
