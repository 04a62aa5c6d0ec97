"""invoke gateway (sparkprov/serving/gateway.py, modules/gateway.py): routes from what the status
play read, LiteLLM's configuration, the hash a running gateway must match, the plan, and the
file writer run for real with python3 in a scratch home (the container part runs on the lab:
tests/lab/test_cluster.py)."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from sparkprov.facts.serving import KeyFile, Listeners, ManagedContainers
from sparkprov.modules.base import FactView, HostContext
from sparkprov.modules.gateway import Args, Gateway
from sparkprov.serving import gateway as gw


def container(name, role, status="running", **labels):
    return {"name": name, "id": name, "status": status, "exit_code": 0, "restarts": 0, "started": "",
            "image": "img", "image_id": "sha256:1",
            "labels": {"sparkprov.managed": "1", "sparkprov.role": role, **labels}}


STATUS = {
    "spark1": {"containers": [
        container("sparkprov-tp-head", "ray-head", **{"sparkprov.deployment": "tp", "sparkprov.port": "8000",
                                                     "sparkprov.model": "llama-3.3-70b",
                                                     "sparkprov.api_key_file": "/home/nvidia/.config/sparkprov/api_key"}),
        container("sparkprov-one", "server", status="exited", **{"sparkprov.deployment": "one", "sparkprov.port": "8001",
                                                               "sparkprov.model": "qwen"}),
        container(gw.CONTAINER, gw.ROLE, **{"sparkprov.gateway_port": "4100", "sparkprov.gateway_image": "lit:1"})]},
    "spark2": {"containers": [
        container("sparkprov-tp-worker", "ray-worker", **{"sparkprov.deployment": "tp"}),
        container("sparkprov-two", "server", **{"sparkprov.deployment": "two", "sparkprov.port": "8000",
                                                "sparkprov.model": "qwen3.6-27b"})]},
}
ADDR = {"spark1": "10.77.0.11", "spark2": "10.77.0.12"}


def test_routes_are_the_running_servers_by_model_name():
    routes = gw.routes_from_status(STATUS, ADDR)
    assert [(r["model"], r["host"], r["api_base"]) for r in routes] == [
        ("llama-3.3-70b", "spark1", "http://10.77.0.11:8000/v1"), ("qwen3.6-27b", "spark2", "http://10.77.0.12:8000/v1")]
    assert routes[0]["key_file"] == "/home/nvidia/.config/sparkprov/api_key" and routes[1]["key_file"] is None
    assert gw.running_gateway(STATUS) == {"host": "spark1", "port": 4100, "bind": "0.0.0.0", "image": "lit:1",
                                          "status": "running"}


def test_config_and_its_hash_follow_routes_and_keys():
    routes = gw.routes_from_status(STATUS, ADDR)
    keys = {("spark1", "/home/nvidia/.config/sparkprov/api_key"): "sekrit-key-one"}
    cfg = gw.litellm_config(routes, keys)
    assert cfg["model_list"][0] == {"model_name": "llama-3.3-70b", "litellm_params": {
        "model": "hosted_vllm/llama-3.3-70b", "api_base": "http://10.77.0.11:8000/v1", "api_key": "sekrit-key-one"}}
    assert cfg["model_list"][1]["litellm_params"]["api_key"] == "none"
    h = gw.state_hash("img", 4000, "0.0.0.0", cfg)
    assert h == gw.state_hash("img", 4000, "0.0.0.0", gw.litellm_config(routes, dict(keys)))
    rotated = gw.litellm_config(routes, {("spark1", "/home/nvidia/.config/sparkprov/api_key"): "sekrit-key-two"})
    assert len({h, gw.state_hash("img", 4000, "0.0.0.0", rotated), gw.state_hash("img", 4001, "0.0.0.0", cfg),
                gw.state_hash("img2", 4000, "0.0.0.0", cfg), gw.state_hash("img", 4000, "0.0.0.0",
                                                                          gw.litellm_config(routes[:1], keys))}) == 5


def _plan(args: dict, *, containers: list, ports=(), master=True, exports=None):
    a = Args.model_validate(args)
    mod = Gateway()
    facts = {ManagedContainers().key: {"access": True, "error": None, "containers": containers},
             Listeners((a.port,)).key: list(ports),
             KeyFile(f"{gw.DIR}/{gw.MASTER_KEY}").key: {"exists": master}}
    ctx = HostContext("spark1", {}, {"user": "nvidia", "home": "/home/nvidia"}, check=True,
                      exports=exports or {}, play_hosts=["spark1"], become=False)
    return mod.plan(a, mod.view(a, FactView(facts, {}), ctx), ctx)


def test_plan_starts_then_is_a_noop_then_follows_a_new_route():
    routes = gw.routes_from_status(STATUS, ADDR)
    exports = {"spark1": {"gateway_keys": {"/home/nvidia/.config/sparkprov/api_key": "sekrit-key-one"}}}
    args = {"routes": routes, "image": "lit:1", "port": 4000}
    p = _plan(args, containers=[], exports=exports)
    assert len(p.changes) == 1 and p.changes[0].summary.startswith("start sparkprov-gateway on port 4000: 2 route(s)")
    script = p.changes[0].script
    run_line = next(line for line in script.splitlines() if line.startswith("docker run"))
    assert "sekrit-key-one" in script and "sekrit-key-one" not in run_line  # the key goes in the heredoc only, never an argv
    assert "sekrit-key-one" not in p.changes[0].diff.after
    digest = next(w.split("=", 1)[1] for w in run_line.split() if w.startswith("sparkprov.gateway_hash="))
    running = container(gw.CONTAINER, gw.ROLE, **{"sparkprov.gateway_hash": digest})
    assert _plan(args, containers=[running], ports=[4000], exports=exports).changes == []
    assert _plan(args, containers=[running], ports=[4000], master=False, exports=exports).changes  # key gone
    fewer = {**args, "routes": routes[:1]}
    assert _plan(fewer, containers=[running], ports=[4000], exports=exports).changes[0].summary.startswith("replace")


def test_plan_refuses_a_taken_port_and_a_missing_key():
    routes = gw.routes_from_status(STATUS, ADDR)
    p = _plan({"routes": routes[1:], "port": 4000}, containers=[], ports=[4000])
    assert p.failed and "port 4000 is in use by a process sparkprov did not start" in p.failed
    p = _plan({"routes": routes, "port": 4000}, containers=[])
    assert p.failed and "the key of llama-3.3-70b on spark1 was not read" in p.failed
    assert _plan({"state": "absent"}, containers=[]).changes == []


def test_host_writer_makes_the_master_key_once_and_a_0600_config(tmp_path):
    cfg = gw.litellm_config(gw.routes_from_status(STATUS, ADDR), {})
    program = gw.writer_program(cfg, None)
    env = dict(os.environ, HOME=str(tmp_path))

    def write():
        r = subprocess.run(["python3", "-", gw.DIR], input=program, text=True, capture_output=True, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "@master_key=created" in write()
    d = tmp_path / gw.DIR[2:]
    key = (d / gw.MASTER_KEY).read_text().strip()
    assert key.startswith("sk-") and len(key) > 40
    for f in (d / gw.MASTER_KEY, d / gw.CONFIG):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    import yaml
    doc = yaml.safe_load((d / gw.CONFIG).read_text())
    assert doc["general_settings"]["master_key"] == key and len(doc["model_list"]) == 2
    assert "@master_key" not in write() and (d / gw.MASTER_KEY).read_text().strip() == key


@pytest.mark.parametrize("bind,at", [("0.0.0.0", "127.0.0.1"), ("10.77.0.11", "10.77.0.11")])
def test_up_script_waits_on_the_address_it_listens_on(bind, at):
    s = gw.up_script(image="lit:1", port=4000, bind=bind, config={"model_list": [], "general_settings": {}},
                     digest="d", timeout=30)
    assert f"http://{at}:4000{gw.READY_PATH}" in s and f"--host {bind} --port 4000" in s


def test_status_table_shows_deployments_and_the_gateway_by_their_labels(capsys):
    """`invoke status` without --json: the rows come from the containers' labels (it raised a
    KeyError on any container before)."""
    from sparkprov.cli.cluster import print_status

    st = {h: {**doc, "reachable": True, "docker": True, "error": None, "host": {}, "deployments": {}}
          for h, doc in STATUS.items()}
    print_status(st)
    out = capsys.readouterr().out
    for words in ("sparkprov-tp-head", "ray-head", "sparkprov-gateway", "gateway", "sparkprov-two", "exited"):
        assert words in out, words
