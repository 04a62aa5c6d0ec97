"""deployment_health: each deployment whose rank 0 runs on this host is whole: every member
container running on its node, Ray (executor ray) seeing every node and GPU, /health answering
and one token generated (the status probe's liveness request).
Reads what serve_status exported from every host in the play before; degraded fails the task
(so `invoke status` exits non-zero)."""

from __future__ import annotations

from typing import TypedDict

from sparkprov.modules.base import Export, Exports, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.modules.serve_status import SERVING_STATUS
from sparkprov.node import ondemand
from sparkprov.serving.spec import ROLE_HEAD, SERVING_ROLES


class Args(ModuleArgs):
    pass


def deployments_led_by(name: str, exports: Exports) -> dict[str, dict]:
    """deployment -> its rank-0 container's record, for those whose rank 0 is on host `name`."""
    mine = SERVING_STATUS.entry(exports, name, "containers") or []
    return {c["labels"].get("sparkprov.deployment"): c for c in mine
            if c["labels"].get("sparkprov.role") in SERVING_ROLES and c["labels"].get("sparkprov.deployment")}


def health(dep: str, lead: dict, name: str, exports: Exports) -> dict:
    """Expected vs joined nodes and GPUs, and what is wrong (empty: healthy)."""
    labels = lead["labels"]
    nodes = int(labels.get("sparkprov.nodes") or labels.get("sparkprov.tp") or 1)
    members = []
    for h, st in SERVING_STATUS.by_host(exports).items():
        for c in st.get("containers") or []:
            if c["labels"].get("sparkprov.deployment") == dep:
                members.append((h, c))
    running = [(h, c) for h, c in members if c["status"] == "running"]
    # on demand (docs/on-demand.md): parked (created or stopped) is what it should be, and starting
    # (running, its API not answering yet) is the gateway's activation, bounded there
    problems = [f"{c['name']} on {h} is {c['status']}" + (f" (exit {c['exit_code']})" if c["status"] == "exited" else "")
                for h, c in members if c["status"] != "running" and not parked(c)]
    if nodes > 1 and len(members) < nodes:
        problems.append(f"{len(members)} of {nodes} member containers exist")
    joined = len(running)
    gpus = None
    if labels.get("sparkprov.role") == ROLE_HEAD:
        ray = lead.get("ray") or {}
        joined, gpus = ray.get("nodes", 0), ray.get("gpus", 0.0)
        if joined < nodes or (gpus or 0) < nodes:
            problems.append(f"Ray sees {joined}/{nodes} nodes and {gpus or 0:g}/{nodes} GPUs")
    # the members that restarted say which rank took the group down (rank 0's API server exits 0
    # when a rank is lost, and its restart policy starts it again: docs/real-vllm.md)
    def restarted(*, lead_too: bool) -> str:
        return ", ".join(f"{c['name']} on {h} (restarts {c['restarts']})" for h, c in members
                         if c.get("restarts") and (lead_too or c is not lead))

    if lead["status"] == "running" and lead.get("health") != 200 and not ondemand.is_on_demand(lead):
        answer = f"HTTP {lead['health']}" if lead.get("health") else "no answer"
        which = restarted(lead_too=True)
        problems.append(f"{lead['name']} on {name}: /health on port {lead.get('port')}: {answer}"
                        + (f"; restarted members: {which}" if which else ""))
    elif lead["status"] == "running" and lead.get("health") == 200 and (lead.get("liveness") or {}).get("status") != 200:
        # /health stays 200 for a while with a rank lost: the token says whether it serves
        live = lead.get("liveness") or {}
        why = f"HTTP {live['status']}" if live.get("status") else (live.get("error") or "no answer")
        which = restarted(lead_too=False)
        problems.append(f"{lead['name']} on {name} generated no token ({why})"
                        + (f"; restarted members: {which}" if which else "; a rank is lost or the engine is hung"))
    return {"expected_nodes": nodes, "joined_nodes": joined, "gpus": gpus if gpus is not None else joined,
            "problems": problems}


def parked(c: dict) -> bool:
    return ondemand.is_on_demand(c) and c["status"] in ondemand.STOPPED


class Health(TypedDict):
    expected_nodes: int
    joined_nodes: int
    gpus: float
    problems: list[str]   # empty: healthy


DEPLOYMENT_HEALTH: Export[dict[str, Health]] = Export("deployment_health", dict,
                                                      "deployment -> its health, for those led from this host")


class DeploymentHealth(Module):
    name = "deployment_health"
    Args = Args
    doc = "Each deployment led from this host is whole (members running, Ray nodes, /health, a token); degraded fails."

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        leads = deployments_led_by(host.name, host.exports)
        report = {dep: health(dep, lead, host.name, host.exports) for dep, lead in leads.items()}
        bad = {d: r for d, r in report.items() if r["problems"]}
        if bad:
            return Plan.fail("; ".join(f"{d} DEGRADED: " + ", ".join(r["problems"]) for d, r in bad.items()),
                             exports=DEPLOYMENT_HEALTH(report))
        if not report:
            return Plan(msg="no deployment led from here", exports=DEPLOYMENT_HEALTH(report))
        return Plan(msg="; ".join(f"{d}: parked (on demand)" if parked(leads[d]) else
                                  f"{d}: {r['joined_nodes']}/{r['expected_nodes']} nodes, healthy"
                                  for d, r in report.items()), exports=DEPLOYMENT_HEALTH(report))
