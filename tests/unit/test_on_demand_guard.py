"""The node side of on-demand deployments (issue 35, docs/on-demand.md): the guard starts or stops a
deployment it already holds, labelled on-demand, on a request signed with HMAC-SHA256 (time, nonce,
body); a replay, a bad signature, an old time, another container are refused. The decisions on
literal data, then the guard daemon's endpoint run for real against the stand-in dockerd."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from sparkprov.node import decide as d
from sparkprov.node import guard as g
from sparkprov.node import ondemand as od
from tests.unit.test_node_package import dockerd, node_files

KEY = bytes(range(32))
PATH = "/v1/deployments/a/start"
T0 = 1_800_000_000.0


def signed(path=PATH, body=b"", now=T0, key=KEY, method="POST", nonce="0" * 31 + "1"):
    return od.signed_headers(key, method, path, body, now=now, nonce=nonce)


def test_a_signed_request_passes_once_and_its_replay_is_refused():
    nonces = od.NonceCache()
    h = signed(body=b'{"reason": "r"}')
    assert od.verify(KEY, "POST", PATH, h, b'{"reason": "r"}', T0 + 5, nonces) is None
    assert od.verify(KEY, "POST", PATH, h, b'{"reason": "r"}', T0 + 6, nonces) == "nonce seen before (a replayed request)"
    # header names as any client spells them
    low = {k.lower(): v for k, v in signed(nonce="2" * 32).items()}
    assert od.verify(KEY, "POST", PATH, low, b"", T0, nonces) is None


@pytest.mark.parametrize("change,why", [
    (lambda r: {**r, "path": "/v1/deployments/b/start"}, "bad signature"),         # another deployment
    (lambda r: {**r, "path": "/v1/deployments/a/stop"}, "bad signature"),          # another action
    (lambda r: {**r, "method": "GET"}, "bad signature"),
    (lambda r: {**r, "body": b'{"reason": "x"}'}, "bad signature"),                # another reason
    (lambda r: {**r, "key": bytes(32)}, "bad signature"),                          # another key
    (lambda r: {**r, "key": None}, "no on-demand key on this node (gateway up writes it)"),
    (lambda r: {**r, "headers": {}}, "unsigned request"),
    (lambda r: {**r, "now": T0 + 31}, "request time -31s from the node's clock, outside 30s"),
    (lambda r: {**r, "now": T0 - 31}, "request time +31s from the node's clock, outside 30s"),
])
def test_a_request_not_signed_for_this_path_body_key_and_time_is_refused(change, why):
    r = change({"path": PATH, "method": "POST", "body": b"", "key": KEY, "now": T0, "headers": signed()})
    nonces = od.NonceCache()
    assert od.verify(r["key"], r["method"], r["path"], r["headers"], r["body"], r["now"], nonces) == why
    assert nonces.seen == {}  # a refused request leaves no nonce: the real one still passes
    assert od.verify(KEY, "POST", PATH, signed(), b"", T0, nonces) is None


def test_the_nonce_cache_forgets_past_the_window_and_is_bounded():
    cache = od.NonceCache(window_s=30, limit=2)
    assert cache.add("a", 0) is None and cache.add("b", 1) is None
    assert cache.add("c", 2) == "more than 2 requests within 60s"
    assert cache.add("c", 62) is None and "a" not in cache.seen   # "a" fell out; its time is refused anyway


def container(name, dep, status, on_demand=True, port=None):
    labels = {"sparkprov.managed": "1", "sparkprov.deployment": dep, "sparkprov.role": "server"}
    if on_demand:
        labels[od.ON_DEMAND_LABEL] = "1"
    return {"name": name, "id": name * 2, "status": status, "labels": labels, "port": port}


def test_only_the_named_deployments_on_demand_containers_are_acted_on():
    held = [container("sparkprov-a", "a", "exited"), container("sparkprov-b", "b", "running"),
            container("sparkprov-c", "c", "running", on_demand=False)]
    assert od.plan(held, "a", "start") == (["sparkprov-a"], None)
    assert od.plan(held, "a", "stop") == ([], None)          # already stopped: nothing to do
    assert od.plan(held, "b", "stop") == (["sparkprov-b"], None)
    assert od.plan(held, "b", "start") == ([], None)         # already running
    assert od.plan(held, "c", "stop") == ([], (403, "sparkprov-c is not on demand (only cluster-up starts and stops "
                                                    "it)"))
    assert od.plan(held, "z", "start") == ([], (404, "this node holds no container of z"))


def test_demand_does_not_overrule_the_guard():
    assert od.held_by_guard(["sparkprov-a"], {}, None) is None
    assert "holds sparkprov-a stopped (stall)" in od.held_by_guard(["sparkprov-a"], {"sparkprov-a": {"kind": "stall"}},
                                                                    None)
    assert "stood down (3 restarts within 6 h)" in od.held_by_guard([], {}, {"why": "3 restarts within 6 h"})


# -- the guard daemon's endpoint, run for real against the stand-in dockerd ---------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _docker_container(cid, name, dep, status, on_demand=True):
    labels = {"sparkprov.managed": "1", "sparkprov.deployment": dep, "sparkprov.role": "server",
              "sparkprov.port": str(_free_port())}
    if on_demand:
        labels[od.ON_DEMAND_LABEL] = "1"
    return {"Id": cid, "Name": "/" + name, "RestartCount": 0,
            "State": {"Status": status, "Pid": 0, "StartedAt": "0001-01-01T00:00:00Z"}, "Config": {"Labels": labels}}


@pytest.fixture
def guard(tmp_path):
    containers = [_docker_container("a" * 64, "sparkprov-a", "a", "created"),
                  _docker_container("c" * 64, "sparkprov-c", "c", "running", on_demand=False)]
    calls: list[str] = []
    sock = tmp_path / "docker.sock"
    srv = dockerd(sock, containers, calls)
    (tmp_path / "meminfo").write_text("MemTotal: 127606784 kB\nMemFree: 100000000 kB\nMemAvailable: 110000000 kB\n")
    (tmp_path / "buddyinfo").write_text("Node 0, zone   Normal   100 50 20 10 5 2 1 1 1 1 3\n")
    (tmp_path / "key").write_text(KEY.hex() + "\n")
    cfg = {**node_files(tmp_path, sock), "port": _free_port(), "fabric_ifaces": [], "ondemand_key": str(tmp_path / "key")}
    guard = g.Guard(cfg)
    guard.listen()
    try:
        yield guard, calls, tmp_path
    finally:
        for s in guard.servers.values():
            s.shutdown()
        srv.shutdown()


def ask(guard, method, path, headers, body=b""):
    conn = http.client.HTTPConnection("127.0.0.1", guard.cfg["port"], timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def journal(tmp_path):
    p = tmp_path / "journal"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_the_guard_starts_and_stops_an_on_demand_deployment_on_a_signed_request_only(guard):
    guard, calls, tmp_path = guard
    guard.step()                                                  # the sampler has read the containers
    body = json.dumps({"reason": "a request for model a"}).encode()
    h = od.signed_headers(KEY, "POST", PATH, body)
    code, doc = ask(guard, "POST", PATH, h, body)
    assert code == 200 and doc["acted"] == ["sparkprov-a"] and calls == [f"/containers/{'a' * 64}/start"]
    assert doc["containers"][0]["state"] == od.STARTING          # running, its API not answering yet
    # the sampler judges it as a load from its start (the load-time memory watch), read at once
    s = guard.step()
    assert d.phases(d.serving_containers(s["containers"]), guard.state["engines"], s["t"]).get("sparkprov-a") == \
        "loading"
    (ev,) = journal(tmp_path)
    assert ev["kind"] == "on-demand-start" and ev["reading"] == "a: a request for model a"
    assert ev["action"] == "started sparkprov-a"
    # the same request again (a replay), unsigned, another key: refused, docker not asked
    assert ask(guard, "POST", PATH, h, body) == (401, {"error": "nonce seen before (a replayed request)"})
    assert ask(guard, "POST", PATH, {}, b"") == (401, {"error": "unsigned request"})
    assert ask(guard, "POST", PATH, od.signed_headers(bytes(32), "POST", PATH), b"") == (401, {"error": "bad signature"})
    # a deployment not on demand is never stopped by a request
    stop_c = "/v1/deployments/c/stop"
    code, doc = ask(guard, "POST", stop_c, od.signed_headers(KEY, "POST", stop_c))
    assert code == 403 and "not on demand" in doc["error"]
    assert calls == [f"/containers/{'a' * 64}/start"]
    # what the node holds, for the gateway rebuilding its view after its own restart
    code, doc = ask(guard, "GET", od.LIST_PATH, od.signed_headers(KEY, "GET", od.LIST_PATH))
    assert code == 200 and [(x["deployment"], x["state"]) for x in doc["deployments"]] == [("a", od.STARTING)]
    # the stop: intended, journaled with its reason
    stop = "/v1/deployments/a/stop"
    body = json.dumps({"reason": "idle 900s"}).encode()
    code, doc = ask(guard, "POST", stop, od.signed_headers(KEY, "POST", stop, body), body)
    assert code == 200 and doc["containers"][0]["state"] == od.PARKED
    assert calls[-1] == f"/containers/{'a' * 64}/stop?t={d.STOP_GRACE_S}"
    assert [(e["kind"], e["reading"]) for e in journal(tmp_path)][-1] == ("on-demand-stop", "a: idle 900s")
    # the sampler after it: nothing held, no restart, nothing counted against the budget
    for _ in range(2):
        guard.docker_t = -1e9
        guard.step()
    assert guard.state["held"] == {} and guard.state["restarts"] == [] and guard.state["stood_down"] is None
    assert [e["kind"] for e in journal(tmp_path)] == ["on-demand-start", "on-demand-stop"]


def test_a_start_is_refused_while_the_guard_holds_the_container_or_stood_down(guard):
    guard, calls, _ = guard
    guard.state["held"]["sparkprov-a"] = {"since": T0, "kind": "mem-critical"}
    code, doc = ask(guard, "POST", PATH, od.signed_headers(KEY, "POST", PATH))
    assert code == 409 and "holds sparkprov-a stopped (mem-critical)" in doc["error"] and calls == []
    guard.state["held"], guard.state["stood_down"] = {}, {"since": T0, "why": "x"}
    assert ask(guard, "POST", PATH, od.signed_headers(KEY, "POST", PATH))[0] == 409 and calls == []


def test_a_node_without_the_key_refuses_every_request(guard):
    guard, calls, tmp_path = guard
    (tmp_path / "key").write_text("")
    assert ask(guard, "POST", PATH, od.signed_headers(KEY, "POST", PATH)) == (
        401, {"error": "no on-demand key on this node (gateway up writes it)"})
    assert calls == []
