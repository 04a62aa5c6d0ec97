"""guard: the node guard (sparkprov/node/guard.py) installed and running on the host.

Writes the node package (every file of sparkprov/node, as it is, under NODE_LIB/sparkprov_node) and
the guard's configuration (/etc/sparkprov/guard.json), then runs `python3 -m sparkprov_node.guard`
as root:
- where systemd is the init (facts.base.SYSTEMD_IS_INIT: a Spark), the unit sparkprov-guard.service,
  enabled and (re)started when a file changed;
- elsewhere (the lab's simulated Sparks, which start it at boot as they start sshd), a detached
  process with a pid file, (re)started when a file changed or it is not running.
The single-file guard of before (/var/lib/sparkprov/guard/guard.py and probe.py) is removed.

Every setting is declared once, with its bounds, default and source, in sparkprov/node/settings.py
(SETTINGS); an argument here wins, then the inventory variable `guard_<setting>`. Check mode and diff
as every module: the config and the unit are shown before and after.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, create_model

from sparkprov import inventory_vars as iv
from sparkprov import node
from sparkprov.facts.files import PathState
from sparkprov.facts.guard import GuardState
from sparkprov.modules._provision import write_file_script
from sparkprov.modules.base import Change, Diff, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.node import guard as g
from sparkprov.node import settings as node_settings
from sparkprov.transport.shell import cmd, quote

UNIT_PATH = f"/etc/systemd/system/{g.UNIT_NAME}"
PACKAGE_DIR = f"{node.NODE_LIB}/{node.NODE_PACKAGE}"
_PYTHON_TYPES = {"float": float, "int": int, "bool": bool, "str": str, "path": str, "list[int]": list[int],
                 "list[str]": list[str]}

# The module's arguments: state, and every setting of the table (None: the inventory var or the default).
Args = create_model("Args", __base__=ModuleArgs, state=(Literal["present", "absent"], "present"),
                    **{name: (Optional[_PYTHON_TYPES[kind]], Field(None, description=f"default {default!r}: {source}"))
                       for name, kind, _, _, default, source in node_settings.SETTINGS})


def settings(args: Any, vars: dict[str, Any]) -> dict[str, Any]:
    """Argument, else inventory var guard_<name> (read through the declaration, sparkprov/
    inventory_vars.py guard_variables, built from the same table), else the default; raises
    ValueError naming the argument or the var, what is allowed and what was given."""
    out = {}
    for name in node_settings.NAMES:
        given = getattr(args, name, None)
        try:
            out[name] = node_settings.check(name, given) \
                if given is not None else iv.value(vars, f"{iv.GUARD_PREFIX}{name}")
        except ValueError as e:
            said = e.line() if isinstance(e, iv.VarError) else f"{name}: {e}"
            raise ValueError(f"inventory var {said}" if given is None else f"guard argument {said}") from None
    return out


def config_text(values: dict[str, Any]) -> str:
    return json.dumps(values, indent=2, sort_keys=True) + "\n"


def package_files() -> dict[str, bytes]:
    """Path on the node -> content: every file of the node package, as it is here."""
    here = Path(node.__file__).parent
    return {f"{PACKAGE_DIR}/{p.name}": p.read_bytes() for p in sorted(here.glob("*.py"))}


def run_command() -> str:
    return f"/usr/bin/python3 -m {node.NODE_PACKAGE}.guard {g.CONFIG_PATH}"


def unit_text() -> str:
    return "\n".join([
        "# sparkprov node guard (written by `invoke provision`; see sparkprov/node/guard.py)",
        "[Unit]",
        "Description=sparkprov node guard: keeps memory over the floor through loads, stops a stalled engine",
        "After=docker.service network-online.target",
        "Wants=docker.service",
        "",
        "[Service]",
        f"Environment=PYTHONPATH={node.NODE_LIB}",
        f"ExecStart={run_command()}",
        "Restart=always",
        "RestartSec=5",
        "# it must outlive the memory pressure it watches",
        "OOMScoreAdjust=-900",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def start_script() -> str:
    """Start the guard detached (no systemd): what the lab's boot runs too (sparklab/boot.py)."""
    return (f"PYTHONPATH={quote(node.NODE_LIB)} setsid -f {run_command()} "
            f"</dev/null >>{quote(g.LOG_PATH)} 2>&1")


def same_boot_script() -> str:
    """Mark this boot as seen before (re)starting the guard: a start by provision is not a boot, and
    the guard measures the rails again only after one (node/requalify.py boot_is_new); provision
    measures them itself (fabric_qualify)."""
    return f"cat {quote(g.INTERNAL['boot_id'])} > {quote(g.BOOT_MARKER)} 2>/dev/null || :"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stop_script(pidfile: str) -> str:
    # the guard of before ran as `python3 .../guard.py`: either is stopped
    return (f'pid=$(cat {quote(pidfile)} 2>/dev/null || true); if [ -n "$pid" ] && tr "\\000" " " '
            f'< "/proc/$pid/cmdline" 2>/dev/null | grep -q -e guard.py -e {quote(g.COMMAND_MARK)}; then kill "$pid"; '
            'for i in 1 2 3 4 5 6 7 8 9 10; do [ -d "/proc/$pid" ] || break; sleep 0.5; done; fi')


def _file_facts() -> dict[str, PathState]:
    facts = {f"file:{path}": PathState(path) for path in package_files()}
    facts.update({f"old:{path}": PathState(path) for path in g.OLD_PROGRAM_PATHS})
    return facts


class GuardModule(Module):
    name = "guard"
    Args = Args
    doc = ("The node guard: keeps MemFree over the floor through loads, stops a stalled engine, records "
           "NVRM lines; restarts within a budget.")

    def needs(self, args: Any, host: HostContext):
        return {"guard": GuardState(**g.paths()), "config": PathState(g.CONFIG_PATH, with_content=True),
                "unit": PathState(UNIT_PATH, with_content=True), **_file_facts()}

    def plan(self, args: Any, facts: FactView, host: HostContext) -> Plan:
        state = facts.guard
        file_keys = list(_file_facts())
        touched = [facts.fact(n) for n in ("guard", "config", "unit", *file_keys)]
        if args.state == "absent":
            return self._absent(state, facts, touched, file_keys)
        try:
            values = settings(args, host.vars)
        except ValueError as e:
            return Plan.fail(f"{host.name}: {e}")
        changes: list[Change] = []
        stale = {p: data for p, data in package_files().items() if facts.named(f"file:{p}").get("sha256") != _sha(data)}
        if stale:
            script = "\n".join(write_file_script(p, data, mode="0644", umask="022") for p, data in stale.items())
            have = {p: facts.named(f"file:{p}") for p in stale}
            changes.append(Change(
                f"{'update' if any(h.get('exists') for h in have.values()) else 'write'} the node package in "
                f"{PACKAGE_DIR} ({len(stale)} file(s))", script,
                Diff(PACKAGE_DIR, "".join(f"{p}: sha256 {h['sha256'][:16]}\n" for p, h in have.items() if h.get("exists")),
                     "".join(f"{p}: sha256 {_sha(data)[:16]} ({len(data)} bytes)\n" for p, data in stale.items())),
                [facts.fact(f"file:{p}") for p in stale]))
        want = {"config": (g.CONFIG_PATH, config_text(values).encode())}
        if state["systemd"]:
            want["unit"] = (UNIT_PATH, unit_text().encode())
        for key, (path, data) in want.items():
            have = getattr(facts, key)
            if have.get("exists") and have.get("sha256") == _sha(data) and format(have["mode"], "04o") == "0644":
                continue
            before = (have.get("content") or b"").decode("utf-8", "replace") if have.get("exists") else ""
            changes.append(Change(f"{'update' if have.get('exists') else 'write'} {path}",
                                  write_file_script(path, data, mode="0644", umask="022"),
                                  Diff(path, before, data.decode()), [facts.fact(key)]))
        old = [p for p in g.OLD_PROGRAM_PATHS if facts.named(f"old:{p}").get("exists")]
        if old:
            changes.append(Change("remove the single-file guard of before (" + ", ".join(old) + ")",
                                  cmd("rm", "-f", "--", *old), Diff("old guard", "".join(p + "\n" for p in old), ""),
                                  [facts.fact(f"old:{p}") for p in old]))
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
        floor = (f"MemFree floor {values['mem_free_floor_gib']:g} GiB, stall {values['stall_s']:g}s, "
                 f"{values['restart_budget']} restarts in {values['restart_window_h']:g} h")
        return Plan(changes, msg=f"guard running (pid {state['pid']}), every {values['interval_s']:g}s, {floor}, "
                    f"/metrics on :{values['port']}" if not changes else "")

    def _absent(self, state: dict, facts: FactView, touched: list, file_keys: list[str]) -> Plan:
        present = [k.split(":", 1)[1] for k in file_keys if facts.named(k).get("exists")]
        present += [p for p, k in ((g.CONFIG_PATH, "config"), (UNIT_PATH, "unit")) if getattr(facts, k).get("exists")]
        if not present and state["pid"] is None:
            return Plan(msg="no guard")
        script = (cmd("systemctl", "disable", "--now", g.UNIT_NAME) + " 2>/dev/null; " if state["systemd"] else "")
        script += _stop_script(g.PIDFILE) + "\n" + cmd("rm", "-f", "--", *present) + "\nsystemctl daemon-reload 2>/dev/null; :"
        return Plan([Change("stop and remove the guard (its journal stays)", script,
                            Diff("guard", "installed\n", "absent\n"), touched)])
