"""cluster-up, cluster-down and status as the commands run them: which deployments, the plays
(sparkprov/plays/serve.py) on the engine, each start recorded and a failed upgrade rolled back
(sparkprov/plays/upgrade.py), and what the CLI prints (sparkprov/cli/cluster.py), as typed results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TypedDict

from sparkprov.data.inventory import Inventory, check_host_files
from sparkprov.data.playbook import Playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import RunOptions
from sparkprov.facts import guard as guard_facts
from sparkprov.modules.allreduce import ALLREDUCE, AllreduceResult
from sparkprov.modules.serve_absent import REMOVED
from sparkprov.facts.guard import GuardSummary
from sparkprov.modules.base import Exports
from sparkprov.modules.vllm_container import CONTAINERS, Container
from sparkprov.modules.vllm_ready import SERVING
from sparkprov.plays import replace as replacing_plays
from sparkprov.plays import upgrade
from sparkprov.outputs import check_output_dir
from sparkprov.plays.book import run_book, serving_options
from sparkprov.plays.gateway import refresh
from sparkprov.plays.guard import guards_of
from sparkprov.plays.serve import (HostStatus, UpOptions, down_book, failed_deployments, nccl_book, playbook_deployments,
                                   read_status, started_anything, up_book)
from sparkprov.serving import node
from sparkprov.serving.bench import GateVerdict
from sparkprov.serving.deployment import Deployment, command_line_deployment, load_serve_playbook


def up_deployments(inv: Inventory, o: UpOptions, playbook: str) -> list[Deployment]:
    """What cluster-up starts: --model's one deployment, else the serve playbook's that --tp,
    --hosts and --deployments select; each checked against the catalog before any host."""
    if o.model:
        deps = [command_line_deployment(inv, o.model, tp=o.tp or 1, pp=o.pp, dp=o.dp, ep=o.ep, executor=o.executor,
                                        hosts=o.hosts, name=o.name, recipe_files=o.recipes)]
    else:
        deps = playbook_deployments(inv, playbook, tp=o.tp, hosts=o.hosts, names=o.deployments, executor=o.executor,
                                    recipe_files=o.recipes)
    return [park(d) for d in deps] if o.park else deps


def park(d: Deployment) -> Deployment:
    """--park: the deployment on demand (parked by this run), checked as a playbook's on_demand: true is."""
    from sparkprov.serving.node import catalog_for

    parked = d.model_copy(update={"on_demand": True})
    problem = parked.on_demand_problem(catalog_for(parked))
    if problem:
        from sparkprov.options import OptionError

        raise OptionError(f"--park: deployment {d.name!r}: {problem[0]}", fix=problem[1])
    return parked


def up_targets(inv: Inventory, deps: list[Deployment], allowed: list[str] | None) -> list[str]:
    """The hosts of the deployments in inventory order, narrowed to `allowed` (--limit), their
    files checked as every other command's hosts are."""
    targets = [h for h in inv.hosts if any(h in d.hosts for d in deps)]
    if allowed is not None:
        targets = [h for h in targets if h in set(allowed)]
    check_host_files(inv, targets)
    return targets


def stage_books(inv: Inventory, deps: list[Deployment], check: bool) -> dict[str, Playbook]:
    """--stage: each deployment's stage plays (the hub listed here first), run before its preflight."""
    from sparkprov.plays.stage import StageOptions, prepare_stage

    return {d.name: prepare_stage(inv, d.hosts, d.model, StageOptions(check=check))[0] for d in deps}


class StartRecord(TypedDict):
    start: int     # its number in the deployment's history
    result: str    # passed | failed


class _DeploymentSummary(TypedDict):
    alias: str
    tp: int
    pp: int
    dp: int
    ep: bool
    executor: str | None          # a cluster's
    hosts: list[str]
    state: str                    # started, already up, unchanged, failed ...
    endpoint: str                 # its OpenAI base URL
    model: str | None             # the name it serves
    api_key_file: str | None      # HOST:PATH
    containers: dict[str, Container | None]  # host -> its container, as vllm_container exported it


class DeploymentSummary(_DeploymentSummary, total=False):
    history: StartRecord          # this run's start of it
    gate: GateVerdict             # --gate bench
    rollback: upgrade.Rollback    # a failed upgrade, rolled back


class _UpSummary(TypedDict):
    check: bool
    seconds: float
    deployments: dict[str, DeploymentSummary]
    remote_calls: dict[str, int]


class UpSummary(_UpSummary, total=False):
    """The JSON document's `cluster` section."""
    upgrade: list[str]            # per failed upgrade: what failed and what serves again
    replaced: list[str]           # --replace: what was removed, and brought back on a failure
    gateway: str | None           # a running gateway's routes, followed (the command adds it)


@dataclass
class UpResult:
    """What cluster-up did: per deployment what the summary shows, and whether what serves changed."""

    check: bool
    seconds: float
    deployments: dict[str, DeploymentSummary]
    remote_calls: dict[str, int]
    upgrade: list[str] = field(default_factory=list)  # per failed upgrade: what failed and what serves again
    replaced: list[str] = field(default_factory=list)  # --replace: what was removed, and brought back on a failure
    serving_changed: bool = False  # a container started, replaced or removed: a running gateway re-routes
    gateway: str | None = None  # what the gateway's refresh did, when one runs and serving changed

    def summary(self) -> UpSummary:
        """The JSON document's `cluster` section."""
        out: UpSummary = {"check": self.check, "seconds": self.seconds, "deployments": self.deployments,
                          "remote_calls": self.remote_calls}
        if self.upgrade:
            out["upgrade"] = self.upgrade
        if self.replaced:
            out["replaced"] = self.replaced
        if self.gateway:
            out["gateway"] = self.gateway
        return out


def cluster_up(inv: Inventory, deps: list[Deployment], o: UpOptions, targets: list[str], report: Report) -> UpResult:
    """The deployments' plays (with --stage their stage plays first), then, not in check mode, each
    start recorded on its rank 0 (with --gate bench, an upgrade benched against its last good start
    first) and a failed one rolled back to its last good start (or removed). With --replace, the
    deployments serving on their hosts are removed first and brought back if the new one fails
    (plays/replace.py). A run that changed what serves re-routes a running gateway."""
    options = serving_options(check=o.check, forks=o.forks, accept_new_host_keys=o.accept_new_host_keys)
    check = o.check
    gate = None
    if o.gate == "bench":
        gate = upgrade.bench_gate(inv, deps, o.gate_ratio, check_output_dir("results", o.results), forks=o.forks,
                                  accept_new_host_keys=o.accept_new_host_keys)
    opts = o
    t0 = time.monotonic()
    # each later run (removals, records, rollbacks) with options of its own, as the first run's
    again = lambda: replace(options)  # noqa: E731
    making_room = replacing_plays.find_replaced(inv, deps, again(), report) if o.replace else None
    if making_room and making_room.replaced:
        opts = replace(opts, replacing=making_room.names_for())
        if not check:
            replacing_plays.remove_replaced(inv, making_room, again(), report)
    book = up_book(deps, opts, staged=stage_books(inv, deps, check) if o.stage else None)
    runner = run_book(inv, book, targets, options, report)
    settled = None if check else upgrade.settle(inv, deps, opts, targets, runner.exports, again, report, gate)
    cleaned = settled.cleaned if settled else []
    bad = {d.name for d in failed_deployments(report, deps)}
    if making_room and not check:
        # what a failed new deployment replaced comes back (unless its own rollback serves again)
        back = replacing_plays.coming_back(making_room, deps, bad, settled.rolled_back if settled else {})
        replacing_plays.bring_back(inv, back, opts, again, report)
    result = UpResult(check=check, seconds=round(time.monotonic() - t0, 2), deployments={},
                      remote_calls={n: t.remote_calls for n, t in report.hosts.items()},
                      serving_changed=not check and (bool(cleaned) or bool(making_room and making_room.replaced) or any(
                          r.module == "vllm_container" and r.status == "changed" for r in report.results)))
    result.replaced = [replacing_plays.describe(r, check) for r in (making_room.replaced if making_room else [])]
    for d in deps:
        changed = started_anything(report, d)
        state = ("failed" + (" (removed again)" if d.name in cleaned else "") if d.name in bad else
                 up_state(d.on_demand, changed, check))
        result.deployments[d.name] = _outcome(inv, d, runner.exports, state)
        if settled:
            add_settled(result, d.name, settled)
    if result.serving_changed:
        result.gateway = refresh(inv, again())  # a running gateway routes to what serves now
    return result


def up_state(on_demand: bool, changed: bool, check: bool) -> str:
    """What cluster-up did with a deployment that did not fail (a parked one: created, left stopped)."""
    if on_demand:
        return ("would park" if changed else "on demand, unchanged") if check else ("parked" if changed else
                                                                                    "on demand, unchanged")
    return ("would start or replace" if changed else "already up, unchanged") if check else \
        ("started" if changed else "already up, unchanged")


def _outcome(inv: Inventory, d: Deployment, exports: Exports, state: str) -> DeploymentSummary:
    head = d.hosts[0]
    serving = SERVING.entry(exports, head, d.name) or {}
    host = inv.hosts[head]
    endpoint = d.endpoint(inv.host_vars(head), "127.0.0.1" if host.connection == "local" else host.address)
    return {"alias": d.model, "tp": d.tp, "pp": d.pp, "dp": d.dp, "ep": d.ep,
            "executor": d.executor if d.cluster else None, "hosts": d.hosts, "state": state,
            "endpoint": f"{endpoint}/v1", "model": serving.get("model"),
            "api_key_file": f"{head}:{serving['api_key_file']}" if serving.get("api_key_file") else None,
            "containers": {h: CONTAINERS.entry(exports, h, d.name) for h in d.hosts}}


def add_settled(result: UpResult, name: str, settled: upgrade.Settled) -> None:
    """A deployment's start record (number, result) and its rollback: what failed, what serves now."""
    out = result.deployments[name]
    rec = settled.recorded.get(name)
    if rec:
        out["history"] = {"start": rec["n"], "result": rec["result"]}
    if name in settled.gated:
        out["gate"] = settled.gated[name]
    r = settled.rolled_back.get(name)
    if r:
        out["rollback"] = r
        out["state"] = (f"failed; rolled back to start #{r['to']}, serving again" if r["serving"]
                        else "failed; rollback failed too (removed again)")
        result.upgrade.append(upgrade.describe(name, r))


@dataclass
class DownResult:
    removed: dict[str, list[str]]  # per host the containers removed
    gateway: str | None            # what the gateway's refresh did, when one runs and something was removed


def cluster_down(inv: Inventory, targets: list[str], names: list[str] | None, options: RunOptions,
                 report: Report) -> DownResult:
    """Remove the containers sparkprov started (only `names`' when given) and their firewall rules,
    then re-route a running gateway when something was removed."""
    runner = run_book(inv, down_book(targets, names), targets, options, report)
    removed = {h: REMOVED.read(runner.exports, h) or [] for h in targets}
    changed = not options.check and any(removed.values())
    return DownResult(removed, refresh(inv, replace(options)) if changed else None)


@dataclass
class FleetStatus:
    hosts: dict[str, HostStatus]      # per host what read_status found
    guards: dict[str, GuardSummary]   # per host its node guard, where one is set up
    code: int  # 0; 2 degraded, a guard acted or is down, a port open to everyone unguarded; 4 unreachable


def fleet_status(inv: Inventory, targets: list[str], options: RunOptions, *, ports: bool) -> FleetStatus:
    """One status play and the exit code of everything it found."""
    st, code = read_status(inv, targets, options, ports=ports)
    if ports and code == 0 and any(r["flag"] for h in st.values() for r in h.get("ports") or []):
        code = 2  # a port open to everyone that nothing guards
    guards = guards_of(st)
    return FleetStatus(st, guards, guard_facts.exit_code(guards, code))  # 2: a guard acted (its action stands) or is down


def serving_image(inv: Inventory, playbook: str) -> str:
    """The serve playbook's first multi-node deployment's image (else its first deployment's), as
    cluster-up would start it."""
    deps = load_serve_playbook(playbook, inv).deployments
    return node.node_image(next((d for d in deps if d.cluster), None) or deps[0]).requested


@dataclass
class NcclImage:
    image: str
    why: str  # where it came from, as nccl-check says it


def nccl_image(inv: Inventory, targets: list[str], options: RunOptions, *, image: str | None,
               playbook: str | None, default_playbook: str) -> NcclImage:
    """The image nccl-check measures in: --image; else --playbook's; else one the hosts hold because a
    deployment runs it on every one of them (one status read per host); else the serve playbook's
    (its image play must find it on every host, or nccl-check stops there, naming the fix)."""
    if image:
        return NcclImage(image, "--image")
    if playbook:
        return NcclImage(serving_image(inv, playbook), f"the first deployment of {playbook}")
    st, _ = read_status(inv, targets, replace(options, check=False))
    found = node.running_image({h: st[h]["containers"] for h in targets}, targets)
    if found:
        return NcclImage(found[0], f"deployment {found[1]} runs it on {', '.join(targets)}")
    return NcclImage(serving_image(inv, default_playbook),
                     f"no deployment runs on every one of {', '.join(targets)}: the first deployment of "
                     f"{default_playbook}")


def nccl_check(inv: Inventory, targets: list[str], image: str, options: RunOptions, report: Report, *,
               backend: str, threshold: float, max_bytes: int, iters: int) -> AllreduceResult | None:
    """All-reduce bus bandwidth across `targets` over the fabric, in `image`: rank 0's result."""
    runner = run_book(inv, nccl_book(targets, image, backend=backend, threshold=threshold,
                                     max_bytes=str(max_bytes), iters=iters), targets, options, report)
    return ALLREDUCE.read(runner.exports, targets[0])
