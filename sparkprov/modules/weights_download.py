"""weights_download: the files that some host of the stage needs and no host holds, downloaded
once, on the source, from the hub (huggingface_hub's downloader, resuming from the bytes on disk;
published only after the sha256 / git blob id matches the hub's).

On a Spark the downloader runs in the serving image as the login user (G23), with the token in a
0600 file mounted read-only (never in argv or the container's config); on the control machine
(a host with `connection: local`) in sparkprov's own environment. Exports nothing new: the
verify step re-reads the store, and the send play reads what the source holds from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from pydantic import Field

from sparkprov.facts.accounts import docker_problem
from sparkprov.modules.base import Change, Export, FactView, HostContext, Module, Plan
from sparkprov.modules.weights_store import (DELIVERED, SEND_ERRORS, STAGE, Args as StoreArgs, items_of, routes_to,
                                             store_fact)
from sparkprov.staging import fanout, fetch
from sparkprov.staging.facts import DOWNLOADER_PREFIX
from sparkprov.staging.hub import endpoint_env, resolve_token
from sparkprov.staging.plan import Status, human, plan_host
from sparkprov.transport.shell import cmd, quote


HELD: Export[list[str]] = Export("stage_held", list, "the source: the files it holds once its download is done")
RUNNER_MARK = "# the downloader\n"  # where the pipelined fan-out wraps the download script


def fan_out(args, host: HostContext, held: list[str], todo: list) -> tuple[list[fanout.Receiver], dict[str, list[str]]]:
    """The receivers this source sends to as files land, and what each needs from it: every file
    it downloads now or holds already that the receiver lacks."""
    mine = set(held) | {i.rel for i in todo}
    receivers, wants = [], {}
    chains = ring_chains(args, host)
    if chains:
        # a ring: to each neighbour, which relays to the next (staging/fanout.py relay_put)
        for chain in chains:
            if not any(rel in mine for r in chain for rel in (STAGE.read(host.exports, r) or {}).get("need") or []):
                continue
            first = len(receivers)
            for k, r in enumerate(chain):
                ex = STAGE.read(host.exports, r)
                wants[r] = [rel for rel in ex.get("need") or [] if rel in mine]
                relay = tuple((first + j, STAGE.read(host.exports, chain[j])["reach"][chain[j - 1]])
                              for j in range(1, len(chain))) if k == 0 else ()
                receivers.append(fanout.Receiver(r, ex.get("user") or "nvidia", ex.get("store"),
                                                 routes_to(args, host.name, r, ex) if k == 0 else [],
                                                 partial=frozenset(ex.get("partial") or ()), relay=relay))
        return receivers, wants
    for r in args.hosts:
        ex = STAGE.read(host.exports, r)
        if r == host.name or not ex:
            continue  # itself, or failed / unreachable in the store play
        need = [rel for rel in ex.get("need") or [] if rel in mine]
        if not need:
            continue
        wants[r] = need
        receivers.append(fanout.Receiver(r, ex.get("user") or "nvidia", ex.get("store"), routes_to(args, host.name, r, ex),
                                         partial=frozenset(ex.get("partial") or ())))
    return receivers, wants


def ring_chains(args, host: HostContext) -> list[list[str]]:
    """On a ring whose every host stages: the two ways round it from the source, each host in turn
    reached over its link with the one before (the first over its link with the source), halves of
    the ring each. [] otherwise (a pair, a switch, a mesh: every host is the source's neighbour)."""
    order = (STAGE.read(host.exports, host.name) or {}).get("ring")
    if not order or host.name not in order or host.name in args.local_hosts:
        return []
    staged = {r: STAGE.read(host.exports, r) for r in order}
    if any(not staged[r] or r not in args.hosts for r in order):
        return []
    k, n = order.index(host.name), len(order)
    ways = [[order[(k + j) % n] for j in range(1, n // 2 + 1)], [order[(k - j) % n] for j in range(1, n - n // 2)]]
    for way in ways:
        for prev, r in zip([host.name] + way, way):
            if not (staged[r].get("reach") or {}).get(prev):
                return []
    return [w for w in ways if w]


def download_job(args, store: str, todo: list, refs: dict[str, str], *, in_turn: bool) -> dict:
    """What the downloader (staging/fetch.py) runs: the files to fetch, each with its place in
    the stage's items (the pipelined fan-out's queue names files by it). `in_turn`: the weights
    one after another, for a fan-out that sends each on as it lands."""
    index = {i.rel: n for n, i in enumerate(items_of(args))}
    job = {"endpoint": args.endpoint, "store": store, "workers": args.workers,
           "files": [{"repo": i.repo, "path": i.path, "commit": i.commit, "size": i.size, "large": i.large,
                      "digest": i.digest, "rel": i.rel, "link": i.link, "link_target": i.link_target,
                      "n": index[i.rel]} for i in todo], "refs": refs}
    if in_turn:
        job["large_in_turn"] = True
    return job


class Args(StoreArgs):
    endpoint: str
    hosts: list[str] = Field(min_length=1)   # every host of the stage (whose needs count)
    workers: int = Field(default=4, ge=1, le=64)
    # the pipelined fan-out (as weights_send takes them): at most `streams` sends at once
    streams: int = Field(default=4, ge=1, le=64)
    addresses: dict[str, str] = Field(default_factory=dict)
    ssh_options: dict[str, list[str]] = Field(default_factory=dict)


def to_download(args, host: HostContext, own) -> list:
    """Items some host needs that no host holds (the source's own fresh state counts for it)."""
    held: set[str] = set(r for r, f in own.files.items() if f.status is Status.OK)
    needed: set[str] = set(f.item.rel for f in own.to_fetch)
    for h in args.hosts:
        if h == host.name:
            continue
        held |= set(STAGE.entry(host.exports, h, "ok") or [])
        needed |= set(STAGE.entry(host.exports, h, "need") or [])
    out, seen = [], set()
    for i in items_of(args):
        if i.rel in needed - held and i.rel not in seen:
            seen.add(i.rel)
            out.append(i)
    return out


class WeightsDownload(Module):
    name = "weights_download"
    Args = Args
    doc = "Download, once and on the source, what no host of the stage holds (stage-weights)."

    def needs(self, args: Args, host: HostContext):
        return {"store": store_fact(args, host)}

    def plan(self, args: Args, facts: FactView, host: HostContext) -> Plan:
        sf = facts.store
        own = plan_host(host.name, items_of(args), sf)
        todo = to_download(args, host, own)
        ok = sorted(r for r, f in own.files.items() if f.status is Status.OK)
        held = HELD(ok)
        if not todo:
            return Plan(msg="nothing to download: every file is on some host", exports=held)
        items = items_of(args)
        links = [i for i in items if i.link and i.rel in {t.rel for t in todo}]
        resume = sum(own.files[i.rel].have for i in todo if i.rel in own.files)
        token, _ = resolve_token()
        # docker answers only root here (the login user is not in the docker group yet): the
        # download runs as root and the sends are left to the send play, as the login user
        become = self._needs_root(sf) and host.name not in args.local_hosts
        receivers, wants = fan_out(args, host, ok, todo) if not become else ([], {})
        job = download_job(args, sf.store, todo, own.refs, in_turn=bool(receivers))
        try:
            script = self._script(args, host, sf, job, token, become)
        except ValueError as exc:
            return Plan.fail(f"{host.name}: {exc}")
        if receivers:
            start, feed, finish = fanout.pipeline(sf.store, receivers, items, wants, args.streams)
            head, runner = script.rsplit(RUNNER_MARK, 1)
            script = (head + start + fanout.queue_now([r for r in ok if any(r in w for w in wants.values())],
                                                      items)
                      + "{ " + runner.rstrip("\n") + "\n} | " + feed + "\n" + finish)
        else:
            script = script.replace(RUNNER_MARK, "")
        total = sum(i.size for i in todo)

        def outcome(out: str) -> str | None:
            results = {}
            for line in out.splitlines():
                if line.startswith("SPARKPROV-FETCH "):
                    msg = json.loads(line[len("SPARKPROV-FETCH "):])
                    if "file" in msg:
                        results[msg["file"]["rel"]] = msg["file"]
            if receivers:
                got, errors = fanout.parse_sent(out, receivers, items)
                change.exports = {**DELIVERED(got), **SEND_ERRORS(errors)}
            bad = [i for i in todo if not results.get(i.rel, {}).get("ok")]
            if bad:
                return (f"{len(bad)} of {len(todo)} files failed: "
                        + "; ".join(f"{i.path}: {results.get(i.rel, {}).get('error', 'no result')}" for i in bad[:3]))
            return None

        from sparkprov.staging import verify

        publish_links = verify.script(sf.store, [], links=links) if links else ""
        change = Change(f"download {len(todo)} files ({human(total)}) from {args.endpoint}"
                        + (f", resuming {human(resume)} on disk" if resume else "")
                        + (f"; each file on to {', '.join(r.name for r in receivers)} as it lands" if receivers else ""),
                        script, touches=[facts.fact("store")], become=become, timeout=7 * 24 * 3600, outcome=outcome)
        return Plan([change] + ([Change(f"link {len(links)} snapshot paths", publish_links, touches=[facts.fact("store")])]
                                if links else []), exports=held)

    @staticmethod
    def _needs_root(sf) -> bool:
        """docker answers only root here (the login user is not in the docker group yet)."""
        state = sf.image or ""
        return state.startswith("error") and "permission denied" in state.lower()

    @staticmethod
    def _script(args: Args, host: HostContext, sf, job: dict, token: str | None, become: bool) -> str:
        env = {**endpoint_env(args.endpoint), "HF_HOME": sf.store, "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1"}
        # __sp_life: the pipelined fan-out's lifeline (staging/fanout.py), gone with the script
        lines = ["set -e", f"S={quote(sf.store)}", "T=$(mktemp -d)",
                 "trap 'kill ${__sp_life:-} 2>/dev/null || true; rm -rf \"$T\"' EXIT INT TERM HUP"]
        token_file = ("(umask 077; cat > \"$T/token\") <<'SPARKPROV_TOKEN'\n" + token + "\nSPARKPROV_TOKEN") if token else ""
        if host.name in args.local_hosts:
            lines += ['mkdir -p "$S/.sparkprov"'] + ([token_file] if token else [])
            envs = " ".join(f"{k}={quote(v)}" for k, v in env.items())
            runner = f"{envs} SPARKPROV_TOKEN_FILE=\"$T/token\" {quote(sys.executable)} -"
        else:
            if not args.image:
                raise ValueError("no image to run huggingface_hub in (fix: --image, or a catalog alias)")
            if "docker" not in sf.tools:
                raise ValueError("docker is not installed (fix: invoke provision first)")
            state = sf.image or ""
            if state.startswith("error") and not become:  # as root, the store is still written as the login user
                raise ValueError(docker_problem(state[len("error: "):], host.name, host.user))
            owner = f"{sf.uid}:{sf.gid}"
            if become:
                lines += [f'[ -d "$S" ] || {{ mkdir -p "$S" && chown {owner} "$S"; }}',
                          f'[ -d "$S/.sparkprov" ] || {{ mkdir -p "$S/.sparkprov" && chown {owner} "$S/.sparkprov"; }}']
            else:
                lines.append('mkdir -p "$S/.sparkprov"')
            if token:
                lines.append(token_file)
                if become:
                    lines.append(f'chown {owner} "$T" "$T/token"')
            name = DOWNLOADER_PREFIX + hashlib.sha1(sf.store.encode()).hexdigest()[:12]
            lines.append(cmd("docker", "rm", "-f", name) + " >/dev/null 2>&1 </dev/null || true")
            if state != "present":
                lines.append(cmd("docker", "pull", "-q", args.image) + " </dev/null >&2")
            argv = ["docker", "run", "--rm", "-i", "--name", name, "--network", "host", "--user", owner,
                    "--entrypoint", "python3", "-v", f"{sf.store}:{sf.store}"]
            for k, v in env.items():
                argv += ["-e", f"{k}={v}"]
            runner = cmd(*argv) + (f' -v "$T/token":{fetch.TOKEN_MOUNT}:ro' if token else "") + " " + cmd(args.image, "-")
        if host.name in args.local_hosts:
            job = {**job, "watch_pid": os.getpid()}
        lines.append(f"{RUNNER_MARK}{runner} <<'SPARKPROV_FETCH'\n{fetch.program(job)}\nSPARKPROV_FETCH")
        return "\n".join(lines) + "\n"
