"""One endpoint in front of every deployment: LiteLLM's proxy (`invoke gateway up`).

Why LiteLLM's proxy: it is the OpenAI-compatible router Spark owners already run (sparkrun ships
one), it routes by model name to vLLM servers (`hosted_vllm/` models), balances between
deployments that serve the same name, and keeps its own key apart from the servers' keys. vLLM's
own router balances replicas of one model, not several models behind one name space.

The proxy runs in a container on one host (host networking, restarted with the host), from a
configuration file that holds the servers' keys and its own master key: the file is 0600 in the
login user's ~/.config/sparkprov/gateway/, mounted read-only; no key is in an argv, an
environment variable or `docker inspect`. The file is written on the host by HOST_WRITER from a
script that arrives on stdin, and the master key is made there once and never leaves it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, TypedDict

from sparkprov.catalog.lint import VLLM_DEFAULT_UTILIZATION
from sparkprov.catalog.memory import budget_gib
from sparkprov.inventory_vars import default
from sparkprov.facts.docker_run import reporting_cause
from sparkprov.node import activate
from sparkprov.node import ondemand as od
from sparkprov.serving import gateway_hook
from sparkprov.serving.address import reached_at
from sparkprov.serving.spec import SERVING_ROLES
from sparkprov.transport.shell import cmd

IMAGE = default("gateway_image")  # pin it: gateway_image in the inventory, or --image
CONTAINER = "sparkprov-gateway"
ROLE = "gateway"
PORT = default("gateway_port")
DIR = "~/.config/sparkprov/gateway"
CONFIG = "config.yaml"
MASTER_KEY = "master_key"
READY_PATH = "/health/liveliness"  # LiteLLM's own liveness endpoint: up once the proxy serves
# On-demand deployments (docs/on-demand.md): the hook's configuration (0600: it holds the key), the
# key the nodes' guards check (made on the gateway host once, 0600; ondemand_key places it on the
# nodes), and the hook's files (serving/gateway_hook.py and the node package's activation logic),
# each mounted read-only into the container beside config.yaml, where LiteLLM imports a callback's
# file from.
ONDEMAND_CONFIG = "ondemand.json"
ONDEMAND_KEY = "ondemand_key"
HOOK_DIR = "hook"
VIEW_DIR = "state"    # the hook writes its view here (mounted read-write): `invoke status` reads it
VIEW_FILE = "ondemand-view.json"
APP = "/app"          # the container's folder of config.yaml
CALLBACK = f"{gateway_hook.MODULE}.proxy_handler_instance"


class Route(TypedDict):
    model: str           # the name clients ask for
    deployment: str
    host: str
    api_base: str        # the server's OpenAI base URL, at the host's inventory address
    key_file: str | None  # its API key file there
    on_demand: bool       # parked until a request asks for it (the hook starts it)
    idle_stop_s: int | None
    utilization: float | None  # an on-demand server's --gpu-memory-utilization (its label)


class RunningGateway(TypedDict):
    host: str
    port: int
    bind: str
    image: str
    status: str


def routes_from_status(status: dict[str, dict], addresses: dict[str, str]) -> list[Route]:
    """Every deployment server the status play found running, and every on-demand one (parked or
    not: the hook starts it on a request), as a route: the model name clients ask for, the server's
    OpenAI base URL (the host's inventory address) and its key file there."""
    routes = []
    for host, st in status.items():
        for c in st.get("containers") or []:
            lab = c["labels"]
            on_demand = od.is_on_demand(c)
            if not (c["status"] == "running" or on_demand and c["status"] in od.STOPPED):
                continue
            if lab.get("sparkprov.role") not in SERVING_ROLES or not lab.get("sparkprov.port") \
                    or not lab.get("sparkprov.model"):
                continue
            idle, util = lab.get(od.IDLE_STOP_LABEL) or "", lab.get(od.UTILIZATION_LABEL) or ""
            routes.append({"model": lab["sparkprov.model"], "deployment": lab.get("sparkprov.deployment") or "",
                           "host": host, "api_base": f"http://{addresses[host]}:{lab['sparkprov.port']}/v1",
                           "key_file": lab.get("sparkprov.api_key_file") or None, "on_demand": on_demand,
                           "idle_stop_s": int(idle) if on_demand and idle.isdigit() else None,
                           "utilization": _number(util) if on_demand else None})
    return sorted(routes, key=lambda r: (r["model"], r["host"]))


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def guard_address(host: str, gateway_host: str, listen: list[str]) -> str | None:
    """Where the gateway reaches `host`'s guard: loopback on its own host (host networking), else
    the first fabric address the guard listens on (it listens on loopback and the fabric: status
    reads them from its state); None: not reachable from the gateway's host."""
    if host == gateway_host:
        return "127.0.0.1"
    return next((a for a in listen if a != "127.0.0.1"), None)


def ondemand_budgets(status: dict[str, dict], hosts: list[str], host_gib: dict[str, float],
                     headroom_gib: dict[str, float], given: dict[str, float | None]) -> dict[str, float]:
    """What on-demand deployments may take on each host, GiB: the inventory's ondemand_budget_gib
    where given, else the host's memory less the planner's headroom less what the deployments not
    on demand that run there reserve (each its --gpu-memory-utilization share, catalog/memory.py;
    their containers carry no utilization label, so vLLM's default 0.9 is assumed: an owner whose
    deployments reserve less gives the budget)."""
    out = {}
    for h in hosts:
        if given.get(h) is not None:
            out[h] = float(given[h])  # type: ignore[arg-type]
            continue
        held = sum(budget_gib(_number(c["labels"].get(od.UTILIZATION_LABEL) or "") or VLLM_DEFAULT_UTILIZATION,
                              host_gib[h])
                   for c in (status.get(h) or {}).get("containers") or []
                   if c["status"] == "running" and c["labels"].get("sparkprov.role") in SERVING_ROLES
                   and not od.is_on_demand(c))
        out[h] = round(max(0.0, host_gib[h] - headroom_gib[h] - held), 2)
    return out


def ondemand_config(routes: list[Route], keys: dict[tuple[str, str], str | None], *, guard_port: int,
                    addresses: dict[str, str], budgets_gib: dict[str, float], host_gib: dict[str, float],
                    bound_s: float = activate.BOUND_S) -> dict[str, Any] | None:
    """The hook's configuration (node/activate.py activator_from reads it) without its key (the
    gateway host adds it from its key file): each on-demand deployment's host, model, API base and
    key, idle_stop_s and the planner's memory figure there (its utilization share of the host,
    catalog/memory.py budget_gib); each host's guard address and budget. None: no on-demand route."""
    ondemand = [r for r in routes if r.get("on_demand")]
    if not ondemand:
        return None
    deployments = []
    for r in ondemand:
        h = r["host"]
        util = r.get("utilization") or VLLM_DEFAULT_UTILIZATION
        deployments.append({"name": r["deployment"], "model": r["model"], "hosts": [h],
                            "memory_gib": {h: round(budget_gib(util, host_gib[h]), 2)}, "api_base": r["api_base"],
                            "api_key": keys.get((h, r["key_file"])) if r["key_file"] else None,
                            "idle_stop_s": r.get("idle_stop_s")})
    hosts = sorted({r["host"] for r in ondemand})
    return {"guard_port": guard_port, "addresses": {h: addresses[h] for h in hosts},
            "budgets_gib": {h: budgets_gib[h] for h in hosts}, "bound_s": bound_s,
            "deployments": sorted(deployments, key=lambda d: d["name"])}


def hook_files() -> dict[str, str]:
    """The hook's files as the gateway's folder holds them (relative path -> text): the hook
    (serving/gateway_hook.py) and the part of the node package it imports, as they are here."""
    node = Path(od.__file__).parent
    return {f"{gateway_hook.MODULE}.py": Path(gateway_hook.__file__).read_text(),
            **{f"sparkprov_node/{n}": (node / n).read_text() for n in ("__init__.py", "activate.py", "ondemand.py")}}


def running_gateway(status: dict[str, dict]) -> RunningGateway | None:
    """Where the gateway runs (host, port, bind, image), from the status play; None: nowhere."""
    for host, st in status.items():
        for c in st.get("containers") or []:
            lab = c["labels"]
            if c["name"] == CONTAINER and lab.get("sparkprov.role") == ROLE:
                return {"host": host, "port": int(lab.get("sparkprov.gateway_port") or PORT),
                        "bind": lab.get("sparkprov.gateway_bind") or "0.0.0.0",
                        "image": lab.get("sparkprov.gateway_image") or IMAGE, "status": c["status"]}
    return None


def litellm_config(routes: list[Route], keys: dict[tuple[str, str], str | None]) -> dict[str, Any]:
    """LiteLLM's proxy configuration without its master key (the host adds it). `keys`:
    (host, key file) -> the server's key. Two servers of one model name are one model group,
    which LiteLLM balances. With an on-demand route the hook is named in it (callbacks)."""
    model_list = []
    for r in routes:
        key = keys.get((r["host"], r["key_file"])) if r["key_file"] else None
        model_list.append({"model_name": r["model"],
                           "litellm_params": {"model": f"hosted_vllm/{r['model']}", "api_base": r["api_base"],
                                              "api_key": key or "none"}})
    settings: dict[str, Any] = {"drop_params": True}
    if any(r.get("on_demand") for r in routes):
        settings["callbacks"] = [CALLBACK]
    return {"model_list": model_list, "litellm_settings": settings, "general_settings": {}}


def state_hash(image: str, port: int, bind: str, config: dict[str, Any], ondemand: dict[str, Any] | None = None,
               key: str | None = None) -> str:
    """What the running gateway must match: image, address and the whole configuration (the
    keys as they are: a rotated server key is a changed gateway); with on-demand deployments their
    configuration, the on-demand key's digest and the hook's files too (a gateway without them
    hashes as before)."""
    parts: list[Any] = [image, port, bind, config]
    if ondemand is not None:
        parts += [ondemand, hashlib.sha256((key or "").encode()).hexdigest(),
                  hashlib.sha256(json.dumps(hook_files(), sort_keys=True).encode()).hexdigest()]
    doc = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


# Runs on the gateway host (python3, standard library): makes the master key once, writes the
# configuration with it (0600, atomically); with on-demand deployments the hook's configuration with
# the on-demand key (0600; the key made there before by the ondemand_key task) and the hook's files,
# else removes them. Both configurations come inside this program's text (JSON, emitted by json),
# which arrives in a heredoc of the script on stdin.
HOST_WRITER = r"""
import json, os, secrets, shutil, sys
d = os.path.expanduser(sys.argv[1])
cfg = json.loads(CONFIG_JSON)
ondemand = json.loads(ONDEMAND_JSON)
os.makedirs(d, mode=0o700, exist_ok=True)
os.umask(0o077)

def write(path, text, mode):
    tmp = path + ".new"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)

kf = os.path.join(d, "master_key")
if not (os.path.isfile(kf) and open(kf).read().strip()):
    write(kf, "sk-" + secrets.token_urlsafe(32) + "\n", 0o600)
    print("@master_key=created")
os.chmod(kf, 0o600)
cfg["general_settings"]["master_key"] = open(kf).read().strip()
hook = os.path.join(d, HOOK_DIR)
if ondemand is None:
    shutil.rmtree(hook, ignore_errors=True)
    shutil.rmtree(os.path.join(d, VIEW_DIR), ignore_errors=True)
    if os.path.exists(os.path.join(d, ONDEMAND_CONFIG)):
        os.remove(os.path.join(d, ONDEMAND_CONFIG))
else:
    ondemand["key"] = open(os.path.join(d, ONDEMAND_KEY)).read().strip()
    write(os.path.join(d, ONDEMAND_CONFIG), json.dumps(ondemand, indent=1), 0o600)
    shutil.rmtree(hook, ignore_errors=True)
    os.makedirs(os.path.join(d, VIEW_DIR), mode=0o700, exist_ok=True)
    for name, text in HOOK_FILES.items():
        os.makedirs(os.path.dirname(os.path.join(hook, name)), mode=0o755, exist_ok=True)
        write(os.path.join(hook, name), text, 0o644)
    os.chmod(hook, 0o755)
write(os.path.join(d, "config.yaml"), json.dumps(cfg, indent=1), 0o600)  # YAML is a superset of JSON
"""


HOST_DIR = "$HOME/" + DIR[2:]  # the same folder, as the shell on the host names it (inside "...")


def writer_program(config: dict[str, Any], ondemand: dict[str, Any] | None) -> str:
    """HOST_WRITER with its data: every value a Python literal made by repr of json's text."""
    data = {"CONFIG_JSON": json.dumps(config), "ONDEMAND_JSON": json.dumps(ondemand), "HOOK_DIR": HOOK_DIR,
            "VIEW_DIR": VIEW_DIR,
            "ONDEMAND_CONFIG": ONDEMAND_CONFIG, "ONDEMAND_KEY": ONDEMAND_KEY,
            "HOOK_FILES": hook_files() if ondemand is not None else {}}
    return "".join(f"{k} = {v!r}\n" for k, v in data.items()) + HOST_WRITER


def mounts(ondemand: bool) -> list[tuple[str, str, bool]]:
    """The gateway container's mounts: (its path under DIR, its path in the container, read-only).
    Only the hook's view folder is writable (the hook writes its view there)."""
    files = [(CONFIG, f"{APP}/config.yaml", True)]
    if ondemand:
        files += [(ONDEMAND_CONFIG, f"{APP}/{ONDEMAND_CONFIG}", True),
                  (f"{HOOK_DIR}/{gateway_hook.MODULE}.py", f"{APP}/{gateway_hook.MODULE}.py", True),
                  (f"{HOOK_DIR}/sparkprov_node", f"{APP}/sparkprov_node", True),
                  (VIEW_DIR, f"{APP}/{VIEW_DIR}", False)]
    return files


def container_mounts(ondemand: bool) -> list[str]:
    return [f'-v "{HOST_DIR}/{src}:{dst}' + (':ro"' if ro else '"') for src, dst, ro in mounts(ondemand)]


def mark_idle(status: dict[str, dict], views: list[dict]) -> None:
    """Each on-demand container of the status play gets `idle_for_s` (idle_for; None: not idle or
    no view), from the hook's views read on the targets (empty ones where no gateway runs)."""
    views = [v for v in views if v.get("view")]
    for doc in status.values():
        for c in doc.get("containers") or []:
            if c.get("on_demand"):
                c["idle_for_s"] = idle_for(views, (c.get("labels") or {}).get("sparkprov.deployment") or "")


def idle_for(views: list[dict], deployment: str) -> float | None:
    """How long an on-demand deployment has had no request, from the hook's view files the status
    play read ({"now": the host's epoch, "view": Activator.view()}): its idle_s when written plus
    the time since (the view is rewritten every sweep, 10 s); None where no view holds it idle."""
    for v in views:
        doc = (v.get("view") or {}).get("deployments", {}).get(deployment) or {}
        if doc.get("idle_s") is not None:
            return round(float(doc["idle_s"]) + max(0.0, float(v["now"]) - float(v["view"]["written"])), 1)
    return None


def up_script(*, image: str, port: int, bind: str, config: dict[str, Any], digest: str, timeout: float,
              ondemand: dict[str, Any] | None = None) -> str:
    """Write the configuration, replace the container, wait (bounded) for the proxy to answer."""
    run = cmd("docker", "run", "-d", "--name", CONTAINER, "--restart", "unless-stopped", "--network", "host",
              "--label", "sparkprov.managed=1", "--label", f"sparkprov.role={ROLE}",
              "--label", f"sparkprov.gateway_hash={digest}", "--label", f"sparkprov.gateway_port={port}",
              "--label", f"sparkprov.gateway_bind={bind}", "--label", f"sparkprov.gateway_image={image}",
              # the model price list ships with LiteLLM: no fetch from the internet at start
              "-e", "LITELLM_LOCAL_MODEL_COST_MAP=True") + " " + " ".join(container_mounts(ondemand is not None)) \
        + " " + cmd(image, "--config", f"{APP}/config.yaml", "--host", bind, "--port", str(port))
    return (f"python3 - {cmd(DIR)} <<'SPARKPROV_GATEWAY'\n{writer_program(config, ondemand)}\nSPARKPROV_GATEWAY\n"
            + cmd("docker", "rm", "-f", CONTAINER) + " >/dev/null 2>&1 || true\n"
            + reporting_cause(run) + " >/dev/null\n" + wait_ready_script(CONTAINER, bind, port, READY_PATH, timeout))


def wait_ready_script(container: str, bind: str, port: int, path: str, timeout: float) -> str:
    """POSIX sh: wait (bounded) until http://BIND:PORT/PATH answers (loopback for a wildcard bind);
    prints `@ready SECONDS`, or `@failed WHY` and the container's last log lines."""
    at = reached_at(bind, "127.0.0.1")
    probe = (f"import urllib.request as u; u.build_opener(u.ProxyHandler({{}})).open("
             f"'http://{at}:{port}{path}', timeout=3)")
    logs = cmd("docker", "logs", "--tail", "8", container) + " 2>&1 | tail -n 8"
    return (f"i=0\nwhile [ $i -lt {int(timeout)} ]; do\n"
            f"  st=$(docker inspect --format '{{{{.State.Status}}}}' {container} 2>/dev/null)\n"
            f'  [ "$st" = running ] || {{ echo "@failed the container is $st"; {logs}; exit 0; }}\n'
            f"  if python3 -c {cmd(probe)} 2>/dev/null; then echo \"@ready $i\"; exit 0; fi\n"
            "  sleep 1; i=$((i+1))\ndone\n"
            f'echo "@failed not answering after {int(timeout)}s"; {logs}\n')


def down_script() -> str:
    """Remove the container, the configuration (it holds the servers' keys) and the on-demand one
    (it holds the on-demand key), the hook's files and the on-demand key; the master key stays, so
    that clients keep theirs across a down and an up."""
    return (cmd("docker", "rm", "-f", CONTAINER) + f' >/dev/null 2>&1 || true\nrm -f "{HOST_DIR}/{CONFIG}" '
            f'"{HOST_DIR}/{ONDEMAND_CONFIG}" "{HOST_DIR}/{ONDEMAND_KEY}"\nrm -rf "{HOST_DIR}/{HOOK_DIR}" "{HOST_DIR}/{VIEW_DIR}"\n')
