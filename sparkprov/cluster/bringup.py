"""`invoke cluster-up`: start what the serve playbook defines, prove it serves, report.

One gather per host reads everything (containers by label, images, store, key file, fabric,
driver, docker access, memory, listeners, the running server's /health). A deployment whose
containers all run with the wanted recipe hash and answer /health is left alone: a no-op run
costs one remote call per host. Otherwise, after a preflight that changes nothing (lint, facts,
weights, image, memory, ports), the deployment's containers are replaced: single node = one
`docker run` per host; TP > 1 = Ray head, then workers, a watched wait until Ray reports every
node's GPU, vLLM on the head. Then /health (long timeout, progress), a warm-up request and the
smoke test (arithmetic, thinking set explicitly, degenerate output fails it). A failure after
anything started removes that deployment's containers (by label) on all its hosts; containers
sparkprov did not start are never touched.
"""

from __future__ import annotations

import json
import posixpath
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

from sparkprov.catalog.lint import WARNING, errors as lint_errors, lint_cluster, lint_launch
from sparkprov.catalog.load import Catalog, load_catalog
from sparkprov.catalog.render import HostServeContext, Launch, render_launch
from sparkprov.cluster import probe, spec as specmod
from sparkprov.cluster.facts import ImageId, KeyFile, Listeners, ManagedContainers, RayStatus, ServerState
from sparkprov.cluster.hosts import (DEFAULT_KEY_FILE, DEFAULT_PORT, Node, become_fix, close_all, connect_and_gather, regather)
from sparkprov.cluster.playbook import Deployment, ServePlaybook
from sparkprov.cluster.progress import Poll, Progress, WaitTimeout
from sparkprov.data.inventory import Inventory
from sparkprov.engine.report import Report, TaskResult
from sparkprov.errors import SparkprovError
from sparkprov.facts.hardware import FabricInfo, MemInfo, NvidiaSmi, OllamaState, gib
from sparkprov.staging.facts import StoreState
from sparkprov.staging.plan import repo_dir
from sparkprov.transport.shell import cmd, quote

PLAY = "cluster-up"


@dataclass
class UpOptions:
    check: bool = False
    recipes: list[str] = field(default_factory=list)
    accept_new_host_keys: bool = False
    stage: bool | None = None         # None: ask on a terminal, else say how
    unload_ollama: bool = False
    drop_caches: bool = True
    image_source: str = "auto"        # auto | registry | peer
    ray_timeout: float = 300.0
    health_timeout: float | None = None  # default: the recipe's startup.health_timeout_s
    verify: bool = False              # smoke-test deployments that were already up too
    prune: bool = False               # remove sparkprov containers of deployments not in the playbook
    progress_stream: TextIO | None = None
    live: bool | None = None
    progress_interval: float = 10.0
    quiet: bool = False


@dataclass
class Plan:
    dep: Deployment
    specs: list[specmod.ContainerSpec]
    launches: dict[str, Launch]
    action: str = "start"            # ok | wait | start | replace
    why: str = ""
    summary: dict[str, Any] = field(default_factory=dict)


class Failed(Exception):
    def __init__(self, host: str, step: str, msg: str):
        super().__init__(msg)
        self.host, self.step, self.msg = host, step, msg


def staged_problem(facts, repo: str, revision: str) -> str | None:
    """Why a repo is not staged and verified in this store (None: it is). Needs no hub: the
    snapshot's links must resolve to published blobs whose verified record (size, mtime) holds."""
    base = repo_dir(repo)
    commit = revision if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision) else \
        (facts.refs.get(f"{base}/refs/{revision}") or "").strip()
    if not commit:
        return f"{repo}@{revision} is not in the store (no {base}/refs/{revision})"
    snap = f"{base}/snapshots/{commit}/"
    links = {p: e for p, e in facts.entries.items() if p.startswith(snap)}
    if not links:
        return f"{repo}: snapshot {commit[:12]} is empty"
    if not any(p.endswith("/config.json") or p == snap + "config.json" for p in links):
        return f"{repo}: snapshot {commit[:12]} has no config.json"
    for p, e in sorted(links.items()):
        if e.kind != "l":
            return f"{repo}: {p[len(snap):]} is not a link into blobs/ (a stray file in the snapshot)"
        blob = posixpath.normpath(posixpath.join(posixpath.dirname(p), e.target))
        b = facts.entries.get(blob)
        if b is None or b.kind != "f":
            return f"{repo}: {p[len(snap):]} points at a missing blob"
        rec = facts.verified.get(blob)
        if rec is None or rec.size != b.size or rec.mtime_ns != b.mtime_ns:
            return f"{repo}: {p[len(snap):]} is not verified (changed since it was hashed, or never hashed)"
    return None


def _repos(recipe) -> list[tuple[str, str]]:
    out = [] if recipe.model.local_dir else [(recipe.model.repo, recipe.model.revision)]
    out += [(x.repo, x.revision) for x in recipe.extra_repos]
    return out


class ClusterUp:
    def __init__(self, inventory: Inventory, playbook: ServePlaybook, deployments: list[Deployment],
                 options: UpOptions, report: Report):
        self.inv = inventory
        self.pb = playbook
        self.deps = deployments
        self.o = options
        self.report = report
        self.catalog: Catalog = load_catalog(list(playbook.recipe_files) + list(options.recipes))
        self.progress = Progress(options.progress_stream, live=options.live, interval=options.progress_interval,
                                 quiet=options.quiet)
        self.hosts = [h for h in inventory.hosts if any(h in d.hosts for d in deployments)]
        self.nodes: dict[str, Node] = {}
        self.recipes = {d.name: self.catalog.get(d.model) for d in deployments}
        for d in deployments:
            r = self.recipes[d.name]
            if d.tp not in r.tp_sizes:
                raise d.error(f"{d.model} runs at TP {', '.join(map(str, r.tp_sizes))}, not {d.tp} (G35)",
                              fix=f"set tp: {r.tp_sizes[0]} (and as many hosts)")
        report.set_hosts(self.hosts)
        self.summary: dict[str, Any] = {"deployments": {}}
        self._store_fact: dict[str, StoreState] = {}
        self._listen_fact: dict[str, Listeners] = {}
        self._all_plans: list[Plan] = []

    # ------------------------------------------------------------------ facts
    def _port(self, d: Deployment, node: Node) -> int:
        return int(d.port or node.vars.get("serve_port") or DEFAULT_PORT)

    def _facts(self, node: Node):
        out = [NvidiaSmi(), FabricInfo(), MemInfo(), OllamaState(), ManagedContainers()]
        repos: list[str] = []
        ports: list[int] = []
        for d in self.deps:
            if node.name not in d.hosts:
                continue
            r = self.recipes[d.name]
            repos += [repo for repo, _ in _repos(r)]
            img = self.catalog.image(r.image)
            out.append(ImageId(r.image if ("@" in r.image or img is None) else img.pinned))
            port = self._port(d, node)
            ports.append(port)
            if not d.cluster or node.name == d.head:
                key = node.vars.get("api_key_file", DEFAULT_KEY_FILE) or None
                if key:
                    out.append(KeyFile(str(key)))
                out.append(ServerState(self._base(node, port), str(key) if key else None))
        self._store_fact[node.name] = StoreState(str(node.vars.get("model_store") or "~/vllm"), tuple(sorted(set(repos))))
        self._listen_fact[node.name] = Listeners(tuple(sorted(set(ports))))
        return out + [self._store_fact[node.name], self._listen_fact[node.name]]

    def _base(self, node: Node, port: int) -> str:
        bind = str(node.vars.get("serve_bind") or "0.0.0.0")
        host = "127.0.0.1" if bind in ("0.0.0.0", "::", "localhost") else bind
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ report helpers
    def _rec(self, host: str, task: str, status: str, msg: str = "", warnings: list[str] | None = None) -> None:
        self.report.record(TaskResult(host, PLAY, task, "cluster", status, msg, warnings=warnings or []))

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            self.nodes = connect_and_gather(self.inv, self.hosts, self._facts,
                                            accept_new_host_keys=self.o.accept_new_host_keys)
            dead = [n for n in self.nodes.values() if n.unreachable]
            for n in dead:
                self.report.record(TaskResult(n.name, PLAY, "connect", "-", "unreachable", n.unreachable))
            if dead:
                return self.summary
            plans = []
            for d in self.deps:
                try:
                    plans.append(self._plan(d))
                except Failed as f:
                    self._rec(f.host, f.step, "failed", f.msg)
                except (SparkprovError, ValueError) as exc:
                    self._rec(d.head, "render", "failed", f"deployment {d.name}: {exc}")
            if any(t.failed for t in self.report.hosts.values()):
                return self.summary
            self._all_plans = plans
            self._prune_check(plans)
            if any(t.failed for t in self.report.hosts.values()):
                return self.summary
            for p in plans:
                self._do(p)
        finally:
            close_all(self.nodes, self.report)
            self.summary["seconds"] = round(time.monotonic() - t0, 2)
            self.summary["remote_calls"] = {n: t.remote_calls for n, t in self.report.hosts.items()}
        return self.summary

    # ------------------------------------------------------------------ planning
    def _ctx(self, d: Deployment, node: Node, name: str) -> HostServeContext:
        v = node.vars
        fabric = node.fact(FabricInfo()) if d.cluster else {}
        smi = node.values.get(NvidiaSmi().key) or {}
        extra: dict[str, Any] = {"container_name": name, "port": self._port(d, node)}
        if "api_key_file" not in v:
            extra["api_key_file"] = node.key_file()
        if d.cluster:
            extra["cluster_size"] = d.tp
            if "fabric_ifaces" not in v and fabric.get("nccl_socket_ifname"):
                extra["fabric_ifaces"] = [fabric["nccl_socket_ifname"]]
            if "ib_hcas" not in v and fabric.get("nccl_ib_hca"):
                extra["ib_hcas"] = fabric["nccl_ib_hca"].split(",")
            if "fabric_ip" not in v and fabric.get("node_ip"):
                extra["node_ip"] = fabric["node_ip"]
        if "driver_version" not in v and smi.get("driver_version"):
            extra["driver_version"] = smi["driver_version"]
        if "model_store" not in v:
            extra["model_store"] = node.store()
        if "compile_cache" not in v:
            extra["compile_cache"] = node.path("~/vllm-compile-cache")
        return HostServeContext.from_host_vars(node.name, v, home=node.home, **extra)

    def _plan(self, d: Deployment) -> Plan:
        r = self.recipes[d.name]
        launches: dict[str, Launch] = {}
        for i, h in enumerate(d.hosts):
            name = f"sparkprov-{d.name}" if not d.cluster else f"sparkprov-{d.name}-{'head' if i == 0 else 'worker'}"
            launches[h] = render_launch(r, self._ctx(d, self.nodes[h], name), d.tp, d.overrides, catalog=self.catalog)
        if d.cluster:
            specs = specmod.cluster(d.name, [(h, launches[h]) for h in d.hosts], d.ray_port)
        else:
            specs = [specmod.single(d.name, h, launches[h]) for h in d.hosts]
        plan = Plan(d, specs, launches)
        # what runs now
        problems = []
        healthy = True
        for s in specs:
            node = self.nodes[s.host]
            cont = node.fact(ManagedContainers())
            if not cont["access"]:
                raise Failed(s.host, "preflight", f"{s.host}: {node.info.get('user')} cannot use docker: {cont['error']} "
                             "(fix: invoke provision --hosts " + s.host + " --tags docker)")
            mine = [c for c in cont["containers"] if c["labels"].get("sparkprov.deployment") == d.name]
            have = next((c for c in mine if c["name"] == s.name), None)
            if have is None:
                problems.append(f"{s.host}: {s.name} absent")
            elif have["labels"].get("sparkprov.recipe_hash") != s.hash:
                problems.append(f"{s.host}: {s.name} runs recipe hash {have['labels'].get('sparkprov.recipe_hash')}, "
                                f"want {s.hash}")
            elif have["status"] != "running":
                problems.append(f"{s.host}: {s.name} is {have['status']}")
            if any(c["name"] != s.name for c in mine):
                problems.append(f"{s.host}: stray containers of {d.name}: "
                                + ", ".join(c["name"] for c in mine if c["name"] != s.name))
            if s.serves and have is not None:
                st = node.values.get(ServerState(self._base(node, s.port), self._keyvar(node)).key) or {}
                if st.get("health") != 200:
                    healthy = False
        if problems:
            plan.action = "replace" if any("absent" not in p for p in problems) else "start"
            plan.why = "; ".join(problems)
        else:
            plan.action = "ok" if healthy else "wait"
            plan.why = "running with the wanted recipe" + ("" if healthy else ", /health not answering yet")
        return plan

    def _keyvar(self, node: Node) -> str | None:
        k = node.vars.get("api_key_file", DEFAULT_KEY_FILE)
        return str(k) if k else None

    def _prune_check(self, plans: list[Plan]) -> None:
        """sparkprov containers on these hosts that the playbook does not define: removed with
        --prune, else they block a deployment that would share their port."""
        wanted = {p.dep.name for p in plans}
        for h in self.hosts:
            node = self.nodes[h]
            others = [c for c in node.fact(ManagedContainers())["containers"]
                      if c["labels"].get("sparkprov.deployment") not in wanted]
            if not others:
                continue
            if self.o.prune and not self.o.check:
                res = node.run("\n".join(cmd("docker", "rm", "-f", c["name"]) + " >/dev/null" for c in others))
                status = "changed" if res.ok else "failed"
                self._rec(h, "prune", status, ("removed " if res.ok else "could not remove ")
                          + ", ".join(c["name"] for c in others) + ("" if res.ok else f": {res.stderr.strip()[-200:]}"))
                continue
            if self.o.check and self.o.prune:
                self._rec(h, "prune", "changed", "would remove " + ", ".join(c["name"] for c in others))
                continue
            for c in others:
                port = c["labels"].get("sparkprov.port")
                role = c["labels"].get("sparkprov.role")
                if (port and int(port) in {s.port for p in plans for s in p.specs if s.host == h and s.port}) or \
                        role in (specmod.ROLE_HEAD, specmod.ROLE_WORKER):
                    self._rec(h, "preflight", "failed",
                              f"{h}: container {c['name']} of deployment {c['labels'].get('sparkprov.deployment')!r} "
                              f"(not in {self.pb.path}) holds the GPU/port this playbook needs "
                              "(fix: invoke cluster-down --deployments "
                              f"{c['labels'].get('sparkprov.deployment')}, or rerun with --prune)")

    # ------------------------------------------------------------------ acting
    def _do(self, p: Plan) -> None:
        d = p.dep
        info = {"model": p.specs[0].launch.served_model_name, "alias": d.model, "tp": d.tp, "hosts": d.hosts,
                "action": p.action}
        self.summary["deployments"][d.name] = info
        head = next(s for s in p.specs if s.serves)
        info["endpoint"] = self._endpoint(self.nodes[head.host], head.port)
        info["api_key_file"] = f"{head.host}:{head.launch.ctx.api_key_file}" if head.launch.ctx.api_key_file else None
        if p.action == "ok":
            for s in p.specs:
                self._rec(s.host, f"{d.name}: {s.role}", "ok", f"{s.name} up with recipe {s.hash} ({d.model})")
            if self.o.verify and not self.o.check:
                self._guard(p, lambda: self._smoke(p, head), cleanup=False)
            info["nodes"] = self._node_states(p)
            return
        if self.o.check:
            for s in p.specs:
                self._rec(s.host, f"{d.name}: {s.role}", "changed" if p.action != "wait" else "ok",
                          ("would " + ("start " if p.action == "start" else "replace ") + s.name + f": {p.why}")
                          if p.action != "wait" else f"{s.name} starting: {p.why}")
            self._preflight(p, report_ok=True)
            return
        if p.action == "wait":
            if self._guard(p, lambda: (self._wait_health(p, head), self._smoke(p, head)), cleanup=False):
                for s in p.specs:
                    self._rec(s.host, f"{d.name}: {s.role}", "ok", f"{s.name} up with recipe {s.hash}")
            info["nodes"] = self._node_states(p)
            return
        if not self._preflight(p):
            info["action"] = "failed"
            return
        t0 = time.monotonic()
        ok = self._guard(p, lambda: self._start(p, head), cleanup=True)
        info["action"] = (p.action if ok else "failed")
        info["seconds"] = round(time.monotonic() - t0, 1)
        info["nodes"] = self._node_states(p) if ok else {}

    def _endpoint(self, node: Node, port: int) -> str:
        bind = str(node.vars.get("serve_bind") or "0.0.0.0")
        host = node.host.address if bind in ("0.0.0.0", "::") else bind
        if node.host.connection == "local" and bind in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"http://{host}:{port}/v1"

    def _guard(self, p: Plan, fn, *, cleanup: bool) -> bool:
        try:
            fn()
            return True
        except Failed as f:
            self._rec(f.host, f.step, "failed", f.msg)
        except (WaitTimeout, RuntimeError, SparkprovError) as exc:
            self._rec(p.dep.head, "bring-up", "failed", str(exc))
        if cleanup:
            self._remove(p, reason="bring-up failed")
        return False

    def _remove(self, p: Plan, *, reason: str) -> None:
        flt = ["--filter", "label=sparkprov.managed=1", "--filter", f"label=sparkprov.deployment={p.dep.name}"]
        script = (f"ids=$({cmd('docker', 'ps', '-aq', *flt)}); [ -z \"$ids\" ] || "
                  "{ docker inspect --format '{{.Name}}' $ids | tr -d / | tr '\\n' ' '; docker rm -f $ids >/dev/null; }")

        def one(h: str):
            try:
                res = self.nodes[h].run(script)
            except SparkprovError as exc:  # unreachable now: say so, clean the others
                self._rec(h, f"{p.dep.name}: cleanup", "failed", f"{reason}: could not remove containers: {exc.line()} "
                          f"(fix: invoke cluster-down --hosts {h} --deployments {p.dep.name} once it is back)")
                return
            gone = res.stdout.strip()
            if gone:
                self._rec(h, f"{p.dep.name}: cleanup", "changed", f"{reason}: removed {gone}")

        with ThreadPoolExecutor(max_workers=len(p.dep.hosts)) as pool:
            list(pool.map(one, p.dep.hosts))

    # ------------------------------------------------------------------ preflight
    def _preflight(self, p: Plan, *, report_ok: bool = True) -> bool:
        d = p.dep
        fails: dict[str, list[str]] = {h: [] for h in d.hosts}
        warns: dict[str, list[str]] = {h: [] for h in d.hosts}
        notes: dict[str, list[str]] = {h: [] for h in d.hosts}
        r = self.recipes[d.name]
        # lint on the rendered launches (with what else this playbook puts on the host: G13)
        for h, launch in p.launches.items():
            colocated = [o.launches[h] for o in self._plans_on(h) if o is not p]
            findings = lint_launch(launch, catalog=self.catalog, colocated=colocated)
            for f in findings:
                if f.silenced:
                    continue
                (fails if f.severity != WARNING else warns)[h].append(f"{f.severity} {f.rule}: {f.message} "
                                                                      f"(fix: {f.fix}) [{'; '.join(f.sources)}]")
        if d.cluster:
            for f in lint_errors(lint_cluster([p.launches[h] for h in d.hosts])):
                fails[d.head].append(f"{f.rule}: {f.message} (fix: {f.fix})")
        for h in d.hosts:
            node = self.nodes[h]
            fails[h] += self._host_checks(p, node, notes[h], warns[h])
        if d.cluster:
            self._fabric_checks(p, fails)
        # weights
        missing = {h: [] for h in d.hosts}
        for h in d.hosts:
            node = self.nodes[h]
            try:
                sf = node.fact(self._store_fact[h])
            except SparkprovError as exc:
                fails[h].append(str(exc))
                continue
            for repo, rev in _repos(r):
                why = staged_problem(sf, repo, rev)
                if why:
                    missing[h].append(why)
        need_stage = [h for h, m in missing.items() if m]
        if need_stage and not any(fails.values()) and self._want_stage(d, need_stage, missing):
            if self._stage(d, need_stage):
                for h in need_stage:
                    node = self.nodes[h]
                    sf_fact = self._store_fact[h]
                    regather(node, [sf_fact])
                    missing[h] = [w for w in (staged_problem(node.fact(sf_fact), repo, rev) for repo, rev in _repos(r)) if w]
        for h, m in missing.items():
            if m:
                fails[h].append(f"{h}: weights not staged and verified in {self.nodes[h].store()}: {m[0]}"
                                + (f" (+{len(m) - 1} more)" if len(m) > 1 else "")
                                + f" (fix: invoke stage-weights {d.model} --hosts {','.join(d.hosts)}, "
                                "or rerun cluster-up with --stage)")
            else:
                notes[h].append(f"weights of {r.model.repo} staged and verified")
        # image: same ID everywhere (pull / fan out when missing)
        if not any(fails.values()):
            self._images(p, fails, notes)
        ok = not any(fails.values())
        for h in d.hosts:
            if fails[h]:
                self._rec(h, f"{d.name}: preflight", "failed", " | ".join(fails[h]), warns[h])
            elif report_ok:
                self._rec(h, f"{d.name}: preflight", "ok", "; ".join(notes[h]), warns[h])
        return ok

    def _plans_on(self, h: str) -> list[Plan]:
        return [pl for pl in self._all_plans if h in pl.dep.hosts]

    def _host_checks(self, p: Plan, node: Node, notes: list[str], warns: list[str]) -> list[str]:
        h, d = node.name, p.dep
        out = []
        if not node.fact(ManagedContainers())["access"]:
            out.append(f"{h}: {node.info.get('user')} cannot use docker (fix: invoke provision --hosts {h} --tags docker)")
        smi = node.values.get(NvidiaSmi().key)
        if not smi or not smi.get("present"):
            out.append(f"{h}: nvidia-smi not found: no NVIDIA driver (fix: invoke provision --hosts {h} --tags gpu)")
        elif smi.get("error"):
            out.append(f"{h}: the NVIDIA driver does not answer: {smi['error']} (fix: invoke provision --hosts {h} --tags gpu)")
        else:
            notes.append(f"driver {smi.get('driver_version')}")
        # memory (G13-G15): what the new containers will take of MemTotal
        mem = node.values.get(MemInfo().key) or {}
        total, avail, cached = mem.get("MemTotal", 0), mem.get("MemAvailable", 0), mem.get("Cached", 0)
        launch = p.launches[h]
        util = launch.number("--gpu-memory-utilization") or 0.9
        need = util * total
        ollama = (node.values.get(OllamaState().key) or {}).get("models") or []
        freed = (cached if self.o.drop_caches else 0)
        for c in node.fact(ManagedContainers())["containers"]:
            if c["labels"].get("sparkprov.deployment") == d.name and c["status"] == "running":
                freed += util * total  # the old containers of this deployment go first
        if ollama and self.o.unload_ollama:
            freed += sum(m.get("size") or 0 for m in ollama)
        elif ollama:
            warns.append(f"{h}: Ollama holds {', '.join(m['name'] for m in ollama)} in unified memory (G14); "
                         "rerun with --unload-ollama to unload them first")
        if total and avail + freed < need:
            out.append(f"{h}: {launch.alias} needs {gib(int(need))} ({util:.2f} of {gib(total)}), {gib(avail)} available"
                       + (f" + {gib(int(freed))} sparkprov can free" if freed else "")
                       + " (fix: stop other runtimes or models on the host"
                       + ("" if self.o.unload_ollama or not ollama else ", --unload-ollama")
                       + ", or lower --gpu-memory-utilization in the playbook's overrides)")
        elif total:
            notes.append(f"memory {gib(avail)} available for {gib(int(need))}")
        # ports: something else listening on the serving port
        spec_here = next(s for s in p.specs if s.host == h)
        if spec_here.port:
            listening = node.values.get(self._listen_fact[h].key) or []
            ours = any(c["labels"].get("sparkprov.port") == str(spec_here.port)
                       for c in node.fact(ManagedContainers())["containers"]
                       if c["labels"].get("sparkprov.deployment") == d.name)
            if spec_here.port in listening and not ours:
                out.append(f"{h}: port {spec_here.port} is already in use by a process sparkprov did not start "
                           "(fix: stop it, or set port: in the playbook / serve_port in the inventory)")
        if self.o.drop_caches and not node.can_become():
            out.append(f"{h}: dropping the page cache before the load (G15) needs root: sudo answered "
                       f"{node.become_how or 'nothing'} (fix: {become_fix(node)}; or --no-drop-caches)")
        return out

    def _fabric_checks(self, p: Plan, fails: dict[str, list[str]]) -> None:
        """G32/G33: every node has a rail; VLLM_HOST_IP is one of its rail addresses; the workers'
        addresses are on the head's subnet."""
        import ipaddress

        d = p.dep
        nets = {}
        for h in d.hosts:
            node = self.nodes[h]
            fab = node.values.get(FabricInfo().key) or {}
            rails = fab.get("rails") or []
            ip = p.launches[h].env_value("VLLM_HOST_IP")
            if not rails:
                fails[h].append(f"{h}: no fabric rail with an IPv4 address (ConnectX-7 twins Up in ibdev2netdev): "
                                f"Ray and NCCL would use the management LAN (G32) (fix: invoke provision --hosts {h} --tags fabric)")
                continue
            rail = next((r for r in rails if r["address"] == ip), None)
            if rail is None:
                fails[h].append(f"{h}: fabric address {ip} (VLLM_HOST_IP) is not on any rail of {h} "
                                f"({', '.join(r['iface'] + ' ' + r['address'] for r in rails)}) "
                                "(fix: correct fabric_ip in the inventory, or remove it to use the provisioned rail)")
                continue
            nets[h] = (ipaddress.ip_interface(f"{rail['address']}/{rail['prefix']}").network, rail)
        if d.head in nets:
            head_net, head_rail = nets[d.head]
            for h in d.hosts[1:]:
                if h in nets and nets[h][0] != head_net:
                    rail = nets[h][1]
                    fails[h].append(f"{h}: fabric address {rail['address']}/{rail['prefix']} on {rail['iface']} is not on "
                                    f"the head's subnet {head_net} ({d.head} {head_rail['address']} on {head_rail['iface']}): "
                                    f"the Ray worker cannot reach the head over the fabric (G33) "
                                    f"(fix: invoke provision --hosts {','.join(d.hosts)} --tags fabric)")

    def _want_stage(self, d: Deployment, hosts: list[str], missing: dict[str, list[str]]) -> bool:
        if self.o.stage is not None:
            return self.o.stage
        if sys.stdin.isatty() and not self.o.quiet and not self.o.check:
            answer = input(f"weights of {d.model} are missing on {', '.join(hosts)}: stage them now? [y/N] ")
            return answer.strip().lower() in ("y", "yes")
        return False

    def _stage(self, d: Deployment, hosts: list[str]) -> bool:
        from sparkprov.staging.transfer import StageOptions, run_stage

        sub = Report(self.progress.stream, quiet=self.o.quiet)
        run_stage(self.inv, d.hosts, d.model, StageOptions(accept_new_host_keys=self.o.accept_new_host_keys,
                                                           progress_stream=self.progress.stream), sub)
        for h in d.hosts:
            t = sub.hosts.get(h)
            if t is not None:
                self.report.hosts[h].remote_calls += t.remote_calls
        bad = [r for r in sub.results if r.status in ("failed", "unreachable")]
        for r in bad:
            self._rec(r.host, f"{d.name}: stage-weights", "failed", r.msg)
        if not bad:
            for h in hosts:
                self._rec(h, f"{d.name}: stage-weights", "changed", f"staged {d.model}")
        return not bad

    def _images(self, p: Plan, fails: dict[str, list[str]], notes: dict[str, list[str]]) -> None:
        d = p.dep
        image = p.specs[0].image
        ids = {h: (self.nodes[h].values.get(ImageId(image).key) or {}).get("id") for h in d.hosts}
        lacking = [h for h, i in ids.items() if not i]
        if len({i for i in ids.values() if i}) > 1:
            lacking = list(d.hosts)  # two builds under one tag (G34): pull on every node
        if lacking and self.o.check:
            for h in lacking:
                notes[h].append(f"would pull {image}")
            return
        for h in lacking:
            got = self._acquire(h, image, ids)
            if got is None:
                fails[h].append(f"{h}: cannot get {image}: {self._img_err} (fix: check the registry, or "
                                "docker pull it on one node and rerun with --image-source peer)")
            else:
                ids[h] = got
                self._rec(h, f"{d.name}: image", "changed", f"{image} {got[:19]} ({self._img_how})")
        distinct = {i for i in ids.values() if i}
        if len(distinct) > 1:
            for h in d.hosts:
                fails[h].append(f"{h}: {image} is {ids[h][:19] if ids[h] else 'absent'}; the nodes hold different "
                                "builds of one tag (G34) (fix: pin a digest in the catalog)")
        else:
            for h in d.hosts:
                if ids[h]:
                    notes[h].append(f"image {ids[h][7:19]}")

    _img_err = ""
    _img_how = ""

    def _acquire(self, h: str, image: str, ids: dict[str, str | None]) -> str | None:
        node = self.nodes[h]
        order = {"auto": ("registry", "peer"), "registry": ("registry",), "peer": ("peer",)}[self.o.image_source]
        errs = []
        for how in order:
            if how == "registry":
                res = node.run(f"{cmd('docker', 'pull', '-q', image)} >/dev/null && "
                               f"{cmd('docker', 'image', 'inspect', '--format', '{{.Id}}', image)}", timeout=3600)
                if res.ok and res.stdout.strip().startswith("sha256:"):
                    self._img_how = "pulled from the registry"
                    return res.stdout.strip()
                errs.append("pull: " + (res.stderr.strip().splitlines() or ["failed"])[-1])
            else:
                donor = next((o for o, i in ids.items() if i and o != h), None)
                if donor is None:
                    errs.append("no node has it to fan out from")
                    continue
                fab = self.nodes[h].values.get(FabricInfo().key) or {}
                target = fab.get("node_ip") or self.nodes[h].host.address
                user = self.nodes[h].info.get("user") or "nvidia"
                res = self.nodes[donor].run(
                    f"{cmd('docker', 'save', image)} | {cmd('ssh', '-o', 'BatchMode=yes', '-o', 'StrictHostKeyChecking=yes', f'{user}@{target}', 'docker load -q')}",
                    timeout=3600)
                if res.ok:
                    regather(node, [ImageId(image)])
                    got = (node.values.get(ImageId(image).key) or {}).get("id")
                    if got:
                        self._img_how = f"copied from {donor} over {target}"
                        return got
                errs.append(f"copy from {donor}: " + (res.stderr.strip().splitlines() or ["failed"])[-1])
        self._img_err = "; ".join(errs)
        return None

    # ------------------------------------------------------------------ start
    def _prepare(self, node: Node, s: specmod.ContainerSpec, *, memory: bool) -> None:
        """Ollama unload and page-cache drop (root), before the load."""
        h = node.name
        if memory and self.o.unload_ollama:
            models = (node.values.get(OllamaState().key) or {}).get("models") or []
            for m in models:
                body = json.dumps({"model": m["name"], "keep_alive": 0})
                res = node.run(cmd("curl", "-sf", "-m", "60", "--noproxy", "*", "-X", "POST",
                                   "http://127.0.0.1:11434/api/generate", "-H", "Content-Type: application/json",
                                   "-d", body) + " >/dev/null")
                self._rec(h, "memory", "changed" if res.ok else "failed", f"unload Ollama model {m['name']}")
        if memory and self.o.drop_caches:
            res = node.run("sync\necho 3 > /proc/sys/vm/drop_caches\ngrep MemAvailable /proc/meminfo", become=True)
            if not res.ok:
                raise Failed(h, "memory", f"{h}: dropping the page cache failed: {res.stderr.strip()[-200:]}")
            self._rec(h, "memory", "changed", "dropped the page cache (G15): " + res.stdout.strip())

    def _run_script(self, s: specmod.ContainerSpec) -> str:
        lines = [cmd("docker", "rm", "-f", s.name) + " >/dev/null 2>&1 || true"]
        kf = s.launch.ctx.api_key_file
        if kf and s.serves:
            lines += [f"f={quote(kf)}", 'mkdir -p "$(dirname "$f")"', "umask 077",
                      'if [ ! -s "$f" ]; then head -c 32 /dev/urandom | od -An -tx1 | tr -d " \\n" > "$f.new" '
                      '&& mv "$f.new" "$f" && echo "@key=created"; else echo "@key=kept"; fi', 'chmod 600 "$f"']
        lines.append(cmd(*s.argv))
        return "set -e\n" + "\n".join(lines) + "\n"

    def _start_one(self, s: specmod.ContainerSpec) -> None:
        node = self.nodes[s.host]
        kf = s.launch.ctx.api_key_file
        become = bool(kf and s.serves and not kf.startswith(node.home.rstrip("/") + "/"))
        res = node.run(self._run_script(s), become=become, timeout=600)
        if not res.ok:
            raise Failed(s.host, f"{s.deployment}: {s.role}", f"{s.host}: docker run {s.name} failed: "
                         + (res.stderr.strip().splitlines() or [f"exit status {res.rc}"])[-1])
        key = " (API key created, 0600)" if "@key=created" in res.stdout else ""
        self._rec(s.host, f"{s.deployment}: {s.role}", "changed",
                  f"started {s.name} ({s.launch.alias}, recipe {s.hash}){key}")

    def _start(self, p: Plan, head: specmod.ContainerSpec) -> None:
        d = p.dep
        # old containers of this deployment go first, on every node (the GPU and port are theirs)
        self._remove(p, reason="replacing (" + p.why + ")" if p.action == "replace" else "clearing")
        with ThreadPoolExecutor(max_workers=len(d.hosts)) as pool:
            list(pool.map(lambda s: self._prepare(self.nodes[s.host], s, memory=True), p.specs))
        if not d.cluster:
            with ThreadPoolExecutor(max_workers=len(p.specs)) as pool:
                errs = [f for f in pool.map(self._try_start, p.specs) if f]
            if errs:
                raise errs[0]
        else:
            self._start_one(head)
            self._wait_ray(p, head, want=1, label=f"{head.host}: Ray head {head.name}")
            workers = [s for s in p.specs if s.role == specmod.ROLE_WORKER]
            with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
                errs = [f for f in pool.map(self._try_start, workers) if f]
            if errs:
                raise errs[0]
            self._wait_ray(p, head, want=d.tp, label=f"{head.host}: Ray cluster {d.name} ({d.tp} nodes, {d.tp} GPUs)")
            self._rec(head.host, f"{d.name}: ray", "ok", f"Ray reports {d.tp} nodes and {d.tp} GPUs")
        self._wait_health(p, head)
        self._smoke(p, head)

    def _try_start(self, s):
        try:
            self._start_one(s)
            return None
        except Failed as f:
            return f

    def _container_state(self, node: Node, name: str) -> tuple[str, int, str]:
        res = node.run(f"{cmd('docker', 'inspect', '--format', '{{.State.Status}} {{.RestartCount}}', name)} 2>/dev/null || echo absent 0\n"
                       f"echo @logs; {cmd('docker', 'logs', '--tail', '12', name)} 2>&1 | tail -n 12")
        head, _, logs = res.stdout.partition("@logs\n")
        parts = head.split()
        return (parts[0] if parts else "absent"), (int(parts[1]) if len(parts) > 1 else 0), logs.strip()

    def _wait_ray(self, p: Plan, head: specmod.ContainerSpec, *, want: int, label: str) -> None:
        node = self.nodes[head.host]

        def poll() -> Poll:
            regather(node, [RayStatus(head.name)])
            rs = node.values.get(RayStatus(head.name).key) or {}
            state = rs.get("container_state")
            if state not in ("running",):
                st, restarts, logs = self._container_state(node, head.name)
                if st == "running":  # `ray status` did not answer this time (busy GCS): poll again
                    return Poll(done=False, status=f"waiting for `ray status` in {head.name}")
                return Poll(failed=f"{head.host}: the Ray head container {head.name} is {st} "
                                   f"(restarts {restarts}); its log ends: {_last(logs)}")
            return Poll(done=rs.get("ok") and rs["nodes"] >= want and rs["gpus"] >= want,
                        status=f"{rs.get('nodes', 0)}/{want} nodes, {rs.get('gpus', 0):g}/{want} GPUs")

        try:
            self.progress.wait_for(label, poll, self.o.ray_timeout)
        except WaitTimeout as exc:
            # name the node that did not join, with its own words
            rs = node.values.get(RayStatus(head.name).key) or {}
            culprits = []
            for s in p.specs:
                if s.role != specmod.ROLE_WORKER:
                    continue
                st, restarts, logs = self._container_state(self.nodes[s.host], s.name)
                if st != "absent":
                    culprits.append((s, st, restarts, logs))
            if want > 1 and culprits:
                s, st, restarts, logs = culprits[0]
                ip = s.launch.env_value("VLLM_HOST_IP")
                head_ip = head.launch.env_value("VLLM_HOST_IP")
                raise Failed(s.host, f"{p.dep.name}: ray",
                             f"{s.host}: the Ray worker ({ip}) did not join the head {head.host} at "
                             f"{head_ip}:{p.dep.ray_port} in {self.o.ray_timeout:.0f}s (Ray sees "
                             f"{rs.get('nodes', 0)}/{want} nodes); worker container {st}, restarts {restarts}; "
                             f"its log ends: {_last(logs)} (fix: check the fabric between {head.host} and {s.host}: "
                             f"invoke provision --hosts {','.join(p.dep.hosts)} --tags fabric)") from None
            raise Failed(head.host, f"{p.dep.name}: ray", f"{head.host}: {exc}") from None

    def _wait_health(self, p: Plan, head: specmod.ContainerSpec) -> None:
        node = self.nodes[head.host]
        timeout = self.o.health_timeout or p.specs[0].launch.startup.health_timeout_s
        fact = ServerState(self._base(node, head.port), head.launch.ctx.api_key_file)
        seen_restarts = [None]

        def poll() -> Poll:
            res = node.run(fact.command(_Sh(node.home)) + "\n"
                           + f"echo @state; {cmd('docker', 'inspect', '--format', '{{.State.Status}} {{.RestartCount}}', head.name)} 2>/dev/null || echo absent 0")
            body, _, state = res.stdout.partition("@state\n")
            parts = state.split()
            status = parts[0] if parts else "absent"
            restarts = int(parts[1]) if len(parts) > 1 else 0
            if seen_restarts[0] is None:
                seen_restarts[0] = restarts
            if status not in ("running",) or restarts > seen_restarts[0]:
                st, rc, logs = self._container_state(node, head.name)
                return Poll(failed=f"{head.host}: {head.name} {'restarted' if status == 'running' else 'is ' + st} "
                                   f"while loading (restarts {rc}); its log ends: {_last(logs)}")
            try:
                st = probe.parse(body)
            except ValueError:
                return Poll(status="probe: " + (res.stderr.strip()[-120:] or "no answer"))
            if st.get("health") == 200:
                return Poll(done=True, status=f"serving {', '.join(st.get('models') or [])}")
            return Poll(status="loading (" + (str(st.get("health")) if st.get("health") else "not listening yet") + ")")

        try:
            secs = self.progress.wait_for(f"{head.host}: {head.name} /health", poll, timeout)
        except WaitTimeout as exc:
            _, _, logs = self._container_state(node, head.name)
            raise Failed(head.host, f"{p.dep.name}: health", f"{head.host}: {exc}; its log ends: {_last(logs)} "
                         "(fix: a first start compiles and autotunes for minutes (G20): raise --health-timeout)") from None
        self._rec(head.host, f"{p.dep.name}: health", "ok", f"/health 200 after {secs:.0f}s")

    def _smoke(self, p: Plan, head: specmod.ContainerSpec) -> None:
        node = self.nodes[head.host]
        smoke = head.launch.smoke
        kwargs = dict(smoke.chat_template_kwargs) or {"enable_thinking": False}
        spec = {"model": head.launch.served_model_name, "prompt": smoke.prompt, "max_tokens": smoke.max_tokens,
                "kwargs": kwargs, "timeout": 900}
        res = node.run(probe.script("smoke", self._base(node, head.port), head.launch.ctx.api_key_file, spec),
                       timeout=2000)
        try:
            out = probe.parse(res.stdout)
        except ValueError:
            raise Failed(head.host, f"{p.dep.name}: smoke", f"{head.host}: the smoke test did not run: "
                         f"{(res.stderr.strip() or res.stdout.strip())[-200:]}") from None
        w, s = out["warmup"], out["smoke"]
        if w["status"] != 200:
            raise Failed(head.host, f"{p.dep.name}: smoke", f"{head.host}: warm-up request failed: HTTP {w['status']}: {w['error']}")
        if s.get("status") != 200:
            raise Failed(head.host, f"{p.dep.name}: smoke", f"{head.host}: smoke request failed: HTTP {s.get('status')}: {s.get('error')}")
        problems = smoke.check(s.get("content"))
        if not (s.get("content") or "").strip() and s.get("finish") == "length" and s.get("reasoning"):
            problems = [f"content empty with finish_reason length: thinking used all {smoke.max_tokens} tokens (G28)"]
        if problems:
            raise Failed(head.host, f"{p.dep.name}: smoke",
                         f"{head.host}: smoke test {smoke.prompt!r} -> {(s.get('content') or '')[:80]!r}: {'; '.join(problems)}")
        self._rec(head.host, f"{p.dep.name}: smoke", "ok",
                  f"{smoke.prompt} -> {(s.get('content') or '').strip()[:60]!r} in {s['seconds']}s "
                  f"(warm-up {w['seconds']}s; chat_template_kwargs {json.dumps(kwargs)})")

    def _node_states(self, p: Plan) -> dict[str, Any]:
        return {s.host: {"container": s.name, "role": s.role, "recipe_hash": s.hash,
                         "node_ip": s.launch.env_value("VLLM_HOST_IP")} for s in p.specs}


class _Sh:
    def __init__(self, home: str):
        self.home = home

    def path(self, p: str) -> str:
        if p == "~" or p.startswith("~/"):
            return quote(self.home.rstrip("/") + p[1:])
        return quote(p)


def _last(logs: str) -> str:
    lines = [ln for ln in logs.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-3:])[-400:] if lines else "(empty)"


def cluster_up(inventory: Inventory, playbook: ServePlaybook, deployments: list[Deployment], options: UpOptions,
               report: Report) -> dict[str, Any]:
    up = ClusterUp(inventory, playbook, deployments, options, report)
    return up.run()
