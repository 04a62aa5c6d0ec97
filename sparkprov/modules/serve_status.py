"""serve_status: what serves on this host (read-only): sparkprov's containers with their state,
health, models, KV-cache use, running and waiting requests and speculative-decoding acceptance,
Ray's view on a Ray head; and the host's unified memory (MemAvailable, swap: on GB10 the only
place free memory can be read, G16), GPU temperature and power where nvidia-smi reports them.
Exports it all as `serving_status` for the play after it (deployment_health)."""

from __future__ import annotations

from sparkprov.facts.accounts import docker_problem
from sparkprov.facts.guard import GuardState, guard_summary
from sparkprov.facts.topology import TopologyRecord, host_view
from sparkprov.facts.hardware import GpuSensors, MemInfo
from sparkprov.facts.serving import OnDemandView, ServingStatus
from sparkprov.modules.base import Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.node import guard
from sparkprov.serving import gateway as gw
from typing import Any, TypedDict


class Args(ModuleArgs):
    pass


class ServingStatusReport(TypedDict, total=False):
    access: bool                          # docker reachable
    error: str | None
    containers: list[dict[str, Any]]      # facts/serving.py ServingStatus: name, status, labels, health, ray, ...
    host: dict[str, Any]                  # memory, swap, GPU sensors, the node guard's summary
    ondemand_view: dict[str, Any]         # the gateway's hook's view, where the gateway runs (facts OnDemandView)


SERVING_STATUS: Export[ServingStatusReport] = Export("serving_status", ServingStatusReport,
                                                     "sparkprov's containers on the host and how they serve")


class ServeStatus(Module):
    name = "serve_status"
    Args = Args
    doc = "Read sparkprov's containers on the host: state, health, models, metrics, Ray (changes nothing)."

    def needs(self, args: Args, host: HostContext):
        return {"status": ServingStatus(), "mem": MemInfo(), "sensors": GpuSensors(),
                "guard": GuardState(**guard.paths()), "topology": TopologyRecord(),
                "view": OnDemandView(f"{gw.DIR}/{gw.VIEW_DIR}/{gw.VIEW_FILE}")}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        mem = facts.mem
        st = {**facts.status, "host": {
            "mem_total": mem.get("MemTotal"), "mem_available": mem.get("MemAvailable"),
            "swap_total": mem.get("SwapTotal"), "swap_used": (mem.get("SwapTotal") or 0) - (mem.get("SwapFree") or 0),
            **facts.sensors, "guard": guard_summary(facts.guard),
            # the fabric's topology as provision recorded it (facts/topology.py): kind and this host's links
            "fabric_topology": host_view(facts.topology, host.name) if facts.topology else None},
              "ondemand_view": facts.view}
        if not st["access"]:
            return Plan.fail(f"{host.name}: {docker_problem(st['error'], host.name, host.user)}",
                             exports=SERVING_STATUS(st))
        running = sum(1 for c in st["containers"] if c["status"] == "running")
        return Plan(msg=f"{len(st['containers'])} sparkprov containers, {running} running",
                    exports=SERVING_STATUS(st))
