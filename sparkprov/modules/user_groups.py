"""user_groups: a user is (or is not) a member of some groups. Other memberships are kept."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator

from sparkprov.modules.base import Change, Diff, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.accounts import GroupInfo, UserInfo
from sparkprov.transport.shell import cmd

_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


class Args(ModuleArgs):
    user: str | None = None  # default: the login user
    groups: list[str]
    state: Literal["present", "absent"] = "present"

    @field_validator("groups")
    @classmethod
    def _groups(cls, v):
        for g in v:
            if not _NAME.fullmatch(g):
                raise ValueError(f"{g!r} is not a valid group name")
        return v


class UserGroupsModule(Module):
    name = "user_groups"
    Args = Args
    doc = "The user is a member of each listed group (state: present) or of none (absent)."

    def needs(self, args: Args, host: HostContext):
        return {"user": UserInfo(args.user or host.user), **{f"group {g}": GroupInfo(g) for g in args.groups}}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        args = args.model_copy(update={"user": args.user or host.user})
        if not _NAME.fullmatch(args.user):
            return Plan.fail(f"{args.user!r} is not a valid user name")
        user = facts.user
        if user is None:
            return Plan.fail(f"user {args.user} does not exist on {host.name}")
        missing = [g for g in args.groups if facts.named(f"group {g}") is None]
        if missing and args.state == "present":
            return Plan.fail(f"group(s) {', '.join(missing)} do not exist on {host.name} "
                             f"(create them first with the group module)")
        current = set(user["groups"])
        touched = [UserInfo(args.user)] + [GroupInfo(g) for g in args.groups]
        # A membership only takes effect in a new login: reconnect before verifying our own user.
        reconnect = args.user == host.user
        changes = []
        if args.state == "present":
            for g in args.groups:
                if g not in current:
                    after = {**user, "groups": sorted(current | {g})}
                    changes.append(Change(f"add {args.user} to group {g}", cmd("usermod", "-a", "-G", g, args.user),
                                          Diff(f"groups of {args.user}", " ".join(sorted(current)) + "\n",
                                               " ".join(sorted(current | {g})) + "\n"), touched, reconnect,
                                          predicts=[(UserInfo(args.user), after)]))
        else:
            for g in args.groups:
                if g in current and g not in missing:
                    changes.append(Change(f"remove {args.user} from group {g}", cmd("gpasswd", "-d", args.user, g),
                                          Diff(f"groups of {args.user}", " ".join(sorted(current)) + "\n",
                                               " ".join(sorted(current - {g})) + "\n"), touched, reconnect))
        verb = "in" if args.state == "present" else "not in"
        return Plan(changes, msg=f"{args.user} {verb} {', '.join(args.groups)}")
