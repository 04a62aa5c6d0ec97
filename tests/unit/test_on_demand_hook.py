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


# A streamed chat completion as LiteLLM 1.108.7's proxy hands it to the iterator hook (proxy/utils.py
# ProxyLogging.async_post_call_streaming_iterator_hook): OpenAI's chunk objects, here as their JSON.
CHUNKS = [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
          {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Blue."}}]},
          {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]


def request(call_id: str) -> dict:
    """A request's data as the proxy gives it to every hook: the client's fields and the call id it
    sets before the pre-call hook (the failure hook gets it without its logging object)."""
    return {"model": "model-a", "stream": True, "messages": [{"role": "user", "content": "Name a color."}],
            "litellm_call_id": call_id}


async def upstream(fail_after: int | None = None):
    for i, chunk in enumerate(CHUNKS):
        if i == fail_after:
            raise ConnectionError("upstream closed the stream")
        yield chunk


async def served_two(h) -> tuple[dict, dict]:
    """Two requests for model-a held and served; the second stays in flight throughout."""
    stream, other = request("c-stream"), request("c-other")
    await h.async_pre_call_hook(None, None, stream, "acompletion")
    await h.async_pre_call_hook(None, None, other, "acompletion")
    assert h.act.inflight["a"] == 2
    return stream, other


def test_a_stream_ends_its_request_at_its_last_chunk_once_whatever_else_reports_it():
    """LiteLLM calls no success hook for a stream (common_request_processing.py returns the
    StreamingResponse before post_call_success_hook): the stream's end is counted where it ends, and
    a success or failure report of the same request after it changes nothing."""
    h = hook(Nodes())

    async def go():
        stream, other = await served_two(h)
        got = [c async for c in h.async_post_call_streaming_iterator_hook(None, upstream(), stream)]
        assert got == CHUNKS                 # the chunks pass unchanged
        assert h.act.inflight["a"] == 1
        await h.async_post_call_success_hook(stream, None, None)
        await h.async_post_call_failure_hook(stream, RuntimeError("late"), None)
        assert h.act.inflight["a"] == 1      # the other request is still counted
        await h.async_post_call_success_hook(other, None, None)
        assert h.act.inflight["a"] == 0
        h.sweeper.cancel()
    asyncio.run(go())


def test_a_stream_its_client_drops_half_way_ends_its_request():
    """A client gone mid-stream: the proxy closes the stream's generators (proxy_server.py
    async_data_generator, on GeneratorExit or CancelledError) and calls neither post-call hook."""
    h = hook(Nodes())

    async def go():
        stream, _ = await served_two(h)
        it = h.async_post_call_streaming_iterator_hook(None, upstream(), stream)
        assert await it.__anext__() == CHUNKS[0]
        assert h.act.inflight["a"] == 2
        await it.aclose()
        assert h.act.inflight["a"] == 1
        h.sweeper.cancel()
    asyncio.run(go())


def test_a_stream_that_fails_half_way_is_counted_once_and_its_deployment_rechecked():
    """An upstream error mid-stream leaves the iterator hook and then reaches the failure hook
    (async_data_generator's `except Exception`): one end, and the guard asked about the deployment
    (here the guard stopped it under the hook's feet: parked, the next request starts it again)."""
    nodes = Nodes()
    h = hook(nodes)

    async def go():
        stream, _ = await served_two(h)
        nodes.running.discard("a")
        with pytest.raises(ConnectionError):
            [c async for c in h.async_post_call_streaming_iterator_hook(None, upstream(fail_after=1), stream)]
        assert h.act.inflight["a"] == 1
        await h.async_post_call_failure_hook(stream, ConnectionError("upstream closed the stream"), None)
        assert h.act.inflight["a"] == 1 and h.act.state["a"] == od.PARKED
        h.sweeper.cancel()
    asyncio.run(go())


def test_a_failure_of_a_request_the_hook_never_held_leaves_the_others_counted():
    """The failure hook also comes for a request refused before or by the hook (a 503 whose hold
    counted its own end): it must not end another request's count."""
    h = hook(Nodes())

    async def go():
        _, other = await served_two(h)
        await h.async_post_call_failure_hook(request("c-refused"), RuntimeError("refused"), None)
        assert h.act.inflight["a"] == 2
        h.sweeper.cancel()
    asyncio.run(go())


def test_concurrent_requests_a_client_gave_one_call_id_each_end_once():
    """x-litellm-call-id is the client's to set: two requests in flight under one id are two."""
    h = hook(Nodes())

    async def go():
        first, second = request("same"), request("same")
        await h.async_pre_call_hook(None, None, first, "acompletion")
        await h.async_pre_call_hook(None, None, second, "acompletion")
        [c async for c in h.async_post_call_streaming_iterator_hook(None, upstream(), first)]
        assert h.act.inflight["a"] == 1
        await h.async_post_call_success_hook(second, None, None)
        assert h.act.inflight["a"] == 0 and h.held == {}
        h.sweeper.cancel()
    asyncio.run(go())


def test_a_request_cancelled_while_it_is_held_is_not_left_in_flight():
    """A held request whose task is cancelled (LiteLLM's cancel_on_disconnect, a server shutting
    down) reaches none of the post-call hooks: its hold ends it itself."""
    nodes = Nodes(warmup=10**9)              # the model starting throughout
    h = hook(nodes)

    async def go():
        held = asyncio.ensure_future(h.async_pre_call_hook(None, None, request("c-gone"), "acompletion"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert h.act.inflight["a"] == 1
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        assert h.act.inflight["a"] == 0 and h.held == {}
        for t in h.act._tasks.values():
            t.cancel()
        h.sweeper.cancel()
    asyncio.run(go())
