"""`invoke monitor`: the Prometheus scrape configuration and the Grafana dashboard it writes
(sparkprov/serving/monitor.py, sparkprov/cli/monitor.py), rendered from literal deployments and
from a literal status document of the shape `invoke status --json` prints.

Every PromQL expression of the dashboard must name only metrics that something really exposes:
vLLM's names as the lab engine's /metrics prints them (rendered in-process: no lab, no socket
served), and the exporter names listed below with their sources."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from helpers import SAFE_INVENTORY
from sparkprov.cli.monitor import write_files
from sparkprov.serving import monitor as mon

REPO = Path(__file__).resolve().parents[2]

# node_exporter's meminfo collector (collector/meminfo.go, meminfo_linux.go): every /proc/meminfo
# field FIELD as node_memory_FIELD_bytes (kB fields scaled to bytes).
NODE_EXPORTER = {"node_memory_MemTotal_bytes", "node_memory_MemFree_bytes", "node_memory_MemAvailable_bytes",
                 "node_memory_SwapTotal_bytes",
                 "node_memory_SwapFree_bytes"}
# NVIDIA dcgm-exporter's default counters (etc/default-counters.csv): DCGM field names as metric names.
DCGM_EXPORTER = {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK"}

SECRET = "sk-sparkprov-test-0123456789abcdef-must-never-leak"


# -- what the lab engine's /metrics prints --------------------------------------------------------

@pytest.fixture(scope="module")
def lab_metric_names() -> set[str]:
    """The sample names of the lab engine's /metrics, with speculative decoding on (its
    spec_decode counters appear only then, as in vLLM), after one request's worth of counts."""
    from sparklab.engine import cli as lab_cli
    from sparklab.engine.engine import Config
    from sparklab.engine.server import Server

    log = logging.getLogger("test_monitor")
    args, _ = lab_cli.parse(["serve", "org/model", "--host", "127.0.0.1", "--port", "0", "--speculative-config",
                             '{"method": "ngram", "num_speculative_tokens": 3}'], log)
    srv = Server(args, log)  # binds a loopback port and never serves it: render_metrics only
    try:
        srv.cfg = Config(args, SimpleNamespace(model_type="qwen3", is_fp4_moe=False))
        srv.cfg.kv_capacity = 4096
        text = srv.render_metrics()
    finally:
        srv.httpd.server_close()
    names = {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
             for line in text.splitlines() if line.strip() and not line.startswith("#")}
    assert "vllm:spec_decode_num_draft_tokens_total" in names  # spec decoding really on
    return names


@pytest.fixture(scope="module")
def guard_metric_names() -> set[str]:
    """The sample names the node guard's /metrics prints (node/metrics.py render_metrics, the code
    the guard serves), from a state document as the guard writes it: a sample with memory, swap,
    the GPU query, one container's liveness and one qualified rail, and one journaled event."""
    from sparkprov.node.metrics import render_metrics

    doc = {"sample": {"t": 1764158400.5, "mem": {"MemTotal": 128_000_000_000, "MemAvailable": 60_000_000_000,
                                                 "MemFree": 30_000_000_000,
                                                 "SwapTotal": 16_000_000_000, "SwapFree": 15_000_000_000},
                      "gpu": {"temperature_c": 50.0, "power_w": 15.57, "clock_sm_mhz": 2522.0,
                              "clock_max_sm_mhz": 3003.0},
                      "containers": [{"name": "sparkprov-one", "liveness": {"status": 200, "seconds": 0.4}}],
                      "rails": [{"iface": "enp1s0f1np1", "peer": "spark2", "gbps": 92.57, "floor_gbps": 46.0,
                                 "status": "ok"}]},
           "mem_floor_bytes": 8_589_934_592, "held": {}, "stood_down": None}
    text = render_metrics(doc, {"memory": 1})
    return {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            for line in text.splitlines() if line.strip() and not line.startswith("#")}


# -- PromQL: the metric names an expression selects -----------------------------------------------

_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
                "bool", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers that are not functions (followed by
    '('), aggregation keywords, grouping label lists, label matchers, range selectors, strings or
    Grafana variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\$\{?\w+\}?", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w:.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0).lower() in _NOT_METRICS:
            continue
        names.add(m.group(0))
    return names


def test_the_promql_parser_finds_metric_names_and_nothing_else():
    assert promql_metric_names('histogram_quantile(0.95, sum by (deployment, le) (rate(a:b_bucket{x=~"$y"}'
                                '[$__rate_interval])))') == {"a:b_bucket"}
    assert promql_metric_names('1 + sum by (d) (rate(x_total{d="a b"}[5m])) / on (d) group_left y') == {"x_total", "y"}
    assert promql_metric_names("node_a{h=~\"$host\"} - node_b") == {"node_a", "node_b"}
    assert promql_metric_names("bogus_name_not_exposed") == {"bogus_name_not_exposed"}


# -- literal inputs -------------------------------------------------------------------------------

HOSTS = {
    "spark1": mon.MonitoredHost("spark1", "192.168.1.163", guard="192.168.100.10:9410"),
    "spark2": mon.MonitoredHost("spark2", "192.168.1.164", guard="192.168.100.11:9410"),
    "spark3": mon.MonitoredHost("spark3", "spark3.lan", bind="127.0.0.1"),  # its guard: no fabric address
}


def _container(dep, role, status="running", *, port=None, key=None, model=None):
    labels = {"sparkprov.managed": "1", "sparkprov.deployment": dep, "sparkprov.role": role,
              "sparkprov.recipe": "llama-3.3-70b", "sparkprov.tp": "2"}
    if port:
        labels.update({"sparkprov.port": str(port), "sparkprov.model": model or dep})
    if key:
        labels["sparkprov.api_key_file"] = key
    return {"name": f"sparkprov-{dep}-{role}", "id": "c0ffee", "status": status, "exit_code": 0, "restarts": 0,
            "started": "", "labels": labels, "metrics": {"kv_cache_usage": 0.25}}


@pytest.fixture
def status(tmp_path):
    """`invoke status --json`'s hosts: a Ray cluster led from spark1 (with an API key whose file
    holds SECRET), its worker on spark2, a single-node server on spark3 that has exited, and a
    native rank on spark2 that serves no API."""
    key = tmp_path / "api_key"
    key.write_text(SECRET + "\n")
    key.chmod(0o600)
    return {
        "spark1": {"reachable": True, "docker": True, "containers": [
            _container("llama70b", "ray-head", port=8000, key=str(key), model="meta-llama/Llama-3.3-70B-Instruct")]},
        "spark2": {"reachable": True, "docker": True, "containers": [
            _container("llama70b", "ray-worker"), _container("qwen-native", "rank")]},
        "spark3": {"reachable": True, "docker": True, "containers": [
            _container("qwen", "server", status="exited", port=8001)]},
    }, str(key)


def test_deployments_from_status_take_rank_0_of_each_and_keep_one_that_is_down(status):
    st, key = status
    deps = mon.deployments_from_status(st, HOSTS)
    assert [(d.name, d.host, d.target, d.state, d.api_key_file, d.nodes) for d in deps] == [
        ("llama70b", "spark1", "192.168.1.163:8000", "running", key, ("spark1", "spark2")),
        ("qwen", "spark3", "127.0.0.1:8001", "exited", None, ("spark3",)),  # serve_bind 127.0.0.1
    ]
    assert deps[0].model == "meta-llama/Llama-3.3-70B-Instruct"
    assert mon.loopback(deps[1].address) and not mon.loopback(deps[0].address)


def _render(status, node_port=9100):
    st, _ = status
    return mon.render(mon.deployments_from_status(st, HOSTS), list(HOSTS.values()), node_exporter_port=node_port)


# -- the dashboard --------------------------------------------------------------------------------

def _queries(dash: dict) -> list[tuple[str, str]]:
    out = []
    for p in dash["panels"]:
        out += [(p["title"], t["expr"]) for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"])
            assert m, v["query"]
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def test_every_dashboard_query_names_a_metric_vllm_the_guard_or_an_exporter_exposes(status, lab_metric_names,
                                                                                   guard_metric_names):
    dash = json.loads(_render(status)[mon.DASHBOARD])
    exposed = lab_metric_names | guard_metric_names | NODE_EXPORTER | DCGM_EXPORTER
    queries = _queries(dash)
    assert len(queries) >= 14
    used = set()
    for where, expr in queries:
        names = promql_metric_names(expr)
        assert names, (where, expr)
        assert names <= exposed, (where, expr, names - exposed)
        used |= names
    # the figures of issue 17, each on the dashboard
    assert {"node_memory_MemAvailable_bytes", "node_memory_SwapTotal_bytes", "node_memory_SwapFree_bytes",
            "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "vllm:kv_cache_usage_perc",
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:spec_decode_num_draft_tokens_total", "vllm:generation_tokens_total"} <= used
    assert {"sparkprov_guard_mem_available_bytes", "sparkprov_guard_swap_used_bytes", "sparkprov_guard_gpu_temperature_celsius",
            "sparkprov_guard_gpu_power_watts", "sparkprov_guard_gpu_clock_sm_mhz", "sparkprov_guard_events_total",
            "sparkprov_guard_held_containers", "sparkprov_guard_stood_down", "sparkprov_rail_gbps"} <= used


def test_on_a_fleet_running_only_what_sparkprov_installs_every_host_query_reads_the_guard(status, guard_metric_names):
    """No node_exporter, no dcgm-exporter: every query outside the deployments row selects a guard
    metric, and each one that names an exporter metric has the guard's reading before an `or`, one
    series a host on either side (matched on `host` alone: the two come from different jobs)."""
    dash = json.loads(_render(status)[mon.DASHBOARD])
    for where, expr in _queries(dash):
        names = promql_metric_names(expr)
        if any(n.startswith("vllm:") for n in names):
            continue
        assert names & guard_metric_names, (where, expr)
        exporters = names & (NODE_EXPORTER | DCGM_EXPORTER)
        if exporters:
            first, _, fallback = expr.partition(" or ")
            assert promql_metric_names(first) <= guard_metric_names, (where, expr)
            assert promql_metric_names(fallback) <= exporters and first.startswith("max by (host) ("), (where, expr)
            assert fallback.startswith("max by (host) ("), (where, expr)
    # the events counter exists only once the guard journaled one: a clean host reads 0, not nothing
    (events,) = [e for w, e in _queries(dash) if w == "Guard events"]
    assert " or on (host) (0 * max by (host) (sparkprov_guard_up" in events


def test_the_dashboard_is_grafana_json_with_a_prometheus_datasource_variable(status):
    dash = json.loads(_render(status)[mon.DASHBOARD])
    assert dash["schemaVersion"] >= 39 and dash["uid"] and dash["title"]
    ds = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert [(v["name"], v["query"]) for v in ds] == [("datasource", "prometheus")]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]  # no two panels overlap
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["fieldConfig"]["defaults"]["unit"] and p["targets"]
            assert all(t["datasource"] == p["datasource"] for t in p["targets"])


# -- Prometheus -----------------------------------------------------------------------------------

_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def test_file_sd_targets_have_prometheus_shape_and_only_rank_0_serves_metrics(status):
    files = _render(status, node_port=9200)
    for rel in (mon.VLLM_TARGETS, mon.GUARD_TARGETS, mon.NODE_TARGETS, mon.DCGM_TARGETS):
        groups = json.loads(files[rel])
        assert isinstance(groups, list) and groups, rel
        for g in groups:
            assert set(g) == {"targets", "labels"}, rel
            assert all(isinstance(t, str) and re.fullmatch(r"(\[[0-9a-f:%\w]+\]|[\w.-]+):\d{1,5}", t)
                       for t in g["targets"]), g
            assert all(_LABEL.fullmatch(k) and isinstance(v, str) for k, v in g["labels"].items()), g
    vllm = json.loads(files[mon.VLLM_TARGETS])
    assert [(g["targets"], g["labels"]["deployment"], g["labels"]["host"]) for g in vllm] == [
        (["192.168.1.163:8000"], "llama70b", "spark1"), (["127.0.0.1:8001"], "qwen", "spark3")]
    assert not any("192.168.1.164" in t for g in vllm for t in g["targets"])  # the Ray worker: no HTTP
    assert [g["targets"] for g in json.loads(files[mon.NODE_TARGETS])] == [
        ["192.168.1.163:9200"], ["192.168.1.164:9200"], ["spark3.lan:9200"]]
    assert [(g["targets"], g["labels"]) for g in json.loads(files[mon.GUARD_TARGETS])] == [
        (["192.168.100.10:9410"], {"host": "spark1"}), (["192.168.100.11:9410"], {"host": "spark2"})]
    assert [g["targets"] for g in json.loads(files[mon.DCGM_TARGETS])] == [
        ["192.168.1.163:9400"], ["192.168.1.164:9400"], ["spark3.lan:9400"]]
    assert mon.host_port("fe80::1", 8000) == "[fe80::1]:8000"


def test_prometheus_yml_parses_and_references_the_file_sd_files(status):
    st, key = status
    files = _render(status)
    doc = yaml.safe_load(files[mon.PROMETHEUS_YML])
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert set(jobs) == {"vllm", "vllm-spark1", "guard", "node", "dcgm"}
    for j in jobs.values():
        for sd in j["file_sd_configs"]:
            for f in sd["files"]:
                assert not os.path.isabs(f) and f in files, f  # relative to prometheus.yml, and written
    assert {f for j in jobs.values() for sd in j["file_sd_configs"] for f in sd["files"]} == {
        mon.VLLM_TARGETS, mon.GUARD_TARGETS, mon.NODE_TARGETS, mon.DCGM_TARGETS}
    # the keyed deployment's job reads its key from a file beside the configuration
    assert jobs["vllm-spark1"]["authorization"] == {"type": "Bearer", "credentials_file": "keys/spark1.api_key"}
    assert "authorization" not in jobs["vllm"] and "authorization" not in jobs["node"]
    assert key not in yaml.safe_dump(doc)  # the path on the Spark is a comment, never a setting
    # each vLLM target is kept by exactly one vllm job (Prometheus anchors relabel regexes)
    for g in json.loads(files[mon.VLLM_TARGETS]):
        keeping = [name for name, j in jobs.items() if name.startswith("vllm")
                   for r in j["relabel_configs"]
                   if r["action"] == "keep" and re.fullmatch(r["regex"], g["labels"][r["source_labels"][0]])]
        assert keeping == (["vllm-spark1"] if g["labels"]["deployment"] == "llama70b" else ["vllm"]), g


def test_without_keys_there_is_one_vllm_job_and_no_authorization():
    deps = [mon.RunningDeployment("a", "m", "s.1", "10.0.0.1", 8000)]
    doc = yaml.safe_load(mon.prometheus_config(deps))
    assert [j["job_name"] for j in doc["scrape_configs"]] == ["vllm", "guard", "node", "dcgm"]
    assert "authorization" not in doc["scrape_configs"][0]
    assert "API keys this configuration reads" not in mon.prometheus_config(deps)


def test_no_secret_ever_appears_in_the_outputs(status, tmp_path):
    files = _render(status)
    for rel, text in files.items():
        assert SECRET not in text, rel
        assert SECRET[:16] not in text, rel
    out = tmp_path / "monitoring"
    write_files(out, files)
    written = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(str(p.relative_to(out)) for p in written) == sorted(files)
    assert not any(SECRET in p.read_text() for p in written)


# -- writing --------------------------------------------------------------------------------------

def test_files_are_written_atomically_once_and_check_writes_nothing(status, tmp_path):
    files = _render(status)
    out = tmp_path / "m"
    assert {s for _, s in write_files(out, files, check=True)} == {"would write"} and not out.exists()
    assert {s for _, s in write_files(out, files)} == {"wrote"}
    assert (out / mon.PROMETHEUS_YML).stat().st_mode & 0o777 == 0o644
    assert {s for _, s in write_files(out, files)} == {"unchanged"}
    (out / mon.VLLM_TARGETS).write_text("[]\n")
    states = dict(write_files(out, files, check=True))
    assert states[str(out / mon.VLLM_TARGETS)] == "would change"
    assert (out / mon.VLLM_TARGETS).read_text() == "[]\n"
    assert dict(write_files(out, files))[str(out / mon.VLLM_TARGETS)] == "wrote"
    assert (out / mon.VLLM_TARGETS).read_text() == files[mon.VLLM_TARGETS]
    assert not [p for p in out.rglob(".*.tmp")]  # no temporary file left behind


# -- the command line (loopback inventory: port 9, nothing listens) --------------------------------

def _invoke(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKPROV_")}
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), "monitor", "write", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("args, words", [
    (["--node-exporter-port", "0"], "--node-exporter-port 0 is out of range"),
    (["--node-exporter-port", "http"], "--node-exporter-port 'http' is not a whole number"),
    (["--out", ""], "--out '' is empty"),
    (["--out", "{d}/inventory.yaml"], "is a file, not a folder"),
    (["--forks", "0"], "--forks 0 is out of range"),
])
def test_bad_options_are_one_line_exit_1_and_nothing_written(tmp_path, args, words):
    (tmp_path / "inventory.yaml").write_text(SAFE_INVENTORY)
    proc = _invoke([a.replace("{d}", str(tmp_path)) for a in args], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("sparkprov: ") and words in proc.stderr, proc.stderr
    assert not (tmp_path / "monitoring").exists()


def test_an_unreachable_host_means_nothing_written_exit_4(tmp_path):
    (tmp_path / "inventory.yaml").write_text(SAFE_INVENTORY)
    proc = _invoke(["--inventory", str(tmp_path / "inventory.yaml"), "--out", str(tmp_path / "mon")], tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "s1: unreachable" in proc.stderr and "nothing written" in proc.stderr
    assert not (tmp_path / "mon").exists()
