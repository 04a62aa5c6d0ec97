"""vllm_container: this node's container of a deployment, converged to its recipe hash.

It receives the container built for this node (serving/node.py NodeContainer: the `docker run`
argv, labels, recipe hash and image, built by node_container, the task before it in the same play,
from the node's facts and rank 0's fabric address and container) and compares it with the
deployment's containers on the node. Running with the wanted hash: nothing to do. Otherwise the
deployment's containers on this node are removed, the page cache is dropped as root (G15) and
Ollama's models unloaded (G14) when asked, the API key file is created 0600 if missing (rank 0
only; never in argv or `docker inspect`), and the container is started. The checks a start needs
(G34: every node holds the same image build; the image's flags; a pinned deployment's registry
digest) are node_container's: it builds no container that would fail them.
"""

from __future__ import annotations

import json

from sparkprov.modules.base import Change, Diff, Export, FactView, HostContext, Module, Plan
from sparkprov.facts.docker_run import reporting_cause
from sparkprov.facts.runtimes import OllamaState
from sparkprov.facts.serving import ManagedContainers, ServeReady
from sparkprov.modules._serving import ServeArgs
from sparkprov.serving.node import NodeContainer
from sparkprov.node import ondemand
from sparkprov.transport.shell import cmd, quote
from typing import TypedDict


class Args(ServeArgs):
    drop_caches: bool = True
    unload_ollama: bool = False
    # on every node of a cluster before rank 0 starts, after node_container's checks (the same
    # build, the image's flags): whether this run (re)starts the node's container (STARTS)
    checks_only: bool = False
    # on a cluster's other ranks, before rank 0 starts: when rank 0 is (re)started, this node's old
    # rank goes first. Left running, it would join the new rank 0's rendezvous (the rank supervisor
    # rejoins whatever rank 0 listens at its address) and be replaced a moment later, ending the new
    # group (measured on the lab: docs/upgrades.md). Its replacement would come anyway: a rank's
    # recipe hash includes rank 0's container ID.
    stale_ranks: bool = False


def _run_script(spec, serves: bool) -> str:
    lines = [cmd("docker", "rm", "-f", spec.name) + " >/dev/null 2>&1 || true"]
    kf = spec.launch.ctx.api_key_file
    if kf and serves:
        lines += [f"f={quote(kf)}", 'mkdir -p "$(dirname "$f")"', "(umask 077",
                  ' if [ ! -s "$f" ]; then head -c 32 /dev/urandom | od -An -tx1 | tr -d " \\n" > "$f.new" '
                  '&& mv "$f.new" "$f" && echo "@key=created"; fi)', 'chmod 600 "$f"']
    lines.append(reporting_cause(cmd(*spec.argv)) + " >/dev/null")
    return "\n".join(lines)


class Container(TypedDict, total=False):
    name: str
    role: str
    hash: str     # the recipe hash it runs
    id: str       # its container ID, once it runs (the other ranks carry rank 0's)


# node_container writes it (the task before this module's in the same play); declared here, beside
# its reader, because node_container imports this module
NODE_CONTAINER: Export[dict[str, NodeContainer]] = Export("node_container", dict,
                                                          "deployment -> the container built for this host")
CONTAINERS: Export[dict[str, Container]] = Export("containers", dict, "deployment -> its container on this host")
STARTS: Export[dict[str, bool]] = Export("starts", dict,
                                         "deployment -> whether this run (re)starts its container here (checks_only)")
# Exported by the start itself (Change.exports): only once it ran. An upgrade is a start that replaced
# a container of the deployment that ran here before (plays/upgrade.py rolls a failed one back).
REPLACED: Export[dict[str, str | None]] = Export("replaced", dict,
                                                 "deployment -> the container this run's start replaced here "
                                                 "(None: none was there)")


class VllmContainer(Module):
    name = "vllm_container"
    Args = Args
    doc = "This node's container of a deployment, converged to the recipe hash (started or replaced)."

    def needs(self, args: Args, host: HostContext):
        return {"containers": ManagedContainers(), "ollama": OllamaState()}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        dep, h = args.deployment, host.name
        cont = facts.containers
        mine = [c for c in cont["containers"] if c["labels"].get("sparkprov.deployment") == dep.name]
        if args.stale_ranks:
            return self._stale_rank(dep, host, cont, mine)
        built = NODE_CONTAINER.entry(host.exports, h, dep.name)
        if built is None:
            return Plan.fail(f"{h}: no container was built for {dep.name} (node_container runs before vllm_container)")
        spec, image = built.spec, built.image
        have = next((c for c in mine if c["name"] == spec.name), None)
        strays = [c["name"] for c in mine if c["name"] != spec.name]
        # parked (on demand): left as it is whether the gateway started it or not; on demand or not
        # is a label (outside the hash): a container that is the other kind is made again
        kept = ("running", "restarting") + (ondemand.STOPPED if dep.on_demand else ())
        unchanged = bool(have and not strays and have["labels"].get("sparkprov.recipe_hash") == spec.hash
                         and have["status"] in kept and ondemand.is_on_demand(have) == dep.on_demand)
        if args.checks_only:
            return Plan(msg=f"{h} can start its rank: the same build as the others, flags known to the image"
                            + (f", pinned to {image.runs}" if image.why == "pinned" else ""), exports=STARTS({dep.name: not unchanged}))
        if unchanged:
            return Plan(msg=f"{spec.name} {'parked (' + have['status'] + ')' if dep.on_demand else 'up'} with recipe "
                            f"{spec.hash} ({dep.model})",
                        exports=CONTAINERS({dep.name: {"name": spec.name, "role": spec.role, "hash": spec.hash,
                                                       "id": have["id"]}}))
        before = "absent\n" if not have else (f"{have['name']} {have['status']} recipe "
                                              f"{have['labels'].get('sparkprov.recipe_hash')}\n")
        why = ("absent" if not have else
               f"recipe {have['labels'].get('sparkprov.recipe_hash')} -> {spec.hash}"
               if have["labels"].get("sparkprov.recipe_hash") != spec.hash else
               ("on demand" if dep.on_demand else "no longer on demand")
               if ondemand.is_on_demand(have) != dep.on_demand else f"{have['status']}")
        if dep.on_demand:
            return self._park(dep, host, spec, have, strays, before, why, cont)
        changes: list[Change] = []
        if strays:
            changes.append(Change(f"remove {', '.join(strays)} (other containers of {dep.name})",
                                  cmd("docker", "rm", "-f", *strays) + " >/dev/null"))
        ollama = (facts.ollama or {}).get("models") or []
        if args.unload_ollama and ollama:
            changes.append(Change("unload Ollama models " + ", ".join(m["name"] for m in ollama) + " (G14)", "\n".join(
                cmd("curl", "-sf", "-m", "60", "--noproxy", "*", "-X", "POST", "http://127.0.0.1:11434/api/generate",
                    "-H", "Content-Type: application/json", "-d", json.dumps({"model": m["name"], "keep_alive": 0}))
                + " >/dev/null" for m in ollama)))
        if args.drop_caches:
            changes.append(Change("drop the page cache before the load (G15)",
                                  "docker rm -f " + quote(spec.name) + " >/dev/null 2>&1 || true\nsync\n"
                                  "echo 3 > /proc/sys/vm/drop_caches", become=True))
        serves = built.serves
        ready = ServeReady(spec.name, built.base_url, built.key_file) if serves else None
        predicted = {"access": True, "error": None, "containers": [c for c in cont["containers"] if c["name"] != spec.name
                                                                   and c["name"] not in strays]
                     + [{"name": spec.name, "status": "running", "labels": spec.labels, "id": "(new)"}]}
        start = Change(f"{'start' if not have else 'replace'} {spec.name} ({spec.role}, {dep.model}, recipe "
                       f"{spec.hash}): {why}", _run_script(spec, serves),
                       Diff(f"{h}: {spec.name}", before, f"{spec.name} running recipe {spec.hash}\n"),
                       touches=[ManagedContainers()] + ([ready] if ready else []), timeout=600,
                       predicts=[(ManagedContainers(), predicted)])

        def key_note(out: str) -> None:
            if "@key=created" in out:  # said once, when the key is made (it never leaves the host)
                start.summary += " (API key created, 0600)"

        start.outcome = key_note
        # every deployment started on this host in this run, not only the latest (one key per host)
        start.exports = REPLACED({**(REPLACED.read(host.exports, h) or {}), dep.name: have["name"] if have else None})
        changes.append(start)
        return Plan(changes, exports=CONTAINERS({dep.name: {"name": spec.name, "role": spec.role, "hash": spec.hash}}))

    @staticmethod
    def _park(dep, host: HostContext, spec, have, strays: list[str], before: str, why: str, cont) -> Plan:
        """An on-demand deployment's container created and left stopped (spec: `docker create`):
        no load, so no page-cache drop and no Ollama unload; the API key file made as a start makes it."""
        changes: list[Change] = []
        if strays:
            changes.append(Change(f"remove {', '.join(strays)} (other containers of {dep.name})",
                                  cmd("docker", "rm", "-f", *strays) + " >/dev/null"))
        predicted = {"access": True, "error": None, "containers": [c for c in cont["containers"] if c["name"] != spec.name
                                                                   and c["name"] not in strays]
                     + [{"name": spec.name, "status": "created", "labels": spec.labels, "id": "(new)"}]}
        park = Change(f"park {spec.name} ({spec.role}, {dep.model}, recipe {spec.hash}): {why}",
                      _run_script(spec, dep.serves_on(host.name)),
                      Diff(f"{host.name}: {spec.name}", before, f"{spec.name} parked recipe {spec.hash}\n"),
                      touches=[ManagedContainers()], timeout=120, predicts=[(ManagedContainers(), predicted)])
        park.exports = REPLACED({**(REPLACED.read(host.exports, host.name) or {}),
                                 dep.name: have["name"] if have else None})
        changes.append(park)
        return Plan(changes, exports=CONTAINERS({dep.name: {"name": spec.name, "role": spec.role, "hash": spec.hash}}))

    @staticmethod
    def _stale_rank(dep, host: HostContext, cont, mine) -> Plan:
        """A rank of the old group removed before a new rank 0 starts (Args.stale_ranks)."""
        if not STARTS.entry(host.exports, dep.hosts[0], dep.name) or not mine:
            return Plan(msg="no rank of an old group here" if not mine else "rank 0 stays: its ranks stay")
        names = [c["name"] for c in mine]
        left = {**cont, "containers": [c for c in cont["containers"] if c not in mine]}
        return Plan([Change(f"remove {', '.join(names)} before rank 0 ({dep.hosts[0]}) starts again: a rank of the "
                            "old group would join the new one", cmd("docker", "rm", "-f", *names) + " >/dev/null",
                            Diff(f"{host.name}: {', '.join(names)}", "".join(f"{n} running\n" for n in names), ""),
                            touches=[ManagedContainers()], predicts=[(ManagedContainers(), left)])])
