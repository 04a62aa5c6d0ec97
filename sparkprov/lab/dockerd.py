"""Each host's own dockerd (Debian docker.io), detached, inside the host's namespaces."""
from __future__ import annotations

import json
import time

from .hosts import nsexec, nspopen, write_file
from .state import BRIDGE_IP, REGISTRY_PORT

SOCK = "/run/docker.sock"
PIDFILE = "/run/docker.pid"
CONTAINERD_PIDFILE = "/run/docker/containerd/containerd.pid"
LOG = "/var/log/dockerd.log"
DATA_ROOT = "/var/lib/docker"   # inside the host: a bind of <state>/hosts/NAME/docker


def cgroup_parent(name: str) -> str:
    return f"sparklab-{name}"


def daemon_json(settings: dict | None = None) -> str:
    """/etc/docker/daemon.json of a host: the lab registry as mirror and insecure registry
    (`settings`: the "daemon" part of sparkprov.lab.registry.client_settings, if given)."""
    reg = f"http://{BRIDGE_IP}:{REGISTRY_PORT}"
    conf = {"registry-mirrors": [reg], "insecure-registries": [f"{BRIDGE_IP}:{REGISTRY_PORT}"]}
    conf.update(settings or {})
    return json.dumps(conf, indent=2, sort_keys=True) + "\n"


def argv(name: str) -> list[str]:
    return ["/usr/sbin/dockerd", "--data-root", DATA_ROOT, "--exec-root", "/run/docker",
            "--pidfile", PIDFILE, "-H", f"unix://{SOCK}", "--group", "docker",
            "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false",
            "--ip-forward=false", "--exec-opt", "native.cgroupdriver=cgroupfs",
            "--cgroup-parent", f"/{cgroup_parent(name)}"]


def dockerd_pid(name: str) -> int | None:
    r = nsexec(name, ["sh", "-c", f"p=$(cat {PIDFILE} 2>/dev/null) && kill -0 \"$p\" && "
                      "grep -qx dockerd /proc/$p/comm && echo $p"], check=False)
    return int(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def ready(name: str) -> bool:
    return nsexec(name, ["docker", "-H", f"unix://{SOCK}", "version", "--format",
                         "{{.Server.Version}}"], check=False, timeout=20).returncode == 0


def start_dockerd(name: str, wait: float = 60.0, settings: dict | None = None) -> bool:
    """Start the host's dockerd if it is not running; wait until it answers. True if started."""
    started = start_dockerd_async(name, settings)
    wait_dockerd(name, wait)
    return started


def start_dockerd_async(name: str, settings: dict | None = None) -> bool:
    """Launch the host's dockerd without waiting (see wait_dockerd). True if launched.
    Without `settings` an existing daemon.json is kept as it is."""
    if settings is None and nsexec(name, ["test", "-f", "/etc/docker/daemon.json"],
                                   check=False).returncode == 0:
        changed = False
    else:
        changed = write_file(name, "/etc/docker/daemon.json", daemon_json(settings))
    pid = dockerd_pid(name)
    if pid and not changed:
        return False  # running with the current config (wait_dockerd checks it answers)
    if pid:
        stop_dockerd(name)
    # a containerd left over from a killed dockerd still holds its database: stop it first
    # (a dead one may linger as a zombie until init reaps it, which still passes `kill -0`:
    # dockerd would then wait for it forever, so its pid file goes too)
    nsexec(name, ["sh", "-c",
                  f"f={CONTAINERD_PIDFILE}; p=$(cat $f 2>/dev/null) || exit 0; "
                  "live() { [ -r /proc/$p/stat ] && grep -qx containerd /proc/$p/comm && "
                  "! awk '{exit ($3==\"Z\")?0:1}' /proc/$p/stat; }; "
                  "if live; then kill $p; for i in $(seq 100); do live || break; sleep 0.1; done; "
                  "live && kill -9 $p; fi; rm -f $f /run/docker/containerd/containerd.sock"],
           check=False)
    nsexec(name, ["rm", "-f", PIDFILE, SOCK], check=False)
    nspopen(name, argv(name), log=LOG)
    return True


def wait_dockerd(name: str, wait: float = 60.0) -> None:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if dockerd_pid(name) and ready(name):
            return
        time.sleep(0.2)
    tail = nsexec(name, ["tail", "-n", "30", LOG], check=False).stdout
    raise RuntimeError(f"{name}: dockerd did not come up:\n{tail}")


def stop_dockerd(name: str, sig: str = "TERM", wait: float = 20.0) -> bool:
    """Stop (sig TERM: containers stopped cleanly) or kill (sig KILL) the host's dockerd."""
    pid = dockerd_pid(name)
    if not pid:
        return False
    nsexec(name, ["kill", f"-{sig}", str(pid)], check=False)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and dockerd_pid(name):
        time.sleep(0.1)
    if dockerd_pid(name):
        nsexec(name, ["kill", "-KILL", str(pid)], check=False)
    return True
