"""Per-host sshd, the lab's control key and its strict known_hosts."""
from __future__ import annotations

import os
import subprocess
import time

from . import state
from .hosts import nsexec, write_file
from .state import LOGIN_USER

SSHD_CONFIG = "/etc/ssh/sshd_config"
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key"
PIDFILE = "/run/sshd.pid"
# The host's sshd log (inside the host). LogLevel VERBOSE records every connection
# ("Accepted publickey for ...") and every session a client starts on it ("Starting session:
# command for ...", "subsystem 'sftp'", "shell"), so remote executions can be counted from it.
LOG = "/var/log/sshd.log"

CONFIG = f"""\
# sparkprov lab: this host's sshd (started as `sshd -f {SSHD_CONFIG}` in its namespaces)
Port 22
ListenAddress 0.0.0.0
HostKey {HOST_KEY}
PidFile {PIDFILE}
AuthorizedKeysFile /etc/ssh/authorized_keys/%u
UsePAM no
StrictModes no
PermitRootLogin no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
X11Forwarding no
PrintMotd no
LogLevel VERBOSE
AcceptEnv LANG LC_*
Subsystem sftp /usr/lib/openssh/sftp-server
"""


def ensure_control_key() -> bool:
    key = state.key_path()
    if key.exists() and key.with_suffix(".pub").exists():
        return False
    for p in (key, key.with_suffix(".pub")):
        p.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sparkprov-lab",
                    "-f", str(key)], check=True)
    os.chmod(key, 0o600)
    return True


def ensure_host_sshd_files(name: str) -> bool:
    """Host key (own, ed25519 only), config, the control key authorized for nvidia."""
    changed = False
    # the key must be this host's own (in its /etc overlay's upper layer), not the control
    # machine's that shows through from below
    own = state.host_dir(name) / "ovl" / "etc" / "upper" / HOST_KEY.removeprefix("/etc/")
    if not (own.exists() and own.with_suffix(".pub").exists()):
        # drop the control machine's host keys from this host's view, make its own
        nsexec(name, ["sh", "-c", "rm -f /etc/ssh/ssh_host_*; ssh-keygen -q -t ed25519 -N '' "
                      f"-C root@{name} -f {HOST_KEY}"])
        changed = True
    changed |= write_file(name, SSHD_CONFIG, CONFIG)
    changed |= _authorize_control_key(name)
    return changed


def _authorize_control_key(name: str) -> bool:
    """The control key must be authorized; other lines (keys that provision's SSH mesh added)
    belong to the host's owner and stay, as on a real Spark."""
    path = f"/etc/ssh/authorized_keys/{LOGIN_USER}"
    pub = state.key_path().with_suffix(".pub").read_text().strip()
    cur = nsexec(name, ["cat", path], check=False)
    lines = cur.stdout.splitlines() if cur.returncode == 0 else []
    if pub in (line.strip() for line in lines):
        return False
    return write_file(name, path, "".join(line + "\n" for line in lines + [pub]))


def host_pubkey(name: str) -> list[str]:
    return nsexec(name, ["cat", HOST_KEY + ".pub"]).stdout.split()[:2]


def write_known_hosts(addresses: dict[str, str]) -> bool:
    lines = []
    for name, addr in sorted(addresses.items()):
        kt, kb = host_pubkey(name)
        lines.append(f"{addr} {kt} {kb}\n")
    text = "".join(lines)
    p = state.known_hosts_path()
    if p.exists() and p.read_text() == text:
        return False
    p.write_text(text)
    os.chmod(p, 0o644)
    return True


def sshd_pid(name: str) -> int | None:
    """The listener's pid, if it is alive. A killed sshd stays a zombie until init reaps it (up
    to seconds), and a zombie still passes `kill -0`: it does not count as running."""
    r = nsexec(name, ["sh", "-c", f"p=$(cat {PIDFILE} 2>/dev/null) && kill -0 \"$p\" && "
                      "grep -q sshd /proc/$p/comm && ! awk '{exit ($3==\"Z\")?0:1}' /proc/$p/stat && echo $p"],
               check=False)
    return int(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def start_sshd(name: str) -> bool:
    """Start the host's sshd if it is not running. True if started."""
    if sshd_pid(name):
        return False
    nsexec(name, ["/usr/sbin/sshd", "-f", SSHD_CONFIG, "-E", LOG])
    for _ in range(100):
        if sshd_pid(name):
            return True
        time.sleep(0.02)
    raise RuntimeError(f"{name}: sshd did not start; see /var/log/sshd.log in the host")


def reload_sshd(name: str) -> bool:
    """Make a running sshd re-read its configuration and host key (SIGHUP: it re-executes
    itself; open sessions keep running). True if one was running."""
    pid = sshd_pid(name)
    if not pid:
        return False
    nsexec(name, ["kill", "-HUP", str(pid)])
    for _ in range(100):
        time.sleep(0.02)
        if sshd_pid(name):
            return True
    raise RuntimeError(f"{name}: sshd did not come back after SIGHUP; see {LOG} in the host")


def log_path(name: str):
    """Where the host's sshd log is on the control machine (the upper layer of the host's
    /var/log overlay); only readable after sshd has written to it."""
    return state.host_dir(name) / "ovl" / "var-log" / "upper" / LOG.removeprefix("/var/log/")


def stop_sshd(name: str) -> bool:
    """Stop the listener (existing sessions keep running, as on a real host)."""
    pid = sshd_pid(name)
    if not pid:
        return False
    nsexec(name, ["kill", str(pid)])
    for _ in range(100):
        if not sshd_pid(name):
            return True
        time.sleep(0.02)
    nsexec(name, ["kill", "-9", str(pid)], check=False)
    return True
