"""Each host's own dockerd (Debian docker.io), detached, inside the host's namespaces."""
from __future__ import annotations

import json
import subprocess
import time

from .hosts import nsexec, nspopen, write_file
from .state import BRIDGE_IP, REGISTRY_PORT

SOCK = "/run/docker.sock"
PIDFILE = "/run/docker.pid"
CONTAINERD_PIDFILE = "/run/docker/containerd/containerd.pid"
LOG = "/var/log/dockerd.log"
DATA_ROOT = "/var/lib/docker"   # inside the host: a bind of <state>/hosts/NAME/docker

# Recipes run containers with `--ulimit memlock=-1` (unlimited locked memory, as on a Spark). runc
# sets a container's rlimits in its init process, which may not exceed the hard limits dockerd has
# unless it holds CAP_SYS_RESOURCE; a dockerd started from a login session inherits that session's
# hard RLIMIT_MEMLOCK (8 MiB: the kernel's and systemd's default), so runc failed with "error
# setting rlimit type 8: operation not permitted". The lab's dockerd therefore starts under
# `prlimit --memlock=unlimited:unlimited`. Where even root may not raise a hard limit (no
# CAP_SYS_RESOURCE, e.g. inside a container), the hosts' dockerd runs containers through
# RLIMIT_RUNTIME instead: runc, with every rlimit of a container's config.json capped at the hard
# limit the daemon has (what it can grant), each cap noted in RLIMIT_LOG.
RLIMIT_RUNTIME_NAME = "sparklab-runc"
RLIMIT_RUNTIME = "/etc/docker/sparklab-runc"   # inside the host (its private /etc)
RLIMIT_LOG = "/var/log/sparklab-runc.log"
RUNC = "/usr/sbin/runc"
RLIMIT_RUNTIME_SCRIPT = f"""#!/usr/bin/python3
# sparkprov lab: runc with each container rlimit capped at the hard limit this dockerd has
# (root here may not raise hard limits: no CAP_SYS_RESOURCE). See sparklab/dockerd.py.
import json, os, resource, sys, time
args = sys.argv[1:]
bundle = None
for i, a in enumerate(args):
    if a in ("--bundle", "-b") and i + 1 < len(args):
        bundle = args[i + 1]
    elif a.startswith("--bundle="):
        bundle = a.split("=", 1)[1]
if bundle and ("create" in args or "run" in args):
    path = os.path.join(bundle, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    notes = []
    for rl in cfg.get("process", {{}}).get("rlimits") or []:
        kind = getattr(resource, rl.get("type", ""), None)
        if kind is None:
            continue
        hard_max = resource.getrlimit(kind)[1]
        if hard_max == resource.RLIM_INFINITY or rl.get("hard", 0) <= hard_max:
            continue
        notes.append("%s %s:%s -> %s:%s" % (rl["type"], rl.get("soft"), rl.get("hard"),
                                             min(rl.get("soft", 0), hard_max), hard_max))
        rl["hard"], rl["soft"] = hard_max, min(rl.get("soft", 0), hard_max)
    if notes:
        with open(path + ".tmp", "w") as fh:
            json.dump(cfg, fh)
        os.replace(path + ".tmp", path)
        try:
            with open({RLIMIT_LOG!r}, "a") as log:
                log.write("%s %s: capped %s\\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), bundle, "; ".join(notes)))
        except OSError:
            pass
os.execv({RUNC!r}, [{RUNC!r}] + args)
"""
_CAN_RAISE: bool | None = None


def can_raise_memlock() -> bool:
    """Whether this machine's root may raise the hard RLIMIT_MEMLOCK (CAP_SYS_RESOURCE)."""
    global _CAN_RAISE
    if _CAN_RAISE is None:
        try:
            _CAN_RAISE = subprocess.run(["prlimit", "--memlock=unlimited:unlimited", "true"],
                                        capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            _CAN_RAISE = False
    return _CAN_RAISE


def memlock_hard(pid: int) -> str | None:
    """The hard 'Max locked memory' of a process ("unlimited" or bytes), from /proc."""
    try:
        with open(f"/proc/{pid}/limits") as fh:
            for line in fh:
                if line.startswith("Max locked memory"):
                    return line.split()[4]
    except OSError:
        return None
    return None


def cgroup_parent(name: str) -> str:
    return f"sparklab-{name}"


def daemon_json(settings: dict | None = None) -> str:
    """/etc/docker/daemon.json of a host: the lab registry as mirror and insecure registry
    (`settings`: the "daemon" part of sparklab.registry.client_settings, if given)."""
    reg = f"http://{BRIDGE_IP}:{REGISTRY_PORT}"
    conf = {"registry-mirrors": [reg], "insecure-registries": [f"{BRIDGE_IP}:{REGISTRY_PORT}"]}
    conf.update(settings or {})
    return json.dumps(_with_rlimit_runtime(conf), indent=2, sort_keys=True) + "\n"


def _with_rlimit_runtime(conf: dict) -> dict:
    conf = dict(conf)
    if can_raise_memlock():
        conf.pop("default-runtime", None)
        runtimes = {k: v for k, v in (conf.get("runtimes") or {}).items() if k != RLIMIT_RUNTIME_NAME}
        if runtimes:
            conf["runtimes"] = runtimes
        else:
            conf.pop("runtimes", None)
    else:
        conf["runtimes"] = {**(conf.get("runtimes") or {}), RLIMIT_RUNTIME_NAME: {"path": RLIMIT_RUNTIME}}
        conf["default-runtime"] = RLIMIT_RUNTIME_NAME
    return conf


def argv(name: str) -> list[str]:
    raise_memlock = ["prlimit", "--memlock=unlimited:unlimited", "--"] if can_raise_memlock() else []
    return [*raise_memlock, "/usr/sbin/dockerd", "--data-root", DATA_ROOT, "--exec-root", "/run/docker",
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
    cur = nsexec(name, ["cat", "/etc/docker/daemon.json"], check=False)
    if settings is None and cur.returncode == 0:
        try:
            text = json.dumps(_with_rlimit_runtime(json.loads(cur.stdout)), indent=2, sort_keys=True) + "\n"
        except ValueError:
            text = daemon_json(None)
        changed = text != cur.stdout and write_file(name, "/etc/docker/daemon.json", text)
    else:
        changed = write_file(name, "/etc/docker/daemon.json", daemon_json(settings))
    if not can_raise_memlock():
        changed = write_file(name, RLIMIT_RUNTIME, RLIMIT_RUNTIME_SCRIPT, 0o755) or changed
    pid = dockerd_pid(name)
    if pid and can_raise_memlock() and memlock_hard(pid) != "unlimited":
        changed = True  # started before the lab raised its memlock limit
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
