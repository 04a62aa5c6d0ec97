"""The serve playbook: which model runs where, with which overrides (the catalog supplies the recipe).

    recipes: [my-recipes.yaml]          # optional user recipe files (paths relative to the playbook)
    deployments:
      - name: coder                     # container names sparkprov-coder[-head|-worker], label value
        model: qwen3-coder-next         # catalog alias
        hosts: sparks                   # inventory pattern (names, groups, globs, !exclusions)
        tp: 2                           # 1 (default): one independent server per host;
                                        # tp x pp > 1: one engine across exactly tp x pp hosts, rank 0 first
        pp: 1                           # pipeline-parallel size (default 1)
        dp: 1                           # data-parallel replicas behind rank 0's API (default 1; native,
                                        # one Spark each): the deployment spans tp x pp x dp hosts
        ep: false                       # --enable-expert-parallel (MoE recipes; tp x dp > 1)
        executor: ray                   # ray (default: a Ray cluster, head = rank 0) or native
                                        # (vLLM's own --nnodes/--node-rank; the other ranks --headless;
                                        # the default with dp > 1)
        overrides: {--max-model-len: 32768, --enable-chunked-prefill: null}   # null removes a flag
        port: 8000                      # default: the host's serve_port var, else 8000
        ray_port: 6379                  # Ray GCS port on the head (executor ray)
        master_port: 29501              # rendezvous port on rank 0 (executor native)
        on_demand: false                # true: cluster-up parks it (every step of a start but the start:
                                        # its container created and left stopped); the gateway starts it
                                        # when a request asks for its model (docs/on-demand.md)
        idle_stop_s: 900                # on demand: the gateway stops it after this long without a request

Errors are one line with the file position (FILE:LINE:COL: message (fix: ...)).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from sparkprov.catalog.layout import Layout, override_conflicts
from sparkprov import inventory_vars as iv
from sparkprov.defaults import MASTER_PORT, RAY_PORT
from sparkprov.errors import InputError
from sparkprov.hosts import Inventory
from sparkprov.options import DEPLOYMENT_NAME
from sparkprov.serving.address import reached_at
from sparkprov.yamlpos import load_yaml, parse_model

if TYPE_CHECKING:
    from sparkprov.catalog.load import Catalog

NAME_RE = re.compile(rf"{DEPLOYMENT_NAME}\Z")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Where = tuple[str | None, int | None, int | None]  # file (or the option that made it), line, column


class Deployment(BaseModel):
    """A deployment: a serve playbook's entry, cluster-up --model's, and the serving modules' argument."""

    # The modules receive as_args(), its plain data. `hosts` are inventory names once resolved (rank 0
    # first for a cluster); a playbook may give one pattern, resolved on load.

    model_config = ConfigDict(extra="forbid")
    name: str
    model: str
    hosts: list[str]
    tp: int = Field(default=1, ge=1, le=64)
    pp: int = Field(default=1, ge=1, le=64)
    dp: int = Field(default=1, ge=1, le=64)
    ep: bool = False
    executor: Literal["ray", "native"] | None = None  # None: ray, native with dp > 1
    overrides: dict[str, Any] = Field(default_factory=dict)
    port: int | None = Field(default=None, ge=1, le=65535)
    ray_port: int = Field(default=RAY_PORT, ge=1, le=65535)
    master_port: int = Field(default=MASTER_PORT, ge=1, le=65535)
    recipe_files: list[str] = Field(default_factory=list)  # user recipe files merged over the catalog
    # cluster-up --image: the deployment's image instead of the recipe's (serving/node.py node_image
    # decides what its containers run)
    image_override: str | None = None
    # cluster-up --pin: runs by the registry digest every node's docker holds for its image (REPO@sha256:...)
    pin: SkipJsonSchema[bool] = False
    # on demand (issue 35, docs/on-demand.md): parked by cluster-up (cluster-up --park sets it), started
    # by the gateway when a request asks for its model, stopped by it after idle_stop_s without one
    on_demand: bool = False
    idle_stop_s: int | None = Field(default=None, ge=10, le=7 * 86400)
    # where it was written (errors name it); never part of the arguments the modules receive
    where: SkipJsonSchema[Where] = Field(default=(None, None, None), exclude=True)
    override_where: SkipJsonSchema[dict[str, tuple[int | None, int | None]]] = Field(default_factory=dict,
                                                                                     exclude=True)

    @field_validator("hosts", mode="before")
    @classmethod
    def _one_pattern(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a deployment name (lowercase letters, digits, '.', '_', '-')")
        return v

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k, val in v.items():
            if not isinstance(k, str) or not re.fullmatch(r"--[a-z0-9][a-z0-9-]*", k):
                raise ValueError(f"override {k!r} is not a long vLLM option (like --max-model-len)")
            if k in ("--api-key",):
                raise ValueError("--api-key in argv shows in `docker inspect` and `ps`: sparkprov passes the "
                                 "host's 0600 key file instead (G31)")
            if k in ("--host", "--port", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless",
                     "--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-address",
                     "--data-parallel-rpc-port", "--data-parallel-rank"):
                raise ValueError(f"{k} comes from the deployment (its layout, ranks and port) and the host's vars")
            if not (val is None or isinstance(val, (str, int, float, bool, dict, list))):
                raise ValueError(f"override {k}: unsupported value {val!r}")
        return v

    @model_validator(mode="after")
    def _layout(self):
        """The sizes are the deployment's (an override may not set them against it); the executor
        defaults to ray, native with data-parallel replicas."""
        conflict = override_conflicts(self.overrides, Layout(self.tp, self.pp, self.dp, self.ep))
        if conflict:
            raise ValueError(f"override {conflict}")
        if self.executor is None:
            self.executor = "native" if self.dp > 1 else "ray"
        if self.idle_stop_s is not None and not self.on_demand:
            raise ValueError("idle_stop_s is the idle time after which the gateway stops an on-demand deployment: "
                             "give on_demand: true with it, or leave it out")
        return self

    @property
    def nodes(self) -> int:
        """Sparks of the deployment: tp x pp x dp GPUs, one GPU per Spark (G35)."""
        return Layout(self.tp, self.pp, self.dp).nodes

    @property
    def cluster(self) -> bool:
        return self.nodes > 1

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.dp, self.ep, self.executor if self.cluster else None)

    @property
    def head(self) -> str:
        return self.hosts[0]

    def rank(self, host: str) -> int:
        return self.hosts.index(host)

    def serves_on(self, host: str) -> bool:
        """Whether this host's container serves the API (every host of single-node deployments;
        rank 0 of a cluster)."""
        return not self.cluster or self.rank(host) == 0

    def as_args(self) -> dict[str, Any]:
        """What the serving modules take as their `deployment` argument (plain data)."""
        # cluster-up's --image, --pin, and on demand: absent where unset (the arguments as before them)
        unset = {k for k in ("image_override", "pin", "on_demand", "idle_stop_s") if not getattr(self, k)}
        return self.model_dump(exclude_none=False, exclude=unset or None)

    def port_on(self, host_vars: dict[str, Any]) -> int:
        """The API port on a host: the deployment's, else the host's serve_port var (8000)."""
        return self.port or iv.value(host_vars, "serve_port")

    def endpoint(self, host_vars: dict[str, Any], address: str) -> str:
        """The API's URL on a host, reached at `address` (how the caller reaches that host) where
        the server binds every address (serve_bind 0.0.0.0 or ::), else at its bind address."""
        return f"http://{reached_at(iv.value(host_vars, 'serve_bind'), address)}:{self.port_on(host_vars)}"

    def hosts_problem(self) -> str | None:
        """Why the hosts cannot carry the layout (G35: a cluster takes exactly tp x pp x dp Sparks)."""
        if self.cluster and len(self.hosts) != self.nodes:
            return (f"{Layout(self.tp, self.pp, self.dp).describe()} needs exactly {self.nodes} hosts (one GPU per "
                    f"Spark, G35), hosts gives {len(self.hosts)}: {', '.join(self.hosts)}")
        return None

    def check(self, catalog: Catalog, host_vars: dict[str, Any] | None = None) -> None:
        """The alias is in the catalog, the layout one its recipe runs, and the hosts carry it (an
        InputError at the deployment's place). `host_vars`: rank 0's inventory vars, whose declared
        fabric_topology and fabric_links the layout must fit (a ring: tp only, ranks along it)."""
        from sparkprov.catalog.layout import layout_of, ring_order_problem, topology_problem

        topology = (host_vars or {}).get("fabric_topology") if self.cluster else None
        links = (host_vars or {}).get("fabric_links")
        size = len(links) if topology == "ring" and isinstance(links, list) else None
        try:
            layout_of(catalog.get(self.model), catalog, self.layout)
        except InputError as exc:
            raise self.error(exc.message, fix=exc.fix) from None
        bad = topology_problem(self.layout, topology, size)
        if bad:
            raise self.error(f"{self.layout.describe()}: {bad[0]} (fabric_topology in the inventory)", fix=bad[1])
        problem = self.hosts_problem()
        if problem:
            raise self.error(problem, fix=f"give {self.nodes} hosts, the first is rank 0")
        problem = self.on_demand_problem(catalog)
        if problem:
            raise self.error(problem[0], fix=problem[1])
        if topology == "ring" and links and self.nodes > 2:
            from sparkprov.facts.topology import parse_links

            problem = ring_order_problem(self.hosts, parse_links(links))
            if problem:
                raise self.error(problem + " (fabric_links in the inventory)", fix="list the hosts in ring order")

    def on_demand_problem(self, catalog: Catalog) -> tuple[str, str] | None:
        """Why it cannot be parked and started on demand, and the fix (None: it can). A multi-node
        deployment's activation (every rank started, rank 0 as its executor needs) is not built yet; a
        recipe restarting its container `always` would start every parked one at each boot of docker."""
        if not self.on_demand:
            return None
        if self.cluster:
            return (f"on demand is single-node only for now ({self.layout.describe()} spans {self.nodes} hosts; "
                    "issue 35)", "leave out on_demand (and --park), or serve it on one host per replica")
        restart = catalog.get(self.model).docker.restart
        if restart == "always":
            return ("its recipe restarts the container always: docker would start every parked one at each boot",
                    "give the recipe docker.restart: unless-stopped (sparkprov's default)")
        return None

    def error(self, message: str, fix: str | None = None, *, override: str | None = None) -> InputError:
        """An error at the deployment's place in its playbook (or at one of its overrides)."""
        file, line, col = self.where
        if override in self.override_where:
            line, col = self.override_where[override]
        return InputError(f"deployment {self.name!r}: {message}", file=file, line=line, column=col, fix=fix)


_FLAG_WORD = re.compile(r"--?[A-Za-z]")


def override_value_problem(value: Any, top: bool = True) -> str | None:
    """Why an override's value is not one value of its flag, or None. It becomes one argv word of
    `vllm serve` (and a line of the unit file that restarts it): a line break would split that
    line, `$(` or a backtick would be read by any shell it meets, and a second word that looks like
    a flag (`32768 --trust-remote-code`) smuggles in an option the playbook does not show as one."""
    if isinstance(value, str):
        if any(not c.isprintable() for c in value):
            return f"{value!r} holds a line break or another control character"
        if "$(" in value or "`" in value:
            return f"{value!r} holds a command substitution ($( or a backtick)"
        if top and any(_FLAG_WORD.match(w) for w in value.split()):
            return f"{value!r} holds a word that reads as an option"
    elif isinstance(value, dict):
        return next((p for k, x in value.items() for p in (override_value_problem(str(k), False),
                                                           override_value_problem(x, False)) if p), None)
    elif isinstance(value, list):
        return next((p for x in value if (p := override_value_problem(x, False))), None)
    return None


SET_BY_SPARKPROV = {"recipe_files", "image", "image_override", "pin", "where", "override_where"}  # not a playbook's keys


class ServePlaybookFile(_Strict):
    recipes: list[str] = Field(default_factory=list)
    deployments: list[Deployment]


@dataclass
class ServePlaybook:
    path: str
    recipe_files: list[str]
    deployments: list[Deployment] = field(default_factory=list)


def load_serve_playbook(path: str | Path, inventory: Inventory) -> ServePlaybook:
    data, pos = load_yaml(path)
    file = str(path)
    if not isinstance(data, dict):
        raise InputError("a serve playbook is a mapping with deployments:", file=file,
                         fix="see playbooks/cluster.yaml in the sparkprov repository")
    for i, entry in enumerate(data["deployments"] if isinstance(data.get("deployments"), list) else []):
        set_here = sorted(set(entry) & SET_BY_SPARKPROV) if isinstance(entry, dict) else []
        if set_here:
            raise pos.error(("deployments", i, set_here[0]), f"{set_here[0]} is not a key of a deployment",
                            fix="recipe files go under the playbook's recipes:; cluster-up --image runs another image, "
                                "--pin runs it by digest")
    model: ServePlaybookFile = parse_model(ServePlaybookFile, data, pos)
    base = Path(file).resolve().parent
    recipes = [str(p if Path(p).is_absolute() else base / p) for p in model.recipes]
    for i, r in enumerate(recipes):
        if not Path(r).exists():
            raise pos.error(("recipes", i), f"recipe file {model.recipes[i]} not found", fix="check the path")
        if not Path(r).is_file():  # `.` or a folder: the catalog would name the folder, not this line
            raise pos.error(("recipes", i), f"recipe file {model.recipes[i]!r} is not a file",
                            fix="name a user recipe file (YAML: images:, recipes:)")
    seen: dict[str, int] = {}
    out = ServePlaybook(file, recipes)
    for i, d in enumerate(model.deployments):
        where = ("deployments", i)
        if d.name in seen:
            raise pos.error(where + ("name",), f"deployment {d.name!r} is defined twice", fix="give it another name")
        seen[d.name] = i
        for flag, value in d.overrides.items():
            problem = override_value_problem(value)
            if problem:
                raise pos.error(where + ("overrides", flag), f"deployment {d.name!r}: override {flag}: {problem}",
                                fix="give one value per flag (each flag its own key under overrides:)")
        line, col = pos.at(where + ("hosts",))
        pattern = data["deployments"][i]["hosts"]  # as written: one pattern, or a list of them
        words = [w for w in (pattern if isinstance(pattern, list) else re.split(r"[,:\s]+", str(pattern))) if w]
        twice = next((w for j, w in enumerate(words) if w in words[:j]), None)
        if twice is not None:  # [spark1, spark1] would be one host where the playbook counted two
            raise pos.error(where + ("hosts",), f"deployment {d.name!r}: hosts name {twice!r} twice",
                            fix="name each host once (the first is rank 0)")
        hosts = inventory.resolve(pattern, where=(file, line, col), what=f"hosts of deployment {d.name!r}")
        if not hosts:
            raise pos.error(where + ("hosts",), f"deployment {d.name!r}: hosts {pattern!r} match no host",
                            fix="name hosts or groups of the inventory")
        d = d.model_copy(update={"hosts": hosts, "recipe_files": recipes, "where": (file, *pos.at(where)),
                                 "override_where": {f: pos.at(where + ("overrides", f), key=True) for f in d.overrides}})
        problem = d.hosts_problem()
        if problem:
            raise pos.error(where + ("tp",), f"deployment {d.name!r}: {problem}",
                            fix=f"list {d.nodes} hosts (the first is rank 0) or set tp: {len(hosts)}")
        out.deployments.append(d)
    # one host, one port: two deployments on a host must not share a port
    by_host: dict[tuple[str, int | None], str] = {}
    for d in out.deployments:
        for h in d.hosts:
            key = (h, d.port)
            if key in by_host:
                raise d.error(f"shares host {h} and port {d.port or 'default'} with deployment {by_host[key]!r}",
                              fix="give one of them another port: (or put it on another host)")
            by_host[key] = d.name
    return out


def default_name(alias: str) -> str:
    """The name of the deployment `cluster-up --model ALIAS` starts without --name."""
    return re.sub(r"[^a-z0-9_.-]", "-", alias.lower())[:40]


def command_line_deployment(inv: Inventory, model: str, *, tp: int, pp: int, dp: int, ep: bool, executor: str | None,
                            hosts: str | None, name: str | None, recipe_files: list[str]) -> Deployment:
    """cluster-up --model ALIAS [--tp N] [--pp N] [--dp N] [--ep] [--hosts H1,H2] [--name NAME]: without
    --hosts a cluster takes the inventory's first hosts. The alias, the layout and the hosts are
    checked as a playbook's deployment is (Deployment.check), before any host."""
    from sparkprov.catalog.load import load_catalog

    dep_name = name or default_name(model)
    if not NAME_RE.match(dep_name):
        raise InputError(f"--name {dep_name!r} is not a deployment name", fix="lowercase letters, digits, '.', '_', '-'")
    chosen = inv.resolve(hosts, what="--hosts") if hosts else list(inv.hosts)
    d = Deployment(name=dep_name, model=model, hosts=chosen, tp=tp, pp=pp, dp=dp, ep=ep, executor=executor,
                   recipe_files=recipe_files, where=("--model", None, None))
    if d.cluster and not hosts:
        d.hosts = chosen[:d.nodes]  # rank 0 first, as the inventory lists them
    d.check(load_catalog(recipe_files), inv.host_vars(d.hosts[0]) if d.hosts else None)
    return d


def select(pb: ServePlaybook, *, tp: int | None, hosts: list[str] | None, names: list[str] | None) -> list[Deployment]:
    """The deployments a command acts on: --tp (deployments of that size), --deployments (names),
    --hosts (single-node deployments narrowed to them; a cluster must be selected whole)."""
    out = []
    known = {d.name for d in pb.deployments}
    for n in names or []:
        if n not in known:
            raise InputError(f"no deployment {n!r} in {pb.path}", fix=f"deployments: {', '.join(sorted(known))}")
    for d in pb.deployments:
        if names and d.name not in names:
            continue
        if tp is not None and d.tp != tp:
            continue
        if hosts is not None:
            inside = [h for h in d.hosts if h in hosts]
            if not inside:
                continue
            if d.cluster and len(inside) != len(d.hosts):
                raise d.error(f"is a {d.nodes}-node cluster on {', '.join(d.hosts)}; --hosts selects only "
                              f"{', '.join(inside)}", fix="select every host of the cluster, or none")
            d = d.model_copy(update={"hosts": inside})
        out.append(d)
    if not out:
        what = [f"tp {tp}" if tp is not None else None, f"hosts {','.join(hosts)}" if hosts else None]
        raise InputError(f"{pb.path}: no deployment matches " + (" and ".join(w for w in what if w) or "the selection"),
                         fix="check --tp / --hosts / --deployments against the playbook")
    return out
