"""`invoke status` shows how long an on-demand deployment has had no request (issue 35): the gateway's
hook writes its view at each sweep into the gateway's folder (serving/gateway_hook.py, Activator.view),
the status play reads it on the gateway's host (facts/serving.py OnDemandView) and puts the idle time
on each on-demand container (serving/gateway.py idle_for); the table shows it. The hook runs against
the nodes' stand-in of test_on_demand_activate (their HTTP answers)."""

from __future__ import annotations

import asyncio
import json

from sparkprov.facts.serving import OnDemandView
from sparkprov.node import ondemand as od
from sparkprov.serving import gateway as gw
from sparkprov.serving.gateway_hook import make_handler
from tests.unit.test_on_demand_activate import Nodes, activator
from tests.unit.test_on_demand_hook import HTTPException


def test_the_view_has_each_deployments_idle_time_while_it_serves_with_no_request():
    now = [1000.0]
    nodes = Nodes(warmup=0)
    act = activator(nodes, budget=12.0, clock=lambda: now[0])

    async def go():
        await act.hold("model-a")
        act.done("model-a")               # answered at 1000
        await act.hold("model-b")         # in flight
        now[0] += 42
    asyncio.run(go())
    view = act.view()
    assert view["deployments"]["a"] == {"state": od.SERVING, "inflight": 0, "idle_s": 42.0, "idle_stop_s": 30.0}
    assert view["deployments"]["b"]["idle_s"] is None and view["deployments"]["b"]["inflight"] == 1
    assert [e["kind"] for e in view["events"]][:2] == ["activate", "serving"]
    json.dumps(view)                      # it goes to a file as JSON


def test_the_hook_writes_its_view_at_each_sweep(tmp_path):
    nodes = Nodes(warmup=0)
    path = tmp_path / "view.json"
    h = make_handler(object, HTTPException, lambda: activator(nodes), sweep_every_s=0.01, view_path=str(path))()

    async def go():
        data = {"model": "model-a"}
        await h.async_pre_call_hook(None, None, data, "completion")
        await h.async_post_call_success_hook(data, None, None)
        for _ in range(200):
            if path.exists():
                break
            await asyncio.sleep(0.01)
        h.sweeper.cancel()
    asyncio.run(go())
    view = json.loads(path.read_text())
    assert view["deployments"]["a"]["state"] == od.SERVING and view["deployments"]["a"]["idle_s"] is not None
    assert view["deployments"]["b"]["state"] == od.PARKED


def test_the_status_fact_reads_the_view_with_the_hosts_clock_and_idle_for_counts_since_it_was_written():
    view = {"written": 1000.0, "deployments": {"a": {"state": "serving", "inflight": 0, "idle_s": 42.0},
                                               "b": {"state": "parked", "inflight": 0, "idle_s": None}}, "events": []}
    fact = OnDemandView("~/.config/sparkprov/gateway/state/ondemand-view.json")
    got = fact.parse("1010\n" + json.dumps(view) + "\n", "", 0)
    assert got == {"now": 1010.0, "view": view}
    assert fact.parse("1010\n\n", "", 0) == {"now": 1010.0, "view": None}           # no gateway here
    assert fact.parse("1010\n{\"written\": 1, \"depl\n", "", 0)["view"] is None     # cut short
    assert fact.parse('1010\n{"deployments": {}}\n', "", 0)["view"] is None          # no view: no time
    assert gw.idle_for([got], "a") == 52.0                                           # 42 s, written 10 s ago
    assert gw.idle_for([got], "b") is None and gw.idle_for([], "a") is None
    # the status play's containers: on-demand ones get it, wherever their host and the gateway's are
    st = {"spark1": {"containers": [{"name": "sparkprov-gateway", "labels": {}}]},
          "spark2": {"containers": [{"name": "sparkprov-a", "on_demand": "serving", "labels": {"sparkprov.deployment": "a"}},
                                    {"name": "sparkprov-b", "on_demand": "parked", "labels": {"sparkprov.deployment": "b"}},
                                    {"name": "sparkprov-c", "labels": {"sparkprov.deployment": "c"}}]}}
    gw.mark_idle(st, [got, {}])
    assert [c.get("idle_for_s", "-") for c in st["spark2"]["containers"]] == [52.0, None, "-"]


def test_status_shows_idle_for_beside_the_on_demand_state(capsys):
    from sparkprov.cli.cluster import print_status

    c = {"name": "sparkprov-a", "id": "a", "status": "running", "exit_code": 0, "restarts": 0, "started": "",
         "image": "img", "image_id": "sha256:1", "on_demand": od.SERVING, "idle_for_s": 312.0,
         "labels": {"sparkprov.managed": "1", "sparkprov.role": "server", "sparkprov.deployment": "a"}}
    st = {"spark1": {"reachable": True, "docker": True, "error": None, "host": {}, "deployments": {},
                     "containers": [c, {**c, "name": "sparkprov-b", "on_demand": od.PARKED, "idle_for_s": None}]}}
    print_status(st)
    out = capsys.readouterr().out
    assert "serving (on demand, idle 5m 12s)" in out and "parked (on demand)" in out
