"""group: a system group exists (or not), optionally with a fixed GID."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from sparkprov.modules.base import Change, Diff, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.accounts import GroupInfo
from sparkprov.transport.shell import cmd


class Args(ModuleArgs):
    name: str
    gid: int | None = Field(default=None, ge=0, le=2**31)
    system: bool = True
    state: Literal["present", "absent"] = "present"

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", v):
            raise ValueError(f"{v!r} is not a valid group name")
        return v


class GroupModule(Module):
    name = "group"
    Args = Args
    doc = "A group exists (created with groupadd) or is absent."

    def needs(self, args: Args, host: HostContext):
        return {"group": GroupInfo(args.name)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        fact = facts.fact("group")
        grp = facts.group
        if args.state == "absent":
            if grp is None:
                return Plan(msg=f"group {args.name} absent")
            return Plan([Change(f"remove group {args.name}", cmd("groupdel", args.name),
                                Diff(f"group {args.name}", f"gid {grp['gid']}\n", "absent\n"), [fact])])
        if grp is None:
            argv = ["groupadd"] + (["--system"] if args.system else []) + (["--gid", str(args.gid)] if args.gid is not None else []) + [args.name]
            return Plan([Change(f"create group {args.name}", cmd(*argv),
                                Diff(f"group {args.name}", "absent\n", f"gid {args.gid if args.gid is not None else 'auto'}\n"), [fact],
                                predicts=[(fact, {"name": args.name, "gid": args.gid, "members": []})])])
        if args.gid is not None and grp["gid"] != args.gid:
            return Plan([Change(f"group {args.name}: gid {grp['gid']} -> {args.gid}", cmd("groupmod", "--gid", str(args.gid), args.name),
                                Diff(f"group {args.name}", f"gid {grp['gid']}\n", f"gid {args.gid}\n"), [fact])])
        return Plan(msg=f"group {args.name} present (gid {grp['gid']})")
