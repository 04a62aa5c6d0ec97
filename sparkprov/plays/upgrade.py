"""Upgrades that cannot break a working deployment (issue 26): after cluster-up's plays, each
deployment this run started is recorded in its history on rank 0 (modules/deployment_history.py);
one whose start failed is rolled back to its last good start, on every node, and proven to serve
again (its smoke test), else removed as before.

    NAME: history nodes   every node  what it runs: container, recipe hash, image ID and digest
    NAME: history         rank 0      the start appended to the history, with its smoke result

A deployment that started nothing in this run (already up and unchanged, or refused before any
container) is not recorded: a run that changes nothing stays one round trip per host.

With `--gate bench` an upgrade must also keep up: before anything starts, each deployment's last
good start and the stored bench run of it (its image and recipe, serving/bench.py gate_baseline)
are found, or the run is refused; after a start that replaced a running one passes its smoke
test, the bench runs again with that run's parameters, and a start below the gate's ratio of its
output tok/s is recorded as failed and rolled back like a start that failed its smoke test.
"""

from __future__ import annotations

import os
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypedDict

from sparkprov.data.playbook import Playbook
from sparkprov.engine.report import Report, TaskResult
from sparkprov.engine.run import RunOptions
from sparkprov.modules.base import Exports
from sparkprov.modules.deployment_history import HISTORY, HistoryRead
from sparkprov.modules.vllm_container import REPLACED
from sparkprov.node.guard import JOURNAL_PATH
from sparkprov.plays.book import play, run_book, task
from sparkprov.plays.serve import UpOptions, down_book, failed_deployments, started_anything, up_book
from sparkprov.serving import bench as sb
from sparkprov.serving import history
from sparkprov.serving.deployment import Deployment


def recorded(d: Deployment) -> Deployment:
    """The deployment as its history records it: the recipe files as absolute paths (a rollback may
    run from another directory)."""
    return d.model_copy(update={"recipe_files": [os.path.abspath(f) for f in d.recipe_files]})


def history_book(d: Deployment, *, kind: str = history.START, rollback_of: int | None = None,
                 failure: str | None = None, when: str | None = None, bench: sb.GateVerdict | None = None) -> Playbook:
    where = ("history", None, None)
    args: dict[str, Any] = {"deployment": recorded(d).as_args(), "kind": kind,
                            "rollback_of": rollback_of, "bench": bench,
                            "failure": failure[:4000] if failure else None,
                            "time": when or _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime())}
    book = Playbook("history", [
        play(f"{d.name}: history nodes", d.hosts, [task(f"{d.name}: history node", "deployment_history",
                                                        {**args, "phase": "node"}, where)], where=where),
        play(f"{d.name}: history", d.hosts[:1], [task(f"{d.name}: history", "deployment_history",
                                                      {**args, "phase": "record"}, where)], where=where)])
    for p in book.plays:
        p.subject = d.name
    return book


def read_history(runner, d: Deployment) -> HistoryRead | None:
    """What the history play exported on rank 0: its records and this start's (None: it did not record)."""
    return HISTORY.entry(runner.exports, d.hosts[0], d.name)


def failure_of(report: Report, d: Deployment, since: int = 0) -> str | None:
    """The first failure of a deployment's plays (from result `since` on), as the run reported it."""
    for r in report.results[since:]:
        if r.subject == d.name and r.status in ("failed", "unreachable"):
            return f"{r.host}: {r.msg}" if not r.msg.startswith(r.host) else r.msg
    return None


def deployment_from(spec: history.Spec) -> Deployment:
    """A recorded spec as a deployment cluster-up starts again (a value a record lacks or holds as
    null: the default)."""
    from pydantic import ValidationError

    from sparkprov.errors import InputError
    from sparkprov.yamlpos import validation_error, Positions

    known = {k: v for k, v in spec.items() if k in Deployment.model_fields and v is not None}
    try:
        return Deployment.model_validate({**known, "where": ("history", None, None)})
    except ValidationError as exc:  # a record edited by hand, or written by another sparkprov
        said = validation_error(exc, Positions("history"), model=Deployment)
        raise InputError(f"the recorded spec of {spec.get('name')!r} is no deployment: {said.message}",
                         fix="invoke history shows the records; start it with cluster-up instead") from None


class Baseline(TypedDict):
    start: int           # the last good start
    run: sb.BenchRun     # its stored bench run


@dataclass
class BenchGate:
    """cluster-up --gate bench: what each deployment's upgrade is measured against."""
    ratio: float
    results: Path                                                 # where bench runs are stored
    baselines: dict[str, Baseline] = field(default_factory=dict)  # deployment name -> its baseline
    ungated: dict[str, str] = field(default_factory=dict)         # deployment name -> why nothing gates it


def last_good_starts(inv, heads: dict[str, str], *, what: str, forks: int,
                     accept_new_host_keys: bool) -> dict[str, history.Record | None]:
    """Each deployment's last good start (None: none passed), read from its rank 0's history
    (`heads`: deployment -> host), one read per host. A history that cannot be read is refused,
    naming the option that needs it (`what`)."""
    from sparkprov.engine.gather import gather_facts
    from sparkprov.errors import SparkprovError
    from sparkprov.facts.history import HistoryFile

    got = gather_facts(inv, sorted(set(heads.values())), {n: HistoryFile(history.history_file(n)) for n in heads},
                       forks=forks, accept_new_host_keys=accept_new_host_keys)
    out = {}
    for name, host in heads.items():
        r = got[host]
        if name not in r["facts"]:
            why = r["errors"].get(name) or next(iter(r["errors"].values()), "unreachable")
            raise SparkprovError(f"{what}: the history of {name} on {host} could not be read: {why}",
                                 fix=f"reach the host, or leave out {what}")
        out[name] = history.last_good(history.parse(r["facts"][name]["text"]))
    return out


def bench_gate(inv, deps: list[Deployment], ratio: float, results: Path, *, forks: int,
               accept_new_host_keys: bool) -> BenchGate:
    """Before anything starts: each deployment's last good start (its rank 0's history, one read per
    rank 0) and the stored run of it. A deployment never started, or asked for as it last passed, has
    nothing to gate; one whose last good start has no stored run is refused here, nothing started."""
    from sparkprov.errors import SparkprovError
    from sparkprov.modules.deployment_history import spec_of

    out = BenchGate(ratio, results)
    goods = last_good_starts(inv, {d.name: d.hosts[0] for d in deps}, what="--gate bench", forks=forks,
                             accept_new_host_keys=accept_new_host_keys)
    for d in deps:
        good = goods[d.name]
        if good is None:
            out.ungated[d.name] = "no start of it passed before: nothing to measure against"
            continue
        if history.comparable_spec(good.get("spec") or {}) == history.comparable_spec(spec_of(recorded(d))):
            out.ungated[d.name] = f"its spec is start #{good['n']}'s, the last good: not an upgrade"
            continue
        rank0 = (good.get("nodes") or {}).get((good.get("spec") or {}).get("hosts", [d.hosts[0]])[0]) or {}
        runs, skipped = sb.stored_runs(results, d.name)
        baseline = sb.gate_baseline(runs, rank0)
        if baseline is None:
            unread = f"; {len(skipped)} stored file(s) skipped, the first {skipped[0].line()}" if skipped else ""
            raise SparkprovError(
                f"--gate bench: no stored bench run of {d.name}'s last good start #{good['n']} (image "
                f"{(rank0.get('image_id') or '?')[7:19]}, recipe {rank0.get('recipe_hash') or '?'}) under {results}"
                + unread, fix=f"run invoke bench {d.name} before the upgrade (the gate reruns its parameters), "
                              "or leave out --gate bench")
        out.baselines[d.name] = {"start": good["n"], "run": baseline}
    return out


def run_gate(inv, d: Deployment, gate: BenchGate, live: list[str], options: Callable[[], RunOptions],
             report: Report) -> sb.GateVerdict:
    """The bench at the baseline's parameters on the new start, judged against it (serving/bench.py
    gate); a gate that fails is a failed task of the deployment in the report (exit 2)."""
    from sparkprov.plays.bench import run_bench

    base = gate.baselines[d.name]
    found = run_bench(inv, live, sb.gate_args(d.name, base["run"]), options(), report, results=gate.results)
    new = next((run for run in found.runs if run["host"] == d.hosts[0]), None)
    judged: sb.GateVerdict
    if new is None:
        judged = {"passed": False, "line": "bench gate: the bench of the new start brought back no run"}
    else:
        judged = {**sb.gate(new, base["run"], gate.ratio), "run": new["path"]}
    judged["against_start"] = base["start"]
    if not judged["passed"]:
        report.record(TaskResult(d.hosts[0], f"{d.name}: bench gate", f"{d.name}: bench gate", "serve_bench",
                                 "failed", judged["line"], subject=d.name))
    return judged


class Rollback(TypedDict):
    """A start rolled back to a recorded good one (rollback)."""
    to: int                          # the good start that runs again
    failure: str | None              # what failed in the start it replaces
    serving: bool                    # it runs again and passed its smoke test
    rollback_failure: str | None     # what failed in the rollback itself
    record: int | None               # the rollback's own start in the history
    seconds: float
    notes: list[str]                 # nodes that run another build than the good start did
    digests: dict[str, str | None]   # node -> the image it runs (registry digest, else image ID)


@dataclass
class Settled:
    cleaned: list[str] = field(default_factory=list)                          # removed again, as before (no last good)
    rolled_back: dict[str, Rollback] = field(default_factory=dict)            # name -> what failed, what serves now
    recorded: dict[str, history.Record] = field(default_factory=dict)         # name -> the record of its start
    gated: dict[str, sb.GateVerdict] = field(default_factory=dict)            # name -> its bench gate (--gate bench)


def settle(inv, deps: list[Deployment], opts: UpOptions, targets: list[str], exports: Exports,
           options: Callable[[], RunOptions], report: Report, gate: BenchGate | None = None) -> Settled:
    """After cluster-up's plays (not in check mode; `exports`: theirs): record each start; roll a
    failed upgrade back (failed: a play of it failed, or with `gate` its bench fell below the gate):
    what to do is after_start's."""
    out = Settled()
    failed = {d.name for d in failed_deployments(report, deps)}
    for d in deps:
        if not started_anything(report, d):
            continue
        live = [h for h in d.hosts if h in targets and not report.hosts[h].unreachable]
        # a park started nothing: nothing to gate or roll back to (a failed one is removed)
        upgraded = replaced_running(exports, d) and not d.on_demand
        failure = failure_of(report, d) if d.name in failed else None
        gated = None
        if failure is None and gate is not None and d.name in gate.baselines and upgraded:
            gated = out.gated[d.name] = run_gate(inv, d, gate, live, options, report)
        failure = start_failure(failure, gated)
        hist: HistoryRead | None = None
        if d.hosts[0] in live:
            hist = read_history(run_book(inv, history_book(d, kind=history.PARK if d.on_demand else history.START,
                                                           failure=failure, bench=gated), live, options(), report), d)
            if hist is not None:
                out.recorded[d.name] = hist["record"]
        step = after_start(failure, upgraded, hist["records"] if hist else [],
                           hist["record"].get("spec") if hist else None, live)
        if step.rollback_to is not None:
            result = rollback(inv, d, step.rollback_to, opts, live, options, report, failure=failure)
            out.rolled_back[d.name] = result
            if result["serving"]:
                continue
        if step.failure is None:
            continue
        # nothing to go back to (or going back failed): remove what this run started, so that
        # nothing half-up holds the GPUs
        run_book(inv, down_book(live, [d.name], reason="bring-up failed"), live, options(), report)
        out.cleaned.append(d.name)
    return out


def replaced_running(exports: Exports, d: Deployment) -> bool:
    """Whether this run's start replaced a container of the deployment that ran before it on one of
    its nodes (an upgrade), rather than starting one where none was: what vllm_container's start
    exported once it ran (REPLACED)."""
    return any(started.get(d.name) for started in REPLACED.by_host(exports, d.hosts).values())


def start_failure(play_failure: str | None, gated: sb.GateVerdict | None) -> str | None:
    """Why a start failed: its plays' first failure, else the bench gate's verdict (run_gate's) when it
    fell below; None: it serves and keeps up."""
    if play_failure is not None:
        return play_failure
    if gated is not None and not gated["passed"]:
        return gated["line"]
    return None


@dataclass
class AfterStart:
    """What settle does with a start: nothing (it passed), go back to a recorded good start, or
    remove what it started (a rollback that fails is removed too)."""
    failure: str | None
    rollback_to: history.Record | None = None


def after_start(failure: str | None, upgraded: bool, records: list[history.Record], spec: history.Spec | None,
                live: list[str]) -> AfterStart:
    """`records`: the deployment's history with this start recorded last (its `spec`). An upgrade
    (this run replaced what ran) that failed goes back to the last good start of another spec, when
    every host of that start can be reached; a first start, a failed start of the last good spec
    itself, or one whose good start's hosts are out of reach, is removed."""
    if failure is None:
        return AfterStart(None)
    # a first start (nothing of it ran before this run) has nothing to go back to, whatever an
    # earlier deployment of the same name left in the history
    good = history.rollback_target(records, spec) if upgraded else None
    if good is not None and set(good["spec"]["hosts"]) <= set(live):
        return AfterStart(failure, rollback_to=good)
    return AfterStart(failure)


def rollback(inv, failed: Deployment, good: history.Record, opts: UpOptions, live: list[str],
             options: Callable[[], RunOptions], report: Report, *, failure: str | None = None,
             remove_first: bool = True) -> Rollback:
    """Start a recorded good start again on every node, wait for its smoke test, record it.
    remove_first=False (what runs has the good start's spec: history.runs_already): cluster-up's
    plays alone; when they change nothing, nothing is recorded (`record` None)."""
    back = deployment_from(good["spec"])
    t0 = _time.monotonic()
    # the failed start's containers go first, on every node: a rank of it still running while the good
    # start's rank 0 comes up joins that rank 0's rendezvous (the supervisor rejoins a new rank 0), and
    # its replacement a moment later ends the new group (measured on the lab); and unified memory holds
    # one engine's weights at a time
    if remove_first:
        gone = sorted(set(failed.hosts) & set(live))
        run_book(inv, down_book(gone, [failed.name], reason="rolled back"), gone, options(), report)
    since = len(report.results)
    run_book(inv, up_book([back], opts), back.hosts, options(), report)
    again = failure_of(report, back, since)
    if not remove_first and again is None and not started_anything(report, back, since):
        return {"to": good["n"], "failure": failure, "serving": True, "rollback_failure": None, "record": None,
                "seconds": round(_time.monotonic() - t0, 1), "notes": [], "digests": {}}
    hist = read_history(run_book(inv, history_book(back, kind=history.ROLLBACK, rollback_of=good["n"],
                                                   failure=again), back.hosts, options(), report), back)
    rec: history.Record = hist["record"] if hist is not None else {}
    return {"to": good["n"], "failure": failure, "serving": again is None and rec.get("result") == history.PASSED,
            "rollback_failure": again, "record": rec.get("n"), "seconds": round(_time.monotonic() - t0, 1),
            "notes": history.digest_changes(good, rec.get("nodes") or {}),
            "digests": {h: n.get("digest") or n.get("image_id") for h, n in (rec.get("nodes") or {}).items()}}


def describe(name: str, r: Rollback) -> str:
    """One line: what failed and what serves now."""
    if r["serving"]:
        line = (f"{name}: the new start failed ({r['failure']}); rolled back to start #{r['to']} on every node in "
                f"{r['seconds']:.0f}s, which passed its smoke test again (recorded as #{r['record']})")
    else:
        line = (f"{name}: the new start failed ({r['failure']}); rolling back to start #{r['to']} failed too "
                f"({r['rollback_failure'] or 'its smoke test'}): removed")
    return line + "".join(f"; {n}" for n in r["notes"])



@dataclass
class DeploymentHistory:
    name: str
    host: str  # its rank 0: the host whose history of it is the newest
    records: list[history.Record]
    skipped: list[str] = field(default_factory=list)  # lines of its file that are no record, and why
    # its on-demand starts and stops by the gateway, as every target's guard journaled them, oldest first
    on_demand: list[history.OnDemandEvent] = field(default_factory=list)


def find_history(inv, targets: list[str], name: str, *, forks: int, accept_new_host_keys: bool,
                 journal: str = JOURNAL_PATH) -> DeploymentHistory:
    """A deployment's recorded starts, read on every target (one gather): the host whose history
    of it is the newest is its rank 0; and its on-demand starts and stops from each target's guard
    journal (`journal`, the same gather)."""
    from sparkprov.engine.gather import gather_facts
    from sparkprov.errors import SparkprovError
    from sparkprov.facts.history import HistoryFile, OnDemandJournal

    got = gather_facts(inv, targets, {"history": HistoryFile(history.history_file(name)),
                                      "ondemand": OnDemandJournal(journal)}, forks=forks,
                       accept_new_host_keys=accept_new_host_keys)
    on_demand = sorted((e for h, r in got.items() if "ondemand" in r["facts"]
                        for e in history.on_demand_events(r["facts"]["ondemand"]["text"], name, h)),
                       key=lambda e: (e["epoch"], e["host"]))
    read = {h: history.read(r["facts"]["history"]["text"]) for h, r in got.items()
            if r["ok"] and r["facts"]["history"]["exists"]}
    found = {h: recs for h, (recs, _) in read.items() if recs}
    if not found:
        unread = [f"{h} ({next(iter(r['errors'].values()), 'unreadable')})" for h, r in got.items() if not r["ok"]]
        raise SparkprovError(f"no history of deployment {name!r} on {', '.join(targets)}"
                             + (f"; not read: {', '.join(unread)}" if unread else ""),
                             fix="check the name (invoke status lists deployments); a start is recorded on its rank 0 "
                                 "from this version of sparkprov on")
    head = max(found, key=lambda h: (found[h][-1].get("time") or "", len(found[h])))
    return DeploymentHistory(name, head, found[head], read[head][1], on_demand)


def rollback_target(hist: DeploymentHistory, to: int | None) -> history.Record:
    """The start `invoke rollback` goes back to: start #`to` (it must have passed its smoke test),
    else the last good one with another spec than the newest."""
    from sparkprov.errors import InputError

    name, records = hist.name, hist.records
    if to is not None:
        good = history.find(records, to)
        if good is None or good.get("result") != history.PASSED:
            ok = ", ".join(f"#{r['n']}" for r in records if r.get("result") == history.PASSED) or "none"
            raise InputError(f"--to {to}: start #{to} of {name} " + ("is not recorded" if good is None else
                                                                     "did not pass its smoke test"),
                             fix=f"give a start that passed ({ok}): invoke history {name}")
        return good
    newest = records[-1]
    good = history.last_good(records, unlike=newest.get("spec"))
    if good is None:
        raise InputError(f"{name}: no start that passed with another spec than start #{newest['n']}",
                         fix=f"invoke history {name}, then --to N")
    return good


@dataclass
class RolledBack:
    to: int  # the start that runs again
    result: Rollback
    message: str  # one line: what runs now, or that it failed and was removed

    @property
    def serving(self) -> bool:
        return bool(self.result["serving"])


def rollback_deployment(inv, hist: DeploymentHistory, good: history.Record, opts: UpOptions,
                        options: Callable[[], RunOptions], report: Report) -> RolledBack:
    """`invoke rollback`: the newest start's containers removed, `good` started on every node and
    smoke-tested; if it fails too, removed (nothing half-up holds the GPUs). When the newest start
    passed with good's spec, nothing is removed first: what already runs stays (changed=0)."""
    name = hist.name
    current = deployment_from(hist.records[-1]["spec"])
    live = sorted(set(current.hosts) | set(good["spec"]["hosts"]))
    result = rollback(inv, current, good, opts, live, options, report,
                      remove_first=not history.runs_already(hist.records, good))
    if not result["serving"]:
        back = deployment_from(good["spec"])
        run_book(inv, down_book(back.hosts, [name], reason="rollback failed"), back.hosts, options(), report)
    if result["serving"] and result["record"] is None:
        line = f"{name}: start #{good['n']} already runs on every node: nothing changed"
    elif result["serving"]:
        line = (f"{name}: start #{good['n']} runs again on every node and passed its smoke test (recorded as "
                f"#{result['record']}, {result['seconds']:.0f}s)")
    else:
        line = f"{name}: start #{good['n']} failed again ({result['rollback_failure'] or 'its smoke test'}): removed"
    line += "".join(f"; {n}" for n in result["notes"])
    return RolledBack(good["n"], result, line)
