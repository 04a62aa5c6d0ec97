"""Prometheus on a host of the user's choice (`invoke monitor up|down`), scraping what
sparkprov/serving/monitor.py renders: every deployment's /metrics and every node guard's.

The container (host networking, restarted with the host, labelled sparkprov.managed=1 and
sparkprov.role=monitor: `status` lists it, cluster-down and the guard leave it alone, as the
gateway) runs as the login user, so it reads the files this host keeps in DIR/config (mounted
read-only: prometheus.yml, targets/*.json, keys/HOST.api_key at 0600) and writes its data in
DIR/data. The files, the API keys among them, arrive inside a program on the script's stdin,
never in an argv. It listens on one address: by default the host's first fabric address, which
the host itself and its fabric peers reach and nothing on the management LAN does (docs/security.md:
what sparkprov opens is closed to all but the fabric).

The image: prometheus_image in the inventory, else IMAGE (upstream's, pinned). The arguments are
the ones upstream's image and Debian's package both take; the image's entrypoint is Prometheus.
Grafana is not run: import the dashboard `invoke monitor write` writes into a Grafana of your own.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sparkprov.inventory_vars import default
from sparkprov.facts.docker_run import reporting_cause
from sparkprov.serving.gateway import wait_ready_script
from sparkprov.transport.shell import cmd

IMAGE = default("prometheus_image")  # an LTS release of upstream's image; pin a digest for repeatable runs
CONTAINER = "sparkprov-prometheus"
ROLE = "monitor"
PORT = default("prometheus_port")
DIR = "~/.local/share/sparkprov/monitor"
CONFIG = "config"      # under DIR: what `render` returns and the keys, mounted read-only at MOUNT
DATA = "data"          # under DIR: the TSDB
MOUNT = "/etc/sparkprov-monitor"
RETENTION = "15d"      # Prometheus's own default
READY_PATH = "/-/ready"
KEY_MODE, FILE_MODE = 0o600, 0o644
HOST_DIR = "$HOME/" + DIR[2:]  # DIR as the shell on the host names it (inside "...")


def running_monitor(status: dict[str, dict]) -> dict[str, Any] | None:
    """Where sparkprov's Prometheus runs (host, port, bind, image, status), from the status play;
    None: nowhere."""
    for host, st in status.items():
        for c in st.get("containers") or []:
            lab = c["labels"]
            if c["name"] == CONTAINER and lab.get("sparkprov.role") == ROLE:
                return {"host": host, "port": int(lab.get("sparkprov.monitor_port") or PORT),
                        "bind": lab.get("sparkprov.monitor_bind") or None,
                        "image": lab.get("sparkprov.monitor_image") or IMAGE, "status": c["status"]}
    return None


def file_modes(files: dict[str, str]) -> dict[str, int]:
    return {rel: KEY_MODE if rel.startswith("keys/") else FILE_MODE for rel in files}


def expected_tree(files: dict[str, str]) -> dict[str, tuple[int, str]]:
    """What facts/monitor.py FileTree reads once `files` are in place: path -> (mode, sha256)."""
    modes = file_modes(files)
    return {rel: (modes[rel], hashlib.sha256(text.encode()).hexdigest()) for rel, text in files.items()}


def state_hash(image: str, port: int, bind: str, files: dict[str, str]) -> str:
    """What the running container must match: image, address and every file (a rotated key is a
    changed Prometheus: it reads the key at each scrape, but the hash says it is the one in place)."""
    doc = json.dumps([image, port, bind, files], sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


# Runs on the host (python3, standard library): writes every file under DIR/config atomically with
# its mode, removes the ones no longer wanted (a key of a deployment that went), makes DIR/data.
HOST_WRITER = r'''
import json, os, sys
top = os.path.expanduser(sys.argv[1])
cfg, data = os.path.join(top, "config"), os.path.join(top, "data")
files = json.loads(FILES_JSON)
os.umask(0o077)
for d in (top, cfg, data):
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
for rel, (mode, text) in files.items():
    path = os.path.join(cfg, rel)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path + ".new", "w") as fh:
        fh.write(text)
    os.chmod(path + ".new", mode)
    os.replace(path + ".new", path)
for root, dirs, names in os.walk(cfg, topdown=False):
    for n in names:
        if os.path.relpath(os.path.join(root, n), cfg) not in files:
            os.unlink(os.path.join(root, n))
    if root != cfg and not os.listdir(root):
        os.rmdir(root)
'''


def up_script(*, image: str, port: int, bind: str, files: dict[str, str], digest: str, timeout: float) -> str:
    """Write the files, replace the container, wait (bounded) until Prometheus is ready."""
    modes = file_modes(files)
    program = "FILES_JSON = " + repr(json.dumps({rel: [modes[rel], text] for rel, text in files.items()})) \
        + "\n" + HOST_WRITER
    run = (cmd("docker", "run", "-d", "--name", CONTAINER, "--restart", "unless-stopped", "--network", "host",
               "--label", "sparkprov.managed=1", "--label", f"sparkprov.role={ROLE}",
               "--label", f"sparkprov.monitor_hash={digest}", "--label", f"sparkprov.monitor_port={port}",
               "--label", f"sparkprov.monitor_bind={bind}", "--label", f"sparkprov.monitor_image={image}")
           # the login user's: it owns the files (the keys are 0600)
           + ' --user "$(id -u):$(id -g)"'
           + f' -v "{HOST_DIR}/{CONFIG}:{MOUNT}:ro" -v "{HOST_DIR}/{DATA}:/prometheus" '
           + cmd(image, f"--config.file={MOUNT}/prometheus.yml", "--storage.tsdb.path=/prometheus",
                 f"--storage.tsdb.retention.time={RETENTION}", f"--web.listen-address={listen(bind, port)}"))
    return (f"python3 - {cmd(DIR)} <<'SPARKPROV_MONITOR'\n{program}\nSPARKPROV_MONITOR\n"
            + cmd("docker", "rm", "-f", CONTAINER) + " >/dev/null 2>&1 || true\n"
            + reporting_cause(run) + " >/dev/null\n" + wait_ready_script(CONTAINER, bind, port, READY_PATH, timeout))


def listen(bind: str, port: int) -> str:
    return f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"


def down_script() -> str:
    """Remove the container and every file of it (configuration, keys, data)."""
    return cmd("docker", "rm", "-f", CONTAINER) + f' >/dev/null 2>&1 || true\nrm -rf "{HOST_DIR}"\n'
