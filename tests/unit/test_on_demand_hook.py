"""The LiteLLM hook of on-demand deployments (sparkprov/serving/gateway_hook.py): a request for a
parked model is held and goes on once it answers; one that cannot be served gets HTTP 503 with the
reason; each request's end is counted; the view is rebuilt from the guards at the first request.
LiteLLM's CustomLogger and fastapi's HTTPException are stood in for (LiteLLM is not a dependency
of sparkprov); the hook's activation runs against the nodes' stand-in of test_on_demand_activate."""

from __future__ import annotations

import asyncio
import json

import pytest

from sparkprov.node import ondemand as od
from sparkprov.node.activate import activator_from
from sparkprov.serving.gateway_hook import make_handler
from tests.unit.test_on_demand_activate import Nodes, activator


class HTTPException(Exception):
    """fastapi's, as the proxy turns it into a response: a status code and a detail."""

    def __init__(self, status_code, detail):
        super().__init__(status_code, detail)
        self.status_code, self.detail = status_code, detail


def hook(nodes, **kw):
    return make_handler(object, HTTPException, lambda: activator(nodes, **kw), sweep_every_s=3600)()


def test_a_request_for_a_parked_model_is_held_until_it_answers_and_then_counted():
    nodes = Nodes()
    nodes.running = set()
    h = hook(nodes)

    async def go():
        data = {"model": "model-a", "messages": []}
        assert await h.async_pre_call_hook(None, None, data, "completion") is data
        assert h.act.inflight["a"] == 1
        await h.async_post_call_success_hook(data, None, None)
        assert h.act.inflight["a"] == 0
        h.sweeper.cancel()
    asyncio.run(go())
    assert nodes.calls == [("start", "a")]


def test_the_first_requests_after_a_start_of_the_proxy_share_one_view_and_one_activation():
    """Found by the real LiteLLM (tests/gateway_real): 8 first requests at once each built a view of
    their own while the first one's rebuild waited on the guards, and the model was started twice."""
    nodes = Nodes()
    h = hook(nodes)

    async def go():
        await asyncio.gather(*(h.async_pre_call_hook(None, None, {"model": "model-a"}, "completion")
                               for _ in range(8)))
        h.sweeper.cancel()
    asyncio.run(go())
    assert nodes.calls == [("start", "a")] and h.act.inflight["a"] == 8


def test_a_request_that_cannot_be_served_gets_503_with_the_reason():
    nodes = Nodes(warmup=10**9)
    h = hook(nodes, bound_s=0.05)

    async def go():
        with pytest.raises(HTTPException) as e:
            await h.async_pre_call_hook(None, None, {"model": "model-a"}, "completion")
        await h.act.settle()
        h.sweeper.cancel()
        return e.value
    err = asyncio.run(go())
    assert err.status_code == 503
    assert err.detail == {"error": "sparkprov on demand: model-a is starting on h1 and did not answer within 0.05s; "
                                   "try again shortly"}


def test_the_first_request_after_a_restart_finds_what_the_guards_hold():
    nodes = Nodes()
    nodes.running = {"a"}
    h = hook(nodes)

    async def go():
        await h.async_pre_call_hook(None, None, {"model": "model-a"}, "completion")
        await h.async_post_call_failure_hook({"model": "model-a"}, RuntimeError("x"), None)
        h.sweeper.cancel()
    asyncio.run(go())
    assert nodes.calls == [] and h.act.state["a"] == od.SERVING and h.act.inflight["a"] == 0


def test_the_configuration_gateway_up_writes_is_read_and_a_keyless_one_refused():
    doc = {"key": "ab" * 32, "guard_port": 9403, "addresses": {"spark1": "10.77.0.11"}, "budgets_gib": {"spark1": 40},
           "bound_s": 120, "deployments": [{"name": "a", "model": "lab-tiny", "hosts": ["spark1"],
                                            "memory_gib": {"spark1": 30}, "api_base": "http://10.77.0.11:8000/v1",
                                            "api_key": None, "idle_stop_s": 600}]}
    act = activator_from(json.loads(json.dumps(doc)))
    assert act.bound_s == 120 and act.budgets == {"spark1": 40.0}
    assert act.deployments["a"].memory_gib == {"spark1": 30.0} and act.deployments["a"].idle_stop_s == 600.0
    assert act.guard.addresses == {"spark1": "10.77.0.11"} and act.guard.port == 9403
    with pytest.raises(ValueError, match="holds no key"):
        activator_from({**doc, "key": "short"})


def test_built_inside_the_proxys_loop_the_hook_loads_at_once_and_stops_an_idle_model_with_no_request():
    """LiteLLM builds the hook while its startup (a coroutine) loads the config: after the gateway's
    host rebooted, a model that came back with the host is stopped when idle though no request comes."""
    nodes = Nodes(warmup=0)
    nodes.running, nodes.asked = {"a"}, {"a": 1}
    now = [100.0]

    async def go():
        h = make_handler(object, HTTPException, lambda: activator(nodes, clock=lambda: now[0]),
                         sweep_every_s=0.01, view_path=None)()
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert h.act is not None and h.act.state["a"] == od.SERVING
        now[0] += 31                         # idle_stop_s 30 passed
        for _ in range(50):
            await asyncio.sleep(0.01)
        h.sweeper.cancel()
        return h
    h = asyncio.run(go())
    assert nodes.calls == [("stop", "a")] and h.act.state["a"] == od.PARKED


def test_a_model_not_on_demand_is_not_held_while_the_view_waits_for_a_guard():
    nodes = Nodes(silent=10**9)              # a host's guard that does not answer (down)
    h = make_handler(object, HTTPException, lambda: activator(nodes, guard_wait_s=30), sweep_every_s=3600,
                     view_path=None)()

    async def go():
        data = {"model": "some-fixed-model"}
        assert await asyncio.wait_for(h.async_pre_call_hook(None, None, data, "completion"), 1) is data
    asyncio.run(go())
