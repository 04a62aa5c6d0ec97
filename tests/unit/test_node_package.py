"""The code that runs on nodes (sparkprov/node) is a package of its own: every import it makes is the
standard library's or its own, and it runs as what the guard module installs (`sparkprov_node`, under
a python3 with no site-packages); its settings are one table of plain data; the daemon's sample,
decision and action wiring, run for real against stand-ins for dockerd (its API over a unix socket)
and a vLLM engine's /metrics, with the node's /proc files as files."""

from __future__ import annotations

import ast
import http.server
import json
import os
import shutil
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sparkprov import node
from sparkprov.modules import guard as guard_module
from sparkprov.node import guard as g
from sparkprov.node import settings

NODE_DIR = Path(node.__file__).parent


def test_every_import_is_the_standard_librarys_or_the_packages_own():
    for path in sorted(NODE_DIR.glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level:
                continue   # relative: the package's own
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module] if isinstance(n, ast.ImportFrom) else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__", f"{path.name} imports {name}"


def test_it_runs_as_the_package_the_module_installs_with_no_site_packages(tmp_path):
    lib = tmp_path / "lib"
    for dest, data in guard_module.package_files().items():
        f = lib / node.NODE_PACKAGE / dest.rsplit("/", 1)[1]
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    python = shutil.which("python3", path="/usr/bin:/bin")
    r = subprocess.run([python, "-S", "-B", "-c", "import sparkprov_node.guard, sparkprov_node.probe, sparkprov_node.rail; "
                        "print(sparkprov_node.guard.COMMAND_MARK)"], cwd=tmp_path, env={"PYTHONPATH": str(lib)},
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "sparkprov_node.guard", r.stderr
    assert {p.name for p in (lib / "sparkprov_node").iterdir()} == {p.name for p in NODE_DIR.glob("*.py")}


def test_every_setting_has_a_source_a_default_in_bounds_and_checks_what_it_is_given():
    for name, kind, lo, hi, default, source in settings.SETTINGS:
        assert len(source) > 10, name
        assert settings.check(name, default) == default, name
        if kind in ("float", "int") and hi is not None:
            with pytest.raises(ValueError, match="must be between"):
                settings.check(name, hi + 1)
    assert settings.check("interval_s", 2) == 2.0 and settings.check("restart_budget", 3.0) == 3
    for name, bad in (("act", "yes"), ("meminfo", "proc/meminfo"), ("fatal_xids", [48, "x"]), ("restart_budget", 2.5)):
        with pytest.raises(ValueError):
            settings.check(name, bad)
    with pytest.raises(ValueError, match="^stall_s: must be between 1 and 600"):
        settings.resolve({"stall_s": 0})
    # the table is plain data: names, types, bounds, defaults and sources as JSON can hold them
    assert json.loads(json.dumps(settings.SETTINGS))[0][0] == "interval_s"


# -- the daemon's wiring, run for real against stand-ins ----------------------------------------------

class _Unix(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _serve(server) -> None:
    threading.Thread(target=server.serve_forever, daemon=True).start()


def dockerd(sock: Path, containers: list[dict], calls: list[str]):
    """dockerd's API as the guard calls it: GET /containers/json, GET /containers/ID/json, POST
    .../stop and .../start (each recorded and applied)."""
    class H(http.server.BaseHTTPRequestHandler):
        def address_string(self):
            return "docker"

        def log_message(self, *a):
            pass

        def _send(self, code: int, body: object = None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            path = self.path.split("?")[0]
            if path == "/containers/json":
                return self._send(200, [{"Id": c["Id"]} for c in containers])
            c = next((c for c in containers if path == f"/containers/{c['Id']}/json"), None)
            return self._send(200, c) if c else self._send(404, {"message": "no such container"})

        def do_POST(self):  # noqa: N802
            calls.append(self.path)
            for c in containers:
                if self.path.startswith(f"/containers/{c['Id']}/"):
                    c["State"]["Status"] = "exited" if "/stop" in self.path else "running"
            self._send(204)

    srv = _Unix(str(sock), H)
    _serve(srv)
    return srv


def engine_metrics(values: dict[str, float]):
    """vLLM's /metrics for the names the guard asks (what prometheus_client serves with `name[]`)."""
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):  # noqa: N802
            body = "".join(f'{k}{{engine="0",model_name="lab-tiny"}} {v}\n' for k, v in values.items()).encode() \
                if self.path.startswith("/metrics") else b"{}"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    _serve(srv)
    return srv


def node_files(tmp_path: Path, sock: Path) -> dict:
    """The guard's settings with every file it reads or writes under tmp_path (meminfo, buddyinfo and
    the qualification record written by the test), docker at `sock`, no NVML and no nvidia-smi."""
    for f in ("kmsg", "drop_caches", "compact_memory"):
        (tmp_path / f).write_text("")
    return {**settings.DEFAULTS, **g.INTERNAL, "meminfo": str(tmp_path / "meminfo"),
            "buddyinfo": str(tmp_path / "buddyinfo"), "kernel_log": str(tmp_path / "kmsg"),
            "docker_socket": str(sock), "nvidia_smi": "/nonexistent/nvidia-smi",
            **{k: str(tmp_path / k) for k in ("journal", "state", "resume", "qualification", "drop_caches",
                                               "compact_memory", "boot_id", "boot_marker")}}


def rank0_container(cid: str, name: str, port: int) -> dict:
    """A running rank-0 container as docker's API lists it, its engine's port labelled."""
    return {"Id": cid, "Name": f"/{name}", "RestartCount": 0,
            "State": {"Status": "running", "Pid": 1, "StartedAt": "2026-11-28T13:01:02.1Z"},
            "Config": {"Labels": {"sparkprov.managed": "1", "sparkprov.role": "rank0", "sparkprov.port": str(port)}}}


def write_memory(tmp_path: Path, free_kb: int, available_kb: int, top_blocks: int) -> None:
    """The guard's memory readings under tmp_path: /proc/meminfo's figures (kB) of a 121.7 GiB GB10 and
    /proc/buddyinfo with `top_blocks` free blocks of the highest order."""
    (tmp_path / "meminfo").write_text(f"MemTotal:       127606784 kB\nMemFree:        {free_kb:>8} kB\n"
                                      f"MemAvailable:   {available_kb:>8} kB\n")   # the kernel's %8lu
    (tmp_path / "buddyinfo").write_text(f"Node 0, zone   Normal   100 50 20 10 5 2 1 1 1 1 {top_blocks}\n")


def test_the_daemon_stops_a_stalled_engine_drops_caches_and_resumes(tmp_path):
    values = {"vllm:generation_tokens_total": 100.0, "vllm:prompt_tokens_total": 40.0,
              "vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 0.0, "vllm:kv_cache_usage_perc": 0.1}
    web = engine_metrics(values)
    port = web.server_address[1]
    cid = "c0" * 32
    containers = [rank0_container(cid, "sparkprov-nat-rank0", port)]
    calls: list[str] = []
    sock = tmp_path / "docker.sock"
    srv = dockerd(sock, containers, calls)
    # a Spark during a page-cache flood: MemFree 5 GiB, MemAvailable 22.5 GiB (vllm#54200)
    write_memory(tmp_path, 5242880, 23592960, 3)
    cfg = node_files(tmp_path, sock)
    try:
        guard = g.Guard(cfg)
        t0 = 1_800_000_000.0
        clock = iter(t0 + i for i in range(100))
        real_time = g.time.time
        g.time.time = lambda: next(clock)
        try:
            s = guard.step()
            assert [c["engine"]["running"] for c in s["containers"]] == [4.0]
            for _ in range(200):                      # the reclaim runs in its thread (10 s: a loaded CI)
                if (tmp_path / "compact_memory").read_text():
                    break
                threading.Event().wait(0.05)
            assert (tmp_path / "drop_caches").read_text() == "3\n" and (tmp_path / "compact_memory").read_text() == "1\n"
            for _ in range(4):                        # the counters stand still: stall_s 3 s
                guard.step()
        finally:
            g.time.time = real_time
        assert calls == [f"/containers/{cid}/stop?t=0"]
        events = [json.loads(x) for x in (tmp_path / "journal").read_text().splitlines()]
        assert [e["kind"] for e in events] == ["reclaim", "stall"]
        assert events[1]["action"] == "stopped sparkprov-nat-rank0"
        state = json.loads((tmp_path / "state").read_text())
        assert state["held"]["sparkprov-nat-rank0"]["kind"] == "stall" and state["sample"]["hugeblocks"] == 3
        # invoke guard --resume leaves its file: taken (removed) at the next sample, journaled
        (tmp_path / "resume").write_text("1\n")
        guard.step()
        assert not (tmp_path / "resume").exists()
        last = [json.loads(x)["kind"] for x in (tmp_path / "journal").read_text().splitlines()][2:]
        assert last == ["resume", "restart-waiting"]    # MemFree 5 GiB: not back over the floor yet
    finally:
        srv.shutdown()
        web.shutdown()


def test_a_docker_socket_that_does_not_answer_is_reported_not_fatal(tmp_path):
    cfg = {**settings.DEFAULTS, **g.INTERNAL, "docker_socket": str(tmp_path / "none.sock"),
           "kernel_log": str(tmp_path / "kmsg"), "nvidia_smi": "/nonexistent/nvidia-smi",
           **{k: str(tmp_path / k) for k in ("journal", "state", "resume", "qualification")}}
    s = g.Guard(cfg).step()
    assert s["containers"] == [] and s["docker_error"].startswith(f"docker's socket {tmp_path}/none.sock: GET "
                                                                  "/containers/json: [Errno 2]")
    assert os.path.exists(tmp_path / "state")


def test_a_new_qualification_record_is_in_the_state_file_at_the_next_sample(tmp_path):
    """After the guard re-measured the rails (its requalify thread rewrites the record and asks for a
    fresh read), the next sample's state file, which `invoke status` reads, carries the new rails, not
    up to STATE_EVERY_S later (the lab's power-cycle test read the old ones, status exit 0)."""
    sock = tmp_path / "docker.sock"
    srv = dockerd(sock, [], [])
    write_memory(tmp_path, 117440512, 120586240, 30)   # at rest
    rail = {"iface": "enp1s0f1np1", "peer": "spark2", "gbps": 92.57, "floor_gbps": 46.0, "status": "ok"}
    qual = tmp_path / "qualification"
    qual.write_text(json.dumps({"ok": True, "rails": [rail]}))
    cfg = node_files(tmp_path, sock)
    try:
        guard = g.Guard(cfg)
        guard.step()
        assert json.loads((tmp_path / "state").read_text())["sample"]["rails"][0]["status"] == "ok"
        qual.write_text(json.dumps({"ok": False, "rails": [{**rail, "gbps": 0.1, "status": "degraded"}]}))
        guard.rails_t = -1e9            # what the requalify thread does after writing the record
        guard.step()
        assert json.loads((tmp_path / "state").read_text())["sample"]["rails"][0]["status"] == "degraded"
    finally:
        srv.shutdown()


def test_the_last_token_of_each_container_stays_in_the_state_and_on_metrics(tmp_path):
    """The token probe's result is kept per container from the sample that took it on: the state file
    and /metrics (sparkprov_guard_liveness_seconds, the dashboard's liveness panel) show it; it was
    seen only in the one sample that took it (the lab's monitoring test found the panel empty)."""
    from sparkprov.node.metrics import render_metrics

    web = engine_metrics({"vllm:generation_tokens_total": 10.0, "vllm:prompt_tokens_total": 4.0,
                          "vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
                          "vllm:kv_cache_usage_perc": 0.0})
    containers = [rank0_container("c1" * 32, "sparkprov-mon-rank0", web.server_address[1])]
    sock = tmp_path / "docker.sock"
    srv = dockerd(sock, containers, [])
    write_memory(tmp_path, 117440512, 120586240, 30)   # at rest
    cfg = node_files(tmp_path, sock)
    try:
        guard = g.Guard(cfg)
        guard.tokens["sparkprov-mon-rank0"] = {"status": 200, "seconds": 0.05, "error": None}
        guard.step()
        guard.state_t = -1e9
        guard.step()                    # a later sample, no new token: the last one is still shown
        doc = json.loads((tmp_path / "state").read_text())
        (c,) = doc["sample"]["containers"]
        assert c["liveness"]["seconds"] == 0.05
        assert 'sparkprov_guard_liveness_seconds{container="sparkprov-mon-rank0"} 0.05' in render_metrics(doc, {})
    finally:
        srv.shutdown()
        web.shutdown()
