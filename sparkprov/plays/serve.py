"""The serving commands as playbooks for the engine: cluster-up, cluster-down, status, nccl-check, bench.

Each command builds plays of the serving modules (sparkprov/modules/serve_*.py, vllm_*.py,
docker_image.py, allreduce.py) and runs them on the engine that provision uses, so they share
its gather (one remote call per host for a run with nothing to do: gather_ahead), pure plan,
apply, re-read and verify, check mode, diff, recap, JSON, exit codes, forks and --limit.

cluster-up, per deployment, plays in this order (plays are barriers):

    NAME: preflight         every node     lint, driver, docker, fabric rail and its qualification,
                                           weights, memory, port
    NAME: one fabric        every node     a cluster's ranks on rank 0's fabric subnet (G33)
    NAME: versions          every node     a cluster's kernel, driver, CUDA, firmware alike
    NAME: image             every node     the image present (pull, or copy from a peer), same build
    NAME: image NCCL        every node     a cluster's image: system NCCL or a pip wheel (once per build)
    NAME: same NCCL         every node     a cluster's nodes load the same NCCL
    NAME: ranks can start   every node     a cluster's start checks (G34, the image's flags), each
                                           node's container built: a rank that would fail fails first
    NAME: old ranks         the others     when rank 0 is (re)started, the old group's ranks removed first
    NAME: firewall, token   every node     a cluster's internal ports closed; Ray's token
    NAME: rank 0            rank 0         its container (Ray head: before the workers join it)
    NAME: ranks             the others     their containers (Ray workers, or native --headless ranks)
                                           (each of these three: node_container builds the node's
                                           container, vllm_container compares it and starts it)
    NAME: ready             serving nodes  wait for Ray / the load / /health, warm-up, smoke test

An on-demand deployment (on_demand: true, cluster-up --park) is parked: its containers are created
(`docker create`, the same argv and recipe hash) and left stopped, and no ready play runs.

A deployment that fails after something started is removed again (cleanup play, by label).
"""

from __future__ import annotations

from typing import Any, TypedDict

from sparkprov.catalog.derive import ImageChoice
from sparkprov.data.playbook import Playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import RunOptions
from sparkprov.modules.deployment_health import Health
from sparkprov.modules.listening_ports import PORTS
from sparkprov.modules.serve_status import SERVING_STATUS
from sparkprov.plays.book import play, run_book, task  # noqa: F401 (run_book: the commands run these books)
from sparkprov.plays.options import UpOptions
from sparkprov.serving import node
from sparkprov.serving.deployment import Deployment
from sparkprov.serving.gateway import Route, mark_idle


def playbook_deployments(inv, path: str, *, tp: int | None, hosts: str | None, names: list[str] | None,
                         executor: str | None, recipe_files: list[str]) -> list[Deployment]:
    """The serve playbook's deployments cluster-up starts (--tp, --hosts, --deployments select them;
    --executor replaces theirs), each checked once against the catalog with the playbook's recipe
    files and `recipe_files`: the alias, the layout on its hosts, the override flags."""
    from sparkprov.catalog.knownflags import default_cache_dir
    from sparkprov.catalog.load import load_catalog
    from sparkprov.engine.validate import check_override_flags
    from sparkprov.serving.deployment import load_serve_playbook, select

    pb = load_serve_playbook(path, inv)
    files = list(pb.recipe_files) + list(recipe_files)
    cat = load_catalog(files)
    out = []
    for d in select(pb, tp=tp, hosts=inv.resolve(hosts, what="--hosts") if hosts else None, names=names):
        d = d.model_copy(update={"recipe_files": files, **({"executor": executor} if executor else {})})
        d.check(cat, inv.host_vars(d.hosts[0]) if d.hosts else None)
        check_override_flags(d, cat.get(d.model), cat, str(default_cache_dir()))
        out.append(d)
    return out


def up_book(deployments: list[Deployment], o: UpOptions,
            staged: dict[str, Playbook] | None = None) -> Playbook:
    """`staged`: per deployment, the stage plays (--stage) that put its weights in place first.
    A cluster is all its nodes or nothing: a node that fails stops the others (any_errors_fatal),
    so nothing starts on them either."""
    book = Playbook("cluster-up")
    for d in deployments:
        first = len(book.plays)
        if staged and d.name in staged:
            for p in staged[d.name].plays:
                p.name = f"{d.name}: {p.name}"
                book.plays.append(p)
        args = {"deployment": d.as_args()}
        where = d.where
        # the image ships no Ray, or the recipe pip installs: the containers run an image derived from
        # it (nothing installed at container start), which rank 0 builds once the image is there
        chosen = node.node_image(d)
        image = chosen.requested
        pre = {**args, "drop_caches": o.drop_caches, "unload_ollama": o.unload_ollama}
        book.plays += [
            # become on the play: sudo is probed in the first gather (the page-cache drop needs it);
            # the tasks themselves run as the login user
            play(f"{d.name}: preflight", d.hosts, [task(f"{d.name}: preflight", "serve_preflight",
                                                        {**pre, "staged_here": bool(staged),
                                                         "force_degraded_fabric": o.force_degraded_fabric,
                                                         "replacing": o.replacing.get(d.name, [])},
                                                        where, become=False)],
                 become=o.drop_caches, where=where),
            *group_plays(d, where),
            *drift_plays(d, where),
            play(f"{d.name}: image", d.hosts,
                 [task(f"{d.name}: image", "docker_image", {"image": image, "source": o.image_source,
                                                             "peers": d.hosts, "deployment": d.name}, where)], where=where),
            # the image's own vLLM says which options it knows (once per build, cached here)
            play(f"{d.name}: image options", d.hosts[:1],
                 [task(f"{d.name}: image options", "image_flags",
                       {"images": [image], "versions": {image: node.image_version(d)}}, where)], where=where),
            *nccl_plays(d, image, where),
        ]
        if chosen.derived:
            book.plays += derived_plays(d, chosen, where)
        if d.cluster:
            book.plays.append(play(f"{d.name}: ranks can start", d.hosts, [
                node_container(d, where),
                task(f"{d.name}: ranks can start", "vllm_container", {**pre, "checks_only": True}, where,
                     become=False)], where=where))
            book.plays.append(play(f"{d.name}: old ranks", d.hosts[1:], [
                task(f"{d.name}: old ranks", "vllm_container", {**pre, "stale_ranks": True}, where,
                     become=False)], where=where))
            book.plays += internals_plays(d, args, where)
        # rank 0 first (the Ray head the workers join; the native rank 0 the others rendezvous
        # with), then the other ranks, which name rank 0's container (replaced with it)
        start = [d.hosts[:1], d.hosts[1:]] if d.cluster else [d.hosts]
        for group in start:
            role = "rank 0" if group == d.hosts[:1] and len(start) > 1 else ("ranks" if len(start) > 1 else "containers")
            book.plays.append(play(f"{d.name}: {role}", group,
                                   [node_container(d, where),
                                    task(f"{d.name}: container", "vllm_container", pre, where, become=False)],
                                   become=o.drop_caches, where=where))
        serving = [h for h in d.hosts if d.serves_on(h)]
        # parked (on demand): nothing started, nothing to wait for; its start is the gateway's
        book.plays += [] if d.on_demand else [play(f"{d.name}: ready", serving, [task(
            f"{d.name}: ready", "vllm_ready", {**args, "ray_timeout": o.ray_timeout, "health_timeout": o.health_timeout,
                                               "verify": o.verify}, where)], where=where)]
        for p in book.plays[first:]:
            p.subject = d.name  # its results are found by it (failed_deployments, started_anything)
        if d.cluster:
            together(Playbook(book.path, book.plays[first:]), d.hosts)
    return book


def node_container(d: Deployment, where: tuple):
    """The task that builds this node's container of `d` (modules/node_container.py) for the
    vllm_container task after it in the same play: built where that play runs, after the plays
    whose exports it reads (rank 0's fabric address, the image's builds and flags, and for the other
    ranks rank 0's container)."""
    return task(f"{d.name}: node container", "node_container", {"deployment": d.as_args()}, where, become=False)


def derived_plays(d: Deployment, image: ImageChoice, where: tuple) -> list:
    """Rank 0 builds the derived image (its wheels from this machine), the others copy it from rank 0.
    Named `ray image` where Ray alone goes in, as before pip steps were baked too."""
    reqs = list(image.requirements)
    what = "ray image" if all(r.startswith("ray==") for r in reqs) else "derived image"
    plays = [play(f"{d.name}: {what}", d.hosts[:1], [task(f"{d.name}: {what}", "derived_image",
                                                          {"base": image.requested, "requirements": reqs}, where)],
                  where=where)]
    if d.hosts[1:]:
        plays.append(play(f"{d.name}: {what} copies", d.hosts[1:], [task(
            f"{d.name}: {what}", "docker_image", {"image": image.runs, "source": "peer", "peers": d.hosts[:1],
                                                  "deployment": d.name}, where)], where=where))
    return plays


def internals_plays(d: Deployment, args: dict[str, Any], where: tuple) -> list:
    """Before any container of a multi-node deployment starts: its internal ports closed to all but
    its members (firewall, every node), and for Ray the deployment's token on every member (made on
    rank 0, copied to the others; no_log: the token never reaches a report)."""
    plays = [play(f"{d.name}: firewall", d.hosts, [task(f"{d.name}: firewall", "firewall", args, where,
                                                        become=True)], where=where)]
    if d.executor == "ray":
        for phase, group in (("make", d.hosts[:1]), ("copy", d.hosts[1:])):
            t = task(f"{d.name}: ray token", "ray_token", {**args, "phase": phase}, where)
            t.no_log = True
            plays.append(play(f"{d.name}: ray token" + (" copies" if phase == "copy" else ""), group, [t], where=where))
    return plays


def group_plays(d: Deployment, where: tuple) -> list:
    """After every node's preflight, what a cluster's nodes must agree on (G33: one fabric subnet)."""
    if not d.cluster:
        return []
    return [play(f"{d.name}: one fabric", d.hosts, [task(f"{d.name}: one fabric", "serve_preflight",
                                                         {"deployment": d.as_args(), "phase": "group"}, where,
                                                         become=False)], where=where)]


def drift_plays(d: Deployment, where: tuple) -> list:
    """The nodes of a multi-node deployment run one kernel, driver and CUDA, none known to break NCCL
    across nodes (modules/drift.py): refused before anything is pulled or started, both versions named."""
    if not d.cluster:
        return []
    return [play(f"{d.name}: versions", d.hosts, [task(f"{d.name}: versions", "drift",
                                                       {"record": False, "multinode": True}, where)], where=where),
            play(f"{d.name}: same versions", d.hosts, [task(f"{d.name}: same versions", "drift",
                                                            {"phase": "compare", "strict": True}, where)], where=where)]


def nccl_plays(d: Deployment, image: str, where: tuple) -> list:
    """Once the image is on every node of a multi-node deployment: which NCCL its vLLM loads there (the
    system's or a pip wheel's, its version; probed once per build, modules/image_nccl.py), and the nodes
    alike (drift's compare): refused before anything starts, every node's NCCL named."""
    if not d.cluster:
        return []
    return [play(f"{d.name}: image NCCL", d.hosts, [task(f"{d.name}: image NCCL", "image_nccl", {"images": [image]},
                                                         where)], where=where),
            play(f"{d.name}: same NCCL", d.hosts, [task(f"{d.name}: same NCCL", "drift",
                                                        {"phase": "compare", "nccl": True, "strict": True}, where)],
                 where=where)]


def down_book(hosts: list[str], deployments: list[str] | None, reason: str = "") -> Playbook:
    where = ("cluster-down", None, None)
    return Playbook("cluster-down", [play("cluster-down", hosts, [
        task("remove sparkprov containers", "serve_absent", {"deployments": deployments, "reason": reason,
                                                             "exclude_roles": ["gateway", "monitor"]},  # gateway|monitor down remove them
             where, become=False),
        # after the containers: their ports close with them, then nothing is left to guard
        task("remove firewall rules", "firewall", {"state": "absent", "deployments": deployments}, where,
             become=True)], where=where)])


def status_book(hosts: list[str], ports: bool = False) -> Playbook:
    """`ports`: also every listening port and who can reach it, read in the same gather (as root:
    `ss` names other users' processes and nftables is root's)."""
    where = ("status", None, None)
    serving = [task("containers", "serve_status", {}, where)]
    if ports:
        serving.append(task("ports", "listening_ports", {}, where, become=True))
    return Playbook("status", [play("serving", hosts, serving),
                               play("deployments", hosts, [task("deployments", "deployment_health", {}, where)])])


class _HostStatus(TypedDict):
    reachable: bool
    error: str | None                 # why it is unreachable, or docker's error
    docker: bool                      # docker answered
    containers: list[dict[str, Any]]  # sparkprov's containers (facts/serving.py ServingStatus)
    host: dict[str, Any]              # memory, swap, GPU sensors, its node guard (facts/guard.py GuardSummary)
    deployments: dict[str, Health]    # each deployment it leads (rank 0)
    problem: str | None               # the status play's failure on it
    remote_calls: int


class HostStatus(_HostStatus, total=False):
    ports: list[dict[str, Any]] | None  # with ports=True: every listening port (serving/ports.py report)


def read_status(inv, targets: list[str], options: RunOptions,
                ports: bool = False) -> tuple[dict[str, HostStatus], int]:
    """One status play: per host what serves, its health and each deployment it leads; the exit
    code. status, monitor, gateway and bench read the fleet through this."""
    import io

    from sparkprov.modules.deployment_health import deployments_led_by, health

    report = Report(io.StringIO(), quiet=True)
    runner = run_book(inv, status_book(targets, ports), targets, options, report)
    st: dict[str, HostStatus] = {}
    for h in targets:
        tally = report.hosts[h]
        unreachable = next((r.msg for r in report.results if r.host == h and r.status == "unreachable"), None)
        failed = next((r.msg for r in report.results if r.host == h and r.status == "failed"), None)
        doc = SERVING_STATUS.read(runner.exports, h) or {}
        st[h] = {"reachable": not tally.unreachable, "error": unreachable or doc.get("error"),
                 "docker": bool(doc.get("access")), "containers": doc.get("containers") or [],
                 "host": doc.get("host") or {},
                 "deployments": {d: health(d, lead, h, runner.exports)
                                 for d, lead in deployments_led_by(h, runner.exports).items()},
                 "problem": failed, "remote_calls": tally.remote_calls}
        if ports:
            st[h]["ports"] = PORTS.read(runner.exports, h)
    # how long each serving on-demand deployment has had no request: the gateway's hook's view, read
    # where the gateway runs (any target)
    mark_idle(st, [(SERVING_STATUS.read(runner.exports, h) or {}).get("ondemand_view") or {} for h in targets])
    return st, report.exit_code()


def nccl_book(hosts: list[str], image: str, **bench: Any) -> Playbook:
    """The hosts' all-reduce is one group: a host that fails a check stops every host (any_errors_fatal),
    so no rank starts to wait for one that never comes (issue 36: the healthy host's rank waited 7
    minutes for a host that lacked the image); a rank that starts alone gives up at its rendezvous
    bound (modules/allreduce.py)."""
    where = ("nccl-check", None, None)
    common = {"hosts": hosts, "image": image, **bench}
    book = Playbook("nccl-check", [
        play("nccl-check: hosts", hosts, [task("fabric and image", "allreduce", {**common, "phase": "prepare"}, where),
                                          # which NCCL the image loads on each host (once per build)
                                          task("image NCCL", "image_nccl", {"images": [image]}, where)]),
        play("nccl-check: same NCCL", hosts, [task("same NCCL", "drift", {"phase": "compare", "nccl": True}, where)]),
        play("nccl-check: all-reduce", hosts, [task("all-reduce", "allreduce", {**common, "phase": "run"}, where)]),
    ])
    return together(book, hosts)


def together(book: Playbook, hosts: list[str]) -> Playbook:
    """Every play of `book` stops on every one of `hosts` when one of them fails (the hosts work as one)."""
    for p in book.plays:
        p.any_errors_fatal, p.stops_together = True, tuple(hosts)
    return book


def bench_book(hosts: list[str], **bench: Any) -> Playbook:
    """Every host reads its containers; the ones that serve the deployment run the client."""
    where = ("bench", None, None)
    return Playbook("bench", [play("bench", hosts, [task(f"bench {bench['deployment']}", "serve_bench", bench,
                                                         where)])])


def gateway_book(gateway_host: str, routes: list[Route], **gateway: Any) -> Playbook:
    """The serving hosts hand over their servers' keys (no_log); with on-demand routes the gateway
    host makes (once) or reads the on-demand key and the hosts of on-demand deployments place it
    where their guard reads it (as root, no_log); then the gateway host converges."""
    where = ("gateway", None, None)
    key_files: dict[str, list[str]] = {}
    for r in routes:
        if r.get("key_file"):
            key_files.setdefault(r["host"], [])
            if r["key_file"] not in key_files[r["host"]]:
                key_files[r["host"]].append(r["key_file"])
    plays = []
    for host, files in key_files.items():
        plays.append(play(f"gateway: keys on {host}", [host],
                          [_no_log(task("server keys", "gateway_keys", {"key_files": files}, where))], where=where))
    nodes = sorted({r["host"] for r in routes if r.get("on_demand")})
    if nodes:
        plays.append(play("gateway: on-demand key", [gateway_host],
                          [_no_log(task("on-demand key", "ondemand_key", {"role": "gateway"}, where))], where=where))
        plays.append(play("gateway: on-demand key on the nodes", nodes,
                          [_no_log(task("on-demand key", "ondemand_key", {"role": "node", "source": gateway_host},
                                        where))], become=True, where=where))
    plays.append(play("gateway", [gateway_host], [task("gateway", "gateway", {**gateway, "routes": routes}, where)],
                      where=where))
    return Playbook("gateway", plays)


def _no_log(t):
    t.no_log = True
    return t


def gateway_down_book(gateway_host: str, key_hosts: list[str] = ()) -> Playbook:
    """The gateway and what its up wrote on its host; the on-demand key on `key_hosts` (root's)."""
    where = ("gateway", None, None)
    plays = [play("gateway", [gateway_host], [task("gateway", "gateway", {"state": "absent"}, where)], where=where)]
    if key_hosts:
        plays.append(play("gateway: on-demand key on the nodes", list(key_hosts),
                          [_no_log(task("on-demand key", "ondemand_key", {"role": "node", "state": "absent"},
                                        where))], become=True, where=where))
    return Playbook("gateway", plays)


def failed_deployments(report: Report, deployments: list[Deployment]) -> list[Deployment]:
    """Deployments with a failed or unreachable task in any of their plays (Play.subject)."""
    bad = {r.subject for r in report.results if r.status in ("failed", "unreachable")}
    return [d for d in deployments if d.name in bad]


def started_anything(report: Report, d: Deployment, since: int = 0) -> bool:
    """Whether this run (from result `since` on) changed a container of the deployment: started one,
    or removed an old rank."""
    return any(r.subject == d.name and r.module == "vllm_container" and r.status == "changed"
               for r in report.results[since:])
