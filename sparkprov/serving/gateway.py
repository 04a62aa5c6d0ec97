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
from typing import Any, TypedDict

from sparkprov.inventory_vars import default
from sparkprov.facts.docker_run import reporting_cause
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


class Route(TypedDict):
    model: str           # the name clients ask for
    deployment: str
    host: str
    api_base: str        # the server's OpenAI base URL, at the host's inventory address
    key_file: str | None  # its API key file there


class RunningGateway(TypedDict):
    host: str
    port: int
    bind: str
    image: str
    status: str


def routes_from_status(status: dict[str, dict], addresses: dict[str, str]) -> list[Route]:
    """Every running deployment server the status play found, as a route: the model name clients
    ask for, the server's OpenAI base URL (the host's inventory address) and its key file there."""
    routes = []
    for host, st in status.items():
        for c in st.get("containers") or []:
            lab = c["labels"]
            if c["status"] != "running" or lab.get("sparkprov.role") not in SERVING_ROLES:
                continue
            if not lab.get("sparkprov.port") or not lab.get("sparkprov.model"):
                continue
            routes.append({"model": lab["sparkprov.model"], "deployment": lab.get("sparkprov.deployment") or "",
                           "host": host, "api_base": f"http://{addresses[host]}:{lab['sparkprov.port']}/v1",
                           "key_file": lab.get("sparkprov.api_key_file") or None})
    return sorted(routes, key=lambda r: (r["model"], r["host"]))


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
    which LiteLLM balances."""
    model_list = []
    for r in routes:
        key = keys.get((r["host"], r["key_file"])) if r["key_file"] else None
        model_list.append({"model_name": r["model"],
                           "litellm_params": {"model": f"hosted_vllm/{r['model']}", "api_base": r["api_base"],
                                              "api_key": key or "none"}})
    return {"model_list": model_list, "litellm_settings": {"drop_params": True},
            "general_settings": {}}


def state_hash(image: str, port: int, bind: str, config: dict[str, Any]) -> str:
    """What the running gateway must match: image, address and the whole configuration (the
    keys as they are: a rotated server key is a changed gateway)."""
    doc = json.dumps([image, port, bind, config], sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


# Runs on the gateway host (python3, standard library): makes the master key once, writes the
# configuration with it (0600, atomically). The configuration comes inside this program's text,
# which arrives in a heredoc of the script on stdin.
HOST_WRITER = r'''
import json, os, secrets, sys
d = os.path.expanduser(sys.argv[1])
cfg = json.loads(CONFIG_JSON)
os.makedirs(d, mode=0o700, exist_ok=True)
os.umask(0o077)
kf = os.path.join(d, "master_key")
if not (os.path.isfile(kf) and open(kf).read().strip()):
    with open(kf + ".new", "w") as fh:
        fh.write("sk-" + secrets.token_urlsafe(32) + "\n")
    os.replace(kf + ".new", kf)
    print("@master_key=created")
os.chmod(kf, 0o600)
cfg["general_settings"]["master_key"] = open(kf).read().strip()
tmp = os.path.join(d, "config.yaml.new")
with open(tmp, "w") as fh:
    json.dump(cfg, fh, indent=1)  # YAML is a superset of JSON
os.chmod(tmp, 0o600)
os.replace(tmp, os.path.join(d, "config.yaml"))
'''


HOST_DIR = "$HOME/" + DIR[2:]  # the same folder, as the shell on the host names it (inside "...")


def up_script(*, image: str, port: int, bind: str, config: dict[str, Any], digest: str, timeout: float) -> str:
    """Write the configuration, replace the container, wait (bounded) for the proxy to answer."""
    program = "CONFIG_JSON = " + repr(json.dumps(config)) + "\n" + HOST_WRITER
    run = cmd("docker", "run", "-d", "--name", CONTAINER, "--restart", "unless-stopped", "--network", "host",
              "--label", "sparkprov.managed=1", "--label", f"sparkprov.role={ROLE}",
              "--label", f"sparkprov.gateway_hash={digest}", "--label", f"sparkprov.gateway_port={port}",
              "--label", f"sparkprov.gateway_bind={bind}", "--label", f"sparkprov.gateway_image={image}",
              # the model price list ships with LiteLLM: no fetch from the internet at start
              "-e", "LITELLM_LOCAL_MODEL_COST_MAP=True") + f' -v "{HOST_DIR}/{CONFIG}:/app/config.yaml:ro" ' \
        + cmd(image, "--config", "/app/config.yaml", "--host", bind, "--port", str(port))
    return (f"python3 - {cmd(DIR)} <<'SPARKPROV_GATEWAY'\n{program}\nSPARKPROV_GATEWAY\n"
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
    """Remove the container and the configuration (it holds the servers' keys); the master key
    stays, so that clients keep theirs across a down and an up."""
    return cmd("docker", "rm", "-f", CONTAINER) + f' >/dev/null 2>&1 || true\nrm -f "{HOST_DIR}/{CONFIG}"\n'
