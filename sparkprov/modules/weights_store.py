"""weights_store: a model's files in this host's store, as the hub lists them, verified.

Reads the store (StoreState) and plans each file against the hub's listing (staging/plan.py):
published and verified (ok), published but not known good or complete in staging (hash it:
good ones are published, bad ones removed), partial or missing (to fetch). Snapshot links and
refs are made for what is there. Phase `check` (before any transfer) also fails a host without
the space for what it lacks; phase `publish` (after the fan-out) fails a host that still lacks
files, naming them. Exports what it holds and needs for the download and send plays.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from pydantic import Field

from sparkprov import inventory_vars as iv
from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, ModuleArgs, Plan
from sparkprov.facts.fabric import FabricInfo
from sparkprov.staging import fanout, verify
from sparkprov.staging.facts import StoreState
from sparkprov.staging.plan import Item, Status, check_disk, human, plan_host



class StageHost(TypedDict):
    ok: list[str]        # files in place and verified (or staged)
    need: list[str]      # files to fetch
    partial: list[str]   # ... of which a partial is on disk (rsync resumes it)
    store: str
    user: str
    fabric: str | None   # the address peers send to (None on a mesh or ring: `reach`)
    image: str | None
    reach: dict[str, str] | None   # a mesh or ring: peer -> this host's address on the link with it
    ring: list[str] | None         # a ring: its hosts in order (the source relays along it)


# The stage plays' values, declared here for all three weights_* modules (weights_download and
# weights_send import this module; a declaration in theirs would make the import a circle).
STAGE: Export[StageHost] = Export("stage", StageHost, "the store play: what the host holds and needs")
SENT_TO: Export[list[str]] = Export("stage_sent_to", list, "the send play: which hosts this host sent files to")
SEND_ERRORS: Export[dict[str, str]] = Export("stage_send_errors", dict, "receiver -> why sending to it failed")
DELIVERED: Export[dict[str, list[str]]] = Export("stage_delivered", dict, "the source's pipelined fan-out: "
                                                 "receiver -> the files it delivered there")


class Args(ModuleArgs):
    phase: Literal["check", "publish"] = "check"
    model: str
    items: list[dict[str, Any]] = Field(min_length=1)
    rehash: bool = False
    source: str = ""           # the host that downloads
    image: str = ""            # the downloader's image (read on the source: present or not)
    local_hosts: list[str] = Field(default_factory=list)  # hosts that are the control machine


def items_of(args) -> list[Item]:
    return [Item(**i) for i in args.items]


def routes_to(args, sender: str, receiver: str, export: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """Where `sender` sends to `receiver` (whose store play exported `export`), best first, with
    the ssh argv for each: for the download's pipelined fan-out and for the send play alike."""
    reach = export.get("reach")
    if reach is not None and sender not in args.local_hosts:
        # a mesh or ring: over the link between the two, or not at all (no fallback to the management
        # network: a ring's hosts that share no link are reached by relaying, staging/fanout.py)
        return [(reach[sender], fanout.SSH_BASE)] if reach.get(sender) else []
    return fanout.routes(sender, receiver, fabric=export.get("fabric"), address=args.addresses.get(receiver, receiver),
                         local_hosts=args.local_hosts, ssh_options=args.ssh_options.get(receiver, []))


def store_fact(args, host: HostContext) -> StoreState:
    """The host's store (its model_store var) as these items need it; on a source that downloads
    in a container, whether the image is there."""
    items = items_of(args)
    image = args.image if host.name == args.source and host.name not in args.local_hosts else ""
    return StoreState(iv.value(host.vars, "model_store"), tuple(sorted({i.repo for i in items if i.dest is None})),
                      tuple(sorted({i.dest for i in items if i.dest is not None})), image)


class WeightsStore(Module):
    name = "weights_store"
    Args = Args
    doc = "A model's files in the host's store, verified against the hub's listing (stage-weights)."

    def needs(self, args: Args, host: HostContext):
        return {"store": store_fact(args, host), "fabric": FabricInfo()}

    def stale(self, args: Args, host: HostContext):
        """After the fan-out, a host that was sent files reads its store again."""
        sent = any(host.name in to for x in (SENT_TO, DELIVERED) for to in x.by_host(host.exports).values())
        return [store_fact(args, host)] if args.phase == "publish" and sent else []

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        sf = facts.store
        rehashing = args.rehash and args.phase == "check"
        hp = plan_host(host.name, items_of(args), sf, rehash=rehashing)
        fab = facts.fabric or {}
        reach = fab.get("reach")
        fabric = iv.value(host.vars, "fabric_address") or (None if reach is not None else fab.get("node_ip")) or None
        exports = STAGE({"ok": sorted(r for r, f in hp.files.items() if f.status in (Status.OK, Status.UNVERIFIED,
                                                                                     Status.STAGED)),
                         "need": sorted(f.item.rel for f in hp.to_fetch),
                         "partial": sorted(f.item.rel for f in hp.to_fetch if f.have),  # resumed by rsync
                         "store": sf.store, "user": sf.user,
                         "fabric": fabric, "image": sf.image, "reach": reach,
                         "ring": fab.get("order") if fab.get("topology") == "ring" else None})
        if args.phase == "check":
            problem = check_disk(hp, sf.store)
            if problem:
                return Plan.fail(problem.message())
        elif hp.to_fetch and host.check:
            return Plan([Change(f"hash and publish {len(hp.to_fetch)} files as they arrive", ":",
                                touches=[facts.fact("store")])], exports=exports)
        elif hp.to_fetch:
            left = [f.item.path for f in hp.to_fetch]
            why = [e for errors in SEND_ERRORS.by_host(host.exports).values() if (e := errors.get(host.name))]
            return Plan.fail("; ".join(why + [f"{len(left)} files still missing after the transfer: "]) + ", ".join(left[:5])
                             + (" (partial files are kept: a rerun resumes them)"
                                if any(f.status is Status.PARTIAL for f in hp.to_fetch) else ""))
        if hp.complete:
            return Plan(msg=f"complete: {len(hp.files)} files, {human(hp.total_bytes)} verified in {sf.store}",
                        exports=exports)
        changes = []
        checks = [verify.Check("staged" if f.status is Status.STAGED else "published", f.item) for f in hp.to_verify]
        # links and refs are made once every file is there (the publish phase, or now when only
        # they are missing): a ref never names a snapshot whose files are still to come
        links, refs = ([], {}) if hp.to_fetch else (hp.links, hp.refs)
        # what is there with the wrong size (a truncated shard, a stray staged file) goes first:
        # the right bytes then arrive in staging and are published
        remove = sorted({r for f in hp.files.values() for r in f.remove})
        if checks or links or refs or remove:
            what = []
            if checks:
                what.append(f"hash {len(checks)} files ({human(sum(c.item.size for c in checks))}) and publish the good ones")
            if links or refs:
                what.append(f"link {len(links)} snapshot paths" + (f", write {len(refs)} refs" if refs else ""))
            if remove:
                what.append(f"remove {len(remove)} files of the wrong size")
            # --rehash distrusts every record, its own fresh ones too: re-planning it would hash
            # again forever. The publish play after it plans without rehash: that is its check.
            changes.append(Change("; ".join(what), verify.script(sf.store, checks, links=links, refs=refs,
                                                                  remove=remove, parallel=4),
                                  touches=[facts.fact("store")], timeout=24 * 3600, verify=not rehashing))
        msg = (f"{hp.summary()}; needs {human(hp.need_bytes)}" + (f", {human(hp.free)} free" if hp.free is not None
                                                                   else "")) if hp.to_fetch else ""
        return Plan(changes, msg=msg, exports=exports)
