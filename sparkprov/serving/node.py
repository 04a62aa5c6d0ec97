"""One node of a deployment, from what was read on it: its launch (the catalog's recipe rendered
with the node's facts) and the checks a preflight makes before anything starts. Pure functions:
the serving modules call them from `plan`.
"""

from __future__ import annotations

import ipaddress
import posixpath
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from sparkprov.catalog.derive import ImageChoice, choose_image
from sparkprov.catalog.lint import VLLM_DEFAULT_UTILIZATION
from sparkprov.catalog.lint import WARNING, lint_launch
from sparkprov.catalog.load import Catalog, load_catalog
from sparkprov.catalog.render import HostServeContext, Launch, render_launch
from sparkprov import inventory_vars as iv
from sparkprov.defaults import expand_home
from sparkprov.imageref import ImageRef
from sparkprov.serving import spec as specmod
from sparkprov.serving.deployment import Deployment
from sparkprov.staging.plan import repo_dir


@lru_cache(maxsize=16)
def _catalog(files: tuple[str, ...]) -> Catalog:
    return load_catalog(list(files))


def catalog_for(dep: Deployment) -> Catalog:
    return _catalog(tuple(dep.recipe_files))


def node_image(dep: Deployment, digest: str | None = None) -> ImageChoice:
    """The image the deployment's containers run, and why (catalog/derive.py choose_image): its
    --image or the recipe's, the image derived from it, or with --pin it by the registry `digest`
    its nodes hold (pin_digest)."""
    cat = catalog_for(dep)
    return choose_image(cat.get(dep.model), cat, override=dep.image_override,
                        ray_cluster=dep.cluster and dep.executor == "ray", digest=digest)


def repos(dep: Deployment) -> list[tuple[str, str]]:
    r = catalog_for(dep).get(dep.model)
    out = [] if r.model.local_dir else [(r.model.repo, r.model.revision)]
    return out + [(x.repo, x.revision) for x in r.extra_repos]


def base_url(dep: Deployment, host_vars: dict[str, Any]) -> str:
    """The API's URL from the host itself."""
    return dep.endpoint(host_vars, "127.0.0.1")


def key_file(host_vars: dict[str, Any]) -> str | None:
    """The API key file as the inventory says it (may start with ~/); None: no key."""
    return iv.value(host_vars, "api_key_file") or None


def container_name(dep: Deployment, host: str) -> str:
    if not dep.cluster:
        return f"sparkprov-{dep.name}"
    if dep.executor == "native":
        return f"sparkprov-{dep.name}-rank{dep.rank(host)}"
    return f"sparkprov-{dep.name}-{'head' if dep.rank(host) == 0 else 'worker'}"


def launch(dep: Deployment, host: str, host_vars: dict[str, Any], home: str, fabric: dict | None,
           smi: dict | None, image: ImageChoice | None = None) -> Launch:
    """The catalog's launch for this node, with the node's fabric bindings and driver. `image`:
    node_image's choice (a pinned deployment's, with its digest); default: node_image(dep)."""
    cat = catalog_for(dep)
    extra: dict[str, Any] = {"container_name": container_name(dep, host), "port": dep.port_on(host_vars)}
    if "api_key_file" not in host_vars:
        extra["api_key_file"] = expand_home(iv.default("api_key_file"), home)
    fabric = fabric or {}
    if dep.cluster:
        extra["cluster_size"] = dep.nodes
        if "fabric_ifaces" not in host_vars and fabric.get("nccl_socket_ifname"):
            extra["fabric_ifaces"] = [fabric["nccl_socket_ifname"]]
        if "ib_hcas" not in host_vars and fabric.get("nccl_ib_hca"):
            extra["ib_hcas"] = fabric["nccl_ib_hca"].split(",")
        if "fabric_ip" not in host_vars and fabric.get("node_ip"):
            extra["node_ip"] = fabric["node_ip"]
        if "fabric_topology" not in host_vars and fabric.get("topology"):
            extra["fabric_topology"] = fabric["topology"]
    if "driver_version" not in host_vars and (smi or {}).get("driver_version"):
        extra["driver_version"] = smi["driver_version"]
    for var in ("model_store", "compile_cache"):
        if var not in host_vars:
            extra[var] = expand_home(iv.default(var), home)
    ctx = HostServeContext.from_host_vars(host, host_vars, home=home, **extra)
    return render_launch(cat.get(dep.model), ctx, dep.tp, dep.overrides, catalog=cat, pp=dep.pp, dp=dep.dp, ep=dep.ep,
                         image=image or node_image(dep))


def image_info(dep: Deployment):
    """The catalog's record of the deployment's image (None: not in the catalog)."""
    cat = catalog_for(dep)
    return cat.image(cat.get(dep.model).image)


def image_version(dep: Deployment) -> str | None:
    info = image_info(dep)
    return info.vllm_version if info is not None else None


def flag_problems(node_launch: Launch, dep: Deployment, image: ImageChoice, cache_dir: str | None,
                  image_id: str | None) -> list[str]:
    """The launch's flags and VLLM_* variables against what the image's own vLLM said (G4), where
    the image answered; else against the set recorded for its vLLM version (a derived image's:
    the recipe's image's)."""
    cat = catalog_for(dep)
    base = node_launch if not image.derived else node_launch.model_copy(update={"image": cat.get(dep.model).image})
    return [f"{f.rule}: {f.message} (fix: {f.fix})" for f in lint_launch(base, catalog=cat, only=["G4"],
                                                                         flags_cache=cache_dir, image_digest=image_id)
            if f.severity != WARNING and not f.silenced]


def pin_digest(ref: str, held: dict[str, tuple[str | None, str | None]], me: str) -> tuple[str | None, list[str]]:
    """cluster-up --pin: the registry digest the deployment runs `ref` by (node_image), and why it
    cannot be pinned, from what each node's docker holds of `ref` after the image play: (image ID, registry digest),
    the ID None where the node holds none yet (check mode: it would pull it; left out). A node
    whose image has no registry digest (built there, or copied from a peer: docker load keeps
    none) cannot be pinned; nodes that hold different digests run different code. `me`: the node
    that asks (it names the problem, as every node of the deployment does)."""
    problems = [f"{h}: {ref} on {h} has no registry digest (built or loaded there, never pulled): --pin cannot "
                f"pin it (fix: docker pull {ref} on {h}, then cluster-up --pin again; or leave out --pin)"
                for h, (image_id, digest) in held.items() if image_id and not digest]
    digests = {h: d for h, (image_id, d) in held.items() if image_id and d}
    if len(set(digests.values())) > 1:
        problems.append(f"{me}: the nodes hold different registry digests of {ref}: "
                        + ", ".join(f"{h} {d}" for h, d in digests.items())
                        + f" (--pin) (fix: docker pull {ref} on every node so they hold one build, "
                          f"or --image {ImageRef.parse(ref).by_digest('sha256:...')} naming the one to run)")
        return None, problems
    return next(iter(digests.values()), None), problems


def pin_refusal(dep: Deployment) -> str | None:
    """Why cluster-up --pin cannot pin a deployment, known before any host (None: it can): the
    image it runs is one cluster-up derives."""
    image = node_image(dep)
    if image.ray:
        return (f"--pin: deployment {dep.name!r} runs the Ray image cluster-up builds from {image.requested} on "
                "rank 0, which has no registry digest")
    if image.derived:
        return (f"--pin: deployment {dep.name!r} runs the image cluster-up builds from {image.requested} with "
                f"{' '.join(image.requirements)} on rank 0, which has no registry digest")
    return None


def container(dep: Deployment, host: str, node_launch: Launch, head_ip: str | None,
              rank0_id: str = "", home: str = "", *, foreground: bool = False) -> specmod.ContainerSpec:
    """The container this node runs: a single server, or its rank of a cluster (Ray head or
    worker, or a native rank: rank 0 serves the API, the others are --headless). `foreground`:
    for systemd (serving/systemd.py) instead of docker's restart policy."""
    if not dep.cluster:
        spec = specmod.single(dep.name, host, node_launch, foreground=foreground)
        # on demand: created and left stopped, the gateway starts it (a service manager's unit is no park)
        if dep.on_demand and not foreground:
            return specmod.parked(spec, dep.idle_stop_s, node_launch.number("--gpu-memory-utilization")
                                  or VLLM_DEFAULT_UTILIZATION)
        return spec
    rank = dep.rank(host)
    if dep.executor == "native":
        return specmod.native_rank(dep.name, host, node_launch, rank=rank, nnodes=dep.nodes, pp=dep.pp,
                                   master_addr=head_ip or "", master_port=dep.master_port, rank0_id=rank0_id,
                                   dp=dep.dp, foreground=foreground)
    return specmod.ray_rank(dep.name, host, node_launch, rank=rank, nnodes=dep.nodes, head_ip=head_ip or "",
                            ray_port=dep.ray_port, rank0_id=rank0_id,
                            token_file=specmod.ray_token_file(home, dep.name) if home else None, foreground=foreground)


@dataclass(frozen=True)
class NodeInputs:
    """What `build` needs of one node besides the deployment: its inventory variables and home, what
    was read on it (fabric, GPU driver), and what the plays before exported: rank 0's fabric address
    and container ID, each node's image ID and registry digest of the requested image (the image
    play), the image's own flags (rank 0's image options play)."""

    host: str
    vars: dict[str, Any]
    home: str
    fabric: dict | None = None   # FabricInfo (a cluster's node)
    smi: dict | None = None      # NvidiaSmi
    head_ip: str | None = None   # rank 0's fabric address (its preflight's export)
    rank0_id: str | None = None  # rank 0's container ID, once it runs (vllm_container's export)
    # node -> image reference -> its ID there, and its registry digest (the image plays' exports;
    # a node that holds none yet, in check mode: absent)
    image_ids: dict[str, dict[str, str]] = field(default_factory=dict)
    image_digests: dict[str, dict[str, str]] = field(default_factory=dict)
    flags: dict | None = None    # rank 0's image_flags export (None: it did not get that far)


@dataclass(frozen=True)
class NodeContainer:
    """What one node runs for a deployment, built once (`build`) and handed to vllm_container, which
    compares it with the node's containers and starts it: the container (its docker run argv,
    labels, recipe hash), the image it runs and why, and where it serves."""

    spec: specmod.ContainerSpec
    image: ImageChoice
    serves: bool           # it serves the API (a single server, a cluster's rank 0)
    base_url: str          # the API's URL from the node itself
    key_file: str | None   # the API key file as the inventory says it (None: no key)


def build(dep: Deployment, n: NodeInputs) -> tuple[NodeContainer | None, list[str]]:
    """The container node `n.host` runs for `dep`, or why it cannot start (every problem found):
    rank 0 exported no fabric address; with --pin, no single registry digest (pin_digest); the
    nodes hold different builds of the image (G34); a flag or variable the image's vLLM does not
    know (flag_problems)."""
    image, problems = node_image(dep), []
    ids = {h: n.image_ids.get(h, {}).get(image.requested) for h in dep.hosts}
    if dep.pin:
        digest, problems = pin_digest(image.requested, {h: (ids[h], n.image_digests.get(h, {}).get(image.requested))
                                                        for h in dep.hosts}, n.host)
        image = node_image(dep, digest)
    node_launch = launch(dep, n.host, n.vars, n.home, n.fabric if dep.cluster else None, n.smi, image)
    if dep.cluster and not n.head_ip:
        return None, [f"{n.host}: rank 0 ({dep.hosts[0]}) exported no fabric address (its preflight failed)"]
    if len({i for i in ids.values() if i}) > 1:
        problems.append(f"{n.host}: the nodes hold different builds of {image.requested}: "
                        + ", ".join(f"{h} {i[7:19] if i else 'absent'}" for h, i in ids.items())
                        + " (G34) (fix: pin a digest in the catalog)")
    problems += flag_problems(node_launch, dep, image, n.flags["cache"] if n.flags else None,
                              n.flags["ids"].get(image.requested) if n.flags else None)
    if problems:
        return None, problems
    rank0_id = ""
    if dep.cluster and dep.rank(n.host) > 0:
        rank0_id = n.rank0_id or "(rank 0 to be started)"
    spec = container(dep, n.host, node_launch, n.head_ip, rank0_id, n.home)
    return NodeContainer(spec, image, dep.serves_on(n.host), base_url(dep, n.vars), key_file(n.vars)), []


def lint_problems(node_launch: Launch, dep: Deployment) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the linter on this node's launch; cluster-wide rules on rank 0."""
    errors, warnings = [], []
    cat = catalog_for(dep)
    for f in lint_launch(node_launch, catalog=cat, pinned=dep.pin):
        if f.silenced:
            continue
        line = f"{f.severity} {f.rule}: {f.message} (fix: {f.fix}) [{'; '.join(f.sources)}]"
        (warnings if f.severity == WARNING else errors).append(line)
    return errors, warnings


def staged_problem(store_facts, repo: str, revision: str) -> str | None:
    """Why a repo is not staged and verified in this store (None: it is). Needs no hub: the
    snapshot's links must resolve to published blobs whose verified record (size, mtime) holds."""
    base = repo_dir(repo)
    commit = revision if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision) else \
        (store_facts.refs.get(f"{base}/refs/{revision}") or "").strip()
    if not commit:
        return f"{repo}@{revision} is not in the store (no {base}/refs/{revision})"
    snap = f"{base}/snapshots/{commit}/"
    links = {p: e for p, e in store_facts.entries.items() if p.startswith(snap)}
    if not links:
        return f"{repo}: snapshot {commit[:12]} is empty"
    if not any(p.endswith("/config.json") or p == snap + "config.json" for p in links):
        return f"{repo}: snapshot {commit[:12]} has no config.json"
    for p, e in sorted(links.items()):
        if e.kind != "l":
            return f"{repo}: {p[len(snap):]} is not a link into blobs/ (a stray file in the snapshot)"
        blob = posixpath.normpath(posixpath.join(posixpath.dirname(p), e.target))
        b = store_facts.entries.get(blob)
        if b is None or b.kind != "f":
            return f"{repo}: {p[len(snap):]} points at a missing blob"
        rec = store_facts.verified.get(blob)
        if rec is None or rec.size != b.size or rec.mtime_ns != b.mtime_ns:
            return f"{repo}: {p[len(snap):]} is not verified (changed since it was hashed, or never hashed)"
    return None


def rail_problem(host: str, fabric: dict | None, node_ip: str | None, peers_fix: str) -> tuple[str | None, str | None]:
    """(problem, rail network) for a cluster node: it has a rail, and VLLM_HOST_IP is on it (G32)."""
    rails = (fabric or {}).get("rails") or []
    if not rails:
        return (f"{host}: no fabric rail with an IPv4 address (ConnectX-7 twins Up in ibdev2netdev): NCCL and "
                f"the executor would use the management LAN (G32) (fix: invoke provision --hosts {host} --tags fabric)"), None
    if (fabric or {}).get("bootstrap") and node_ip == fabric.get("node_ip"):
        # a mesh or ring: the sockets go over the management link (facts/fabric.py nccl_settings)
        return None, "management"
    rail = next((r for r in rails if r.get("address") == node_ip), None)
    if rail is None:
        return (f"{host}: fabric address {node_ip} (VLLM_HOST_IP) is not on any rail of {host} "
                f"({', '.join(r['address'] for r in rails)}) (fix: {peers_fix})"), None
    net = ipaddress.ip_interface(f"{rail['address']}/{rail.get('prefix', 24)}").network
    return None, str(net)



# the roles of containers that serve (a gateway, Prometheus or nccl-check's own container do not)
NOT_SERVING = ("gateway", "monitor", "nccl-check")


def running_image(containers: dict[str, list[dict[str, Any]]], hosts: list[str]) -> tuple[str, str] | None:
    """An image every one of `hosts` runs a serving container of (`containers`: per host, the status
    play's containers): (image, the deployment that runs it there), preferring a deployment that
    spans all of them; None when no image runs on every host."""
    runs: dict[tuple[str, str], set[str]] = {}   # (image, deployment) -> hosts it runs on
    for h in hosts:
        for c in containers.get(h) or []:
            labels = c.get("labels") or {}
            if c.get("status") != "running" or not c.get("image") or labels.get("sparkprov.role") in NOT_SERVING:
                continue
            runs.setdefault((c["image"], labels.get("sparkprov.deployment") or c["name"]), set()).add(h)
    whole = sorted(k for k, on in runs.items() if on >= set(hosts))
    if whole:
        return whole[0]
    by_image: dict[str, set[str]] = {}
    for (image, _), on in runs.items():
        by_image.setdefault(image, set()).update(on)
    for image in sorted(by_image):
        if by_image[image] >= set(hosts):
            deps = sorted(d for (i, d) in runs if i == image)
            return image, ", ".join(deps)
    return None
