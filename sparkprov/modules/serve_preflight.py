"""serve_preflight: everything a deployment needs on this node, checked before anything starts.

Lint of the rendered launch (the G-rules), the driver answering, docker usable by the login
user, the fabric rail carrying VLLM_HOST_IP (clusters, G32), the weights staged and verified in
the store, memory for the load (G13-G15), the serving port free of processes sparkprov did not
start, sudo for the page-cache drop (G15), and for a multi-node deployment the node's last fabric
qualification (facts/rail.py: a rail recorded degraded refuses the start, naming host, rail, figure
and floor, unless `force_degraded_fabric`). Changes nothing; exports this node's fabric address
and rail network for the plays after it. Its group phase, a play after every node's, checks what
a cluster's nodes must agree on (G33: every rank on rank 0's fabric subnet).
"""

from __future__ import annotations

from typing import Literal

from sparkprov.facts.accounts import docker_problem
from sparkprov.modules.base import FactView, HostContext, Module, Plan
from sparkprov.facts.fabric import FabricInfo
from sparkprov.facts.hardware import MemInfo, NvidiaSmi, gib
from sparkprov.facts.runtimes import OllamaState
from sparkprov.facts.rail import QualificationRecord, degraded
from sparkprov.facts.serving import Listeners, ManagedContainers
from sparkprov.modules._serving import PREFLIGHT, Preflight, ServeArgs, preflight_export
from sparkprov.node import ondemand
from sparkprov.serving import node
from sparkprov.staging.facts import StoreState
from sparkprov import inventory_vars as iv


class Args(ServeArgs):
    drop_caches: bool = True
    unload_ollama: bool = False
    staged_here: bool = False  # the stage plays of this run put the weights in place (--stage)
    force_degraded_fabric: bool = False  # start a multi-node deployment over a rail qualified degraded
    # "node": this node's checks; "group": after every node's, what a cluster's nodes must agree on
    # (each rank on rank 0's fabric subnet, G33), before any image is copied between them or started
    phase: Literal["node", "group"] = "node"
    # cluster-up --replace: deployments removed before this one starts (their containers' port and
    # memory count as free here, as this deployment's own old containers do)
    replacing: list[str] = []


def _with_stages(dep):
    """The deployment as its engine runs: with pp > 1 its launch carries --pipeline-parallel-size
    (the ranks' containers add it, serving/spec.py), so the lint (G35: TP x PP = nodes x GPUs per
    node) judges tp x pp, not tp alone, against the nodes."""
    if dep.pp <= 1 or "--pipeline-parallel-size" in dep.overrides:
        return dep
    return dep.model_copy(update={"overrides": {**dep.overrides, "--pipeline-parallel-size": dep.pp}})


class ServePreflight(Module):
    name = "serve_preflight"
    Args = Args
    doc = "Check a deployment's node before a start: lint, driver, docker, fabric, weights, memory, port."

    def stale(self, args: Args, host: HostContext):
        """After this run's stage plays, the store is read again (it was read before they ran)."""
        return [self.needs(args, host)["store"]] if args.staged_here and not host.check else []

    def needs(self, args: Args, host: HostContext):
        dep = args.deployment
        if args.phase == "group":
            return {}
        named = {"smi": NvidiaSmi(), "fabric": FabricInfo(), "mem": MemInfo(), "ollama": OllamaState(),
                 "containers": ManagedContainers(), "listening": Listeners((dep.port_on(host.vars),)),
                 "store": StoreState(iv.value(host.vars, "model_store"),
                                     tuple(sorted({repo for repo, _ in node.repos(dep)})))}
        if dep.cluster:
            named["qualification"] = QualificationRecord()
        return named

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        dep, h = args.deployment, host.name
        if args.phase == "group":
            return self._group(dep, host)
        fails: list[str] = []
        notes: list[str] = []
        warns: list[str] = []
        launch = node.launch(_with_stages(dep), h, host.vars, host.home, facts.fabric if dep.cluster else None,
                             facts.smi)
        errors, lint_warnings = node.lint_problems(launch, dep)
        fails += errors
        warns += lint_warnings
        cont = facts.containers
        if not cont["access"]:
            fails.append(f"{h}: {docker_problem(cont['error'], h, host.user)}")
        smi = facts.smi
        if not smi or not smi.get("present"):
            fails.append(f"{h}: nvidia-smi not found: no NVIDIA driver (fix: invoke provision --hosts {h} --tags gpu)")
        elif smi.get("error"):
            fails.append(f"{h}: the NVIDIA driver does not answer: {smi['error']} "
                         f"(fix: invoke provision --hosts {h} --tags gpu)")
        else:
            notes.append(f"driver {smi.get('driver_version')}")
        found: Preflight = {}
        info = node.image_info(dep)
        if dep.cluster and info is not None:
            if dep.executor == "native" and info.native_multinode is False:
                fails.append(f"{h}: {info.ref} carries vLLM {info.vllm_version}, which has no native multi-node "
                             "(--nnodes/--node-rank/--headless) (fix: executor ray, or an image with a newer vLLM)")
            if dep.executor == "ray" and info.has_ray is None:
                warns.append(f"{h}: whether {info.ref} ships Ray is not known; if it does not, its Ray head exits "
                             "with 'ray: command not found' (fix: set ray: in the catalog's image entry, or executor native)")
        if dep.cluster:
            ip = launch.env_value("VLLM_HOST_IP")
            problem, net = node.rail_problem(h, facts.fabric, ip, "correct fabric_ip in the inventory, or remove it "
                                             "to use the provisioned rail")
            if problem:
                fails.append(problem)
            fails += topology_problems(h, facts.fabric, dep)
            bad = degraded(h, facts.qualification)
            if bad and args.force_degraded_fabric:
                warns += [f"{b} (started anyway: --force-degraded-fabric)" for b in bad]
            elif bad:
                fails += [f"{b}; a multi-node start over it is refused (--force-degraded-fabric starts it anyway)"
                          for b in bad]
            # every rail's address: the members the firewall lets reach the deployment's internals
            found = {"node_ip": ip, "rail_net": net,
                     "rails": [r["address"] for r in (facts.fabric or {}).get("rails") or [] if r.get("address")]}
        store = facts.store
        missing = [w for w in (node.staged_problem(store, repo, rev) for repo, rev in node.repos(dep)) if w]
        if missing and args.staged_here and host.check:
            notes.append("weights: the stage plays before would put them in place")
        elif missing:
            fails.append(f"{h}: weights not staged and verified in {store.store or iv.value(host.vars, 'model_store')}: "
                         f"{missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
                         + f" (fix: invoke stage-weights {dep.model} --hosts {','.join(dep.hosts)}, "
                         "or rerun with --stage)")
        else:
            notes.append("weights staged and verified")
        if dep.on_demand:  # parked: nothing loads now; the gateway admits its memory when it starts it
            notes.append("parked: its memory is admitted when the gateway starts it")
        else:
            fails += self._memory(args, facts, host, launch, notes, warns)
        port = dep.port_on(host.vars)
        ours = any(c["labels"].get("sparkprov.port") == str(port) for c in cont["containers"])
        if dep.serves_on(h) and port in (facts.listening or []) and not ours:
            fails.append(f"{h}: port {port} is already in use by a process sparkprov did not start "
                         "(fix: stop it, or set port: in the playbook / serve_port in the inventory)")
        others = [c for c in cont["containers"] if c["labels"].get("sparkprov.deployment") not in (dep.name, *args.replacing)
                  # a parked one (this or that) may run later: its port is taken as well
                  and (c["status"] == "running" or dep.on_demand or ondemand.is_on_demand(c))
                  and c["labels"].get("sparkprov.port") == str(port)]
        for c in others:
            fails.append(f"{h}: container {c['name']} of deployment {c['labels'].get('sparkprov.deployment')!r} "
                         f"holds port {port} (fix: invoke cluster-down --deployments "
                         f"{c['labels'].get('sparkprov.deployment')}, or give this deployment another port)")
        if fails:
            return Plan.fail(" | ".join(fails), warnings=warns)
        return Plan(msg="; ".join(notes), warnings=warns, exports=PREFLIGHT({dep.name: found}))

    @staticmethod
    def _group(dep, host: HostContext) -> Plan:
        """G33: a rank whose fabric address is not on rank 0's subnet cannot reach it over the fabric
        (the image copy from rank 0 fails first, then the rendezvous): said here, naming the address."""
        h = host.name
        head_net = preflight_export(host, dep.hosts[0], dep.name).get("rail_net")
        mine = preflight_export(host, h, dep.name)
        if dep.rank(h) > 0 and head_net and mine.get("rail_net") and mine["rail_net"] != head_net:
            return Plan.fail(f"{h}: fabric address {mine.get('node_ip')} is not on rank 0's subnet {head_net} "
                             f"({dep.hosts[0]}): the ranks cannot reach each other over the fabric (G33) "
                             f"(fix: invoke provision --hosts {','.join(dep.hosts)} --tags fabric)")
        return Plan(msg=f"on {head_net or 'the fabric'} with rank 0 ({dep.hosts[0]})")

    @staticmethod
    def _memory(args: Args, facts, host: HostContext, launch, notes: list[str], warns: list[str]) -> list[str]:
        """G13-G15: what the new container takes of MemTotal against what is available, counting
        what sparkprov frees first (this deployment's old containers, the page cache, Ollama)."""
        dep, h = args.deployment, host.name
        mem = facts.mem or {}
        total, avail, cached = mem.get("MemTotal", 0), mem.get("MemAvailable", 0), mem.get("Cached", 0)
        util = launch.number("--gpu-memory-utilization") or 0.9
        need = util * total
        ollama = (facts.ollama or {}).get("models") or []
        freed = cached if args.drop_caches else 0
        for c in facts.containers["containers"]:
            if c["labels"].get("sparkprov.deployment") in (dep.name, *args.replacing) and c["status"] == "running":
                freed += util * total
        if ollama and args.unload_ollama:
            freed += sum(m.get("size") or 0 for m in ollama)
        elif ollama:
            warns.append(f"{h}: Ollama holds {', '.join(m['name'] for m in ollama)} in unified memory (G14); "
                         "rerun with --unload-ollama to unload them first")
        if total and avail + freed < need:
            return [f"{h}: {launch.alias} needs {gib(int(need))} ({util:.2f} of {gib(total)}), {gib(avail)} available"
                    + (f" + {gib(int(freed))} sparkprov can free" if freed else "")
                    + " (fix: stop other runtimes or models on the host"
                    + ("" if args.unload_ollama or not ollama else ", --unload-ollama")
                    + ", or lower --gpu-memory-utilization in the deployment's overrides)"]
        if total:
            notes.append(f"memory {gib(avail)} available for {gib(int(need))}")
        return []


def topology_problems(h: str, fabric: dict | None, dep) -> list[str]:
    """What the fabric's topology as provision recorded it on this node cannot carry of the layout
    (catalog/layout.py topology_problem: a ring of four or more, tp on the native executor only), and
    ranks that do not follow the ring. [] elsewhere."""
    from sparkprov.catalog.layout import ring_order_problem, topology_problem

    fab = fabric or {}
    if fab.get("topology") != "ring":
        return []
    order = fab.get("order") or []
    bad = topology_problem(dep.layout, "ring", len(order) or None)
    if bad:
        return [f"{h}: {dep.layout.describe()}: {bad[0]} (the ring provision recorded: {', '.join(order)}) "
                f"(fix: {bad[1]})"]
    if dep.nodes > 2 and len(order) == dep.nodes:
        cables = [((a, ""), (b, "")) for a, b in zip(order, order[1:] + order[:1])]
        problem = ring_order_problem(list(dep.hosts), cables)
        if problem:
            return [f"{h}: {problem} (fix: --hosts {','.join(order)})"]
    return []
