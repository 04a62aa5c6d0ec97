"""invoke monitor up|down (modules/prometheus.py, serving/prometheus.py, facts/monitor.py): where each
node guard is scraped from (guard_address, on fabric rails of FabricInfo's shape), the plan (start,
nothing to do, replace, remove, refusals) on literal facts, the file writer and the FileTree fact run
for real with python3 and sh in a scratch home (the container part runs on the lab:
tests/lab/test_monitoring.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import yaml

from sparkprov.facts.base import ShellCtx
from sparkprov.facts.fabric import FabricInfo
from sparkprov.facts.monitor import parse_tree
from sparkprov.facts.serving import Listeners, ManagedContainers
from sparkprov.modules.base import FactView, HostContext
from sparkprov.modules.fabric_rails import rails_of
from sparkprov.modules.prometheus import Args, Prometheus, tree_fact
from sparkprov.plays import monitor as plays
from sparkprov.node import decide as guard
from sparkprov.serving import monitor as mon
from sparkprov.serving import prometheus as prom

KEY = "sk-monitor-test-0123456789abcdef-never-in-an-argv"
KEY_FILE = "/home/nvidia/.config/sparkprov/api_key"

# FabricInfo's rails: the GB10 capture (tests/fixtures/gb10/ip-addr-static.txt: enp1s0f1np1
# 192.168.100.10/24) for spark1, its peer on the same cable for spark2; spark3 on another subnet;
# spark4 without a fabric address.
RAILS = {
    "spark1": [{"iface": "enp1s0f1np1", "address": "192.168.100.10", "prefix": 24}],
    "spark2": [{"iface": "enp1s0f1np1", "address": "192.168.100.11", "prefix": 24},
               {"iface": "enP2p1s0f1np1", "address": "192.168.101.11", "prefix": 24}],
    "spark3": [{"iface": "enp1s0f1np1", "address": "192.168.200.13", "prefix": 24}],
    "spark4": [],
}


def test_each_guard_is_scraped_where_the_prometheus_host_reaches_it():
    assert mon.guard_address("spark1", RAILS, "spark1") == ("127.0.0.1", "")  # its own: loopback
    assert mon.guard_address("spark2", RAILS, "spark1") == ("192.168.100.11", "")  # the shared subnet
    addr, note = mon.guard_address("spark3", RAILS, "spark1")
    assert addr is None and "no fabric subnet in common" in note and "spark3" in note
    addr, note = mon.guard_address("spark4", RAILS, "spark1")
    assert addr is None and "spark4 has no fabric address" in note
    # files for a Prometheus run elsewhere: the first rail address
    assert mon.guard_address("spark2", RAILS, None) == ("192.168.100.11", "")


def test_fabric_rails_are_read_from_fabric_info():
    info = {"rails": [{"iface": "enp1s0f1np1", "address": "192.168.100.10", "prefix": 24, "hca": "rocep1s0f1",
                       "mtu": 1500, "up": True}], "node_ip": "192.168.100.10"}
    assert rails_of(info) == RAILS["spark1"] and rails_of({}) == []


def container(name, role, status="running", **labels):
    return {"name": name, "id": name, "status": status, "exit_code": 0, "restarts": 0, "started": "",
            "image": "img", "image_id": "sha256:1", "labels": {"sparkprov.managed": "1", "sparkprov.role": role, **labels}}


ARGS = {"image": "prom/prometheus:v3.5.0", "port": 9090, "scrape_interval": "5s",
        "hosts": [{"name": h, "address": f"10.77.0.{11 + i}", "guard_port": 9410} for i, h in enumerate(RAILS)],
        "deployments": [{"name": "one", "model": "lab-tiny", "host": "spark2", "address": "10.77.0.12", "port": 8000,
                         "api_key_file": KEY_FILE}]}
EXPORTS = {h: {"fabric_rails": r} for h, r in RAILS.items()} | {
    "spark2": {"fabric_rails": RAILS["spark2"], "gateway_keys": {KEY_FILE: KEY}}}


def _plan(args: dict, *, containers=(), ports=(), tree=None, exports=None, fabric=None):
    a = Args.model_validate(args)
    mod = Prometheus()
    facts = {ManagedContainers().key: {"access": True, "error": None, "containers": list(containers)},
             Listeners((a.port,)).key: list(ports), tree_fact().key: tree or {"exists": False, "files": {}},
             FabricInfo().key: fabric if fabric is not None else {"rails": RAILS["spark1"]}}
    ctx = HostContext("spark1", {}, {"user": "nvidia", "home": "/home/nvidia"}, check=True,
                      exports=EXPORTS if exports is None else exports, play_hosts=["spark1"], become=False)
    return mod.plan(a, mod.view(a, FactView(facts, {}), ctx), ctx)


def _applied(plan):
    """The container and the files as the change leaves them (what the re-read finds)."""
    script = plan.changes[0].script
    run_line = next(line for line in script.splitlines() if line.startswith("docker run"))
    digest = next(w.split("=", 1)[1] for w in run_line.split() if w.startswith("sparkprov.monitor_hash="))
    files = json.loads(eval(script.split("FILES_JSON = ", 1)[1].split("\n", 1)[0]))  # the repr of a str
    tree = {"exists": True, "files": prom.expected_tree({rel: text for rel, (_, text) in files.items()})}
    return run_line, container(prom.CONTAINER, prom.ROLE, **{"sparkprov.monitor_hash": digest}), tree, files


def test_plan_starts_on_the_fabric_address_then_is_a_noop_then_follows_a_change():
    p = _plan(ARGS)
    assert not p.failed and len(p.changes) == 1, p
    assert p.changes[0].summary == ("start sparkprov-prometheus at http://192.168.100.10:9090: 1 deployment(s), "
                                    "2 of 4 guard(s)")
    assert sorted(p.warnings) == sorted([
        "spark3's guard is not reachable from spark1: no fabric subnet in common (run Prometheus on a fabric peer of spark3)",
        "spark4 has no fabric address (its guard answers on loopback and the fabric only)"])
    run_line, running, tree, files = _applied(p)
    assert KEY in p.changes[0].script and KEY not in run_line  # the key in the heredoc only, never an argv
    assert KEY not in p.changes[0].diff.after and "keys/spark2.api_key 0600 (a key)" in p.changes[0].diff.after
    assert "--web.listen-address=192.168.100.10:9090" in run_line and '--user "$(id -u):$(id -g)"' in run_line
    assert f"{prom.MOUNT}:ro" in run_line and "sparkprov.managed=1" in run_line and "sparkprov.role=monitor" in run_line
    assert set(files) == {mon.PROMETHEUS_YML, mon.VLLM_TARGETS, mon.GUARD_TARGETS, mon.NODE_TARGETS, mon.DCGM_TARGETS,
                          "keys/spark2.api_key"}
    assert files["keys/spark2.api_key"] == [0o600, KEY + "\n"] and files[mon.PROMETHEUS_YML][0] == 0o644
    assert [g["targets"] for g in json.loads(files[mon.GUARD_TARGETS][1])] == [["127.0.0.1:9410"], ["192.168.100.11:9410"]]
    cfg = yaml.safe_load(files[mon.PROMETHEUS_YML][1])
    assert cfg["global"]["scrape_interval"] == "5s"
    assert {j["job_name"] for j in cfg["scrape_configs"]} == {"vllm", "vllm-spark2", "guard", "node", "dcgm"}
    again = _plan(ARGS, containers=[running], ports=[9090], tree=tree)
    assert again.changes == [] and not again.failed and again.exports["monitor"]["url"] == "http://192.168.100.10:9090"
    # a target file changed by hand, a rotated key, another image: each replaces it
    edited = {"exists": True, "files": {**tree["files"], mon.VLLM_TARGETS: (0o644, "0" * 64)}}
    assert _plan(ARGS, containers=[running], ports=[9090], tree=edited).changes[0].summary.startswith("replace")
    rotated = {**EXPORTS, "spark2": {**EXPORTS["spark2"], "gateway_keys": {KEY_FILE: KEY + "2"}}}
    assert _plan(ARGS, containers=[running], ports=[9090], tree=tree, exports=rotated).changes
    assert _plan({**ARGS, "image": "prom/prometheus:v3.5.1"}, containers=[running], ports=[9090], tree=tree).changes


def test_without_a_fabric_it_listens_on_loopback_and_a_bind_given_wins():
    p = _plan(ARGS, fabric={"rails": []})
    assert "--web.listen-address=127.0.0.1:9090" in p.changes[0].script
    assert "--web.listen-address=[fd00::1]:9090" in _plan({**ARGS, "bind": "fd00::1"}).changes[0].script


def test_plan_refuses_a_taken_port_and_a_missing_key_and_absent_removes_everything():
    p = _plan(ARGS, ports=[9090])
    assert p.failed and "port 9090 is in use by a process sparkprov did not start" in p.failed
    no_keys = {h: {"fabric_rails": r} for h, r in RAILS.items()}
    p = _plan(ARGS, exports=no_keys)
    assert p.failed and "the API key of one on spark2 was not read" in p.failed
    assert _plan({"state": "absent"}).changes == []
    gone = _plan({"state": "absent"}, tree={"exists": True, "files": {}})  # the files without the container
    assert gone.changes and 'rm -rf "$HOME/.local/share/sparkprov/monitor"' in gone.changes[0].script
    running = container(prom.CONTAINER, prom.ROLE)
    assert _plan({"state": "absent"}, containers=[running]).changes[0].summary == (
        "remove sparkprov-prometheus and ~/.local/share/sparkprov/monitor")


def test_the_writer_and_the_file_tree_fact_round_trip_in_a_scratch_home(tmp_path):
    p = _plan(ARGS)
    _, _, want, files = _applied(p)
    program = "FILES_JSON = " + repr(json.dumps(files)) + "\n" + prom.HOST_WRITER
    env = dict(os.environ, HOME=str(tmp_path))
    top = tmp_path / prom.DIR[2:]
    (top / "config" / "keys").mkdir(parents=True)
    (top / "config" / "keys" / "gone.api_key").write_text("a key of a deployment that went\n")

    def write(prog):
        r = subprocess.run(["python3", "-", prom.DIR], input=prog, text=True, capture_output=True, env=env)
        assert r.returncode == 0, r.stderr

    def read_tree():
        # the fact's own command, run by sh here: its real output, parsed
        r = subprocess.run(["sh", "-c", tree_fact().command(ShellCtx(str(tmp_path)))], capture_output=True, text=True)
        return tree_fact().parse(r.stdout, r.stderr, r.returncode)

    assert read_tree() == {"exists": True, "files": {"keys/gone.api_key": (0o644, read_tree()["files"]["keys/gone.api_key"][1])}}
    write(program)
    assert read_tree() == want  # the stale key removed, every file with its mode and digest
    assert stat.S_IMODE((top / "config" / "keys" / "spark2.api_key").stat().st_mode) == 0o600
    assert stat.S_IMODE(top.stat().st_mode) == 0o700 and (top / "data").is_dir()
    write(program)
    assert read_tree() == want
    r = subprocess.run(["sh", "-c", prom.down_script().replace("docker rm -f", "true")], env=env)
    assert r.returncode == 0 and not top.exists()
    assert read_tree() == {"exists": False, "files": {}}
    assert parse_tree("@absent\n") == {"exists": False, "files": {}}


def test_the_running_prometheus_is_found_by_its_labels_and_left_alone_by_cluster_down_and_the_guard():
    st = {"spark1": {"containers": [container("sparkprov-one", "server")]},
          "spark2": {"containers": [container(prom.CONTAINER, prom.ROLE, **{
              "sparkprov.monitor_port": "9091", "sparkprov.monitor_bind": "192.168.100.11",
              "sparkprov.monitor_image": "sparkprov/lab-prometheus:bookworm"})]}}
    assert prom.running_monitor(st) == {"host": "spark2", "port": 9091, "bind": "192.168.100.11",
                                        "image": "sparkprov/lab-prometheus:bookworm", "status": "running"}
    assert prom.running_monitor({"spark1": st["spark1"]}) is None
    from sparkprov.plays.serve import down_book
    (absent,) = [t for t in down_book(["spark1"], None).plays[0].tasks if t.module == "serve_absent"]
    assert prom.ROLE in absent.args["exclude_roles"]
    assert [c["name"] for c in guard.serving_containers(st["spark1"]["containers"] + st["spark2"]["containers"])] == [
        "sparkprov-one"]


def test_the_up_book_reads_rails_everywhere_and_keys_with_no_log_before_prometheus():
    book = plays.up_book("spark1", ARGS["hosts"], ARGS["deployments"], image="img")
    assert [(p.name, p.hosts, [t.module for t in p.tasks]) for p in book.plays] == [
        ("monitor: fabric", ["spark1", "spark2", "spark3", "spark4"], ["fabric_rails"]),
        ("monitor: keys on spark2", ["spark2"], ["gateway_keys"]),
        ("monitor", ["spark1"], ["prometheus"])]
    assert book.plays[1].tasks[0].no_log and book.plays[1].tasks[0].args == {"key_files": [KEY_FILE]}
    Args.model_validate(book.plays[2].tasks[0].args)  # what the CLI hands over is what the module takes
    assert [t.args for p in plays.down_book(["spark1", "spark2"]).plays for t in p.tasks] == [{"state": "absent"}]


def test_the_lab_runs_debians_prometheus_under_the_name_its_inventory_gives():
    """The lab image (sparklab/image.py): Debian's package, the binary as the entrypoint as in
    upstream's image (so monitor up's arguments run both); the lab's generated inventory names it."""
    from sparklab import image
    from sparklab.state import HostRecord, LabRecord
    from sparklab.up import inventory_text

    assert image.image_kind(image.parse_ref(image.PROMETHEUS_IMAGE)) == "prometheus"
    assert image.PROMETHEUS_PACKAGES == ("prometheus",)
    cfg = json.loads(image._config_blob("prometheus", [], "2026-11-26T00:00:00Z", {}))
    assert cfg["config"]["Entrypoint"] == ["/usr/bin/prometheus"]
    rec = LabRecord()
    rec.hosts = {"spark1": HostRecord(name="spark1", index=1, address="10.77.0.11")}
    assert yaml.safe_load(inventory_text(rec, "http://10.77.0.1:5001"))["vars"]["prometheus_image"] == image.PROMETHEUS_IMAGE
