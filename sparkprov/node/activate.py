"""The gateway's side of on-demand deployments (issue 35, docs/on-demand.md): a request for a parked
model is held while its hosts' guards start it and it answers one token; other on-demand deployments
that hold the memory it needs, idle, are stopped first, least recently used first; a request that
waits past the bound gets the reason (the hook answers 503 with it); one idle for its idle_stop_s is
stopped. Deployments not on demand are not in its view and are never stopped by it.

Standard library only: it runs inside the gateway's LiteLLM container (the hook file,
sparkprov/gateway_hook.py, imports it), and `admit` is pure, tested on literal data. The memory
figures are the planner's per node (catalog/memory.py: a vLLM instance reserves its utilization
budget on each of its hosts), each host's budget what on-demand deployments may take there; both
come from the gateway's configuration, written by `gateway up`.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from . import ondemand as od

# What the gateway knows of an on-demand deployment (besides the guard's PARKED, STARTING, SERVING).
STOPPING = "stopping"
BOUND_S = 300.0     # how long a request is held for an activation before its 503
POLL_S = 1.0        # between one-token probes while it starts
GUARD_WAIT_S = 60.0  # how long a rebuild asks a guard that does not answer (the gateway's host booting)


class Unavailable(Exception):
    """Why a request cannot be served now (the hook answers 503 with it)."""


@dataclass
class OnDemand:
    """One on-demand deployment as the gateway's configuration gives it."""
    name: str
    model: str                       # the name clients ask for
    hosts: list[str]
    memory_gib: dict[str, float]     # the planner's figure on each host
    api_base: str                    # its OpenAI base URL (rank 0's)
    api_key: str | None = None
    idle_stop_s: float | None = None


def admit(target: OnDemand, deployments: dict[str, OnDemand], budgets: dict[str, float], state: dict[str, str],
          busy: set[str], last_used: dict[str, float]) -> tuple[list[str], str | None]:
    """Which on-demand deployments to stop so that `target` fits its hosts' budgets (least recently
    used first, only idle ones: not `busy`, not starting), or why it cannot fit. Memory is held by
    every deployment that is not parked (starting, serving, stopping)."""
    def used(host: str, gone: list[str]) -> float:
        return sum(d.memory_gib.get(host, 0.0) for n, d in deployments.items()
                   if n != target.name and n not in gone and state.get(n, od.PARKED) != od.PARKED)

    never = never_fits(target, budgets)
    if never:
        return [], never
    evict: list[str] = []
    candidates = sorted((n for n, d in deployments.items() if n != target.name and n not in busy
                         and state.get(n) == od.SERVING and set(d.hosts) & set(target.hosts)),
                        key=lambda n: last_used.get(n, 0.0))
    for host in target.hosts:
        need, budget = target.memory_gib.get(host, 0.0), budgets[host]
        for n in candidates:
            if used(host, evict) + need <= budget:
                break
            if n not in evict and host in deployments[n].hosts:
                evict.append(n)
        if used(host, evict) + need > budget:
            held = [f"{n} {deployments[n].memory_gib.get(host, 0.0):.1f} GiB ({state.get(n)}"
                    + (", in use" if n in busy else "") + ")" for n in deployments
                    if n != target.name and n not in evict and state.get(n, od.PARKED) != od.PARKED
                    and host in deployments[n].hosts]
            return [], (f"{target.name} needs {need:.1f} GiB on {host}; of its {budget:.1f} GiB "
                        + ", ".join(held) + " cannot be stopped now")
    return evict, None


def never_fits(target: OnDemand, budgets: dict[str, float]) -> str | None:
    """Why `target` can never fit its hosts' budgets, whatever else is stopped (a request for it is
    refused at once); None when it fits once the others make room."""
    for host in target.hosts:
        need, budget = target.memory_gib.get(host, 0.0), budgets.get(host)
        if budget is None:
            return f"{target.name}: no memory budget for {host} in the gateway's configuration"
        if need > budget:
            return (f"{target.name} needs {need:.1f} GiB on {host}, more than the {budget:.1f} GiB on-demand "
                    f"deployments may take there")
    return None


@dataclass
class Activator:
    """The hook's state: what each on-demand deployment is, when it was last asked for, how many
    requests it holds; one activation at a time per deployment (concurrent requests wait for it)
    and one admission at a time. `guard(host, method, path, body)` and `token(deployment)` reach
    the nodes (GuardClient, one_token below; tests give their own)."""

    deployments: dict[str, OnDemand]
    budgets: dict[str, float]
    guard: object
    token: object
    bound_s: float = BOUND_S
    poll_s: float = POLL_S
    guard_wait_s: float = GUARD_WAIT_S
    clock: object = time.monotonic
    state: dict[str, str] = field(default_factory=dict)
    last_used: dict[str, float] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)     # activations and stops, with their reasons
    waiting: dict[str, str] = field(default_factory=dict)  # deployments waiting for room: why they wait
    _tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    _admission: asyncio.Lock | None = None

    def named(self, model: str) -> OnDemand | None:
        return next((d for d in self.deployments.values() if d.model == model), None)

    async def hold(self, model: str) -> None:
        """Before a request for `model` goes on: nothing for a model not on demand or serving; else
        held until its activation (shared with every request for it) is done, or Unavailable."""
        d = self.named(model)
        if d is None:
            return
        t0 = self.clock()
        self.inflight[d.name] = self.inflight.get(d.name, 0) + 1
        self.last_used[d.name] = t0
        if self.state.get(d.name) == od.SERVING:
            return
        task = self._tasks.get(d.name)
        if task is None or task.done():
            task = self._task(d.name, self._activate(d))
        try:
            await asyncio.wait_for(asyncio.shield(task), self.bound_s)
        except asyncio.TimeoutError:
            self.done(model)
            why = self.waiting.get(d.name)
            if why:
                raise Unavailable(f"{model} waited {self.bound_s:g}s for room and got none: {why}") from None
            raise Unavailable(f"{model} is starting on {', '.join(d.hosts)} and did not answer within "
                              f"{self.bound_s:g}s; try again shortly") from None
        except (Unavailable, asyncio.CancelledError):   # cancelled: no post-call hook will count its end
            self.done(model)
            raise

    async def settle(self) -> None:
        """Wait for the activations under way to end (served, or failed)."""
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def done(self, model: str) -> None:
        """A request for `model` ended (answered or failed)."""
        d = self.named(model)
        if d is not None:
            self.inflight[d.name] = max(0, self.inflight.get(d.name, 0) - 1)
            self.last_used[d.name] = self.clock()

    def _lock(self) -> asyncio.Lock:
        if self._admission is None:
            self._admission = asyncio.Lock()
        return self._admission

    async def _activate(self, d: OnDemand) -> None:
        never = never_fits(d, self.budgets)
        if never:
            raise Unavailable(never)
        # Room held by deployments in use or starting is waited for (a switch under load: their
        # requests end, then they are idle and make room), while a request still waits for this one.
        while not await self._admitted(d):
            if not self.inflight.get(d.name):
                raise Unavailable(self.waiting.pop(d.name, f"{d.name}: no request waits for it"))
            await asyncio.sleep(self.poll_s)
        await self._serving(d)

    async def _serving(self, d: OnDemand) -> None:
        """`d` started: serving once it answers a token (within the bound)."""
        started = self.clock()
        while not await self.token(d):
            if self.clock() - started > self.bound_s:
                raise Unavailable(f"{d.name} did not answer a token within {self.bound_s:g}s of its start")
            await asyncio.sleep(self.poll_s)
        self.state[d.name] = od.SERVING
        self._event(d.name, "serving", f"answered a token {self.clock() - started:.1f}s after its start")

    def _task(self, name: str, work) -> asyncio.Task:
        task = self._tasks[name] = asyncio.ensure_future(work)
        # its failure is each waiter's; one that fails after every waiter gave up is no loose error
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _admitted(self, d: OnDemand) -> bool:
        """One admission of `d` (under the lock): the least recently used idle ones stopped and `d`
        started on its hosts (True); False, with why in `waiting`, while the others cannot make room."""
        async with self._lock():
            if self.state.get(d.name) != od.STARTING:
                busy = {n for n, k in self.inflight.items() if k > 0}
                evict, refusal = admit(d, self.deployments, self.budgets, self.state, busy, self.last_used)
                if refusal:
                    self.waiting[d.name] = refusal
                    return False
                self.waiting.pop(d.name, None)
                for n in evict:
                    await self.stop(n, f"least recently used: room for {d.name}")
                self.state[d.name] = od.STARTING
                self._event(d.name, "activate", f"a request for {d.model}" + (f"; stopped {', '.join(evict)}"
                                                                                 if evict else ""))
                for host in d.hosts:   # single-node today (docs/on-demand.md): one start
                    code, doc = await self.guard(host, "POST", f"/v1/deployments/{d.name}/start",
                                                 {"reason": f"a request for {d.model}"})
                    if code != 200:
                        self.state[d.name] = od.PARKED
                        raise Unavailable(f"{host}'s guard did not start {d.name}: {doc.get('error') or code}")
        return True

    async def stop(self, name: str, reason: str) -> None:
        d = self.deployments[name]
        self.state[name] = STOPPING
        for host in d.hosts:
            code, doc = await self.guard(host, "POST", f"/v1/deployments/{name}/stop", {"reason": reason})
            if code != 200:
                self._event(name, "stop-failed", f"{host}: {doc.get('error') or code}")
        self.state[name] = od.PARKED
        self._event(name, "stop", reason)

    async def sweep(self) -> list[str]:
        """Stop every on-demand deployment that serves with no request for its idle_stop_s."""
        now, stopped = self.clock(), []
        async with self._lock():
            for n, d in self.deployments.items():
                idle = now - self.last_used.get(n, now)
                if (d.idle_stop_s and self.state.get(n) == od.SERVING and not self.inflight.get(n)
                        and idle >= d.idle_stop_s):
                    await self.stop(n, f"idle {idle:.0f}s (idle_stop_s {d.idle_stop_s:g})")
                    stopped.append(n)
        return stopped

    async def recheck(self, model: str) -> None:
        """After a request for `model` failed: whether its deployment still runs (the guard may have
        stopped it for memory or a stall, or someone did); one parked on a host is parked here, and
        the next request starts it again."""
        d = self.named(model)
        if d is None or self.state.get(d.name) != od.SERVING:
            return
        for host in d.hosts:
            code, doc = await self.guard(host, "GET", f"/v1/deployments/{d.name}/state", None)
            if code == 200 and any(c.get("state") == od.PARKED for c in doc.get("containers") or []):
                self.state[d.name] = od.PARKED
                self._event(d.name, "stopped", f"found parked on {host} after a failed request")
                return

    async def rebuild(self) -> None:
        """After the gateway's restart: what each node's guard holds (its answer), every running one
        counted as used now (a full idle period before it is stopped), one still starting watched
        until it answers a token (then it serves, and can be stopped idle or for room). After a reboot
        of the gateway's host the proxy may come up before the guard: a guard that does not answer is
        asked again each poll_s, within guard_wait_s; after that its deployments count as parked."""
        now = self.clock()
        seen: dict[str, list[str]] = {}
        for host in sorted({h for d in self.deployments.values() for h in d.hosts}):
            code, doc = await self.guard(host, "GET", od.LIST_PATH, None)
            while code != 200 and self.clock() - now < self.guard_wait_s:
                await asyncio.sleep(self.poll_s)
                code, doc = await self.guard(host, "GET", od.LIST_PATH, None)
            if code != 200:
                self._event(host, "guard-unanswered", f"{host}'s guard: {doc.get('error') or code}")
            for c in doc.get("deployments") or [] if code == 200 else []:
                seen.setdefault(c.get("deployment"), []).append(c.get("state"))
        for n, d in self.deployments.items():
            states = seen.get(n) or [od.PARKED]
            self.state[n] = (od.SERVING if all(s == od.SERVING for s in states) else
                             od.PARKED if all(s == od.PARKED for s in states) else od.STARTING)
            if self.state[n] != od.PARKED:
                self.last_used.setdefault(n, now)
            if self.state[n] == od.STARTING:
                self._task(n, self._serving(d))

    def view(self) -> dict:
        """What `invoke status` shows of the hook's view (written to a file on the gateway's host at
        each sweep): each deployment's state, requests in flight, idle_stop_s and, when it serves
        with none in flight, for how long no request came (idle_s), as of `written` (epoch)."""
        now = self.clock()
        deps = {}
        for n, d in self.deployments.items():
            st = self.state.get(n, od.PARKED)
            idle = (round(now - self.last_used[n], 1) if st == od.SERVING and not self.inflight.get(n)
                    and n in self.last_used else None)
            deps[n] = {"state": st, "inflight": self.inflight.get(n, 0), "idle_s": idle, "idle_stop_s": d.idle_stop_s}
        return {"written": round(time.time(), 3), "deployments": deps, "events": self.events[-20:]}

    def _event(self, name: str, kind: str, reason: str) -> None:
        self.events.append({"time": time.time(), "deployment": name, "kind": kind, "reason": reason})
        del self.events[:-200]


def activator_from(doc: dict, **kw) -> Activator:
    """The hook's Activator from the gateway's on-demand configuration (JSON, 0600, written by
    `gateway up`): {"key": 64 hex digits, "guard_port": N, "addresses": {host: address},
    "budgets_gib": {host: GiB}, "bound_s": S, "deployments": [{"name", "model", "hosts",
    "memory_gib": {host: GiB}, "api_base", "api_key", "idle_stop_s"}]}. A key that is not one is
    refused here: every request to the nodes would be refused anyway."""
    key = od.parse_key(str(doc.get("key") or ""))
    if key is None:
        raise ValueError("the on-demand configuration holds no key (64 hex digits)")
    deps = {}
    for d in doc.get("deployments") or []:
        deps[d["name"]] = OnDemand(d["name"], d["model"], list(d["hosts"]),
                                   {h: float(v) for h, v in (d.get("memory_gib") or {}).items()}, d["api_base"],
                                   d.get("api_key"), float(d["idle_stop_s"]) if d.get("idle_stop_s") else None)
    guard = GuardClient(key, dict(doc.get("addresses") or {}), int(doc["guard_port"]))
    return Activator(deps, {h: float(v) for h, v in (doc.get("budgets_gib") or {}).items()}, guard, one_token,
                     bound_s=float(doc.get("bound_s") or BOUND_S), **kw)


class GuardClient:
    """Signed requests to each host's guard (node/ondemand.py), from a thread (urllib blocks)."""

    def __init__(self, key: bytes, addresses: dict[str, str], port: int, timeout: float = 30):
        self.key, self.addresses, self.port, self.timeout = key, addresses, port, timeout

    def call(self, host: str, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(f"http://{self.addresses[host]}:{self.port}{path}", method=method,
                                     data=data if method == "POST" else None,
                                     headers={**od.signed_headers(self.key, method, path, data),
                                              "Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=self.timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"{}")
            except ValueError:
                return e.code, {}
        except (OSError, ValueError) as e:
            return 0, {"error": f"{type(e).__name__}: {e}"}

    async def __call__(self, host: str, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        return await asyncio.to_thread(self.call, host, method, path, body)


async def one_token(d: OnDemand, timeout: float = 15) -> bool:
    """Whether the deployment generates one token (liveness is work done, not /health)."""
    def ask() -> bool:
        req = urllib.request.Request(f"{d.api_base}/completions", method="POST",
                                     data=json.dumps({"model": d.model, "prompt": "1", "max_tokens": 1}).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {d.api_key}"} if d.api_key else {})})
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=timeout) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False
    return await asyncio.to_thread(ask)
