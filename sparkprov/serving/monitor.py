"""Monitoring what sparkprov serves: a Prometheus scrape configuration (file_sd targets for every
deployment's /metrics, every node guard's /metrics, the hosts' node exporters and dcgm-exporters)
and a Grafana dashboard of the figures `invoke status` shows. Pure: `invoke monitor write`
(sparkprov/cli/monitor.py) learns the deployments from the status play and writes what `render`
returns; `invoke monitor up` puts the same files on a host and runs Prometheus there
(modules/prometheus.py).

The metric names the dashboard queries, and where each comes from (tests/unit/test_monitor.py
checks every query against the lab engine's /metrics and the exporter names listed here):

  vLLM /metrics (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py): the gauges
    vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1); the
    counters vllm:prompt_tokens_total, vllm:generation_tokens_total,
    vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
    vllm:spec_decode_num_accepted_tokens_total (acceptance = accepted / draft tokens, mean
    acceptance length = 1 + accepted / drafts, as vLLM's own SpecDecodingProm documents); the
    histogram vllm:time_to_first_token_seconds. Only the API server (rank 0) serves HTTP: the
    other ranks of a cluster have no /metrics to scrape.
  the node guard (node/metrics.py render_metrics, on every node provision made, port 9410 on
    loopback and the fabric addresses): sparkprov_guard_mem_available_bytes, _mem_total_bytes,
    _mem_floor_bytes, _swap_used_bytes, _gpu_temperature_celsius, _gpu_power_watts,
    _gpu_clock_sm_mhz, _gpu_clock_max_sm_mhz, _liveness_seconds{container}, _held_containers,
    _breaker_open, _events_total{kind} (only once an event is journaled), _last_sample_timestamp_seconds,
    _up; and the fabric qualification provision recorded: sparkprov_rail_gbps{iface,peer},
    sparkprov_rail_floor_gbps{iface}. The host panels query the guard first and fall back to the exporters below (`or`, per
    host), so they show data on a fleet that runs only what sparkprov installs.
  node_exporter (collector/meminfo.go: every /proc/meminfo field as node_memory_<field>_bytes):
    node_memory_MemTotal_bytes, node_memory_MemAvailable_bytes, node_memory_SwapTotal_bytes,
    node_memory_SwapFree_bytes. On GB10 CPU and GPU share 128 GB and MemAvailable is the only
    place free memory can be read (G16).
  NVIDIA dcgm-exporter (etc/default-counters.csv): DCGM_FI_DEV_GPU_TEMP (C) and
    DCGM_FI_DEV_POWER_USAGE (W), DCGM_FI_DEV_SM_CLOCK (MHz), on port 9400, its default. sparkprov
    installs neither exporter.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

import yaml

from sparkprov.errors import one_line
from sparkprov.serving.address import reached_at
from sparkprov.serving.spec import SERVING_ROLES

NODE_EXPORTER_PORT = 9100
DCGM_EXPORTER_PORT = 9400

PROMETHEUS_YML = "prometheus.yml"
VLLM_TARGETS = "targets/vllm.json"
NODE_TARGETS = "targets/node.json"
DCGM_TARGETS = "targets/dcgm.json"
GUARD_TARGETS = "targets/guard.json"
DASHBOARD = "grafana-dashboard.json"
KEY_DIR = "keys"  # beside prometheus.yml: where the operator puts each rank 0's API key (0600)

# A hidden label on each vLLM target (Prometheus drops `__` labels after relabelling): the host
# whose API key the scrape sends, or NO_KEY. Each job keeps only its own targets by it.
KEY_LABEL = "__sparkprov_api_key_of"
NO_KEY = "-"  # never a host name: those start with a letter or digit

# Grafana's classic dashboard JSON model, as Grafana 12 exports it
SCHEMA_VERSION = 41
DASHBOARD_UID = "sparkprov-serving"

NODE_METRICS = ("node_memory_MemTotal_bytes", "node_memory_MemAvailable_bytes", "node_memory_SwapTotal_bytes",
                "node_memory_SwapFree_bytes")
DCGM_METRICS = ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK")


@dataclass(frozen=True)
class MonitoredHost:
    """An inventory host as Prometheus reaches it: its address, the address vLLM binds there (the
    inventory's serve_bind; 0.0.0.0 or :: means every address), and where its guard's /metrics
    answers (host:port; None: not known, no target)."""

    name: str
    address: str
    bind: str = "0.0.0.0"
    guard: str | None = None


@dataclass(frozen=True)
class RunningDeployment:
    """A deployment as the status play found it: its rank-0 container (the API server)."""

    name: str
    model: str
    host: str                   # rank 0's inventory name
    address: str                # where Prometheus reaches its API server
    port: int
    api_key_file: str | None = None  # the key's path on rank 0 (never the key); None: no key
    nodes: tuple[str, ...] = ()
    state: str = "running"

    @property
    def target(self) -> str:
        return host_port(self.address, self.port)


def host_port(address: str, port: int) -> str:
    try:
        v6 = isinstance(ipaddress.ip_address(address.partition("%")[0]), ipaddress.IPv6Address)
    except ValueError:
        v6 = False
    return f"[{address}]:{port}" if v6 else f"{address}:{port}"


def loopback(address: str) -> bool:
    """Only a Prometheus on that machine reaches it."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.partition("%")[0]).is_loopback
    except ValueError:
        return False


def server_address(host: MonitoredHost) -> str:
    return reached_at(host.bind, host.address)


def _rail_networks(rails: list[dict[str, Any]]) -> list[tuple[str, ipaddress.IPv4Network | ipaddress.IPv6Network]]:
    out = []
    for r in rails:
        try:
            out.append((r["address"], ipaddress.ip_interface(f"{r['address']}/{r['prefix']}").network))
        except (KeyError, ValueError):
            continue
    return out


def guard_address(host: str, rails: dict[str, list[dict[str, Any]]], prometheus_host: str | None) -> tuple[str | None, str]:
    """Where a Prometheus reaches HOST's guard, which answers on loopback and on its fabric
    addresses only (node/guard.py): (address, note). `rails`: per host its fabric rails
    ({address, prefix}, FabricInfo's). On the Prometheus host itself, loopback; elsewhere the
    host's rail address on a subnet one of the Prometheus host's rails is on (a fabric peer);
    without a Prometheus host (files for a Prometheus run elsewhere), its first rail address.
    None when no rail of HOST is reachable that way."""
    if host == prometheus_host:
        return "127.0.0.1", ""
    mine = _rail_networks(rails.get(host) or [])
    if not mine:
        return None, f"{host} has no fabric address (its guard answers on loopback and the fabric only)"
    if prometheus_host is None:
        return mine[0][0], ""
    theirs = {net for _, net in _rail_networks(rails.get(prometheus_host) or [])}
    shared = next((addr for addr, net in mine if net in theirs), None)
    if shared is None:
        return None, (f"{host}'s guard is not reachable from {prometheus_host}: no fabric subnet in common "
                      f"(run Prometheus on a fabric peer of {host})")
    return shared, ""


def deployments_from_status(status: dict[str, dict], hosts: dict[str, MonitoredHost]) -> list[RunningDeployment]:
    """Every deployment whose API-serving container exists on a host the status play read
    (`invoke status --json`'s `hosts`). A container that is not running stays in: sparkprov
    keeps it until cluster-down, and a target Prometheus sees down is what an alert needs; one
    left out would simply vanish from the graphs."""
    members: dict[str, list[str]] = {}
    leads: list[tuple[str, dict]] = []
    for h, doc in status.items():
        for c in doc.get("containers") or []:
            labels = c.get("labels") or {}
            dep = labels.get("sparkprov.deployment")
            if not dep:
                continue
            members.setdefault(dep, []).append(h)
            if labels.get("sparkprov.role") in SERVING_ROLES and str(labels.get("sparkprov.port", "")).isdigit():
                leads.append((h, c))
    out = []
    for h, c in leads:
        labels = c["labels"]
        dep = labels["sparkprov.deployment"]
        out.append(RunningDeployment(
            name=dep, model=labels.get("sparkprov.model") or next(iter(c.get("served_models") or []), None)
            or labels.get("sparkprov.recipe") or dep,
            host=h, address=server_address(hosts[h]), port=int(labels["sparkprov.port"]),
            api_key_file=labels.get("sparkprov.api_key_file") or None,
            nodes=tuple(sorted(set(members[dep]), key=list(status).index)), state=c.get("status") or "unknown"))
    return sorted(out, key=lambda d: (d.name, d.host))


# -- Prometheus -------------------------------------------------------------------------------

def vllm_targets(deployments: list[RunningDeployment]) -> list[dict[str, Any]]:
    """file_sd groups: one a deployment, its rank 0's /metrics."""
    return [{"targets": [d.target], "labels": {"deployment": d.name, "model": d.model, "host": d.host,
                                               KEY_LABEL: d.host if d.api_key_file else NO_KEY}}
            for d in deployments]


def exporter_targets(hosts: list[MonitoredHost], port: int) -> list[dict[str, Any]]:
    """file_sd groups: one a host, its exporter on `port`."""
    return [{"targets": [host_port(h.address, port)], "labels": {"host": h.name}} for h in hosts]


def guard_targets(hosts: list[MonitoredHost]) -> list[dict[str, Any]]:
    """file_sd groups: one a host whose guard is reachable, its /metrics."""
    return [{"targets": [h.guard], "labels": {"host": h.name}} for h in hosts if h.guard]


def key_file(host: str) -> str:
    """Where prometheus.yml expects the API key of deployments led from `host` (relative to it)."""
    return f"{KEY_DIR}/{host}.api_key"


def _keep(value: str) -> list[dict[str, Any]]:
    # RE2, anchored by Prometheus; host names hold letters, digits, '.', '_' and '-'
    return [{"source_labels": [KEY_LABEL], "regex": value.replace(".", r"\."), "action": "keep"}]


_HEADER = """\
# Written by `invoke monitor` (sparkprov): Prometheus scrape configuration for the deployments
# sparkprov serves and the hosts they run on. Paths are relative to this file. Run it again after
# cluster-up or cluster-down: Prometheus re-reads the targets/ files by itself (this file, when it
# changes, needs a reload).
#
# vllm*: each deployment's rank 0 (the only node with an HTTP server), at /metrics.
#   vLLM serves /metrics without the API key even when --api-key is set: its authentication
#   middleware guards /v1 (and the other API routes) and names /metrics a public endpoint. A
#   deployment with a key is still scraped with it, as a bearer token read from a file in keys/
#   (`authorization: credentials_file`, read at each scrape; the key never stands in this file):
#   the scrape keeps working where that port sits behind something that checks the key, and the
#   key goes only to the server it belongs to. Each rank-0 host has its own key, so each has its
#   own job; a job keeps its own targets from targets/vllm.json by a hidden label.
# guard: the node guard on every host (provision installs it): MemAvailable and swap (CPU and GPU
#   share the 128 GB), GPU temperature, power and clocks, liveness, its events. It answers on
#   loopback and the fabric addresses only: each target is an address this Prometheus reaches.
# node: node_exporter on every host; dcgm: NVIDIA dcgm-exporter on every host, port 9400. sparkprov
#   installs neither: the dashboard reads the guard and falls back to them (leave their targets down).
"""


def prometheus_config(deployments: list[RunningDeployment], *, scrape_interval: str = "15s") -> str:
    keyed: dict[str, set[str]] = {}
    for d in deployments:
        if d.api_key_file:
            keyed.setdefault(d.host, set()).add(d.api_key_file)
    def vllm_sd() -> list[dict[str, Any]]:  # a fresh list each: no YAML anchors in the file
        return [{"files": [VLLM_TARGETS]}]

    jobs: list[dict[str, Any]] = [{"job_name": "vllm", "metrics_path": "/metrics", "file_sd_configs": vllm_sd(),
                                   "relabel_configs": _keep(NO_KEY)}]
    for host in sorted(keyed):
        jobs.append({"job_name": f"vllm-{host}", "metrics_path": "/metrics", "file_sd_configs": vllm_sd(),
                     "authorization": {"type": "Bearer", "credentials_file": key_file(host)},
                     "relabel_configs": _keep(host)})
    jobs += [{"job_name": "guard", "file_sd_configs": [{"files": [GUARD_TARGETS]}]},
             {"job_name": "node", "file_sd_configs": [{"files": [NODE_TARGETS]}]},
             {"job_name": "dcgm", "file_sd_configs": [{"files": [DCGM_TARGETS]}]}]
    keys = "".join(f"#   {key_file(h)}: copy it from {one_line(h)}:{one_line(p)} (mode 0600, readable by Prometheus)\n"
                   for h, paths in sorted(keyed.items()) for p in sorted(paths))
    body = yaml.safe_dump({"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
                           "scrape_configs": jobs}, sort_keys=False, default_flow_style=False)
    return _HEADER + ("#\n# API keys this configuration reads:\n" + keys if keys else "") + "\n" + body


# -- Grafana ----------------------------------------------------------------------------------

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_DEP = 'deployment=~"$deployment"'
_HOST = 'host=~"$host"'
_RATE = "[$__rate_interval]"


def _by_dep(fn: str, metric: str, rate: bool = False) -> str:
    inner = f"{metric}{{{_DEP}}}" + (_RATE if rate else "")
    return f"{fn} by (deployment) ({f'rate({inner})' if rate else inner})"


def _panel(title: str, description: str, unit: str, queries: list[tuple[str, str]], **defaults: Any) -> dict[str, Any]:
    return {"type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
            "fieldConfig": {"defaults": {"unit": unit, **defaults}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(queries)]}


def _variable(name: str, label: str, metric: str) -> dict[str, Any]:
    query = f"label_values({metric}, {name})"
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE, "query": query,
            "definition": query, "refresh": 2, "sort": 1, "multi": True, "includeAll": True,
            "current": {"text": "All", "value": "$__all"}, "options": [], "hide": 0}


def _per_host(guard: str, exporter: str | None = None) -> str:
    """One series a host: the guard's reading, else (a host without the guard) the exporter's.
    `or` matches on the host label alone: the two come from different jobs and instances."""
    first = f"max by (host) ({guard}{{{_HOST}}})"
    return first if exporter is None else f"{first} or max by (host) ({exporter})"


# Over 80 lines on purpose: one data literal, the dashboard's rows and panels in the order Grafana shows
# them; split up, a panel's query would stand apart from its title and description.
# Long on purpose: data, one panel to a line (the dashboard as Grafana reads it), not logic.
def dashboard() -> dict[str, Any]:
    """Grafana dashboard JSON (classic model): hosts (unified memory, swap, GPU temperature, power
    and clock, from the node guard or else the exporters), the guard (events, containers it holds
    stopped, whether it stood down, liveness, each rail's qualified throughput, its last sample) and deployments (KV cache, running and waiting
    requests, tokens/s, spec-decode acceptance, time to first token). Import it and pick the
    Prometheus data source."""
    spec = ("sum by (deployment) (rate(vllm:spec_decode_num_accepted_tokens_total{%s}%s))" % (_DEP, _RATE))
    swap = f"node_memory_SwapTotal_bytes{{{_HOST}}} - node_memory_SwapFree_bytes{{{_HOST}}}"
    events = f"sum by (host, kind) (increase(sparkprov_guard_events_total{{{_HOST}}}{_RATE}))"
    rows: list[tuple[str, list[dict[str, Any]]]] = [
        ("Hosts: unified memory (CPU and GPU share 128 GB), GPU", [
            _panel("Unified memory: MemFree, MemAvailable", "MemFree and MemAvailable of MemTotal, and the guard's "
                   "MemFree floor (the node guard, else node_exporter). On GB10 the GPU allocates from the same "
                   "memory, and MemFree is what it can take (vllm#48140): page cache counts as available, not as "
                   "free (G16).", "bytes",
                   [(_per_host("sparkprov_guard_mem_free_bytes", f"node_memory_MemFree_bytes{{{_HOST}}}"),
                     "{{host}} free"),
                    (_per_host("sparkprov_guard_mem_available_bytes", f"node_memory_MemAvailable_bytes{{{_HOST}}}"),
                     "{{host}} available"),
                    (_per_host("sparkprov_guard_mem_total_bytes", f"node_memory_MemTotal_bytes{{{_HOST}}}"),
                     "{{host}} total"),
                    (_per_host("sparkprov_guard_mem_floor_bytes"), "{{host}} guard floor")], min=0),
            _panel("Swap used", "SwapTotal - SwapFree (the node guard, else node_exporter): a Spark that swaps "
                   "under a model is over-committed.", "bytes",
                   [(_per_host("sparkprov_guard_swap_used_bytes", swap), "{{host}}")], min=0),
            _panel("GPU temperature", "nvidia-smi's temperature.gpu as the node guard samples it, else "
                   "DCGM_FI_DEV_GPU_TEMP (dcgm-exporter).", "celsius",
                   [(_per_host("sparkprov_guard_gpu_temperature_celsius", f"DCGM_FI_DEV_GPU_TEMP{{{_HOST}}}"),
                     "{{host}}")]),
            _panel("GPU power", "nvidia-smi's power.draw (the node guard), else DCGM_FI_DEV_POWER_USAGE.", "watt",
                   [(_per_host("sparkprov_guard_gpu_power_watts", f"DCGM_FI_DEV_POWER_USAGE{{{_HOST}}}"),
                     "{{host}}")], min=0),
            _panel("GPU SM clock", "The SM clock and its maximum (the node guard; else DCGM_FI_DEV_SM_CLOCK): a "
                   "clock far under its maximum while serving is a thermal or power slow state, or a lost "
                   "clock cap after a reboot.", "suffix: MHz",
                   [(_per_host("sparkprov_guard_gpu_clock_sm_mhz", f"DCGM_FI_DEV_SM_CLOCK{{{_HOST}}}"), "{{host}} SM"),
                    (_per_host("sparkprov_guard_gpu_clock_max_sm_mhz"), "{{host}} max")], min=0),
        ]),
        ("Node guard (docs/guard.md)", [
            _panel("Guard events", "Events the guard journaled (memory, stall, reclaim, nvrm-memory, restart, "
                   "stand-down...), by "
                   "kind; 0 on a host whose journal is empty. `invoke guard --events` lists them.", "short",
                   [(f"{events} or on (host) (0 * max by (host) (sparkprov_guard_up{{{_HOST}}}))",
                     "{{host}} {{kind}}")], min=0),
            _panel("Guard: containers held stopped, stood down", "Serving containers the guard stopped and holds "
                   "(until memory is back), and whether it stood down (1: its restart budget spent or a crash loop; "
                   "no restarts until invoke guard --resume or cluster-up).",
                   "short", [(_per_host("sparkprov_guard_held_containers"), "{{host}} held"),
                             (_per_host("sparkprov_guard_stood_down"), "{{host}} stood down")], min=0),
            _panel("Liveness: seconds to one generated token", "The guard's probe of each serving container "
                   "(a hung engine answers /health and generates nothing).", "s",
                   [(f"max by (host, container) (sparkprov_guard_liveness_seconds{{{_HOST}}})",
                     "{{host}} {{container}}")], min=0),
            _panel("Fabric rails: throughput at qualification", "What each rail carried at its last qualification "
                   "(ib_write_bw, at provision; docs/fabric.md) against the floor it was judged by: a rail under its "
                   "floor is degraded, and cluster-up refuses a multi-node start over it.", "suffix: Gb/s",
                   [(f"max by (host, iface) (sparkprov_rail_gbps{{{_HOST}}})", "{{host}} {{iface}}"),
                    (f"max by (host, iface) (sparkprov_rail_floor_gbps{{{_HOST}}})", "{{host}} {{iface}} floor")], min=0),
            _panel("Guard: seconds since its last sample", "Over 120 s: the guard is not sampling (`invoke status` "
                   "exits 2).", "s",
                   [(f"time() - {_per_host('sparkprov_guard_last_sample_timestamp_seconds')}", "{{host}}")], min=0),
        ]),
        ("Deployments (vLLM /metrics of each rank 0)", [
            _panel("KV-cache use", "vllm:kv_cache_usage_perc: the fraction of KV-cache blocks in use.",
                   "percentunit", [(_by_dep("max", "vllm:kv_cache_usage_perc"), "{{deployment}}")], min=0, max=1),
            _panel("Requests: running and waiting", "vllm:num_requests_running and vllm:num_requests_waiting.",
                   "short", [(_by_dep("sum", "vllm:num_requests_running"), "{{deployment}} running"),
                             (_by_dep("sum", "vllm:num_requests_waiting"), "{{deployment}} waiting")], min=0),
            _panel("Throughput (tokens/s)", "rate of vllm:generation_tokens_total and vllm:prompt_tokens_total.",
                   "suffix: tok/s", [(_by_dep("sum", "vllm:generation_tokens_total", rate=True),
                                      "{{deployment}} generated"),
                                     (_by_dep("sum", "vllm:prompt_tokens_total", rate=True),
                                      "{{deployment}} prompt")], min=0),
            _panel("Spec-decode acceptance", "Accepted / draft tokens (vllm:spec_decode_num_*_total); "
                   "empty for a deployment without speculative decoding.", "percentunit",
                   [(f"{spec} / {_by_dep('sum', 'vllm:spec_decode_num_draft_tokens_total', rate=True)}",
                     "{{deployment}}")], min=0, max=1),
            _panel("Spec-decode mean acceptance length", "1 + accepted tokens / drafts (counts the bonus token).",
                   "short", [(f"1 + {spec} / {_by_dep('sum', 'vllm:spec_decode_num_drafts_total', rate=True)}",
                              "{{deployment}}")], min=1),
            _panel("Time to first token", "p50 and p95 of vllm:time_to_first_token_seconds.", "s",
                   [(f"histogram_quantile({q}, sum by (deployment, le) (rate(vllm:time_to_first_token_seconds_bucket"
                     f"{{{_DEP}}}{_RATE})))", f"{{{{deployment}}}} p{int(q * 100)}") for q in (0.5, 0.95)], min=0),
        ]),
    ]
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in rows:
        panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        y += 1
        for i, p in enumerate(row):
            p["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)}
            panels.append(p)
        y += 8 * ((len(row) + 1) // 2)
    for n, p in enumerate(panels, 1):
        p["id"] = n
    return {
        "uid": DASHBOARD_UID, "title": "sparkprov: DGX Spark serving", "tags": ["sparkprov", "vllm", "dgx-spark"],
        "description": "Written by `invoke monitor`: the figures of `invoke status` over time.",
        "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "timezone": "browser",
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "options": [], "refresh": 1, "regex": "", "hide": 0},
            _variable("host", "Host", "sparkprov_guard_up"),
            _variable("deployment", "Deployment", "vllm:num_requests_running"),
        ]},
        "panels": panels,
    }


def render(deployments: list[RunningDeployment], hosts: list[MonitoredHost], *,
           node_exporter_port: int = NODE_EXPORTER_PORT, scrape_interval: str = "15s") -> dict[str, str]:
    """Every file `invoke monitor write` writes (and `monitor up` puts beside Prometheus): path
    relative to prometheus.yml -> content."""
    def js(doc: Any) -> str:
        return json.dumps(doc, indent=2) + "\n"

    return {
        PROMETHEUS_YML: prometheus_config(deployments, scrape_interval=scrape_interval),
        VLLM_TARGETS: js(vllm_targets(deployments)),
        GUARD_TARGETS: js(guard_targets(hosts)),
        NODE_TARGETS: js(exporter_targets(hosts, node_exporter_port)),
        DCGM_TARGETS: js(exporter_targets(hosts, DCGM_EXPORTER_PORT)),
        DASHBOARD: js(dashboard()),
    }
