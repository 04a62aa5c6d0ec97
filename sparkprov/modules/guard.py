"""guard: the node guard (sparkprov/serving/guard.py) installed and running on the host.

Writes the guard program, the status probe it runs for liveness (facts/probe.py, with the guard's
token timeout) and its configuration (/etc/sparkprov/guard.json), then runs it as root:
- where systemd is the init (facts.base.SYSTEMD_IS_INIT: a Spark), the unit sparkprov-guard.service,
  enabled and (re)started when a file changed;
- elsewhere (the lab's simulated Sparks, which start it at boot as they start sshd), a detached
  process with a pid file, (re)started when a file changed or it is not running.

Every setting is an inventory variable `guard_<setting>`, declared (range and default, the default's
source in serving/guard.py DEFAULTS) by sparkprov/inventory_vars.py; an argument here wins. Check mode and diff as every module: the config and
the unit are shown before and after.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from sparkprov import inventory_vars as iv
from sparkprov.facts import probe
from sparkprov.facts.files import PathState
from sparkprov.facts.guard import GuardState
from sparkprov.modules._provision import write_file_script
from sparkprov.modules.base import Change, Diff, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.serving import guard as g
from sparkprov.transport.shell import cmd, quote

UNIT_PATH = f"/etc/systemd/system/{g.UNIT_NAME}"


class Args(ModuleArgs):
    state: Literal["present", "absent"] = "present"
    interval_s: float | None = None
    mem_floor_pct: float | None = None
    mem_samples: int | None = None
    liveness_timeout_s: float | None = None
    liveness_failures: int | None = None
    restart_after_s: float | None = None
    breaker_restarts: int | None = None
    breaker_window_s: float | None = None
    port: int | None = None
    act: bool | None = None


def settings(args: Args, vars: dict[str, Any]) -> dict[str, Any]:
    """Every setting of the guard (the inventory variables guard_<key>, declared with their ranges
    and defaults by sparkprov/inventory_vars.py guard_variables): the task's argument, else the
    variable, else the default. ValueError naming the argument or the variable."""
    out: dict[str, Any] = {}
    for var in iv.guard_variables():
        key = var.name[len(iv.GUARD_PREFIX):]
        given = getattr(args, key, None)
        try:
            out[key] = var.check(given) if given is not None else iv.value(vars, var.name)
        except iv.VarError as exc:  # "guard_port: 0 is not a port (fix: ...)"
            said = exc.line()
            raise ValueError(f"inventory var {said}" if given is None else
                             f"guard argument {key}: {said[len(var.name) + 2:]}") from None
    return out


def config_text(values: dict[str, Any]) -> str:
    return json.dumps({**values, "probe_program": g.PROBE_PATH, "journal": g.JOURNAL_PATH, "state": g.STATE_PATH},
                      indent=2, sort_keys=True) + "\n"


def unit_text() -> str:
    return "\n".join([
        "# sparkprov node guard (written by `invoke provision`; see sparkprov/serving/guard.py)",
        "[Unit]",
        "Description=sparkprov node guard: stops serving before unified memory runs out",
        "After=docker.service network-online.target",
        "Wants=docker.service",
        "",
        "[Service]",
        f"ExecStart=/usr/bin/python3 {g.PROGRAM_PATH} {g.CONFIG_PATH}",
        "Restart=always",
        "RestartSec=5",
        "# it must outlive the memory pressure it watches",
        "OOMScoreAdjust=-900",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def program_text() -> str:
    return Path(g.__file__).read_text()


def start_script() -> str:
    """Start the guard detached (no systemd): what the lab's boot runs too (sparklab/boot.py)."""
    return (f"setsid -f /usr/bin/python3 {quote(g.PROGRAM_PATH)} {quote(g.CONFIG_PATH)} "
            f"</dev/null >>{quote(g.LOG_PATH)} 2>&1")


def same_boot_script() -> str:
    """Mark this boot as seen before (re)starting the guard: a start by provision is not a boot, and
    the guard measures the rails again only after one (serving/guard.py boot_is_new); provision
    measures them itself (fabric_qualify)."""
    return f"cat {quote(g.DEFAULTS['boot_id'])} > {quote(g.BOOT_MARKER)} 2>/dev/null || :"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stop_script(pidfile: str) -> str:
    return (f'pid=$(cat {quote(pidfile)} 2>/dev/null || true); if [ -n "$pid" ] && tr "\\000" " " '
            '< "/proc/$pid/cmdline" 2>/dev/null | grep -q guard.py; then kill "$pid"; '
            'for i in 1 2 3 4 5 6 7 8 9 10; do [ -d "/proc/$pid" ] || break; sleep 0.5; done; fi')


class GuardModule(Module):
    name = "guard"
    Args = Args
    doc = "The node guard: samples memory, kernel log, GPU and liveness; stops serving on a breach."

    def needs(self, args: Args, host: HostContext):
        return {"guard": GuardState(**g.paths()), "program": PathState(g.PROGRAM_PATH, with_content=True),
                "probe": PathState(g.PROBE_PATH, with_content=True), "config": PathState(g.CONFIG_PATH, with_content=True),
                "unit": PathState(UNIT_PATH, with_content=True)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        state = facts.guard
        touched = [facts.fact(n) for n in ("guard", "program", "probe", "config", "unit")]
        if args.state == "absent":
            return self._absent(state, facts, touched)
        try:
            values = settings(args, host.vars)
        except ValueError as e:
            return Plan.fail(f"{host.name}: {e}")
        want = {"program": (g.PROGRAM_PATH, program_text().encode(), "0755"),
                "probe": (g.PROBE_PATH, probe.program(values["liveness_timeout_s"]).encode(), "0644"),
                "config": (g.CONFIG_PATH, config_text(values).encode(), "0644")}
        if state["systemd"]:
            want["unit"] = (UNIT_PATH, unit_text().encode(), "0644")
        changes: list[Change] = []
        for key, (path, data, mode) in want.items():
            have = getattr(facts, key)
            if have.get("exists") and have.get("sha256") == _sha(data) and format(have["mode"], "04o") == mode:
                continue
            before = (have.get("content") or b"").decode("utf-8", "replace") if have.get("exists") else ""
            shown = data.decode() if key in ("config", "unit") else f"sha256 {_sha(data)[:16]} ({len(data)} bytes)\n"
            was = before if key in ("config", "unit") else (f"sha256 {have['sha256'][:16]}\n" if have.get("exists") else "")
            changes.append(Change(f"{'update' if have.get('exists') else 'write'} {path}", write_file_script(path, data, mode=mode, umask="022"),
                                  Diff(path, was, shown), [facts.fact(key)]))
        running = state["pid"] is not None
        if state["systemd"]:
            if changes or not running:
                changes.append(Change(
                    f"{'restart' if running else 'start'} {g.UNIT_NAME} (enabled at boot)",
                    same_boot_script() + "\nsystemctl daemon-reload && " + cmd("systemctl", "enable", g.UNIT_NAME) + " && "
                    + cmd("systemctl", "restart", g.UNIT_NAME) + " && sleep 1",
                    Diff("guard", "running\n" if running else "stopped\n", "running (new settings)\n"), touched))
        elif changes or not running:
            changes.append(Change(
                f"{'restart' if running else 'start'} the guard (no systemd: a process started at boot)",
                _stop_script(g.PIDFILE) + "\n" + same_boot_script() + "\n" + start_script() + "\nsleep 1",
                Diff("guard", "running\n" if running else "stopped\n", "running (new settings)\n"), touched))
        floor = f"MemAvailable floor {values['mem_floor_pct']:g}% x {values['mem_samples']} samples"
        return Plan(changes, msg=f"guard running (pid {state['pid']}), every {values['interval_s']:g}s, {floor}, "
                    f"/metrics on :{values['port']}" if not changes else "")

    def _absent(self, state: dict, facts: FactView, touched: list) -> Plan:
        present = [p for p, k in ((g.PROGRAM_PATH, "program"), (g.PROBE_PATH, "probe"), (g.CONFIG_PATH, "config"),
                                  (UNIT_PATH, "unit")) if getattr(facts, k).get("exists")]
        if not present and state["pid"] is None:
            return Plan(msg="no guard")
        script = (cmd("systemctl", "disable", "--now", g.UNIT_NAME) + " 2>/dev/null; " if state["systemd"] else "")
        script += _stop_script(g.PIDFILE) + "\n" + cmd("rm", "-f", "--", *present) + "\nsystemctl daemon-reload 2>/dev/null; :"
        return Plan([Change("stop and remove the guard (its journal stays)", script,
                            Diff("guard", "installed\n", "absent\n"), touched)])
