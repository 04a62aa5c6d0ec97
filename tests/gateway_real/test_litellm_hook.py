"""The on-demand hook inside the real LiteLLM proxy (1.108.7, the lab's gateway image's), on loopback:
a request for a parked model is held while the node's guard starts it and answered once it answers;
a request the node's guard refuses to start gets HTTP 503 with the reason; concurrent requests share
one start; a streamed answer (`stream: true`, as chat UIs ask), one its client drops half-way, one
whose client left while it was held and one refused by a stopped engine each end their request once
(the deployment is not left "in use", which would keep it from ever being stopped). The guard and the engines are stand-ins on loopback (the guard verifies the signatures with
node/ondemand.py's verify, as the real one does); LiteLLM is real: its proxy loads the hook file from
the config's folder, as the gateway's container does.

Not part of `make test` (marker `litellm`): it needs LiteLLM's packages, which sparkprov does not
depend on. Give their site-packages (the lab image's layers unpacked) in SPARKPROV_LITELLM_SITE
(colon-separated), then: pytest -m litellm tests/gateway_real.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sparkprov.node import ondemand as od
from sparkprov.serving import gateway as gw

pytestmark = pytest.mark.litellm
SITE = os.environ.get("SPARKPROV_LITELLM_SITE")
REPO = Path(__file__).resolve().parents[2]
KEY = bytes(range(32))
NAMES = ("a", "b", "c")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(handler) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


class World:
    """The engines (answer once started, `load_s` after the start) and the node's guard."""

    def __init__(self, load_s: float = 1.5):
        self.started: dict[str, float] = {}
        self.calls: list[tuple[str, str]] = []
        self.refused = {"b": "the node's guard holds sparkprov-b stopped (stall) until memory is back"}
        self.load_s = load_s
        self.nonces = od.NonceCache()
        self.dropped: list[str] = []      # engines whose stream the proxy closed before its end
        world = self

        class Engine(http.server.BaseHTTPRequestHandler):
            name = ""

            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                ask = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                t = world.started.get(self.name)
                if t is None or time.time() - t < world.load_s:
                    self.send_error(503)
                    return
                chat = self.path.endswith("/chat/completions")
                if chat and ask.get("stream"):
                    return self._stream(ask)
                body = json.dumps({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                   "created": 1, "model": f"model-{self.name}",
                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                **({"message": {"role": "assistant", "content": f"I am {self.name}"}}
                                                   if chat else {"text": "1"})}],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _stream(self, ask):
                """vLLM's OpenAI stream: `data: {chunk}` frames, then `data: [DONE]`; a prompt of
                "slow" goes on a chunk every 0.2 s for up to 20 s (a long answer a client drops)."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                words = ["I", " am", f" {self.name}"]
                if ask["messages"][-1]["content"] == "slow":
                    words += ["."] * 100
                frames = [{"role": "assistant", "content": ""}, *({"content": w} for w in words)]
                try:
                    for i, delta in enumerate(frames):
                        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": f"model-{self.name}",
                                 "choices": [{"index": 0, "delta": delta,
                                              "finish_reason": "stop" if i == len(frames) - 1 else None}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        if len(frames) > 10 and i > 2:
                            time.sleep(0.2)
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except OSError:   # the proxy closed the upstream (its client dropped the stream)
                    world.dropped.append(self.name)

        class Guard(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, code, doc):
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                why = od.verify(KEY, "GET", self.path, dict(self.headers.items()), b"", time.time(), world.nonces)
                if why:
                    return self._answer(401, {"error": why})
                if self.path.endswith("/state"):     # the hook's recheck after a failed request
                    name = self.path.split("/")[3]
                    world.calls.append(("state", name))
                    return self._answer(200, {"deployment": name, "containers": [
                        {"name": f"sparkprov-{name}", "state": "running" if name in world.started else od.PARKED}]})
                self._answer(200, {"deployments": [{"deployment": n, "state": od.PARKED} for n in NAMES]})

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                why = od.verify(KEY, "POST", self.path, dict(self.headers.items()), body, time.time(), world.nonces)
                if why:
                    return self._answer(401, {"error": why})
                name, action = self.path.split("/")[3:5]
                world.calls.append((action, name))
                if action == "start" and name in world.refused:
                    return self._answer(409, {"error": world.refused[name]})
                if action == "start":
                    world.started.setdefault(name, time.time())
                else:
                    world.started.pop(name, None)
                self._answer(200, {"deployment": name, "acted": [f"sparkprov-{name}"]})

        self.engines = {n: _serve(type(f"Engine{n}", (Engine,), {"name": n})) for n in NAMES}
        self.guard = _serve(Guard)

    def close(self):
        for s in [*self.engines.values(), self.guard]:
            s.shutdown()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    if not SITE:
        pytest.skip("SPARKPROV_LITELLM_SITE is not set (LiteLLM's site-packages)")
    d = tmp_path_factory.mktemp("gateway")
    world = World()
    # the gateway's folder as `gateway up` writes it (serving/gateway.py, its host writer run for real
    # with the routes and hook configuration it makes of the status play's parked containers), laid
    # out as the container's mounts place it (gw.mounts)
    status = {"spark1": {"containers": [
        {"name": f"sparkprov-{n}", "id": n, "status": "created", "exit_code": 0, "restarts": 0, "started": "",
         "image": "img", "image_id": "sha256:1",
         "labels": {"sparkprov.managed": "1", "sparkprov.role": "server", "sparkprov.deployment": n,
                    "sparkprov.model": f"model-{n}", "sparkprov.port": str(s.server_address[1]),
                    od.ON_DEMAND_LABEL: "1", od.IDLE_STOP_LABEL: "600", od.UTILIZATION_LABEL: "0.4"}}
        for n, s in world.engines.items()]}}
    routes = gw.routes_from_status(status, {"spark1": "127.0.0.1"})
    ondemand = gw.ondemand_config(routes, {}, guard_port=world.guard.server_address[1],
                                  addresses={"spark1": "127.0.0.1"}, budgets_gib={"spark1": 10},
                                  host_gib={"spark1": 20}, bound_s=20)   # each 0.4 x 20 = 8 GiB: one at a time
    home = d / "home"
    (home / gw.DIR[2:]).mkdir(parents=True)
    (home / gw.DIR[2:] / gw.ONDEMAND_KEY).write_text(KEY.hex() + "\n")   # the ondemand_key task's
    subprocess.run([sys.executable, "-", gw.DIR], input=gw.writer_program(gw.litellm_config(routes, {}), ondemand),
                   text=True, check=True, env={**os.environ, "HOME": str(home)})
    app = d / "app"
    app.mkdir()
    for src, dst, _ in gw.mounts(True):
        (app / dst[len(gw.APP) + 1:]).symlink_to(home / gw.DIR[2:] / src)
    world.master = (home / gw.DIR[2:] / gw.MASTER_KEY).read_text().strip()
    port = _port()
    env = {**os.environ, "PYTHONPATH": SITE, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "SPARKPROV_ONDEMAND_CONFIG": str(app / gw.ONDEMAND_CONFIG),
           "SPARKPROV_ONDEMAND_VIEW": str(app / gw.VIEW_DIR / gw.VIEW_FILE), "NO_PROXY": "*"}
    log = open(d / "proxy.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", "from litellm import run_server; run_server()", "--config",
                             str(app / "config.yaml"), "--host", "127.0.0.1", "--port", str(port)],
                            cwd=app, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(240):
            try:
                urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://127.0.0.1:{port}/health/liveliness", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.5)
        else:
            pytest.fail("the proxy did not answer: " + (d / "proxy.log").read_text()[-2000:])
        if proc.poll() is not None:
            pytest.fail("the proxy exited: " + (d / "proxy.log").read_text()[-2000:])
        yield port, world, d
    finally:
        proc.terminate()
        proc.wait(30)
        world.close()


def chat(port: int, model: str, key: str) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                                 data=json.dumps({"model": model, "messages": [{"role": "user", "content": "who"}],
                                                  "max_tokens": 4}).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_the_hook_loads_its_view_when_the_proxy_starts_before_any_request(proxy):
    """LiteLLM builds the hook in its startup's loop: the view is rebuilt and the sweeper runs with no
    request (after a reboot of the gateway's host, a model back with it is stopped when idle)."""
    port, world, d = proxy
    view_file = d / "home" / gw.DIR[2:] / gw.VIEW_DIR / gw.VIEW_FILE
    for _ in range(40):                  # the first sweep: 10 s after the proxy's start
        if view_file.exists():
            break
        time.sleep(0.5)
    assert view_file.exists(), (d / "proxy.log").read_text()[-2000:]
    assert json.loads(view_file.read_text())["deployments"]["a"]["state"] == od.PARKED


def test_a_request_for_a_parked_model_is_held_and_answered_and_concurrent_ones_share_the_start(proxy):
    port, world, _ = proxy
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: chat(port, "model-a", world.master), range(8)))
    took = time.time() - t0
    assert [code for code, _ in answers] == [200] * 8, answers
    assert {doc["choices"][0]["message"]["content"] for _, doc in answers} == {"I am a"}
    assert world.calls.count(("start", "a")) == 1 and took >= world.load_s
    print(f"8 held requests answered in {took:.2f}s after one start (the engine's load {world.load_s}s)")


def test_a_request_the_guard_refuses_to_start_gets_503_with_the_reason(proxy):
    port, world, d = proxy
    code, doc = chat(port, "model-b", world.master)
    assert code == 503, (code, doc, (d / "proxy.log").read_text()[-3000:])
    assert "holds sparkprov-b stopped (stall)" in json.dumps(doc)


def test_the_hook_writes_its_view_where_status_reads_it(proxy):
    """At each sweep (10 s) the hook writes its view into the gateway's folder (the one writable
    mount): `invoke status` reads each on-demand deployment's idle time from it."""
    port, world, d = proxy
    assert chat(port, "model-a", world.master)[0] == 200   # a serves again (b's start stopped it for room)
    answered = time.time()
    view_file = d / "home" / gw.DIR[2:] / gw.VIEW_DIR / gw.VIEW_FILE
    for _ in range(30):
        if view_file.exists() and json.loads(view_file.read_text())["written"] > answered:
            break
        time.sleep(0.5)
    view = json.loads(view_file.read_text())
    assert view["deployments"]["a"]["state"] == od.SERVING and view["deployments"]["a"]["idle_s"] is not None
    assert view["deployments"]["b"]["state"] == od.PARKED
    assert gw.idle_for([{"now": time.time(), "view": view}], "a") >= view["deployments"]["a"]["idle_s"]



def stream_chat(port: int, model: str, key: str, prompt: str = "who") -> tuple[int, str, bool]:
    """A streamed chat completion read to its end: the status, the content of its deltas, whether it
    ended with `data: [DONE]`."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                                 data=json.dumps({"model": model, "stream": True, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": prompt}]}).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    text, done = "", False
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as r:
            for line in r:
                line = line.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    for choice in json.loads(line[6:]).get("choices") or []:
                        text += (choice.get("delta") or {}).get("content") or ""
            return r.status, text, done
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), False


def dropped_stream(port: int, model: str, key: str) -> str:
    """A client that reads a long stream's first chunk and goes away (a closed chat tab)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions",
                 json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "slow"}]}),
                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    r = conn.getresponse()
    first = ""
    while not first.startswith("data: "):
        first = r.readline().decode()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return first


def view_after(d: Path, t: float) -> dict:
    """The hook's view as its first sweep after `t` wrote it (a sweep every 10 s)."""
    view_file = d / "home" / gw.DIR[2:] / gw.VIEW_DIR / gw.VIEW_FILE
    for _ in range(50):
        if view_file.exists() and json.loads(view_file.read_text())["written"] > t:
            break
        time.sleep(0.5)
    return json.loads(view_file.read_text())


def test_streamed_requests_for_a_parked_model_are_held_started_once_streamed_and_then_not_in_use(proxy):
    """Chat UIs stream every answer: LiteLLM 1.108.7 does not call the post-call success hook for a
    stream (common_request_processing.py returns the StreamingResponse before it), so the hook counts
    a stream's end where the stream ends (its async_post_call_streaming_iterator_hook)."""
    port, world, d = proxy
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: stream_chat(port, "model-c", world.master), range(4)))
    took = time.time() - t0
    assert answers == [(200, "I am c", True)] * 4, (answers, (d / "proxy.log").read_text()[-3000:])
    assert world.calls.count(("start", "c")) == 1 and took >= world.load_s
    view = view_after(d, time.time())
    print(f"4 held streams answered in {took:.2f}s after one start; c in the view after: {view['deployments']['c']}")
    assert view["deployments"]["c"]["state"] == od.SERVING
    assert view["deployments"]["c"]["inflight"] == 0 and view["deployments"]["c"]["idle_s"] is not None


def test_a_stream_its_client_drops_half_way_leaves_nothing_in_flight(proxy):
    port, world, d = proxy
    first = dropped_stream(port, "model-c", world.master)
    assert '"role": "assistant"' in first or '"role":"assistant"' in first, first
    view = view_after(d, time.time() + 1)
    print(f"a dropped stream: the engine's stream closed: {world.dropped}; c in the view after: "
          f"{view['deployments']['c']}")
    assert view["deployments"]["c"]["inflight"] == 0 and view["deployments"]["c"]["state"] == od.SERVING


def test_a_stream_its_client_leaves_while_it_is_held_leaves_nothing_in_flight(proxy):
    """A chat tab closed while the model starts: the request goes on once it serves (LiteLLM does not
    cancel a request whose client left during its pre-call hook), its stream is dropped, and nothing
    stays in flight."""
    port, world, d = proxy
    assert world.started.get("a") is None          # a is parked: c took its room
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions",
                 json.dumps({"model": "model-a", "stream": True, "messages": [{"role": "user", "content": "slow"}]}),
                 {"Authorization": f"Bearer {world.master}", "Content-Type": "application/json"})
    time.sleep(0.5)                                 # held: the start takes load_s
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    left = time.time()
    view = view_after(d, left + world.load_s + 1)
    print(f"a stream whose client left while held: a in the view after: {view['deployments']['a']}; "
          f"starts of a: {world.calls.count(('start', 'a'))}; streams the proxy closed: {world.dropped}")
    assert view["deployments"]["a"]["inflight"] == 0, (d / "proxy.log").read_text()[-3000:]


def test_a_refused_connection_to_a_stopped_engine_reaches_the_failure_hook(proxy):
    """The guard stopped a under the hook's feet (its port refuses): the failed request reaches the
    failure hook, which asks the guard and finds a parked (the next request would start it again)."""
    port, world, d = proxy
    world.started.pop("a")
    engine = world.engines.pop("a")
    engine.shutdown()
    engine.server_close()
    t0 = time.time()
    code, body, _ = stream_chat(port, "model-a", world.master)
    print(f"a streamed request to a refused port: {code} in {time.time() - t0:.2f}s")
    assert code >= 500, body
    view = view_after(d, time.time())
    assert ("state", "a") in world.calls, world.calls
    assert view["deployments"]["a"]["state"] == od.PARKED and view["deployments"]["a"]["inflight"] == 0
