"""gateway: LiteLLM's proxy on this host, routing by model name to every deployment
(sparkprov/serving/gateway.py), converged to the hash of its image, address and configuration.

present: a container running with the wanted hash is nothing to do; otherwise the configuration
is written (0600, the servers' keys from the gateway_keys play before, the master key made on
this host once) and the container replaced, and the change waits until the proxy answers.
absent: the container and the configuration are removed (the master key stays).
The port must be free or the gateway's own."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from sparkprov.facts.accounts import docker_problem
from sparkprov.facts.serving import KeyFile, Listeners, ManagedContainers
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.serving import gateway as gw
from sparkprov.modules.gateway_keys import GATEWAY_KEYS
from sparkprov.modules.ondemand_key import ONDEMAND_KEY


class Route(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256)
    deployment: str = ""
    host: str
    api_base: str = Field(pattern=r"^https?://[^\s/]+(/[^\s]*)?$")
    key_file: str | None = None
    on_demand: bool = False
    idle_stop_s: int | None = Field(default=None, ge=1)
    utilization: float | None = Field(default=None, gt=0, le=1)


class OnDemandArgs(BaseModel):
    """What the hook needs beyond the routes (plays/gateway.py reads it from the status play and
    the inventory): each on-demand host's guard address, its budget and memory (GiB)."""
    model_config = ConfigDict(extra="forbid")
    guard_port: int = Field(ge=1, le=65535)
    addresses: dict[str, str]
    budgets_gib: dict[str, float]
    host_gib: dict[str, float]


class Args(ModuleArgs):
    state: Literal["present", "absent"] = "present"
    image: str = gw.IMAGE
    port: int = Field(default=gw.PORT, ge=1, le=65535)
    bind: str = "0.0.0.0"
    routes: list[Route] = Field(default_factory=list)
    ondemand: OnDemandArgs | None = None
    timeout: float = Field(default=180, gt=0, le=3600)


class Endpoint(TypedDict):
    host: str
    port: int
    master_key_file: str          # HOST:PATH
    models: list[str]
    routes: list[dict[str, Any]]  # serving/gateway.py litellm routes


GATEWAY: Export[Endpoint] = Export("gateway", Endpoint, "where the gateway serves, and the models it routes")


class Gateway(Module):
    name = "gateway"
    Args = Args
    doc = "LiteLLM's proxy on this host in front of every deployment, routing by model name (invoke gateway)."

    def needs(self, args: Args, host: HostContext):
        return {"containers": ManagedContainers(), "ports": Listeners((args.port,)),
                "master": KeyFile(f"{gw.DIR}/{gw.MASTER_KEY}")}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        cont = facts.containers
        if not cont["access"]:
            return Plan.fail(f"{host.name}: {docker_problem(cont['error'], host.name, host.user)}")
        have = next((c for c in cont["containers"] if c["name"] == gw.CONTAINER), None)
        if args.state == "absent":
            if have is None:
                return Plan(msg="no gateway here")
            return Plan([Change(f"remove {gw.CONTAINER} and its configuration", gw.down_script(),
                                Diff(f"{host.name}: gateway", _table(have), ""), touches=[ManagedContainers()])])
        keys = {}
        for r in args.routes:
            if r.key_file:
                key = GATEWAY_KEYS.entry(host.exports, r.host, r.key_file)
                if not key:
                    return Plan.fail(f"{host.name}: the key of {r.model} on {r.host} was not read (its gateway_keys "
                                     "task failed or did not run)")
                keys[(r.host, r.key_file)] = key
        routes = [r.model_dump() for r in args.routes]
        config = gw.litellm_config(routes, keys)
        ondemand, key = None, None
        if any(r.on_demand for r in args.routes):
            key = ONDEMAND_KEY.read(host.exports, host.name)
            if not args.ondemand or not key:
                return Plan.fail(f"{host.name}: the on-demand key or the guards' addresses were not given (the "
                                 "ondemand_key task failed or did not run)")
            ondemand = gw.ondemand_config(routes, keys, **args.ondemand.model_dump())
        digest = gw.state_hash(args.image, args.port, args.bind, config, ondemand, key)
        endpoint: Endpoint = {"host": host.name, "port": args.port, "master_key_file": f"{host.name}:{gw.DIR}/{gw.MASTER_KEY}",
                    "models": sorted({r.model for r in args.routes}), "routes": routes}
        if have and have["status"] == "running" and have["labels"].get("sparkprov.gateway_hash") == digest \
                and facts.master.get("exists"):
            return Plan(msg=f"up, {_summary(args.routes)}", exports=GATEWAY(endpoint))
        if args.port in facts.ports and not (have and have["status"] == "running"):
            return Plan.fail(f"{host.name}: port {args.port} is in use by a process sparkprov did not start "
                             "(fix: --port another one)")
        change = Change(("replace" if have else "start") + f" {gw.CONTAINER} on port {args.port}: {_summary(args.routes)}",
                        gw.up_script(image=args.image, port=args.port, bind=args.bind, config=config, digest=digest,
                                     timeout=args.timeout, ondemand=ondemand),
                        Diff(f"{host.name}: gateway routes", _table(have), _routes_text(args.routes)),
                        touches=[ManagedContainers(), KeyFile(f"{gw.DIR}/{gw.MASTER_KEY}")],
                        timeout=args.timeout + 120)
        change.outcome = lambda out: ready_outcome(out, f"{host.name}: the gateway")
        return Plan([change], exports=GATEWAY(endpoint))


def _summary(routes: list[Route]) -> str:
    models = sorted({r.model for r in routes})
    return f"{len(routes)} route(s) to " + (", ".join(models) if models else "no deployment")


def _routes_text(routes: list[Route]) -> str:
    return "".join(f"{r.model} -> {r.api_base} ({r.deployment} on {r.host}"
                   + (f", on demand, idle_stop_s {r.idle_stop_s or '-'}" if r.on_demand else "") + ")\n" for r in routes)


def _table(have: dict | None) -> str:
    if not have:
        return ""
    return f"{have['name']} ({have['status']}, {have['image']}, hash {have['labels'].get('sparkprov.gateway_hash')})\n"


def ready_outcome(out: str, what: str) -> str | None:
    """Reads what gw.wait_ready_script printed: None once it answered, else why not."""
    lines = out.strip().splitlines()
    if any(line.startswith("@ready") for line in lines):
        return None
    why = next((line[len("@failed "):] for line in lines if line.startswith("@failed")), "no answer")
    tail = [ln for ln in lines if ln.strip() and not ln.startswith("@")][-3:]
    return f"{what} did not come up: {why}" + (f": {' / '.join(tail)}" if tail else "")
