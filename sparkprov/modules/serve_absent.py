"""serve_absent: sparkprov's containers (by label) are gone from this host: every one, or those
of the named deployments. Containers sparkprov did not start are never touched."""

from __future__ import annotations

from pydantic import Field

from sparkprov.facts.accounts import docker_problem
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.serving import ManagedContainers
from sparkprov.transport.shell import cmd


class Args(ModuleArgs):
    deployments: list[str] | None = None  # None: every sparkprov container
    reason: str = ""
    exclude_roles: list[str] = Field(default_factory=list)


REMOVED: Export[list[str]] = Export("removed", list, "the containers removed from this host")


class ServeAbsent(Module):
    name = "serve_absent"
    Args = Args
    doc = "Remove sparkprov's containers (all, or of named deployments) by label."

    def needs(self, args: Args, host: HostContext):
        return {"containers": ManagedContainers()}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        cont = facts.containers
        if not cont["access"]:
            return Plan.fail(f"{host.name}: {docker_problem(cont['error'], host.name, host.user)}")
        doomed = [c for c in cont["containers"]
                  if (args.deployments is None or c["labels"].get("sparkprov.deployment") in args.deployments)
                  and c["labels"].get("sparkprov.role") not in args.exclude_roles]
        if not doomed:
            return Plan(msg="no sparkprov containers" + (f" of {', '.join(args.deployments)}" if args.deployments else ""))
        names = [c["name"] for c in doomed]
        keep = [c for c in cont["containers"] if c["name"] not in names]
        return Plan([Change(("" if not args.reason else args.reason + ": ") + "remove " + ", ".join(names),
                            cmd("docker", "rm", "-f", *names) + " >/dev/null",
                            Diff(f"{host.name}: sparkprov containers", "".join(f"{n}\n" for n in names), ""),
                            touches=[ManagedContainers()],
                            predicts=[(ManagedContainers(), {**cont, "containers": keep})])],
                    exports=REMOVED(names))
