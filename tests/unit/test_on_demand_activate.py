"""The gateway's side of on-demand deployments (issue 35, sparkprov/node/activate.py): admission by
the planner's per-node memory figures with least-recently-used eviction of idle on-demand
deployments, on literal data; the hold, one activation shared by concurrent requests, the 503 past
the bound, the idle stop and the rebuild after a restart, against a stand-in for the nodes' guards
(what they answer over HTTP) and the engines' one-token answer."""

from __future__ import annotations

import asyncio

import pytest

from sparkprov.node import ondemand as od
from sparkprov.node.activate import Activator, OnDemand, Unavailable, admit


def dep(name, gib=6.0, hosts=("h1",), idle=None):
    return OnDemand(name, f"model-{name}", list(hosts), {h: gib for h in hosts}, f"http://{name}/v1", None, idle)


DEPS = {n: dep(n) for n in ("a", "b", "c")}


def test_the_least_recently_used_idle_deployment_makes_room():
    state = {"a": od.SERVING, "b": od.SERVING, "c": od.PARKED}
    last = {"a": 100.0, "b": 50.0}
    assert admit(DEPS["c"], DEPS, {"h1": 13.0}, state, set(), last) == (["b"], None)
    assert admit(DEPS["c"], DEPS, {"h1": 13.0}, state, {"b"}, last) == (["a"], None)    # b has a request
    assert admit(DEPS["c"], DEPS, {"h1": 19.0}, state, set(), last) == ([], None)       # room for all three
    assert admit(DEPS["c"], DEPS, {"h1": 5.0}, state, set(), last) == (
        [], "c needs 6.0 GiB on h1, more than the 5.0 GiB on-demand deployments may take there")


def test_busy_or_starting_deployments_are_never_stopped_and_the_refusal_names_them():
    state = {"a": od.SERVING, "b": od.STARTING, "c": od.PARKED}
    evict, why = admit(DEPS["c"], DEPS, {"h1": 13.0}, state, {"a"}, {"a": 1.0, "b": 0.0})
    assert evict == [] and why == ("c needs 6.0 GiB on h1; of its 13.0 GiB a 6.0 GiB (serving, in use), "
                                   "b 6.0 GiB (starting) cannot be stopped now")


def test_parked_deployments_and_other_hosts_take_nothing():
    deps = {"a": dep("a", hosts=("h2",)), "b": dep("b"), "c": dep("c")}
    state = {"a": od.SERVING, "b": od.PARKED}
    assert admit(deps["c"], deps, {"h1": 6.0, "h2": 6.0}, state, set(), {}) == ([], None)
    assert admit(deps["c"], deps, {}, state, set(), {})[1] == "c: no memory budget for h1 in the gateway's configuration"


class Nodes:
    """The guards of the hosts as the hook meets them over HTTP: start and stop answered 200 (or
    `refuse`), the list of what they hold; and each engine's one token, answered once it has been
    asked `warmup` times since its start."""

    def __init__(self, warmup=2, refuse=None, silent=0):
        self.calls: list[tuple[str, str]] = []
        self.running: set[str] = set()
        self.asked: dict[str, int] = {}
        self.warmup, self.refuse = warmup, refuse
        self.silent = silent     # so many first asks unanswered (the guard not up yet: a host booting)

    async def guard(self, host, method, path, body):
        await asyncio.sleep(0)
        if self.silent:
            self.silent -= 1
            return 0, {"error": "ConnectionRefusedError: [Errno 111] Connection refused"}
        if method == "GET" and path == od.LIST_PATH:
            return 200, {"deployments": [{"deployment": n, "state": od.SERVING if self.asked.get(n, 0) > self.warmup
                                          else od.STARTING} for n in sorted(self.running)]}
        if method == "GET":
            name = path.split("/")[3]
            return 200, {"deployment": name, "containers": [
                {"name": f"sparkprov-{name}", "state": od.SERVING if name in self.running else od.PARKED}]}
        name, action = path.split("/")[3:5]
        self.calls.append((action, name))
        if self.refuse:
            return 409, {"error": self.refuse}
        (self.running.add if action == "start" else self.running.discard)(name)
        self.asked[name] = 0
        return 200, {"deployment": name}

    async def token(self, d):
        await asyncio.sleep(0)
        self.asked[d.name] = self.asked.get(d.name, 0) + 1
        return d.name in self.running and self.asked[d.name] > self.warmup


def activator(nodes, budget=6.0, **kw):
    deps = {n: dep(n, idle=30) for n in ("a", "b")}
    # a bound of seconds: a test whose behaviour is broken fails in seconds, not hangs
    return Activator(deps, {"h1": budget}, nodes.guard, nodes.token, poll_s=0.001, **{"bound_s": 3.0, **kw})


def test_concurrent_requests_for_a_parked_model_wait_for_one_activation():
    nodes = Nodes()
    act = activator(nodes)

    async def go():
        await asyncio.gather(*(act.hold("model-a") for _ in range(8)))
    asyncio.run(go())
    assert nodes.calls == [("start", "a")] and act.state["a"] == od.SERVING and act.inflight["a"] == 8
    assert [e["kind"] for e in act.events] == ["activate", "serving"]


def test_a_request_for_b_while_a_serves_stops_a_then_starts_b():
    nodes = Nodes()
    act = activator(nodes)

    async def go():
        await act.hold("model-a")
        act.done("model-a")
        await act.hold("model-b")
    asyncio.run(go())
    assert nodes.calls == [("start", "a"), ("stop", "a"), ("start", "b")]
    assert act.state == {"a": od.PARKED, "b": od.SERVING}
    assert ("stop", "a", "least recently used: room for b") in [(e["kind"], e["deployment"], e["reason"])
                                                                for e in act.events]


def test_a_request_for_b_while_a_is_in_use_waits_until_a_is_idle_then_a_is_stopped_and_b_served():
    nodes = Nodes()
    act = activator(nodes)

    async def go():
        await act.hold("model-a")            # in flight
        b = asyncio.ensure_future(act.hold("model-b"))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not b.done() and nodes.calls == [("start", "a")]      # held, a not stopped under its request
        assert act.waiting["b"].startswith("b needs 6.0 GiB on h1; of its 6.0 GiB a 6.0 GiB (serving, in use)")
        act.done("model-a")                  # a's request answered: a is idle now
        await asyncio.wait_for(b, 2)
    asyncio.run(go())
    assert nodes.calls == [("start", "a"), ("stop", "a"), ("start", "b")] and act.state == {"a": od.PARKED,
                                                                                            "b": od.SERVING}
    assert act.waiting == {}


def test_a_model_in_use_past_the_bound_is_not_stopped_and_the_request_for_the_other_gets_503_with_the_reason():
    nodes = Nodes()
    act = activator(nodes, bound_s=0.2)

    async def go():
        await act.hold("model-a")            # in flight throughout
        with pytest.raises(Unavailable, match=r"model-b waited 0.2s for room and got none: b needs 6.0 GiB on h1; "
                                              r"of its 6.0 GiB a 6.0 GiB \(serving, in use\) cannot be stopped now"):
            await act.hold("model-b")
        await act.settle()                   # its activation gives up too: no request waits for it
    asyncio.run(go())
    assert nodes.calls == [("start", "a")] and act.inflight == {"a": 1, "b": 0} and "b" not in act.state


def test_a_model_that_never_fits_is_refused_at_once():
    nodes = Nodes()
    act = activator(nodes, budget=5.0, bound_s=30.0)

    async def go():
        with pytest.raises(Unavailable, match="a needs 6.0 GiB on h1, more than the 5.0 GiB"):
            await asyncio.wait_for(act.hold("model-a"), 1)
    asyncio.run(go())
    assert nodes.calls == []


def test_a_request_held_past_the_bound_gets_the_reason_and_the_start_goes_on():
    nodes = Nodes(warmup=10**9)
    act = activator(nodes, bound_s=0.05)

    async def go():
        with pytest.raises(Unavailable, match="model-a is starting on h1 and did not answer within 0.05s"):
            await act.hold("model-a")
        await act.settle()                   # the activation ends too, bounded; the container loads on
    asyncio.run(go())
    assert nodes.calls == [("start", "a")] and act.state["a"] == od.STARTING and act.inflight["a"] == 0


def test_a_guard_that_refuses_the_start_is_the_requests_reason():
    nodes = Nodes(refuse="the node's guard holds sparkprov-a stopped (stall) until memory is back")
    act = activator(nodes)

    async def go():
        with pytest.raises(Unavailable, match="h1's guard did not start a: the node's guard holds sparkprov-a"):
            await act.hold("model-a")
    asyncio.run(go())
    assert act.state["a"] == od.PARKED


def test_a_model_not_on_demand_passes_untouched():
    nodes = Nodes()
    act = activator(nodes)
    asyncio.run(act.hold("some-fixed-model"))
    assert nodes.calls == [] and act.state == {}


def test_an_idle_deployment_is_stopped_after_its_idle_stop_s_and_one_in_use_is_not():
    now = [1000.0]
    nodes = Nodes(warmup=0)
    act = activator(nodes, budget=12.0, clock=lambda: now[0])

    async def go():
        await act.hold("model-a")
        act.done("model-a")
        await act.hold("model-b")            # in flight
        now[0] += 29
        assert await act.sweep() == []
        now[0] += 1
        return await act.sweep()
    assert asyncio.run(go()) == ["a"]
    assert nodes.calls[-1] == ("stop", "a") and act.state == {"a": od.PARKED, "b": od.SERVING}
    assert act.events[-1]["reason"] == "idle 30s (idle_stop_s 30)"


def test_after_a_restart_the_view_is_rebuilt_from_the_guards():
    nodes = Nodes()
    nodes.running = {"b"}
    nodes.asked = {"b": 3}                   # answering: serving
    act = activator(nodes, clock=lambda: 5.0)
    asyncio.run(act.rebuild())
    assert act.state == {"a": od.PARKED, "b": od.SERVING} and act.last_used == {"b": 5.0}
    asyncio.run(act.hold("model-b"))
    assert nodes.calls == []                 # serving: the request goes straight on


def test_a_deployment_stopped_under_its_feet_is_found_after_a_failed_request_and_started_again():
    nodes = Nodes(warmup=0)
    act = activator(nodes)

    async def go():
        await act.hold("model-a")
        act.done("model-a")
        nodes.running.discard("a")           # the guard stopped it (memory, a stall)
        await act.recheck("model-a")         # the request that failed
        assert act.state["a"] == od.PARKED
        await act.hold("model-a")
    asyncio.run(go())
    assert nodes.calls == [("start", "a"), ("start", "a")] and act.state["a"] == od.SERVING


def test_after_a_reboot_a_guard_not_up_yet_is_asked_again_and_its_running_model_counted():
    """The gateway's host rebooted: the proxy may come up before the node's guard; a rebuild that took
    the unanswered guard for "nothing runs" would start the other model beside the one that came back
    with the host (over the budget)."""
    nodes = Nodes(warmup=0, silent=3)
    nodes.running, nodes.asked = {"a"}, {"a": 1}
    act = activator(nodes)

    async def go():
        await act.rebuild()
        assert act.state == {"a": od.SERVING, "b": od.PARKED}
        act.last_used["a"] -= 1              # a: used before b's request, idle now
        await act.hold("model-b")
    asyncio.run(go())
    assert nodes.calls == [("stop", "a"), ("start", "b")]     # room made: a stopped first


def test_after_a_restart_a_model_found_starting_is_watched_until_it_serves_and_can_then_make_room():
    nodes = Nodes(warmup=2)
    nodes.running = {"a"}                    # came back with its host, still loading
    act = activator(nodes)

    async def go():
        await act.rebuild()
        assert act.state["a"] == od.STARTING
        await asyncio.wait_for(act.hold("model-b"), 2)       # waits for a to serve, then a makes room
    asyncio.run(go())
    assert act.state == {"a": od.PARKED, "b": od.SERVING} and nodes.calls == [("stop", "a"), ("start", "b")]
