"""`invoke cluster-down` and `invoke status`: by label, one remote call per host each."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sparkprov.cluster import probe
from sparkprov.cluster.facts import ManagedContainers, RayStatus, ServerState
from sparkprov.cluster.hosts import close_all, connect_and_gather
from sparkprov.data.inventory import Inventory
from sparkprov.engine.report import Report, TaskResult
from sparkprov.transport.shell import cmd, quote


def down(inventory: Inventory, hosts: list[str], report: Report, *, deployments: list[str] | None = None,
         check: bool = False, accept_new_host_keys: bool = False) -> dict[str, Any]:
    """Remove the containers sparkprov started (label sparkprov.managed=1, and sparkprov.deployment
    in `deployments` when given) on every host; the Ray processes live and die inside them.
    Nothing else is touched. One call per host (two when there is something to remove)."""
    report.set_hosts(hosts)
    nodes = connect_and_gather(inventory, hosts, lambda n: [ManagedContainers()],
                               accept_new_host_keys=accept_new_host_keys, become=False)
    out: dict[str, Any] = {}
    try:
        def one(name: str) -> None:
            node = nodes[name]
            if node.unreachable:
                report.record(TaskResult(name, "cluster-down", "connect", "-", "unreachable", node.unreachable))
                return
            st = node.fact(ManagedContainers())
            if not st["access"]:
                report.record(TaskResult(name, "cluster-down", "containers", "cluster", "failed",
                                         f"{name}: cannot use docker: {st['error']}"))
                return
            mine = [c for c in st["containers"]
                    if not deployments or c["labels"].get("sparkprov.deployment") in deployments]
            names = [c["name"] for c in mine]
            out[name] = names
            if not names:
                report.record(TaskResult(name, "cluster-down", "containers", "cluster", "ok",
                                         "no sparkprov container"))
                return
            if check:
                report.record(TaskResult(name, "cluster-down", "containers", "cluster", "changed",
                                         "would remove " + ", ".join(names)))
                return
            ids = [c["id"] for c in mine]
            script = (cmd("docker", "rm", "-f", *ids) + " >/dev/null\n"
                      f"left=$(docker ps -aq --filter {quote('label=sparkprov.managed=1')})\n"
                      "echo \"@left=$left\"")
            res = node.run(script)
            left = res.stdout.split("@left=", 1)[-1].split()
            still = [i for i in left if any(i and c["id"].startswith(i) for c in mine)]
            if not res.ok or still:
                report.record(TaskResult(name, "cluster-down", "containers", "cluster", "failed",
                                         f"{name}: could not remove {', '.join(names)}: {res.stderr.strip()[-200:]}"))
                return
            report.record(TaskResult(name, "cluster-down", "containers", "cluster", "changed",
                                     "removed " + ", ".join(names) + " (and the Ray processes in them)"))

        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            list(pool.map(one, hosts))
    finally:
        close_all(nodes, report)
    return out


def status(inventory: Inventory, hosts: list[str], *, accept_new_host_keys: bool = False) -> dict[str, Any]:
    """Per host: sparkprov's containers, Ray nodes and GPUs (heads), health, served models, KV-cache
    usage and speculative-decoding acceptance. Two calls per host: containers, then the probes of
    what they serve (their ports and key files come from the first call's labels)."""
    nodes = connect_and_gather(inventory, hosts, lambda n: [ManagedContainers()],
                               accept_new_host_keys=accept_new_host_keys, become=False)
    result: dict[str, Any] = {}
    try:
        def one(name: str) -> None:
            node = nodes[name]
            if node.unreachable:
                result[name] = {"reachable": False, "error": node.unreachable}
                return
            st = node.fact(ManagedContainers())
            entry: dict[str, Any] = {"reachable": True, "docker": st["access"], "error": st["error"], "containers": []}
            result[name] = entry
            facts = []
            for c in st["containers"]:
                lab = c["labels"]
                item = {"name": c["name"], "deployment": lab.get("sparkprov.deployment"), "role": lab.get("sparkprov.role"),
                        "recipe": lab.get("sparkprov.recipe"), "recipe_hash": lab.get("sparkprov.recipe_hash"),
                        "status": c["status"], "restarts": c["restarts"], "started": c["started"],
                        "port": lab.get("sparkprov.port"), "model": lab.get("sparkprov.model")}
                entry["containers"].append(item)
                if c["status"] != "running":
                    continue
                if lab.get("sparkprov.role") == "ray-head":
                    facts.append(("ray", item, RayStatus(c["name"])))
                if lab.get("sparkprov.port"):
                    base = f"http://127.0.0.1:{lab['sparkprov.port']}"
                    facts.append(("server", item, ServerState(base, lab.get("sparkprov.api_key_file"), with_metrics=True)))
            if facts:
                from sparkprov.cluster.hosts import regather

                regather(node, [f for _, _, f in facts])
                for kind, item, f in facts:
                    v = node.values.get(f.key)
                    if v is None:
                        item[kind + "_error"] = node.errors.get(f.key)
                    elif kind == "ray":
                        item["ray"] = {"nodes": v["nodes"], "gpus": v["gpus"], "gpus_used": v["gpus_used"],
                                       "error": v.get("error")}
                    else:
                        item["health"] = v.get("health")
                        item["served_models"] = v.get("models")
                        item["metrics"] = probe.metrics(v.get("metrics"))
                        if v.get("error"):
                            item["health_error"] = v["error"]
            entry["remote_calls"] = node.transport.remote_calls

        with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
            list(pool.map(one, hosts))
    finally:
        close_all(nodes)
    return {h: result[h] for h in hosts if h in result}
