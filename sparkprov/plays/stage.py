"""stage-weights as plays on the engine (the modules are sparkprov/modules/weights_*.py):

    stage: store      every host   read the store against the hub's listing; hash what is there but
                                   not known good (publish the good, remove the bad); space check
    stage: download   the source   download, once, what no host holds (huggingface_hub; resumes),
                                   each weight streamed to the hosts that need it while it
                                   downloads, small files as they are verified, each hashed and
                                   published there (pipelined fan-out, staging/fanout.py)
    stage: send       every host   rsync what others still lack from the host chosen to send it
    stage: publish    every host   hash what arrived, publish it, link the snapshot; fail on gaps

The hub is listed on the control machine first (a gated repo without a token fails there, before
any host is touched). A host whose store is complete and verified costs one remote call.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, TypedDict

from sparkprov.plays.book import play, run_book, task
from sparkprov import inventory_vars as iv
from sparkprov.data.inventory import Inventory
from sparkprov.engine.playbook import Playbook
from sparkprov.engine.report import Report
from sparkprov.engine.run import DEFAULT_FORKS, RunOptions
from sparkprov.errors import SparkprovError
from sparkprov.staging.plan import Item
from sparkprov.modules.weights_store import STAGE


def item_args(items: list[Item]) -> list[dict[str, Any]]:
    return [{"repo": i.repo, "revision": i.revision, "commit": i.commit, "path": i.path, "size": i.size,
             "oid": i.oid, "sha256": i.sha256, "dest": i.dest} for i in items]


def ssh_options(inventory: Inventory, name: str) -> list[str]:
    """ssh options the control machine uses for a host: the inventory's key, known_hosts and port."""
    h = inventory.hosts[name]
    opts: list[str] = []
    if h.ssh_key:
        opts += ["-i", os.path.expanduser(h.ssh_key), "-o", "IdentitiesOnly=yes"]
    if h.known_hosts:
        opts += ["-o", f"UserKnownHostsFile={os.path.expanduser(h.known_hosts)}", "-o", "GlobalKnownHostsFile=/dev/null"]
    if h.port:
        opts += ["-p", str(h.port)]
    return opts


def stage_book(inventory: Inventory, hosts: list[str], model: str, items: list[Item], *, source: str, endpoint: str,
               image: str, rehash: bool = False, streams: int = 4) -> Playbook:
    where = ("stage-weights", None, None)
    local = [h for h in hosts if inventory.hosts[h].connection == "local"]
    common = {"model": model, "items": item_args(items), "source": source, "image": image, "local_hosts": local}
    send = {**common, "hosts": hosts, "streams": streams,
            "addresses": {x: inventory.hosts[x].address for x in hosts},
            "ssh_options": {x: ssh_options(inventory, x) for x in hosts} if local else {}}
    return Playbook("stage-weights", [
        play("stage: store", hosts, [task(f"store {model}", "weights_store", {**common, "rehash": rehash}, where)]),
        play("stage: download", [source], [task(f"download {model}", "weights_download",
                                                {**send, "endpoint": endpoint, "workers": min(streams, 8)}, where)]),
        play("stage: send", hosts, [task(f"send {model}", "weights_send", send, where)]),
        play("stage: publish", hosts, [task(f"publish {model}", "weights_store", {**common, "phase": "publish"}, where)]),
    ])


@dataclass
class StageOptions:
    check: bool = False
    rehash: bool = False
    source: str | None = None
    streams: int = 4
    image: str | None = None
    accept_new_host_keys: bool = False
    forks: int = DEFAULT_FORKS
    revision: str | None = None          # the model repo at this branch, tag or commit
    include: list[str] | None = None     # hf download's --include / --exclude patterns
    exclude: list[str] | None = None


class StagedHost(TypedDict):
    store: str | None            # the store's path there
    fabric_address: str | None   # where the others sent to it
    complete: bool               # staged and verified in this run


class _StageSummary(TypedDict):
    model: str
    source: str                  # the host that downloads
    endpoint: str                # the hub
    image: str | None            # the image the download runs in
    token: str | None            # where the hub token came from
    check: bool
    repos: dict[str, str]        # REPO@REVISION -> the commit it resolved to
    include: list[str] | None
    exclude: list[str] | None
    files: int
    bytes: int


class StageSummary(_StageSummary, total=False):
    """What stage-weights staged: its JSON document's `stage` section."""
    seconds: float
    hosts: dict[str, StagedHost]


def prepare_stage(inventory: Inventory, hosts: list[str], model: str, o: StageOptions) -> tuple[Playbook, StageSummary]:
    """List the hub (on the control machine: a gated repo without a token fails here, before any
    host) and build the stage plays; their summary so far."""
    from sparkprov.staging.hub import list_stage, resolve_token, spec_for

    if o.source and o.source not in hosts:
        raise SparkprovError(f"--source {o.source} is not one of the selected hosts ({', '.join(hosts)})",
                             fix="pick a host the stage runs on")
    # the control machine is a Spark of the stage: the bytes are already here
    src = o.source or next((h for h in hosts if inventory.hosts[h].connection == "local"), hosts[0])
    spec = spec_for(model, o.revision)
    image = o.image or spec.image or iv.value(inventory.hosts[src].vars, "stage_image") or ""
    endpoint = iv.value(inventory.hosts[hosts[0]].vars, "hf_endpoint").rstrip("/")
    token, token_src = resolve_token()
    items, listings = list_stage(spec, endpoint, token, include=o.include, exclude=o.exclude)
    book = stage_book(inventory, hosts, model, items, source=src, endpoint=endpoint, image=image, rehash=o.rehash,
                      streams=o.streams)
    size = {i.rel: i.size for i in items}
    return book, {"model": model, "source": src, "endpoint": endpoint, "image": image or None,
                  "token": token_src or None, "check": o.check,
                  "repos": {f"{x.repo}@{x.revision}": x.commit for x in listings},
                  "include": o.include, "exclude": o.exclude,
                  "files": len(size), "bytes": sum(size.values())}


def run_stage(inventory: Inventory, hosts: list[str], model: str, o: StageOptions, report: Report) -> StageSummary:
    """The stage plays on the engine; the summary the commands print."""
    t0 = time.monotonic()
    book, summary = prepare_stage(inventory, hosts, model, o)
    runner = run_book(inventory, book, hosts, RunOptions(check=o.check, forks=o.forks, gather_ahead=True,
                                                          accept_new_host_keys=o.accept_new_host_keys), report)
    exported = {h: STAGE.read(runner.exports, h) or {} for h in hosts}
    summary["seconds"] = round(time.monotonic() - t0, 3)
    summary["hosts"] = {h: {"store": exported[h].get("store"), "fabric_address": exported[h].get("fabric"),
                            "complete": not o.check and not report.hosts[h].failed and not report.hosts[h].unreachable}
                        for h in hosts}
    return summary
