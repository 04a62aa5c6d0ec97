"""directory: a directory with mode and ownership (parents created as needed)."""

from __future__ import annotations

from typing import Literal

from sparkprov.modules.base import Change, Diff, FactView, HostContext, Module, Plan
from sparkprov.facts.files import PathState
from sparkprov.modules._common import OwnedPathArgs, owned_path, ownership_script
from sparkprov.transport.shell import cmd


class Args(OwnedPathArgs):
    state: Literal["present", "absent"] = "present"


class DirectoryModule(Module):
    name = "directory"
    Args = Args
    doc = "A directory with the given mode, owner and group."

    def needs(self, args: Args, host: HostContext):
        return {"path": PathState(args.path)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        path, fact, state = owned_path(args, facts, host)
        if args.state == "absent":
            if not state["exists"]:
                return Plan(msg=f"{path} absent")
            if path in ("/", host.home):
                return Plan.fail(f"refusing to remove {path}")
            return Plan([Change(f"remove directory {path}", cmd("rm", "-rf", "--", path),
                                Diff(path, "directory\n", "absent\n"), [fact])])
        if state["exists"] and state["type"] != "directory":
            return Plan.fail(f"{path} exists and is a {state['type']}, not a directory")
        if not state["exists"]:
            lines = [cmd("mkdir", "-p", "--", path)]
            if args.mode:
                lines.append(cmd("chmod", args.mode, "--", path))
            if args.owner or args.group:
                lines.append(cmd("chown", (args.owner or "") + (":" + args.group if args.group else ""), "--", path))
            after = f"directory mode={args.mode or 'default'} owner={args.owner or '-'} group={args.group or '-'}\n"
            predicted = {"exists": True, "type": "directory", "mode": int(args.mode, 8) if args.mode else 0o755,
                         "owner": args.owner or "root", "group": args.group or "root", "size": 0, "sha256": None}
            return Plan([Change(f"create directory {path}", "\n".join(lines), Diff(path, "absent\n", after), [fact],
                                predicts=[(fact, predicted)])])
        scripts, notes = ownership_script(path, args, state)
        if not scripts:
            return Plan(msg=f"{path} as wanted")
        return Plan([Change(f"{path}: " + ", ".join(notes), "\n".join(scripts),
                            Diff(path, _meta(state), _meta(state, args)), [fact])])


def _meta(state: dict, args: OwnedPathArgs | None = None) -> str:
    mode = args.mode if args and args.mode else format(state["mode"], "04o")
    owner = args.owner if args and args.owner else state["owner"]
    group = args.group if args and args.group else state["group"]
    return f"directory mode={mode} owner={owner} group={group}\n"
