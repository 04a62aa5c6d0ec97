"""A deployment's history: one JSON line per start, kept on its rank 0 node (issue 26).

Each start records what ran, per node (the image reference, its ID and registry digest as that
node's docker reports them, the container and its recipe hash), the model repo and the commit
rank 0's store resolves, the spec cluster-up started it from (model, hosts, layout, executor,
overrides, image override, recipe files: enough to start it again), the smoke test's result and, with
cluster-up --gate bench, the bench gate's run against the last good start's.
The last start that passed (its smoke test, and the gate when one ran) is "last good": what a
failed upgrade rolls back to.

Pure functions: the deployment_history module builds and appends records, the commands read them.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypedDict

from sparkprov.imageref import ImageRef

from pydantic import ValidationError

from sparkprov.inputfiles import Stored, shape_problem

HISTORY_DIR = "~/.local/state/sparkprov/deployments"  # on rank 0, the login user's: DIR/NAME/history.jsonl
PASSED, FAILED, PARKED = "passed", "failed", "parked"
# a park (cluster-up --park, on_demand: true): its containers created and left stopped, no smoke test
START, ROLLBACK, PARK = "start", "rollback", "park"
_COMMIT = re.compile(r"[0-9a-f]{40}")

Spec = dict[str, Any]  # a deployment as cluster-up was asked for it (modules/deployment_history.py spec_of)


class NodeEntry(TypedDict, total=False):
    """What one node ran for a start (node_entry; a node the history play could not read: its host and
    status "unread" only)."""
    host: str
    container: str | None
    container_id: str | None
    image: str | None
    image_id: str | None
    digest: str | None       # REPO@sha256:... where the image came from a registry
    recipe_hash: str | None
    status: str


class ModelCommit(TypedDict):
    alias: str
    repo: str | None
    revision: str | None
    commit: str | None       # what rank 0's store resolved the revision to


class Record(TypedDict, total=False):
    """One start of a deployment, a JSON line of its history on rank 0 (new_record; a record written
    by an older sparkprov may lack keys: read with .get)."""
    n: int
    time: str
    kind: str                # START | ROLLBACK | PARK
    rollback_of: int
    result: str              # PASSED | FAILED | PARKED
    problem: str | None
    spec: Spec
    model: ModelCommit
    nodes: dict[str, NodeEntry]
    smoke: dict[str, Any] | None   # rank 0's smoke answer: prompt, content, status, error
    bench: dict[str, Any]          # its bench gate (serving/bench.py GateVerdict)


def history_file(deployment: str) -> str:
    return f"{HISTORY_DIR}/{deployment}/history.jsonl"


# The shape a record read back must have (a line that does not fit is skipped and named): the
# TypedDicts above, as pydantic models of the file.
class _NodeShape(Stored):
    host: str | None = None
    container: str | None = None
    container_id: str | None = None
    image: str | None = None
    image_id: str | None = None
    digest: str | None = None
    recipe_hash: str | None = None
    status: str | None = None


class _SpecShape(Stored):
    """The deployment's spec (serving/deployment.py Deployment as spec_of dumps it): what the
    history's readers use of it typed; a rollback validates the whole as a Deployment again."""

    name: str | None = None
    model: str | None = None
    hosts: list[str] = []
    tp: int = 1
    pp: int = 1
    dp: int = 1
    executor: str | None = None
    overrides: dict[str, Any] = {}
    recipe_files: list[str] = []


class _ModelShape(Stored):
    repo: str | None = None
    revision: str | None = None
    commit: str | None = None


class _RecordShape(Stored):
    n: int
    time: str | None = None
    kind: str | None = None
    rollback_of: int | None = None
    result: str | None = None
    problem: str | None = None
    spec: _SpecShape = _SpecShape()
    model: _ModelShape | None = None
    nodes: dict[str, _NodeShape] = {}
    smoke: dict[str, Any] | None = None
    bench: dict[str, Any] | None = None


def parse(text: str) -> list[Record]:
    """The records of a history file, oldest first; a line that is not a record (a write cut
    short, or one that does not fit Record) is skipped, the ones after it still count."""
    return read(text)[0]


def read(text: str) -> tuple[list[Record], list[str]]:
    """The records of a history file, oldest first, and a line for each one skipped ("line 4:
    nodes should be a JSON object"); a first line cut by the reader's byte bound is no record."""
    out, skipped = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            _RecordShape.model_validate(doc)
        except RecursionError:
            skipped.append(f"line {n}: nested too deeply")
        except ValidationError as exc:
            skipped.append(f"line {n}: {shape_problem(exc)}")
        except ValueError:
            skipped.append(f"line {n}: not JSON (a write cut short)")
        else:
            out.append(doc)
    return out, skipped


def json_line(record: Record) -> str:
    """A record as one line of the history file."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def node_entry(host: str, containers: list[dict[str, Any]], digests: dict[str, list[str]]) -> NodeEntry:
    """What one node runs for the deployment: its container (ID, image, recipe hash) and the image's
    registry digest (from `containers`: the deployment's containers as DeploymentImages read them)."""
    from sparkprov.serving.bench import pick_digest

    c = containers[0] if containers else None
    if c is None:
        return {"host": host, "container": None, "container_id": None, "image": None, "image_id": None,
                "digest": None, "recipe_hash": None, "status": "absent"}
    return {"host": host, "container": c["name"], "container_id": c["id"], "image": c["image"],
            "image_id": c["image_id"], "digest": pick_digest(c["image"], digests.get(c["image_id"]) or []),
            "recipe_hash": c["recipe_hash"], "status": c["status"]}


def model_commit(revision: str, refs: dict[str, str], repo_dir: str) -> str | None:
    """The commit a revision names in the store: the revision itself when it is one, else its ref."""
    if _COMMIT.fullmatch(revision):
        return revision
    commit = (refs.get(f"{repo_dir}/refs/{revision}") or "").strip()
    return commit if _COMMIT.fullmatch(commit) else None


def same_start(record: Record, nodes: dict[str, NodeEntry]) -> bool:
    """Whether a record is of the start these nodes run now (the same container on every node)."""
    ids = {h: n.get("container_id") for h, n in nodes.items()}
    return any(ids.values()) and {h: n.get("container_id") for h, n in (record.get("nodes") or {}).items()} == ids


def new_record(records: list[Record], *, time: str, kind: str, rollback_of: int | None, spec: Spec,
               nodes: dict[str, NodeEntry], model: ModelCommit, smoke: dict[str, Any] | None,
               failure: str | None, smoke_check, bench: dict[str, Any] | None = None) -> Record:
    """The record of a start. It passed when the start reported no failure and its smoke answer,
    recorded on rank 0 for the container running now, passes the recipe's check (`smoke_check`:
    the answer's problems, as cluster-up's ready step judges them)."""
    problems = [failure] if failure else []
    if kind == PARK:  # nothing started: nothing answered; never a rollback's target (not PASSED)
        smoke = None
    elif smoke is None and not problems:
        problems.append("no smoke test answer recorded for rank 0's container")
    elif smoke is not None and not failure:
        problems += smoke_check(smoke)
    return {"n": (records[-1]["n"] + 1) if records else 1, "time": time, "kind": kind,
            **({"rollback_of": rollback_of} if rollback_of is not None else {}),
            "result": FAILED if problems else PARKED if kind == PARK else PASSED, "problem": "; ".join(problems) or None,
            "spec": spec, "model": model, "nodes": nodes,
            "smoke": None if smoke is None else {k: smoke.get(k) for k in ("prompt", "content", "status", "error")
                                                 if k in smoke},
            **({"bench": bench} if bench is not None else {})}


def comparable_spec(spec: Spec) -> Spec:
    """What makes two specs the same start (the order of recipe files aside)."""
    return {k: v for k, v in spec.items() if v not in (None, [], {})}


def last_good(records: list[Record], *, unlike: Spec | None = None) -> Record | None:
    """The newest start that passed; with `unlike`, the newest that passed with another spec (a
    rollback to the spec that just failed would fail again)."""
    for r in reversed(records):
        if r.get("result") != PASSED:
            continue
        if unlike is not None and comparable_spec(r.get("spec") or {}) == comparable_spec(unlike):
            continue
        return r
    return None


def rollback_target(records: list[Record], failed_spec: Spec | None) -> Record | None:
    """Where a failed start goes back to: the last good start, when it ran another spec (the failed
    start was an upgrade). A failed start of the spec that last passed is no upgrade (a node lost
    its fabric, a container died): nothing to go back to, and it is removed as before."""
    good = last_good(records)
    if good is None or failed_spec is None or comparable_spec(good.get("spec") or {}) == comparable_spec(failed_spec):
        return None
    return good


def runs_already(records: list[Record], target: Record) -> bool:
    """Whether going back to `target` needs nothing removed first: the newest start passed with
    target's spec, so cluster-up's plays converge on what runs (unchanged where its containers run,
    started where they do not) instead of a restart of the same containers."""
    newest = records[-1] if records else None
    return (newest is not None and newest.get("result") == PASSED
            and comparable_spec(newest.get("spec") or {}) == comparable_spec(target.get("spec") or {}))


def find(records: list[Record], n: int) -> Record | None:
    return next((r for r in records if r.get("n") == n), None)


def digest_changes(record: Record, nodes: dict[str, NodeEntry]) -> list[str]:
    """Nodes whose image is not the build a record ran (its ID), each named with both: a rollback by
    tag to a tag that has moved since runs another build."""
    out = []
    for h, was in (record.get("nodes") or {}).items():
        now = nodes.get(h) or {}
        if was.get("image_id") and now.get("image_id") and was["image_id"] != now["image_id"]:
            out.append(f"{h} runs {now.get('image')} {now['image_id'][7:19]}, start #{record['n']} ran "
                       f"{was['image_id'][7:19]}")
    return out


def rows(records: list[Record]) -> list[dict[str, str]]:
    """One row per start and node, for `invoke history` (newest last; "last good" marked)."""
    good = last_good(records)
    out = []
    for r in records:
        spec = r.get("spec") or {}
        layout = f"tp{spec.get('tp', 1)}" + (f" pp{spec['pp']}" if spec.get("pp", 1) > 1 else "") + \
            (f" dp{spec['dp']}" if spec.get("dp", 1) > 1 else "") + (f" {spec['executor']}" if len(spec.get("hosts") or []) > 1
                                                                      else "")
        what = r.get("kind", START) + (f" of #{r['rollback_of']}" if r.get("rollback_of") else "")
        result = r.get("result", "?") + (" (last good)" if good is not None and r is good else "")
        model = r.get("model") or {}
        for i, (h, n) in enumerate((r.get("nodes") or {}).items()):
            out.append({"n": str(r["n"]) if i == 0 else "", "time": r.get("time", "") if i == 0 else "",
                        "start": what if i == 0 else "", "result": result if i == 0 else "", "host": h,
                        "image": n.get("image") or "-",
                        "digest": (ImageRef.parse(n.get("digest") or "").digest or "")[:19]
                        or (n.get("image_id") or "-")[:19],
                        "recipe": n.get("recipe_hash") or "-",
                        "model": f"{model.get('repo')}@{(model.get('commit') or model.get('revision') or '?')[:12]}"
                        if i == 0 else "", "layout": layout if i == 0 else "",
                        "overrides": json.dumps(spec.get("overrides") or {}) if i == 0 and spec.get("overrides") else "",
                        "problem": (r.get("problem") or "") if i == 0 else ""})
    return out


class OnDemandEvent(TypedDict):
    """A start or stop of an on-demand deployment by the gateway, as a node's guard journaled it."""
    time: str       # UTC, ISO 8601
    epoch: float
    host: str
    action: str     # start | stop
    reason: str     # why the gateway asked (a request for MODEL; least recently used: room for B; idle Ns)
    result: str     # what the guard did (started/stopped CONTAINER, or the docker error)


ON_DEMAND_KINDS = {"on-demand-start": "start", "on-demand-stop": "stop"}


def on_demand_events(text: str, deployment: str, host: str) -> list[OnDemandEvent]:
    """The deployment's on-demand starts and stops in a guard's journal lines (node/guard.py writes
    each event's `reading` as "NAME: REASON"); lines that are no such event are left out."""
    out: list[OnDemandEvent] = []
    prefix = f"{deployment}: "
    for line in text.splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if not isinstance(e, dict) or e.get("kind") not in ON_DEMAND_KINDS:
            continue
        reading = str(e.get("reading") or "")
        if not reading.startswith(prefix):
            continue
        try:
            epoch = float(e.get("epoch") or 0)
        except (TypeError, ValueError):
            epoch = 0.0
        out.append({"time": str(e.get("time") or ""), "epoch": epoch, "host": host,
                    "action": ON_DEMAND_KINDS[e["kind"]], "reason": reading[len(prefix):],
                    "result": str(e.get("action") or "")})
    return out
