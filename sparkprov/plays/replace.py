"""cluster-up --replace (issue 26, model switching): put another model on Sparks that serve one.

A Spark's unified memory holds one engine's weights and KV cache (recipes size an engine at 0.7-0.9
of it), so the deployments already serving on the new deployment's hosts are what it replaces:

1. before anything changes: every other sparkprov deployment with a container on those hosts
   (one status read of every host of the inventory: a deployment may span hosts outside the new
   one's) and its last good start (its rank 0's history). One that has none could not be brought
   back: the run is refused, nothing changed (fix: cluster-down it first);
2. they are removed on every host they run on (a cluster loses all its ranks with one);
3. the new deployment starts through cluster-up's plays (the preflight counts the replaced
   deployments' port and memory as free, so --check says what the run would do); its page cache
   drop and smoke test as always;
4. if it fails, it is removed (or rolled back to its own last good start) as any failed start, and
   each replaced deployment's last good start is started again on its own hosts, smoke-tested and
   recorded in its history as a rollback.

In check mode steps 2 and 4 are said, not done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from sparkprov.data.inventory import Inventory
from sparkprov.engine.report import Report
from sparkprov.engine.run import RunOptions
from sparkprov.errors import SparkprovError
from sparkprov.plays.book import run_book
from sparkprov.node import ondemand
from sparkprov.plays.serve import UpOptions, down_book, read_status
from sparkprov.plays.upgrade import Rollback, last_good_starts, rollback
from sparkprov.serving.history import Record
from sparkprov.serving.deployment import Deployment


@dataclass
class Replaced:
    name: str
    hosts: list[str]                     # where its containers run
    good: Record                  # its last good start: what comes back if the new one fails
    for_: str                     # the deployment it makes room for
    back: Rollback | None = None  # after a failed new start: what bringing it back did


@dataclass
class Replacing:
    replaced: list[Replaced] = field(default_factory=list)

    def names_for(self) -> dict[str, list[str]]:
        """deployment -> the deployments removed before it starts (UpOptions.replacing)."""
        out: dict[str, list[str]] = {}
        for r in self.replaced:
            out.setdefault(r.for_, []).append(r.name)
        return out


def serving_on(containers: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, set[str]], dict[str, str]]:
    """From the status play's containers per host: each deployment's hosts (gateway and Prometheus are
    none), and the host of its rank 0 (or single server)."""
    runs: dict[str, set[str]] = {}
    heads: dict[str, str] = {}
    for h, cs in containers.items():
        for c in cs:
            labels = c.get("labels") or {}
            name = labels.get("sparkprov.deployment")
            if not name or labels.get("sparkprov.role") in ("gateway", "monitor"):
                continue
            if ondemand.is_on_demand(c):  # the gateway's to start and stop (docs/on-demand.md), never replaced
                continue
            runs.setdefault(name, set()).add(h)
            if str(labels.get("sparkprov.rank") or "0") == "0":
                heads[name] = h
    return runs, heads


def in_the_way(runs: dict[str, set[str]], deps: list[Deployment]) -> list[tuple[str, Deployment]]:
    """Each deployment (other than the new ones) serving on a new one's hosts, with the first new one
    it is in the way of."""
    new = {d.name for d in deps}
    wanted: list[tuple[str, Deployment]] = []
    for d in deps:
        for name, hosts in sorted(runs.items()):
            if name not in new and hosts & set(d.hosts) and name not in {n for n, _ in wanted}:
                wanted.append((name, d))
    return wanted


def find_replaced(inv: Inventory, deps: list[Deployment], options: RunOptions, report: Report) -> Replacing:
    """Step 1: the deployments the new ones replace, each with its hosts and last good start."""
    every = list(inv.hosts)
    st, _ = read_status(inv, every, options)
    unread = [h for h in every if not st[h]["reachable"]]
    runs, heads = serving_on({h: st[h]["containers"] for h in every})
    out = Replacing()
    for d in deps:
        if any(h in unread for h in d.hosts):
            raise SparkprovError(f"--replace: {', '.join(h for h in d.hosts if h in unread)} could not be read, so "
                                 f"what serves there is not known", fix="reach the host, or leave out --replace")
    wanted = in_the_way(runs, deps)
    if not wanted:
        return out
    head_of = {n: heads.get(n, sorted(runs[n])[0]) for n, _ in wanted}
    goods = last_good_starts(inv, head_of, what="--replace", forks=options.forks,
                             accept_new_host_keys=options.accept_new_host_keys)
    for name, d in wanted:
        good = goods[name]
        if good is None:
            raise SparkprovError(
                f"--replace: {name} serves on {', '.join(sorted(runs[name]))} but has no recorded start that passed "
                f"(on {head_of[name]}), so it could not be brought back if {d.name} fails",
                fix=f"invoke cluster-down --deployments {name} first, or leave out --replace")
        hosts = sorted(runs[name] | set((good.get("spec") or {}).get("hosts") or []))
        out.replaced.append(Replaced(name, hosts, good, d.name))
    for r in out.replaced:
        report.note(r.hosts[0], f"--replace: {r.name} (on {', '.join(r.hosts)}; last good start #{r.good['n']}) "
                                f"{'would be' if options.check else 'is'} removed for {r.for_}")
    return out


def remove_replaced(inv: Inventory, replacing: Replacing, options: RunOptions, report: Report) -> None:
    """Step 2: each replaced deployment removed on every host it runs on."""
    for r in replacing.replaced:
        run_book(inv, down_book(r.hosts, [r.name], reason=f"replaced by {r.for_}"), r.hosts, options, report)


def coming_back(replacing: Replacing, deps: list[Deployment], failed: set[str],
                rolled_back: dict[str, dict[str, Any]]) -> list[tuple[Replaced, Deployment]]:
    """What comes back: each replaced deployment whose new one failed and does not serve again through
    its own rollback (to its own last good start), with that new one."""
    gone = {d.name: d for d in deps if d.name in failed and not (rolled_back.get(d.name) or {}).get("serving")}
    return [(r, gone[r.for_]) for r in replacing.replaced if r.for_ in gone]


def bring_back(inv: Inventory, back: list[tuple[Replaced, Deployment]], opts: UpOptions,
               options: Callable[[], RunOptions], report: Report) -> None:
    """Step 4: each of coming_back's started again from its last good start (the failed new one's
    containers removed first: unified memory holds one engine)."""
    for r, failed in back:
        live = sorted(set(r.hosts) | set(failed.hosts))
        r.back = rollback(inv, failed, r.good, opts, live, options, report,
                          failure=f"{r.for_} failed after replacing it")


def describe(r: Replaced, check: bool = False) -> str:
    if r.back is None:
        return (f"{r.name}: {'would be ' if check else ''}removed for {r.for_} (its last good start "
                f"#{r.good['n']} comes back if {r.for_} fails)")
    if r.back["serving"]:
        return (f"{r.name}: {r.for_} failed, so {r.name}'s start #{r.good['n']} runs again on "
                f"{', '.join(r.hosts)} and passed its smoke test (recorded as #{r.back['record']}, "
                f"{r.back['seconds']:.0f}s)")
    return (f"{r.name}: {r.for_} failed, and bringing {r.name} back failed too "
            f"({r.back['rollback_failure'] or 'its smoke test'})")
