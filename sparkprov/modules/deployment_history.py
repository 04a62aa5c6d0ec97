"""deployment_history: each start of a deployment recorded in its history on rank 0 (issue 26).

phase node (every node): reads what the node runs for the deployment (container, recipe hash, the
image's ID and registry digest, as the node's docker reports them) and exports it; changes nothing.
phase record (rank 0): appends the start to DIR/NAME/history.jsonl (serving/history.py: the nodes'
exports, the model commit rank 0's store resolves, the spec, and the smoke test's result judged as
the ready step judges it) unless a record of the same start (the same containers) is there.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from pydantic import Field

from sparkprov import inventory_vars as iv
from sparkprov.facts.history import DeploymentImages, HistoryFile
from sparkprov.facts.serving import ServeReady
from sparkprov.modules._serving import ServeArgs
from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, Plan
from sparkprov.modules.vllm_ready import VllmReady
from sparkprov.serving import history, node
from sparkprov.staging.facts import StoreState
from sparkprov.staging.plan import repo_dir
from sparkprov.transport.shell import quote



class Args(ServeArgs):
    phase: Literal["node", "record"]
    kind: Literal["start", "rollback", "park"] = "start"
    rollback_of: int | None = Field(default=None, ge=1)
    failure: str | None = Field(default=None, max_length=4000)  # what failed in the start, as the run reported it
    time: str = ""                                                # when it started (UTC, ISO 8601)
    bench: dict[str, Any] | None = None                           # its bench gate (cluster-up --gate bench)


def spec_of(dep) -> history.Spec:
    """The spec a record keeps: the deployment as cluster-up was asked for it (pin only where --pin
    was given, on_demand where it is on demand: a record as before them, comparable with older ones)."""
    unset = {k for k in ("pin", "on_demand") if not getattr(dep, k)}
    return dep.model_dump(exclude=unset or None)


class HistoryRead(TypedDict):
    records: list[history.Record]   # oldest first
    record: history.Record          # this start's


HISTORY_NODE: Export[dict[str, history.NodeEntry]] = Export("history_node", dict,
                                                         "deployment -> what this node runs of it (history.node_entry)")
HISTORY: Export[dict[str, HistoryRead]] = Export("history", dict, "rank 0: deployment -> its history and this start's record")


class DeploymentHistory(Module):
    name = "deployment_history"
    Args = Args
    doc = "Record a start of a deployment (per node image digest, model commit, spec, smoke result) on rank 0."

    def needs(self, args: Args, host: HostContext):
        dep = args.deployment
        if args.phase == "node":
            return {"images": DeploymentImages(dep.name)}
        return {"history": HistoryFile(history.history_file(dep.name)),
                "ready": ServeReady(node.container_name(dep, host.name), node.base_url(dep, host.vars),
                                    node.key_file(host.vars)),
                "store": StoreState(iv.value(host.vars, "model_store"),
                                    tuple(sorted({repo for repo, _ in node.repos(dep)})))}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        dep, h = args.deployment, host.name
        if args.phase == "node":
            img = facts.images
            mine = [c for c in img["containers"] if c["name"] == node.container_name(dep, h)]
            entry = history.node_entry(h, mine, img["digests"])
            return Plan(msg=f"{entry['container'] or 'no container'}: {entry['digest'] or entry['image_id'] or '-'}",
                        exports=HISTORY_NODE({dep.name: entry}))
        records = history.parse(facts.history["text"])
        nodes = {n: HISTORY_NODE.entry(host.exports, n, dep.name) or {"host": n, "status": "unread"}
                 for n in dep.hosts}
        done = next((r for r in reversed(records) if history.same_start(r, nodes)), None)
        if done is not None:
            return Plan(msg=f"start #{done['n']} recorded ({done['result']})",
                        exports=HISTORY({dep.name: {"records": records, "record": done}}))
        recipe = node.catalog_for(dep).get(dep.model)
        repo, revision = next(iter(node.repos(dep)), (None, None))
        model = {"alias": dep.model, "repo": repo or recipe.model.local_dir, "revision": revision,
                 "commit": history.model_commit(revision, facts.store.refs, repo_dir(repo)) if repo else None}
        ready = facts.ready
        smoke = ready.get("smoke")
        if smoke is not None:
            smoke = {**smoke, "prompt": recipe.smoke.prompt}
        rec = history.new_record(records, time=args.time, kind=args.kind, rollback_of=args.rollback_of,
                                 spec=spec_of(dep), nodes=nodes, model=model, smoke=smoke, failure=args.failure,
                                 bench=args.bench,
                                 smoke_check=lambda s: VllmReady._judge(s, recipe.smoke))
        path = history.history_file(dep.name)
        line = history.json_line(rec)
        script = "\n".join([f"f={quote(host.path(path))}",
                            '(umask 077; mkdir -p "$(dirname "$f")")',
                            f"printf '%s\\n' {quote(line)} >> \"$f\""])
        return Plan([Change(f"record start #{rec['n']} of {dep.name} ({rec['kind']}, {rec['result']})", script,
                            Diff(f"{h}: {path}", "", line + "\n"), touches=[facts.fact("history")],
                            verify=False)],
                    exports=HISTORY({dep.name: {"records": records + [rec], "record": rec}}))
