"""A stage run: list the hub, read every store, verify, download once, fan out with rsync, publish.

    1. hub listing (control machine)         gated without a token fails here, before any host
    2. one gather per host                   store state, free space, tools, identity, fabric
    3. plan + disk check on every host       not enough space fails here, with numbers
    4. verify what is present but unproven   sha256 on the host; bad files are removed
    5. download on the source                huggingface_hub in the serving image (or, when the
                                             source is the control machine, sparkprov's own env)
    6. fan-out                               rsync from a host holding the file to each host that
                                             lacks it, over the receiver's fabric address, at most
                                             `streams` rsync processes at once, --partial
                                             --append-verify so a cut link resumes
    7. publish on each receiver              sha256 again there, rename, symlink, record

A host whose store is complete and verified costs one remote call (step 2) and reports ok.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sparkprov.data.inventory import Host, Inventory
from sparkprov.engine.facts import HostInfo, ShellCtx, build_gather, parse_gather
from sparkprov.engine.report import Report, TaskResult
from sparkprov.engine.run import BecomePassword, HostRun, make_transport, settle_become
from sparkprov.errors import SparkprovError
from sparkprov.staging import fetch, verify
from sparkprov.staging.facts import DOWNLOADER_PREFIX, StoreState
from sparkprov.staging.hub import StageSpec, endpoint_env, list_stage, resolve_token, spec_for
from sparkprov.staging.plan import (STAGING, Assignment, HostPlan, Item, Status, StoreFacts, assign, check_disk,
                                    human, plan_host, split_streams, streams_per_pair)
from sparkprov.staging.progress import Progress
from sparkprov.transport.base import Transport, Unreachable
from sparkprov.transport.shell import cmd, quote

DEFAULT_STORE = "~/vllm"
PLAY = "stage-weights"


@dataclass
class StageOptions:
    check: bool = False
    rehash: bool = False
    source: str | None = None
    streams: int = 4
    image: str | None = None
    accept_new_host_keys: bool = False
    interactive: bool | None = None
    progress_stream: Any = None
    live: bool = False
    progress_interval: float = 5.0


@dataclass
class Node:
    host: Host
    hr: HostRun
    store: str = DEFAULT_STORE
    facts: StoreFacts | None = None
    plan: HostPlan | None = None
    fabric: str | None = None          # the address peers send to (fabric), when known
    route: str | None = None           # the address it was actually sent to
    poll_transport: Transport | None = None
    dead: bool = False
    received: dict[str, int] = field(default_factory=dict)   # sender -> bytes
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def t(self) -> Transport:
        return self.hr.transport

    @property
    def local(self) -> bool:
        return self.host.connection == "local"


class Stage:
    def __init__(self, inventory: Inventory, hosts: list[str], model: str, options: StageOptions, report: Report):
        self.inventory = inventory
        self.model = model
        self.o = options
        self.report = report
        self.nodes = {h: Node(inventory.hosts[h], HostRun(inventory.hosts[h])) for h in hosts}
        for n in self.nodes.values():
            n.store = str(n.host.vars.get("model_store") or DEFAULT_STORE)
        self.password = BecomePassword(options.interactive if options.interactive is not None else sys.stdin.isatty())
        self.source = self._pick_source(options.source)
        first = inventory.hosts[hosts[0]]
        self.endpoint = str(first.vars.get("hf_endpoint") or "https://huggingface.co").rstrip("/")
        self.summary: dict[str, Any] = {"model": model, "source": self.source, "endpoint": self.endpoint}
        self.progress: Progress | None = None
        self._route: dict[tuple[str, str], tuple[str, list[str]]] = {}
        self._route_lock = threading.Lock()
        report.set_hosts(hosts)

    # -- choosing -------------------------------------------------------------------------
    def _pick_source(self, wanted: str | None) -> str:
        if wanted:
            if wanted not in self.nodes:
                raise SparkprovError(f"--source {wanted} is not one of the selected hosts ({', '.join(self.nodes)})",
                                     fix="pick a host the stage runs on")
            return wanted
        for name, n in self.nodes.items():  # the control machine is a Spark: the bytes are already here
            if n.local:
                return name
        return next(iter(self.nodes))

    def _result(self, node: Node, task: str, status: str, msg: str = "") -> None:
        self.report.record(TaskResult(node.name, PLAY, task, "stage", status, msg, warnings=list(node.warnings)))
        node.warnings.clear()
        if status in ("failed", "unreachable"):
            node.dead = True

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        spec = spec_for(self.model)
        self.image = self.o.image or spec.image or self.nodes[self.source].host.vars.get("stage_image")
        token, token_src = resolve_token()
        self.token = token
        items, listings = list_stage(spec, self.endpoint, token)
        self.items = items
        self.summary.update({
            "repos": {f"{l.repo}@{l.revision}": l.commit for l in listings},
            "files": len({i.rel for i in items}), "bytes": sum({i.rel: i.size for i in items}.values()),
            "token": token_src or None, "image": self.image,
        })
        try:
            self._gather_all(spec)
            live = [n for n in self.nodes.values() if not n.dead]
            if not live:
                return self._finish(t0)
            for n in live:
                n.plan = plan_host(n.name, items, n.facts, rehash=self.o.rehash)
            problems = [p for n in live if (p := check_disk(n.plan, n.facts.store))]
            if problems:
                for p in problems:
                    self._result(self.nodes[p.host], "disk space", "failed", p.message())
                for n in live:
                    if not n.dead:
                        self._result(n, "disk space", "skipped", "another host lacks space; nothing was transferred")
                return self._finish(t0)
            if self.o.check:
                self._check_report()
                return self._finish(t0)
            self._verify_present()
            self._transfer()
        finally:
            for n in self.nodes.values():
                if n.hr.transport is not None:
                    self.report.hosts[n.name].remote_calls = n.hr.transport.remote_calls
                    n.hr.transport.close()
                if n.poll_transport is not None:
                    n.poll_transport.close()
        return self._finish(t0)

    def _finish(self, t0: float) -> dict[str, Any]:
        self.summary["seconds"] = round(time.monotonic() - t0, 3)
        self.summary["progress_polls"] = self.progress.polls if self.progress else 0
        self.summary["hosts"] = {
            n.name: {"store": n.facts.store if n.facts else None, "fabric_address": n.fabric, "sent_to": n.route,
                     "received": n.received, "seconds": {k: round(v, 3) for k, v in n.seconds.items()},
                     "complete": bool(n.plan and not n.dead and n.plan.complete)}
            for n in self.nodes.values()}
        for n in self.nodes.values():
            if n.hr.transport is not None:
                self.report.hosts[n.name].remote_calls = n.hr.transport.remote_calls
        return self.summary

    # -- 2. gather ------------------------------------------------------------------------------
    def _fabric_fact(self):
        """Provision's FabricInfo fact (sparkprov/facts/hardware.py), when it is installed."""
        try:
            from sparkprov.facts.hardware import FabricInfo  # type: ignore[import-not-found]

            return FabricInfo()
        except (ImportError, TypeError):
            return None

    def _gather_all(self, spec: StageSpec) -> None:
        repos = tuple(sorted({i.repo for i in self.items if i.dest is None}))
        dests = tuple(sorted({i.dest for i in self.items if i.dest is not None}))
        fabric = self._fabric_fact()

        def one(n: Node) -> None:
            try:
                n.hr.transport = make_transport(n.host, self.o.accept_new_host_keys)
                n.t.connect()
                state = StoreState(n.store, repos, dests, self.image or "" if n.name == self.source and not n.local else "")
                facts = [HostInfo(), state] + ([fabric] if fabric is not None else [])
                probe = n.name == self.source and not n.local
                pw = self.password.configured(n.host) if probe else None
                gs = build_gather(facts, ShellCtx(None), become=False, password=pw, probe_become=probe)
                res = n.t.run_script(gs.script)
                parsed = parse_gather(gs, res.stdout)
                if state.key not in parsed.values:
                    raise SparkprovError(f"{n.name}: cannot read the model store: "
                                         f"{parsed.errors.get(state.key) or res.stderr.strip()}")
                n.hr.info = parsed.values.get(HostInfo().key, {})
                n.facts = parsed.values[state.key]
                n._become_how = parsed.become  # settled only if the download needs root for docker
                n._become_pw = pw
                n.fabric = self._fabric_address(n, parsed.values.get(fabric.key) if fabric is not None else None)
            except Unreachable as exc:
                self._result(n, "connect", "unreachable", exc.line())
            except SparkprovError as exc:
                self._result(n, "read store", "failed", exc.line())

        with ThreadPoolExecutor(max_workers=min(32, len(self.nodes))) as pool:
            list(pool.map(one, self.nodes.values()))

    def _fabric_address(self, n: Node, fabric_value: Any) -> str | None:
        explicit = n.host.vars.get("fabric_address")
        if explicit:
            return str(explicit)
        if fabric_value is None:
            return None
        ip = fabric_value.get("node_ip") if isinstance(fabric_value, dict) else getattr(fabric_value, "node_ip", None)
        return str(ip) if ip else None

    # -- check mode --------------------------------------------------------------------------------
    def _check_report(self) -> None:
        plans = {n.name: n.plan for n in self.nodes.values() if not n.dead}
        asg = assign(plans, self.source)
        for n in self.nodes.values():
            if n.dead:
                continue
            p = n.plan
            if p.complete:
                self._result(n, f"stage {self.model}", "ok", f"complete: {len(p.files)} files, {human(p.total_bytes)} verified")
                continue
            what = []
            if p.to_verify:
                what.append(f"verify {len(p.to_verify)} files ({human(sum(f.item.size for f in p.to_verify))})")
            if n.name == self.source and asg.download:
                resume = sum(f.have for f in p.to_fetch if f.item in asg.download)
                what.append(f"download {len(asg.download)} files ({human(sum(i.size for i in asg.download))}) "
                            f"from {self.endpoint}" + (f", resuming {human(resume)} on disk" if resume else ""))
            for (s, r), its in asg.pushes.items():
                if r == n.name:
                    what.append(f"receive {len(its)} files ({human(sum(i.size for i in its))}) from {s}"
                                f" over {self._receiver_address(self.nodes[s], n)[0]}")
            if p.links or p.refs:
                what.append(f"link {len(p.links)} snapshot paths" + (f", write {len(p.refs)} refs" if p.refs else ""))
            self._result(n, f"stage {self.model}", "changed", "would: " + "; ".join(what) +
                         f" [{p.summary()}; {human(p.free or 0)} free]")

    # -- 4. verify -----------------------------------------------------------------------------------
    def _verify_present(self) -> None:
        todo = [n for n in self.nodes.values() if not n.dead and n.plan.to_verify]

        def one(n: Node) -> None:
            checks = [verify.Check("staged" if f.status is Status.STAGED else "published", f.item) for f in n.plan.to_verify]
            t = time.monotonic()
            res = n.t.run_script(verify.script(n.facts.store, checks, parallel=4))
            n.seconds["verify"] = time.monotonic() - t
            found = verify.parse(res.stdout)
            bad = []
            for c in checks:
                good, got = found.get(c.item.rel, (False, "not hashed: " + (res.stderr.strip().splitlines() or ["?"])[-1]))
                fs = n.plan.files[c.item.rel]
                if good:
                    fs.status, fs.have = Status.OK, 0
                else:
                    fs.status, fs.have = Status.MISSING, 0
                    bad.append(f"{c.item.path} ({got})")
            size = human(sum(c.item.size for c in checks))
            if bad:
                self._result(n, "verify store", "changed",
                             f"hashed {len(checks)} files ({size}); {len(bad)} bad, removed: " + ", ".join(bad[:5]))
            else:
                self._result(n, "verify store", "changed" if any(c.mode == "staged" for c in checks) else "ok",
                             f"hashed {len(checks)} files ({size}): all match the hub")

        with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
            list(pool.map(one, todo))
        for n in todo:  # removed bad files grow the need: check the space again
            p = check_disk(n.plan, n.facts.store)
            if p:
                self._result(n, "disk space", "failed", p.message())

    # -- 5-7. transfer ---------------------------------------------------------------------------------
    def _transfer(self) -> None:
        live = {n.name: n.plan for n in self.nodes.values() if not n.dead}
        src = self.nodes[self.source]
        if src.dead:
            raise_for = [n for n in self.nodes.values() if not n.dead and n.plan.to_fetch]
            for n in raise_for:
                self._result(n, f"stage {self.model}", "failed", f"the source {src.name} is not usable")
            return
        asg = assign(live, self.source)
        self._start_progress(asg)
        try:
            if asg.download:
                self._download(src, asg)
            self._fan_out(asg)
        finally:
            if self.progress:
                self.progress.stop()
        for n in self.nodes.values():
            if n.dead:
                continue
            left = n.plan.with_status(Status.MISSING, Status.PARTIAL, Status.WRONG, Status.STAGED, Status.UNVERIFIED)
            if left:
                self._result(n, f"stage {self.model}", "failed",
                             f"{len(left)} files still missing: " + ", ".join(f.item.path for f in left[:5]))
            elif n.plan.links or n.plan.refs:
                self._finish_links(n)
            else:
                self._result(n, f"stage {self.model}", "ok",
                             f"complete: {len(n.plan.files)} files, {human(n.plan.total_bytes)} verified in {n.facts.store}")

    def _finish_links(self, n: Node) -> None:
        res = n.t.run_script(verify.script(n.facts.store, [], links=n.plan.links, refs=n.plan.refs))
        if res.rc != 0:
            self._result(n, "link snapshot", "failed", (res.stderr.strip().splitlines() or [f"rc={res.rc}"])[-1])
            return
        self._result(n, "link snapshot", "changed",
                     f"linked {len(n.plan.links)} snapshot paths" + (f", wrote {len(n.plan.refs)} refs" if n.plan.refs else ""))
        n.plan.links, n.plan.refs = [], {}
        self._result(n, f"stage {self.model}", "ok",
                     f"complete: {len(n.plan.files)} files, {human(n.plan.total_bytes)} verified in {n.facts.store}")

    # -- progress -------------------------------------------------------------------------------------------
    def _start_progress(self, asg: Assignment) -> None:
        stream = self.o.progress_stream
        if stream is None:
            return
        self.progress = Progress(stream, live=self.o.live, interval=self.o.progress_interval)
        watch: dict[str, list[Item]] = {}
        for n in self.nodes.values():
            if n.dead:
                continue
            items = [f.item for f in n.plan.to_fetch]
            if items:
                watch[n.name] = items
                self.progress.set_total(n.name, sum(i.size for i in items), sum(f.have for f in n.plan.to_fetch))
        if not watch:
            self.progress = None
            return

        def poll_host(name: str) -> None:
            n = self.nodes[name]
            if n.poll_transport is None:
                n.poll_transport = make_transport(n.host, self.o.accept_new_host_keys)
                n.poll_transport.connect()
            rels = watch[name]
            script = (f"cd {quote(n.facts.store)} 2>/dev/null || exit 0\n"
                      + "".join(f"printf '%s\\t%s\\n' {quote(i.rel)} \"$(stat -c %s {quote(i.rel)} 2>/dev/null || "
                                f"stat -c %s {quote(i.staged)} 2>/dev/null || echo 0)\"\n" for i in rels))
            out = n.poll_transport.run_script(script, timeout=15).stdout
            sizes = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
            done = sum(min(int(sizes.get(i.rel, "0") or 0), i.size) for i in rels)
            self.progress.bytes(name, done)

        def poll() -> None:
            with ThreadPoolExecutor(max_workers=len(watch)) as pool:
                list(pool.map(poll_host, [h for h in watch if not self.nodes[h].dead]))

        self.progress.start(poll, poll_every=1.0)

    # -- 5. download -------------------------------------------------------------------------------------------
    def _download(self, src: Node, asg: Assignment) -> None:
        if self.progress:
            self.progress.phase(src.name, f"download from {self.endpoint}")
        job = {
            "endpoint": self.endpoint, "store": src.facts.store, "workers": max(1, min(self.o.streams, 8)),
            "files": [{"repo": i.repo, "path": i.path, "commit": i.commit, "size": i.size, "large": i.large,
                       "digest": i.digest, "rel": i.rel, "link": i.link, "link_target": i.link_target}
                      for i in asg.download],
            "refs": src.plan.refs,
        }
        # every snapshot path of a downloaded blob (the same content may sit at two paths)
        links = [i for i in self.items if i.rel in {d.rel for d in asg.download} and i.link and i not in asg.download]
        try:
            script, become = self._download_script(src, job)
        except SparkprovError as exc:
            self._result(src, "download from hub", "failed", exc.line())
            return
        have = sum(src.plan.files[i.rel].have for i in asg.download)
        t = time.monotonic()
        res = src.t.run_script(script, become=become)
        secs = time.monotonic() - t
        src.seconds["download"] = secs
        results = {}
        for line in res.stdout.splitlines():
            if line.startswith("SPARKPROV-FETCH "):
                msg = json.loads(line[len("SPARKPROV-FETCH "):])
                if "file" in msg:
                    results[msg["file"]["rel"]] = msg["file"]
        ok = [i for i in asg.download if results.get(i.rel, {}).get("ok")]
        bad = [i for i in asg.download if i not in ok]
        for i in ok:
            src.plan.files[i.rel].status = Status.OK
        src.plan.refs = {}
        src.plan.links = [i for i in src.plan.links if i.rel not in {d.rel for d in ok}] + links
        got = sum(i.size for i in ok)
        resumed = sum(r.get("resumed_from", 0) for r in results.values())
        rate = (got - have) / secs if secs > 0 else 0
        msg = (f"downloaded {len(ok)} files ({human(got)}) from {self.endpoint} in {secs:.1f}s "
               f"({human(rate)}/s)" + (f", resumed {human(resumed)} already on disk" if resumed else "")
               + f"; sha256 verified and published in {src.facts.store}")
        if self.progress:
            self.progress.phase(src.name, "downloaded" if not bad else "download failed", finished=not bad)
        if bad:
            why = [f"{i.path}: {results.get(i.rel, {}).get('error', 'no result')}" for i in bad[:3]]
            detail = (res.stderr.strip().splitlines() or [""])[-1] if not results else ""
            self._result(src, "download from hub", "failed",
                         f"{len(bad)} of {len(asg.download)} files failed: " + "; ".join(why)
                         + (f" ({detail})" if detail else "") + (f"; {msg}" if ok else ""))
        else:
            self._result(src, "download from hub", "changed", msg)

    def _download_script(self, src: Node, job: dict) -> tuple[str, bool]:
        f = src.facts
        env = {**endpoint_env(self.endpoint), "HF_HOME": f.store, "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1"}
        name = DOWNLOADER_PREFIX + hashlib.sha1(f.store.encode()).hexdigest()[:12]
        lines = ["set -e", f"S={quote(f.store)}", 'T=$(mktemp -d)', "trap 'rm -rf \"$T\"' EXIT INT TERM HUP"]
        become = False
        if src.local:
            job = {**job, "watch_pid": os.getpid()}
            lines.append('mkdir -p "$S/.sparkprov"')
            if self.token:
                lines.append("(umask 077; cat > \"$T/token\") <<'SPARKPROV_TOKEN'\n" + self.token + "\nSPARKPROV_TOKEN")
            envs = " ".join(f"{k}={quote(v)}" for k, v in env.items())
            runner = f"{envs} SPARKPROV_TOKEN_FILE=\"$T/token\" {quote(sys.executable)} -"
        else:
            if not self.image:
                raise SparkprovError(f"{src.name}: no image to run huggingface_hub in",
                                     fix="give --image, or use a catalog alias (its serving image)")
            state = f.image or ""
            if "docker" not in f.tools:
                raise SparkprovError(f"{src.name}: docker is not installed", fix="run `invoke provision` first")
            if state.startswith("error") and "permission denied" in state.lower():
                become = True
                self._settle_become(src)
            elif state.startswith("error"):
                raise SparkprovError(f"{src.name}: docker: {state[len('error: '):]}", fix="check dockerd on the host")
            if become:
                lines.append(f'[ -d "$S" ] || {{ mkdir -p "$S" && chown {f.uid}:{f.gid} "$S"; }}')
                lines.append(f'[ -d "$S/.sparkprov" ] || {{ mkdir -p "$S/.sparkprov" && chown {f.uid}:{f.gid} "$S/.sparkprov"; }}')
            else:
                lines.append('mkdir -p "$S/.sparkprov"')
            if self.token:
                lines.append("(umask 077; cat > \"$T/token\") <<'SPARKPROV_TOKEN'\n" + self.token + "\nSPARKPROV_TOKEN")
                if become:
                    lines.append(f'chown {f.uid}:{f.gid} "$T" "$T/token"')
            lines.append(cmd("docker", "rm", "-f", name) + " >/dev/null 2>&1 </dev/null || true")
            if state != "present":
                lines.append(cmd("docker", "pull", "-q", self.image) + " </dev/null >&2")
            argv = ["docker", "run", "--rm", "-i", "--name", name, "--network", "host", "--user", f"{f.uid}:{f.gid}",
                    "--entrypoint", "python3", "-v", f"{f.store}:{f.store}"]
            for k, v in env.items():
                argv += ["-e", f"{k}={v}"]
            runner = cmd(*argv)
            if self.token:
                runner += f' -v "$T/token":{fetch.TOKEN_MOUNT}:ro'
            runner += " " + cmd(self.image, "-")
        lines.append(f"{runner} <<'SPARKPROV_FETCH'\n{fetch.program(job)}\nSPARKPROV_FETCH")
        return "\n".join(lines) + "\n", become

    def _settle_become(self, n: Node) -> None:
        if n.t.become_method is not None:
            return
        settle_become(n.hr, getattr(n, "_become_how", None), getattr(n, "_become_pw", None), self.password)

    # -- 6. fan-out --------------------------------------------------------------------------------------------
    def _routes(self, sender: Node, receiver: Node) -> list[tuple[str, list[str]]]:
        """Where `sender` can send to `receiver`, best first, each with its ssh options.

        Host to host: the receiver's fabric address, over provision's SSH mesh (the login user's key,
        known_hosts pinned by provision). From the control machine: the fabric address when it can
        reach it, checking the host key against the inventory address's entry (HostKeyAlias), then
        the inventory address; both with the inventory's key and known_hosts."""
        base = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=5",
                "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4", "-o", "Compression=no", "-T", "-x"]
        h = receiver.host
        if not sender.local:
            if receiver.fabric:
                return [(receiver.fabric, base)]
            return [(h.address, base + (["-p", str(h.port)] if h.port else []))]
        opts = list(base)
        if h.ssh_key:
            opts += ["-i", os.path.expanduser(h.ssh_key), "-o", "IdentitiesOnly=yes"]
        if h.known_hosts:
            opts += ["-o", f"UserKnownHostsFile={os.path.expanduser(h.known_hosts)}", "-o",
                     "GlobalKnownHostsFile=/dev/null"]
        if h.port:
            opts += ["-p", str(h.port)]
        routes = []
        # Only a control machine that sits on the fabric itself (a Spark as source) sends there;
        # anything else would route a private address through its default gateway.
        if receiver.fabric and receiver.fabric != h.address and on_local_link(receiver.fabric):
            routes.append((receiver.fabric, opts + ["-o", f"HostKeyAlias={h.address}"]))
        routes.append((h.address, opts))
        return routes

    def _receiver_address(self, sender: Node, receiver: Node) -> tuple[str, list[str]]:
        key = (sender.name, receiver.name)
        with self._route_lock:
            if key in self._route:
                return self._route[key]
        routes = self._routes(sender, receiver)
        if not sender.local and not receiver.fabric:
            receiver.warnings.append(f"no fabric address known for {receiver.name} (run `invoke provision`); "
                                     f"sending over {receiver.host.address}")
        return routes[0]

    def _fan_out(self, asg: Assignment) -> None:
        pushes = {k: v for k, v in asg.pushes.items()
                  if not self.nodes[k[0]].dead and not self.nodes[k[1]].dead}
        # items the source was to download and could not: receivers cannot get them
        per = streams_per_pair(len(pushes), self.o.streams)
        jobs: list[tuple[str, str, list[Item]]] = []
        for (s, r), items in pushes.items():
            ready = [i for i in items if self.nodes[s].plan.files[i.rel].status is Status.OK]
            for group in split_streams(ready, per):
                jobs.append((s, r, group))
        by_receiver: dict[str, list[tuple[str, str, list[Item]]]] = {}
        for j in jobs:
            by_receiver.setdefault(j[1], []).append(j)
        pending = {r: len(js) for r, js in by_receiver.items()}
        lock = threading.Lock()
        failures: dict[str, list[str]] = {}
        started: dict[str, float] = {}

        def push(job: tuple[str, str, list[Item]]) -> None:
            s, r, items = job
            sender, receiver = self.nodes[s], self.nodes[r]
            with lock:
                started.setdefault(r, time.monotonic())
            if self.progress:
                self.progress.phase(r, f"receive from {s}")
            err = self._rsync(sender, receiver, items)
            with lock:
                if err:
                    failures.setdefault(r, []).append(err)
                else:
                    receiver.received[s] = receiver.received.get(s, 0) + sum(i.size for i in items)
                pending[r] -= 1
                last = pending[r] == 0
            if last:
                receiver.seconds["receive"] = time.monotonic() - started[r]
                self._publish_received(receiver, [i for j in by_receiver[r] for i in j[2]], failures.get(r, []))

        with ThreadPoolExecutor(max_workers=max(1, self.o.streams)) as pool:
            list(pool.map(push, jobs))

    def _rsync(self, sender: Node, receiver: Node, items: list[Item]) -> str | None:
        """Push `items` into the receiver's staging area; on an ssh-level failure (rc 255) try the
        next route (the fabric may be out of the control machine's reach). Partial files stay and
        --append-verify resumes them."""
        key = (sender.name, receiver.name)
        with self._route_lock:
            routes = [self._route[key]] if key in self._route else self._routes(sender, receiver)
        if not sender.local and not receiver.fabric:
            receiver.warnings.append(f"no fabric address known for {receiver.name} (run `invoke provision`); "
                                     f"sending over {receiver.host.address}")
        errors = []
        for addr, ssh in routes:
            user = receiver.facts.user or receiver.host.user or "nvidia"
            host = f"[{addr}]" if ":" in addr else addr
            dest = f"{user}@{host}:{receiver.facts.store}/{STAGING}/"
            files = "\n".join(i.rel for i in items)
            argv = ["rsync", "-a", "--mkpath", "--partial", "--append-verify", "--timeout=60", "--files-from=-",
                    "-e", " ".join(quote(w) for w in ssh), f"{sender.facts.store}/", dest]
            res = sender.t.run_script(f"{cmd(*argv)} <<'SPARKPROV_FILES'\n{files}\nSPARKPROV_FILES\n")
            if res.rc == 0:
                with self._route_lock:
                    self._route[key] = (addr, ssh)
                receiver.route = addr
                return None
            detail = (res.stderr.strip().splitlines() or [f"rc={res.rc}"])[-1]
            errors.append(f"rsync {sender.name} -> {receiver.name} ({addr}) failed (rc={res.rc}): {detail}")
            if res.rc != 255:
                break
        return "; ".join(errors)

    def _publish_received(self, n: Node, items: list[Item], errors: list[str], *, retry: bool = True) -> None:
        if self.progress:
            self.progress.phase(n.name, "verify + publish")
        checks = [verify.Check("staged", i) for i in items]
        t = time.monotonic()
        links = [i for i in n.plan.links if i.rel not in {c.item.rel for c in checks}]
        res = n.t.run_script(verify.script(n.facts.store, checks, links=links, refs=n.plan.refs, parallel=4))
        n.seconds["publish"] = n.seconds.get("publish", 0) + time.monotonic() - t
        found = verify.parse(res.stdout)
        good = [i for i in items if found.get(i.rel, (False, ""))[0]]
        # cut short (a failed rsync): kept in staging, the next run resumes them (--append-verify)
        partial = [i for i in items if i not in good and found.get(i.rel, (False, ""))[1].startswith("partial")]
        bad = [i for i in items if i not in good and (i not in partial or not errors)]
        partial = [i for i in partial if i not in bad]
        for i in good:
            n.plan.files[i.rel].status = Status.OK
        n.plan.links, n.plan.refs = [], {}
        # extra snapshot paths that share a blob with a received file
        more = [i for i in self.items if i.link and i.rel in {g.rel for g in good} and i not in items]
        if more:
            n.t.run_script(verify.script(n.facts.store, [], links=more))
        senders = ", ".join(f"{s} ({human(b)})" for s, b in n.received.items())
        secs = n.seconds.get("receive", 0.0)
        got = sum(i.size for i in good)
        if bad and retry and not errors:
            # bytes that arrived wrong (a cut link left garbage, a flipped bit): send those once more
            for i in bad:
                n.plan.files[i.rel].status = Status.MISSING
            sender = next((s for s in n.received), self.source)
            err = self._rsync(self.nodes[sender], n, bad)
            self._publish_received(n, bad, [err] if err else [], retry=False)
            return
        if errors or bad:
            kept = sum(int(found[i.rel][1].split(": ", 1)[1] or 0) for i in partial)
            self._result(n, "receive", "failed", "; ".join(errors[:2]) +
                         (f"; {len(bad)} files failed verification: " + ", ".join(i.path for i in bad[:5]) if bad else "")
                         + (f"; {len(partial)} partial files ({human(kept)}) kept for the next run to resume"
                            if partial else ""))
            if self.progress:
                self.progress.phase(n.name, "failed", finished=True)
            return
        self._result(n, "receive", "changed",
                     f"received {len(good)} files ({human(got)}) from {senders} over {n.route} in {secs:.1f}s "
                     f"({human(got / secs if secs else 0)}/s); sha256 verified and published")
        if self.progress:
            self.progress.phase(n.name, "done", finished=True)


def run_stage(inventory: Inventory, hosts: list[str], model: str, options: StageOptions, report: Report) -> dict:
    return Stage(inventory, hosts, model, options, report).run()


def on_local_link(address: str) -> bool:
    """True when this machine has an interface address in the same subnet as `address`
    (reachable without a gateway)."""
    import ipaddress
    import json as _json
    import subprocess

    try:
        target = ipaddress.ip_address(address)
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
        for iface in _json.loads(out or "[]"):
            for a in iface.get("addr_info", []):
                net = ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
                if target in net and not net.is_loopback:
                    return True
    except (ValueError, OSError, subprocess.SubprocessError, KeyError):
        return False
    return False
