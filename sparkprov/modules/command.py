"""command: run a program (argv, never a shell string). Guards make it idempotent."""

from __future__ import annotations

from pydantic import Field, field_validator

from sparkprov.modules.base import Change, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.files import PathState
from sparkprov.transport.shell import cmd


class Args(ModuleArgs):
    argv: list[str] = Field(min_length=1)
    creates: str | None = None  # skip when this path exists
    removes: str | None = None  # skip unless this path exists
    chdir: str | None = None

    @field_validator("argv")
    @classmethod
    def _argv(cls, v):
        if any("\0" in a for a in v):
            raise ValueError("arguments must not contain NUL")
        return v


class CommandModule(Module):
    name = "command"
    Args = Args
    doc = "Run a command given as an argv list; `creates`/`removes` make it idempotent."

    def needs(self, args: Args, host: HostContext):
        named = {}
        if args.creates:
            named["creates"] = PathState(args.creates)
        if args.removes:
            named["removes"] = PathState(args.removes)
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        if args.creates and facts.creates["exists"]:
            return Plan(msg=f"{args.creates} exists")
        if args.removes and not facts.removes["exists"]:
            return Plan(msg=f"{args.removes} does not exist")
        line = cmd(*args.argv)
        script = (cmd("cd", host.path(args.chdir)) + " && " + line) if args.chdir else line
        touched = [PathState(p) for p in (args.creates, args.removes) if p]
        # Without a guard there is nothing to read back: the run itself is the change.
        return Plan([Change(f"run {line}", script, None, touched, verify=bool(touched), opaque=True)])
