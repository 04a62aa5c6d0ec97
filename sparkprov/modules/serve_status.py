"""serve_status: what serves on this host (read-only): sparkprov's containers with their state,
health, models, KV-cache use and speculative-decoding acceptance, Ray's view on a Ray head.
Exports it all as `serving_status` for the play after it (deployment_health)."""

from __future__ import annotations

from sparkprov.modules.base import FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.serving import ServingStatus


class Args(ModuleArgs):
    pass


class ServeStatus(Module):
    name = "serve_status"
    Args = Args
    doc = "Read sparkprov's containers on the host: state, health, models, metrics, Ray (changes nothing)."

    def needs(self, args: Args, host: HostContext):
        return {"status": ServingStatus()}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        st = facts.status
        if not st["access"]:
            return Plan.fail(f"{host.name}: docker: {st['error']}", exports={"serving_status": st})
        running = sum(1 for c in st["containers"] if c["status"] == "running")
        return Plan(msg=f"{len(st['containers'])} sparkprov containers, {running} running",
                    exports={"serving_status": st})
