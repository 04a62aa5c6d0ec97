"""`gateway up` with on-demand deployments (issue 35, docs/on-demand.md), on literal data: parked
deployments routed by model name, the hook's configuration for a literal fleet (guard addresses, the
planner's per-node figure, each host's budget, idle_stop_s), the hook named in LiteLLM's config and
mounted read-only, the on-demand key made once on the gateway host and placed 0600 on the nodes, never
in an argv or a diff; the host writer run for real (python3, a scratch home) and the files it writes
loaded as the gateway's container loads them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import stat
import subprocess
import sys

import pytest

from sparkprov.facts.files import PathState
from sparkprov.facts.serving import KeyFile, KeyText, Listeners, ManagedContainers
from sparkprov.modules.base import FactView, HostContext
from sparkprov.modules.gateway import Args, Gateway
from sparkprov.modules import ondemand_key as okm
from sparkprov.node import ondemand as od
from sparkprov.plays.serve import gateway_book, gateway_down_book
from sparkprov.serving import gateway as gw

KEY = "ab" * 32
SERVER_KEY = "sekrit-server-key"
KEY_FILE = "/home/nvidia/.config/sparkprov/api_key"


def container(name, status, **labels):
    return {"name": name, "id": name, "status": status, "exit_code": 0, "restarts": 0, "started": "",
            "image": "img", "image_id": "sha256:1", "labels": {"sparkprov.managed": "1", **labels}}


def server(dep, model, port, status="running", **labels):
    return container(f"sparkprov-{dep}", status, **{"sparkprov.role": "server", "sparkprov.deployment": dep,
                                                    "sparkprov.model": model, "sparkprov.port": str(port), **labels})


# spark1: the gateway, one deployment not on demand; spark2: two on-demand ones (one parked, one the
# gateway started before) beside one not on demand (it reserves vLLM's default 0.9 of the host)
ON_DEMAND = {od.ON_DEMAND_LABEL: "1", od.IDLE_STOP_LABEL: "600", od.UTILIZATION_LABEL: "0.3"}
STATUS = {
    "spark1": {"containers": [server("big", "llama-3.3-70b", 8000),
                              container(gw.CONTAINER, "running", **{"sparkprov.role": gw.ROLE})],
               "host": {"guard": {"running": True, "listen": ["127.0.0.1", "192.168.100.11"]}}},
    "spark2": {"containers": [server("small", "qwen-small", 8000),
                              server("coder", "qwen-coder", 8001, status="created", **ON_DEMAND,
                                     **{"sparkprov.api_key_file": KEY_FILE}),
                              server("chat", "qwen-chat", 8002, status="exited",
                                     **{od.ON_DEMAND_LABEL: "1", od.UTILIZATION_LABEL: "0.25"}),
                              server("gone", "qwen-gone", 8003, status="exited")],  # not on demand, stopped
               "host": {"guard": {"running": True, "listen": ["127.0.0.1", "192.168.100.12", "192.168.101.12"]}}},
}
ADDR = {"spark1": "10.77.0.11", "spark2": "10.77.0.12"}
KEYS = {("spark2", KEY_FILE): SERVER_KEY}


def test_parked_deployments_are_routed_by_model_name_beside_the_serving_ones():
    routes = gw.routes_from_status(STATUS, ADDR)
    assert [(r["model"], r["host"], r["on_demand"], r["idle_stop_s"], r["utilization"]) for r in routes] == [
        ("llama-3.3-70b", "spark1", False, None, None), ("qwen-chat", "spark2", True, None, 0.25),
        ("qwen-coder", "spark2", True, 600, 0.3), ("qwen-small", "spark2", False, None, None)]
    cfg = gw.litellm_config(routes, KEYS)
    assert [m["model_name"] for m in cfg["model_list"]] == ["llama-3.3-70b", "qwen-chat", "qwen-coder", "qwen-small"]
    assert cfg["model_list"][2]["litellm_params"] == {"model": "hosted_vllm/qwen-coder",
                                                      "api_base": "http://10.77.0.12:8001/v1", "api_key": SERVER_KEY}
    assert cfg["litellm_settings"]["callbacks"] == ["sparkprov_ondemand.proxy_handler_instance"]


def test_without_on_demand_deployments_the_config_and_its_hash_are_as_before():
    routes = [r for r in gw.routes_from_status(STATUS, ADDR) if not r["on_demand"]]
    cfg = gw.litellm_config(routes, KEYS)
    assert cfg["litellm_settings"] == {"drop_params": True}
    # the hash a gateway started by an earlier sparkprov carries: no restart for an upgrade alone
    before = hashlib.sha256(json.dumps(["lit:1", 4000, "0.0.0.0", cfg], sort_keys=True).encode()).hexdigest()[:16]
    assert gw.state_hash("lit:1", 4000, "0.0.0.0", cfg) == before
    assert gw.ondemand_config(routes, KEYS, guard_port=9410, addresses={}, budgets_gib={}, host_gib={}) is None


def test_the_hooks_config_for_a_literal_fleet():
    routes = gw.routes_from_status(STATUS, ADDR)
    host_gib = {"spark2": 119.6}
    budgets = gw.ondemand_budgets(STATUS, ["spark2"], host_gib, {"spark2": 4.0}, {"spark2": None})
    assert budgets == {"spark2": 7.96}   # 119.6 - 4 - 0.9 x 119.6 (qwen-small runs, not on demand)
    assert gw.ondemand_budgets(STATUS, ["spark2"], host_gib, {"spark2": 4.0}, {"spark2": 60.0}) == {"spark2": 60.0}
    addresses = {"spark2": gw.guard_address("spark2", "spark1", STATUS["spark2"]["host"]["guard"]["listen"])}
    assert addresses == {"spark2": "192.168.100.12"}
    assert gw.guard_address("spark1", "spark1", ["127.0.0.1", "192.168.100.11"]) == "127.0.0.1"
    assert gw.guard_address("spark3", "spark1", ["127.0.0.1"]) is None
    doc = gw.ondemand_config(routes, KEYS, guard_port=9410, addresses=addresses, budgets_gib=budgets, host_gib=host_gib)
    assert doc == {
        "guard_port": 9410, "addresses": {"spark2": "192.168.100.12"}, "budgets_gib": {"spark2": 7.96}, "bound_s": 300.0,
        "deployments": [
            {"name": "chat", "model": "qwen-chat", "hosts": ["spark2"], "memory_gib": {"spark2": 29.9},
             "api_base": "http://10.77.0.12:8002/v1", "api_key": None, "idle_stop_s": None},
            {"name": "coder", "model": "qwen-coder", "hosts": ["spark2"], "memory_gib": {"spark2": 35.88},
             "api_base": "http://10.77.0.12:8001/v1", "api_key": SERVER_KEY, "idle_stop_s": 600}]}
    from sparkprov.node.activate import activator_from
    act = activator_from({**doc, "key": KEY})  # what the hook builds from it
    assert act.budgets == {"spark2": 7.96} and act.deployments["coder"].memory_gib == {"spark2": 35.88}
    assert act.deployments["coder"].idle_stop_s == 600.0 and act.guard.addresses == {"spark2": "192.168.100.12"}


ONDEMAND_ARGS = {"guard_port": 9410, "addresses": {"spark2": "192.168.100.12"}, "budgets_gib": {"spark2": 7.96},
                 "host_gib": {"spark2": 119.6}}


def _plan(args: dict, *, containers: list, exports: dict, ports=()):
    a = Args.model_validate(args)
    mod = Gateway()
    facts = {ManagedContainers().key: {"access": True, "error": None, "containers": containers},
             Listeners((a.port,)).key: list(ports), KeyFile(f"{gw.DIR}/{gw.MASTER_KEY}").key: {"exists": True}}
    ctx = HostContext("spark1", {}, {"user": "nvidia", "home": "/home/nvidia"}, check=True,
                      exports=exports, play_hosts=["spark1"], become=False)
    return mod.plan(a, mod.view(a, FactView(facts, {}), ctx), ctx)


def _argv_words(script: str) -> list[str]:
    """Every word of every command line of a script, here-documents' bodies left out (they travel
    on stdin, never an argv)."""
    words, lines, it = [], script.splitlines(), 0
    while it < len(lines):
        line = lines[it]
        if "<<'" in line:
            tag = line.split("<<'", 1)[1].split("'", 1)[0]
            while it < len(lines) and lines[it] != tag:
                it += 1
        else:
            try:
                words += shlex.split(line)
            except ValueError:
                words += line.split()
        it += 1
    return words


def test_gateway_plan_mounts_the_hook_read_only_and_keeps_the_key_off_argv_and_diff():
    routes = gw.routes_from_status(STATUS, ADDR)
    exports = {"spark2": {"gateway_keys": {KEY_FILE: SERVER_KEY}}, "spark1": {"ondemand_key": KEY}}
    args = {"routes": routes, "image": "lit:1", "port": 4000, "ondemand": ONDEMAND_ARGS}
    p = _plan(args, containers=[], exports=exports)
    change = p.changes[0]
    run_line = next(line for line in change.script.splitlines() if line.startswith("docker run"))
    for mount in ('"$HOME/.config/sparkprov/gateway/ondemand.json:/app/ondemand.json:ro"',
                  '"$HOME/.config/sparkprov/gateway/hook/sparkprov_ondemand.py:/app/sparkprov_ondemand.py:ro"',
                  '"$HOME/.config/sparkprov/gateway/hook/sparkprov_node:/app/sparkprov_node:ro"'):
        assert f"-v {mount}" in run_line, mount
    # the one writable mount: the folder the hook writes its view to (status reads it)
    assert '-v "$HOME/.config/sparkprov/gateway/state:/app/state" ' in run_line
    assert run_line.count(" -v ") == 5
    # the on-demand key is not even in the script: the gateway host reads it from its own file
    assert KEY not in change.script and KEY not in change.diff.after and KEY not in json.dumps(p.exports)
    assert all(SERVER_KEY not in w for w in _argv_words(change.script))
    assert "qwen-coder -> http://10.77.0.12:8001/v1 (coder on spark2, on demand, idle_stop_s 600)" in change.diff.after
    digest = next(w.split("=", 1)[1] for w in run_line.split() if w.startswith("sparkprov.gateway_hash="))
    running = container(gw.CONTAINER, "running", **{"sparkprov.role": gw.ROLE, "sparkprov.gateway_hash": digest})
    assert _plan(args, containers=[running], ports=[4000], exports=exports).changes == []        # a rerun: nothing
    rotated = {**exports, "spark1": {"ondemand_key": "cd" * 32}}
    assert _plan(args, containers=[running], ports=[4000], exports=rotated).changes              # a new key: replaced
    budget = {**args, "ondemand": {**ONDEMAND_ARGS, "budgets_gib": {"spark2": 50.0}}}
    assert _plan(budget, containers=[running], ports=[4000], exports=exports).changes            # a new budget too
    p = _plan(args, containers=[], exports={"spark2": exports["spark2"]})
    assert p.failed and "on-demand key" in p.failed


def test_the_book_places_the_key_as_root_without_a_log_before_the_gateway():
    routes = gw.routes_from_status(STATUS, ADDR)
    book = gateway_book("spark1", routes, image="lit:1", port=4000, ondemand=ONDEMAND_ARGS)
    by_name = {p.name: p for p in book.plays}
    assert [p.name for p in book.plays] == ["gateway: keys on spark2", "gateway: on-demand key",
                                            "gateway: on-demand key on the nodes", "gateway"]
    nodes = by_name["gateway: on-demand key on the nodes"]
    assert nodes.hosts == ["spark2"] and nodes.become and nodes.tasks[0].no_log
    assert nodes.tasks[0].args == {"role": "node", "source": "spark1"}
    assert by_name["gateway: on-demand key"].tasks[0].no_log and by_name["gateway: on-demand key"].hosts == ["spark1"]
    plain = gateway_book("spark1", [r for r in routes if not r["on_demand"]], image="lit:1")
    assert not any("on-demand" in p.name for p in plain.plays)
    down = gateway_down_book("spark1", ["spark2"])
    assert [(p.name, p.hosts, p.become) for p in down.plays] == [
        ("gateway", ["spark1"], False), ("gateway: on-demand key on the nodes", ["spark2"], True)]


def _key_plan(args: dict, facts: dict, exports: dict | None = None, name: str = "spark2"):
    a = okm.Args.model_validate(args)
    mod = okm.OnDemandKey()
    ctx = HostContext(name, {}, {"user": "nvidia", "home": "/home/nvidia"}, check=True, exports=exports or {},
                      play_hosts=[name], become=True)
    return mod.plan(a, mod.view(a, FactView(facts, {}), ctx), ctx)


def test_the_key_is_made_once_on_the_gateway_host_and_placed_0600_root_on_the_nodes():
    text = KeyText(okm.GATEWAY_PATH).key
    made = _key_plan({"role": "gateway"}, {text: None}, name="spark1")
    key = made.exports["ondemand_key"]
    assert od.parse_key(key) is not None and len(made.changes) == 1
    change = made.changes[0]
    assert key not in change.diff.after and key not in change.summary
    assert all(key not in w for w in _argv_words(change.script))
    assert "/home/nvidia/.config/sparkprov/gateway/ondemand_key" in change.script and "chmod 0600" in change.script
    there = _key_plan({"role": "gateway"}, {text: KEY}, name="spark1")
    assert there.changes == [] and there.exports == {"ondemand_key": KEY}

    f = PathState(okm.NODE_PATH).key
    exports = {"spark1": {"ondemand_key": KEY}}
    node = {"role": "node", "source": "spark1"}
    write = _key_plan(node, {f: {"exists": False}}, exports)
    (c,) = write.changes
    assert c.summary == "write the on-demand key /etc/sparkprov/ondemand.key (0600 root)"
    assert "chmod 0600" in c.script and "chown root:root" in c.script
    assert all(KEY not in w for w in _argv_words(c.script)) and KEY not in c.diff.after + c.diff.before
    same = {"exists": True, "sha256": hashlib.sha256((KEY + "\n").encode()).hexdigest(), "mode": 0o600, "owner": "root"}
    assert _key_plan(node, {f: same}, exports).changes == []
    assert _key_plan(node, {f: {**same, "mode": 0o644}}, exports).changes
    assert _key_plan(node, {f: {**same, "sha256": "0" * 64}}, exports).changes[0].summary.startswith("replace")
    assert "was not read" in _key_plan(node, {f: same}, {}).failed
    gone = _key_plan({"role": "node", "state": "absent"}, {f: same})
    assert gone.changes[0].script == "rm -f -- /etc/sparkprov/ondemand.key"
    assert _key_plan({"role": "node", "state": "absent"}, {f: {"exists": False}}).changes == []


def test_host_writer_writes_the_hook_and_its_0600_config_and_removes_them_without_on_demand(tmp_path):
    routes = gw.routes_from_status(STATUS, ADDR)
    cfg = gw.litellm_config(routes, KEYS)
    doc = gw.ondemand_config(routes, KEYS, **ONDEMAND_ARGS)
    env = dict(os.environ, HOME=str(tmp_path))
    d = tmp_path / gw.DIR[2:]
    d.mkdir(parents=True, mode=0o700)
    (d / gw.ONDEMAND_KEY).write_text(KEY + "\n")   # the ondemand_key task made it before

    def write(ondemand, config=cfg):
        r = subprocess.run(["python3", "-", gw.DIR], input=gw.writer_program(config, ondemand), text=True,
                           capture_output=True, env=env)
        assert r.returncode == 0, r.stderr

    write(doc)
    written = json.loads((d / gw.ONDEMAND_CONFIG).read_text())
    assert written == {**doc, "key": KEY}
    assert stat.S_IMODE((d / gw.ONDEMAND_CONFIG).stat().st_mode) == 0o600
    assert stat.S_IMODE((d / gw.CONFIG).stat().st_mode) == 0o600
    import yaml
    assert yaml.safe_load((d / gw.CONFIG).read_text())["litellm_settings"]["callbacks"] == [gw.CALLBACK]
    hook = d / gw.HOOK_DIR
    assert (d / gw.VIEW_DIR).is_dir()
    assert sorted(str(p.relative_to(hook)) for p in hook.rglob("*.py")) == [
        "sparkprov_node/__init__.py", "sparkprov_node/activate.py", "sparkprov_node/ondemand.py",
        "sparkprov_ondemand.py"]
    # the hook as the gateway's container imports it (its own name, the node package beside it)
    spec = importlib.util.spec_from_file_location("sparkprov_ondemand", hook / "sparkprov_ondemand.py")
    mod = importlib.util.module_from_spec(spec)
    saved = dict(sys.modules)
    try:
        spec.loader.exec_module(mod)
        act = mod.load_config(str(d / gw.ONDEMAND_CONFIG))
        assert sorted(act.deployments) == ["chat", "coder"] and act.guard.key == bytes.fromhex(KEY)
        assert type(act).__module__ == "sparkprov_node.activate"
    finally:
        sys.path[:] = [p for p in sys.path if p != str(hook)]
        for name in set(sys.modules) - set(saved):
            del sys.modules[name]
    write(None, gw.litellm_config([r for r in routes if not r["on_demand"]], KEYS))
    assert not (d / gw.ONDEMAND_CONFIG).exists() and not hook.exists() and not (d / gw.VIEW_DIR).exists()
    assert "callbacks" not in yaml.safe_load((d / gw.CONFIG).read_text())["litellm_settings"]


def test_down_removes_what_up_wrote_but_the_master_key(tmp_path):
    d = tmp_path / gw.DIR[2:]
    (d / gw.HOOK_DIR / "sparkprov_node").mkdir(parents=True)
    (d / gw.VIEW_DIR).mkdir()
    (d / gw.VIEW_DIR / gw.VIEW_FILE).write_text("{}")
    for name in (gw.CONFIG, gw.ONDEMAND_CONFIG, gw.ONDEMAND_KEY, gw.MASTER_KEY, f"{gw.HOOK_DIR}/sparkprov_ondemand.py"):
        (d / name).write_text("x")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "docker").chmod(0o755)
    r = subprocess.run(["sh", "-c", gw.down_script()], env=dict(os.environ, HOME=str(tmp_path),
                                                                PATH=f"{bindir}:{os.environ['PATH']}"))
    assert r.returncode == 0
    assert sorted(p.name for p in d.iterdir()) == [gw.MASTER_KEY]


@pytest.mark.parametrize("listen,running,words", [([], False, "does not run"), (["127.0.0.1"], True, "loopback only")])
def test_a_guard_the_gateway_cannot_reach_is_refused_before_any_host(tmp_path, listen, running, words):
    from sparkprov.data.inventory import load_inventory
    from sparkprov.errors import SparkprovError
    from sparkprov.plays.gateway import ondemand_args

    inv_file = tmp_path / "inventory.yaml"
    inv_file.write_text("hosts:\n  spark1: {address: 10.77.0.11}\n  spark2: {address: 10.77.0.12}\n")
    inv = load_inventory(str(inv_file))
    st = {**STATUS, "spark2": {**STATUS["spark2"], "host": {"guard": {"running": running, "listen": listen}}}}
    routes = gw.routes_from_status(st, ADDR)
    with pytest.raises(SparkprovError, match=words):
        ondemand_args(inv, st, routes, "spark1")
    assert ondemand_args(inv, st, routes, "spark2")["addresses"] == {"spark2": "127.0.0.1"}
    assert ondemand_args(inv, STATUS, routes, "spark1") == {
        "guard_port": 9410, "addresses": {"spark2": "192.168.100.12"}, "budgets_gib": {"spark2": 7.96},
        "host_gib": {"spark2": 119.6}}


def test_down_removes_the_key_also_where_the_on_demand_deployment_was_removed_before():
    """A host whose on-demand deployment was removed (cluster-down) before `gateway down` still holds
    the key, which its guard would go on accepting: down removes it on every host it read (no change
    where there is none: the ondemand_key module's absent plan)."""
    from sparkprov.plays.gateway import down_key_hosts

    removed_before = {**STATUS, "spark2": {**STATUS["spark2"], "containers": [server("small", "qwen-small", 8000)]}}
    assert down_key_hosts(removed_before, ["spark1", "spark2"]) == ["spark1", "spark2"]
    assert down_key_hosts(STATUS, ["spark2", "spark1"]) == ["spark1", "spark2"]
