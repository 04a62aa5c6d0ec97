"""prometheus: Prometheus on this host (sparkprov/serving/prometheus.py), scraping every deployment's
/metrics and every node guard's (sparkprov/serving/monitor.py renders its files), converged to the
hash of its image, address and files.

present: the files rendered here from the deployments and hosts given, the keys the gateway_keys
plays read (no_log) and the fabric rails the fabric_rails play exported; a running container with
that hash and those files in place is nothing to do; otherwise the files are written and the
container replaced, and the change waits until Prometheus is ready. Each guard is scraped where this
host reaches it: loopback for its own, a fabric peer's address on a subnet this host shares for the
others (a host with none is a warning, and no target).
absent: the container and every file of it are removed.
The port must be free or Prometheus's own."""

from __future__ import annotations

from typing import Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from sparkprov.facts.accounts import docker_problem
from sparkprov.facts.fabric import FabricInfo
from sparkprov.facts.monitor import FileTree
from sparkprov.facts.serving import Listeners, ManagedContainers
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.modules.fabric_rails import FABRIC_RAILS, rails_of
from sparkprov.modules.gateway import ready_outcome
from sparkprov.serving import monitor as mon
from sparkprov.serving import prometheus as prom
from sparkprov.modules.gateway_keys import GATEWAY_KEYS

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class Target(BaseModel):
    """A host to scrape the guard of, and where its deployments answer."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=_NAME, max_length=253)
    address: str = Field(min_length=1, max_length=253)
    guard_port: int = Field(default=9410, ge=1, le=65535)


class Served(BaseModel):
    """A deployment's rank 0, as the status play found it (monitor.RunningDeployment)."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=256)
    model: str = Field(min_length=1, max_length=256)
    host: str = Field(pattern=_NAME, max_length=253)
    address: str = Field(min_length=1, max_length=253)
    port: int = Field(ge=1, le=65535)
    api_key_file: str | None = None
    state: str = "running"


class Args(ModuleArgs):
    state: Literal["present", "absent"] = "present"
    image: str = prom.IMAGE
    port: int = Field(default=prom.PORT, ge=1, le=65535)
    bind: str | None = None  # default: this host's first fabric address, else 127.0.0.1
    hosts: list[Target] = Field(default_factory=list)
    deployments: list[Served] = Field(default_factory=list)
    node_exporter_port: int = Field(default=mon.NODE_EXPORTER_PORT, ge=1, le=65535)
    scrape_interval: str = Field(default="15s", pattern=r"^[1-9][0-9]*(ms|s|m)$")
    timeout: float = Field(default=120, gt=0, le=3600)


def tree_fact() -> FileTree:
    return FileTree(prom.DIR, prom.CONFIG)


class Monitor(TypedDict):
    host: str
    url: str
    image: str
    bind: str
    port: int
    guards: dict[str, str | None]   # host -> where Prometheus scrapes its guard (None: no target)
    deployments: list[str]
    dir: str                        # HOST:PATH of its files


MONITOR: Export[Monitor] = Export("monitor", Monitor, "where Prometheus runs and what it scrapes")


class Prometheus(Module):
    name = "prometheus"
    Args = Args
    doc = "Prometheus on this host, scraping every deployment and every node guard (invoke monitor up|down)."

    def needs(self, args: Args, host: HostContext):
        return {"containers": ManagedContainers(), "ports": Listeners((args.port,)), "tree": tree_fact(),
                "fabric": FabricInfo()}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        cont = facts.containers
        if not cont["access"]:
            return Plan.fail(f"{host.name}: {docker_problem(cont['error'], host.name, host.user)}")
        have = next((c for c in cont["containers"] if c["name"] == prom.CONTAINER), None)
        tree = facts.tree
        if args.state == "absent":
            if have is None and not tree["exists"]:
                return Plan(msg="no Prometheus here")
            return Plan([Change(f"remove {prom.CONTAINER} and {prom.DIR}", prom.down_script(),
                                Diff(f"{host.name}: prometheus", _table(have, tree["files"]), ""),
                                touches=[ManagedContainers(), tree_fact()])])
        own = rails_of(facts.fabric)
        bind = args.bind or (own[0]["address"] if own else "127.0.0.1")
        rails = {h: FABRIC_RAILS.read(host.exports, h) or [] for h in host.exports}
        rails[host.name] = own
        warnings, monitored = [], []
        for t in args.hosts:
            addr, note = mon.guard_address(t.name, rails, host.name)
            if note:
                warnings.append(note)
            monitored.append(mon.MonitoredHost(t.name, t.address, guard=mon.host_port(addr, t.guard_port) if addr else None))
        deps = [mon.RunningDeployment(d.name, d.model, d.host, d.address, d.port, d.api_key_file, state=d.state)
                for d in args.deployments]
        files = {rel: text for rel, text in mon.render(deps, monitored, node_exporter_port=args.node_exporter_port,
                                                       scrape_interval=args.scrape_interval).items()
                 if rel != mon.DASHBOARD}  # Grafana's, not Prometheus's: `invoke monitor write` writes it
        for d in deps:
            if not d.api_key_file:
                continue
            key = GATEWAY_KEYS.entry(host.exports, d.host, d.api_key_file)
            if not key:
                return Plan.fail(f"{host.name}: the API key of {d.name} on {d.host} was not read (its key task "
                                 "failed or did not run)")
            files.setdefault(mon.key_file(d.host), key + "\n")
        digest = prom.state_hash(args.image, args.port, bind, files)
        want = prom.expected_tree(files)
        url = f"http://{prom.listen(bind, args.port)}"
        summary: Monitor = {"host": host.name, "url": url, "image": args.image, "bind": bind, "port": args.port,
                   "guards": {m.name: m.guard for m in monitored}, "deployments": [d.name for d in deps],
                   "dir": f"{host.name}:{prom.DIR}"}
        if have and have["status"] == "running" and have["labels"].get("sparkprov.monitor_hash") == digest \
                and tree["files"] == want:
            return Plan(msg=f"up at {url}, {_summary(deps, monitored)}", warnings=warnings,
                        exports=MONITOR(summary))
        if args.port in facts.ports and not (have and have["status"] == "running"):
            return Plan.fail(f"{host.name}: port {args.port} is in use by a process sparkprov did not start "
                             "(fix: --port another one)")
        change = Change(("replace" if have else "start") + f" {prom.CONTAINER} at {url}: {_summary(deps, monitored)}",
                        prom.up_script(image=args.image, port=args.port, bind=bind, files=files, digest=digest,
                                       timeout=args.timeout),
                        Diff(f"{host.name}: prometheus", _table(have, tree["files"]),
                             _table({"name": prom.CONTAINER, "status": "running", "image": args.image,
                                     "labels": {"sparkprov.monitor_hash": digest}}, want)),
                        touches=[ManagedContainers(), tree_fact()], timeout=args.timeout + 120)
        change.outcome = lambda out: ready_outcome(out, f"{host.name}: Prometheus")
        return Plan([change], warnings=warnings, exports=MONITOR(summary))


def _summary(deps: list[mon.RunningDeployment], hosts: list[mon.MonitoredHost]) -> str:
    guards = sum(1 for h in hosts if h.guard)
    return f"{len(deps)} deployment(s), {guards} of {len(hosts)} guard(s)"


def _table(have: dict | None, files: dict[str, tuple[int, str]]) -> str:
    """The container and its files, keys by name only (never a digest of a key)."""
    if not have and not files:
        return ""
    head = (f"{have['name']} ({have['status']}, {have['image']}, hash {have['labels'].get('sparkprov.monitor_hash')})\n"
            if have else "no container\n")
    return head + "".join(f"{rel} {mode:04o}" + (" (a key)" if rel.startswith(mon.KEY_DIR + "/") else f" {sha[:12]}") + "\n"
                          for rel, (mode, sha) in sorted(files.items()))
