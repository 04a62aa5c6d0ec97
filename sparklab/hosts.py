"""Simulated hosts: a network namespace plus a mount+UTS namespace anchored by one process.

Run anything inside a host with `nsexec` (waits) or `nspopen` (detached daemons).
"""
from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence

from . import state
from .state import HOST_PATH, LOGIN_USER, HostRecord, LabRecord, host_dir

# Directories each host gets a private copy of. Overlays: the control machine's directory is
# the read-only lower layer, the host's writes land in its own upper layer. Binds: an empty
# per-host directory (nothing of the control machine shows through).
OVERLAYS = ("/etc", "/var/lib", "/var/log", "/var/cache", "/root")
# /srv too: a real Spark's is its own, and two hosts sharing one raced each other's temp files
# (one host's rename took the other's half-written file away).
BINDS = ("/home", "/tmp", "/var/tmp", "/usr/local", "/opt", "/srv", "/run")  # /run must stay last
USR_LOCAL_DIRS = ("bin", "etc", "games", "include", "lib", "sbin", "share", "src")
# Groups a fresh DGX Spark's first user is in (those this Debian has).
LOGIN_GROUPS = ("adm", "cdrom", "sudo", "dip", "plugdev", "video", "render", "lpadmin")


KMSG_FILE = "/var/log/sparklab-kmsg"   # inside the host: what its /dev/kmsg reads
# each host's docker disk (docker_disk), in its folder of the lab's state: sparse, so its size is a
# bound (as a Spark's disk is), not what it takes of the machine's
DOCKER_DISK = "docker.ext4"
DOCKER_DISK_BYTES = 128 << 30


class LabError(RuntimeError):
    pass


def _slug(path: str) -> str:
    return path.strip("/").replace("/", "-") or "root"


def host_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a root process inside a host starts with (no control-machine PATH)."""
    env = {"PATH": HOST_PATH, "HOME": "/root", "USER": "root", "LOGNAME": "root",
           "SHELL": "/bin/bash", "LANG": "C.UTF-8"}
    if extra:
        env.update(extra)
    return env


def _record(host_name: str) -> HostRecord:
    rec = LabRecord.load().hosts.get(host_name)
    if rec is None:
        raise LabError(f"no lab host named {host_name!r} (is the lab up? `invoke lab.up`)")
    return rec


def anchor_alive(rec: HostRecord) -> bool:
    if not rec.anchor_pid or state.proc_start_time(rec.anchor_pid) != rec.anchor_start:
        return False
    try:
        return os.stat(f"/proc/{rec.anchor_pid}/ns/net").st_ino == os.stat(
            f"/run/netns/{rec.name}").st_ino
    except OSError:
        return False


def _nsenter_argv(rec: HostRecord, argv: Sequence[str]) -> list[str]:
    if not anchor_alive(rec):
        raise LabError(f"lab host {rec.name} is not running (run `invoke lab.up`)")
    return ["nsenter", "-t", str(rec.anchor_pid), "-m", "-u", "-n", "--wd=/", "--", *argv]


def nsexec(host_name: str, argv: Sequence[str], *, input: str | bytes | None = None,
           check: bool = True, timeout: float | None = None,
           env: Mapping[str, str] | None = None, text: bool = True,
           capture: bool = True) -> subprocess.CompletedProcess:
    """Run argv as root inside a lab host (its mount, UTS and network namespaces) and wait.

    stdout/stderr are captured (str when text=True). env adds to the host's clean root
    environment. Raises subprocess.CalledProcessError on a non-zero exit when check=True."""
    rec = _record(host_name)
    if isinstance(input, bytes):
        text = False
    return subprocess.run(_nsenter_argv(rec, argv), input=input, check=check, timeout=timeout,
                          env=host_env(env), text=text,
                          capture_output=capture, cwd="/")


def nspopen(host_name: str, argv: Sequence[str], *, log: str | None = None,
            env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start a detached process inside a lab host (new session, stdin from /dev/null).

    Output goes to `log`, a path inside the host (opened inside it, appended), else
    /dev/null. Returns the Popen of the process (nsenter execs it: same PID)."""
    rec = _record(host_name)
    full = list(argv)
    if log:
        full = ["sh", "-c", 'exec "$@" >>' + shlex.quote(log) + " 2>&1", "sh", *full]
    return subprocess.Popen(_nsenter_argv(rec, full), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=host_env(env), start_new_session=True, cwd="/",
                            close_fds=True)


def host_pids(host_name: str) -> list[int]:
    """Every process in the host's network namespace or its anchor's mount namespace."""
    pids: set[int] = set()
    out = subprocess.run(["ip", "netns", "pids", host_name], capture_output=True, text=True)
    pids.update(int(p) for p in out.stdout.split() if p.isdigit())
    rec = LabRecord.load().hosts.get(host_name)
    if rec and anchor_alive(rec):
        try:
            mnt = os.stat(f"/proc/{rec.anchor_pid}/ns/mnt").st_ino
        except OSError:
            mnt = None
        if mnt:
            for d in os.listdir("/proc"):
                if d.isdigit():
                    try:
                        if os.stat(f"/proc/{d}/ns/mnt").st_ino == mnt:
                            pids.add(int(d))
                    except OSError:
                        pass
    pids.discard(os.getpid())
    return sorted(pids)


def kill_pids(pids: Sequence[int], grace: float = 3.0) -> None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL what is left."""
    alive = []
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
            alive.append(p)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if Path(f"/proc/{p}").exists() and not _zombie(p)]
        time.sleep(0.05)
    for p in alive:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def cgroup_mount_lines() -> list[str]:
    """Shell lines that re-create, inside a host, the control machine's cgroup mounts
    (`ip netns exec` remounts /sys, which hides them; dockerd needs them)."""
    lines = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, post = line.split(" - ", 1)
        fstype, _src, sopts = post.split(" ", 2)
        mnt = pre.split()[4]
        if not mnt.startswith("/sys/fs/cgroup"):
            continue
        if fstype == "tmpfs" and mnt == "/sys/fs/cgroup":
            lines.append("mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup")
        elif fstype == "cgroup":
            opts = [o for o in sopts.split(",") if o not in ("rw", "ro")]
            # super options: controllers and name=...; keep only those
            ctl = [o for o in opts if o.startswith("name=") or o in (
                "cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids",
                "net_cls", "net_prio", "perf_event", "hugetlb", "rdma", "misc", "none")]
            lines.append(f"mkdir -p {mnt} && mount -t cgroup -o {','.join(ctl)} cgroup {mnt}")
        elif fstype == "cgroup2":
            lines.append(f"mkdir -p {mnt} && mount -t cgroup2 cgroup2 {mnt}")
    return lines


def _anchor_script(name: str, hdir: Path) -> str:
    q = shlex.quote
    lines = ["set -eu", f"hostname {q(name)}", "mount --make-rprivate /"]
    lines += cgroup_mount_lines()
    for d in OVERLAYS:
        o = hdir / "ovl" / _slug(d)
        lines.append(f"mount -t overlay sparklab-{_slug(d)} -o lowerdir={d},"
                     f"upperdir={q(str(o / 'upper'))},workdir={q(str(o / 'work'))} {d}")
    # POSIX shared memory of its own, as a separate machine has: with one /dev/shm for every host,
    # the real vLLM takes two Sparks for one node (its same-node test opens a shared-memory segment)
    # and waits forever on a local channel the other host cannot reach
    lines.append("mount -t tmpfs -o mode=1777,nosuid,nodev sparklab-shm /dev/shm")
    # a kernel log of its own: the host's /dev/kmsg is a file on its disk (/var/log persists, as a
    # journal does), where `lab.fault nvrm` writes the NVRM lines a Spark's kernel printed
    lines.append(f"touch {KMSG_FILE} && mount --bind {KMSG_FILE} /dev/kmsg")
    # docker's store on a disk of its own, as a Spark's is (see docker_disk): with a folder of the
    # machine's shared ext4, pulling the real vLLM's image spent most of its time in that aged file
    # system's inode allocator (the lab needs loop devices: mount's own error says so where there are none)
    lines.append("mkdir -p /var/lib/docker")
    lines.append(f"mount -o loop,discard,noinit_itable {q(str(hdir / DOCKER_DISK))} /var/lib/docker")
    for d in BINDS:
        lines.append(f"mount --bind {q(str(hdir / 'fs' / _slug(d)))} {d}")
    # the host's memory figures and the kernel's reclaim knobs are files of its own (replays change and
    # answer them: sparklab/replay.py), so a node guard in the lab reads a Spark's memory, not the shared
    # machine's, and never drops the machine's caches
    from .replay import stand_in_lines
    lines += stand_in_lines()
    lines += ["echo READY", "exec sleep infinity </dev/null >/dev/null 2>&1"]
    return "\n".join(lines) + "\n"


def docker_disk(path: Path) -> None:
    """A host's docker disk: an ext4 file system in a sparse file (blocks taken as written, and given
    back as deleted: the mount's `discard`), made once and kept across the host's reboots, removed
    with the lab (one file, where a folder of docker's store was hundreds of thousands)."""
    if path.exists():
        return
    tmp = path.with_suffix(".new")
    with open(tmp, "wb") as f:
        f.truncate(DOCKER_DISK_BYTES)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "sparklab-docker",
                    "-E", "nodiscard,lazy_itable_init=1", str(tmp)], check=True, capture_output=True)
    tmp.rename(path)


def _prepare_dirs(name: str) -> Path:
    hdir = host_dir(name)
    for d in OVERLAYS:
        for sub in ("upper", "work"):
            (hdir / "ovl" / _slug(d) / sub).mkdir(parents=True, exist_ok=True)
    for d in BINDS:
        p = hdir / "fs" / _slug(d)
        p.mkdir(parents=True, exist_ok=True)
    os.chmod(hdir / "fs" / "tmp", 0o1777)
    os.chmod(hdir / "fs" / "var-tmp", 0o1777)
    for sub in USR_LOCAL_DIRS:
        (hdir / "fs" / "usr-local" / sub).mkdir(exist_ok=True)
    for sub in ("sshd", "lock", "user"):
        (hdir / "fs" / "run" / sub).mkdir(exist_ok=True)
    os.chmod(hdir / "fs" / "run" / "lock", 0o1777)
    docker_disk(hdir / DOCKER_DISK)
    # root's shell start-up files: Debian's defaults, not the control machine's (pyenv, cargo)
    root_upper = hdir / "ovl" / "root" / "upper"
    for src, dst in (("/usr/share/base-files/dot.bashrc", ".bashrc"),
                     ("/usr/share/base-files/dot.profile", ".profile")):
        if not (root_upper / dst).exists() and Path(src).exists():
            shutil.copy(src, root_upper / dst)
    return hdir


def start_anchor(rec: HostRecord) -> None:
    """Create the host's mount+UTS namespace inside its network namespace and record the
    PID of the process that keeps it alive."""
    hdir = _prepare_dirs(rec.name)
    script = hdir / "anchor.sh"
    script.write_text(_anchor_script(rec.name, hdir))
    log = hdir / "anchor.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", rec.name, "unshare", "--mount", "--uts",
             "--propagation", "private", "/bin/sh", str(script)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, env={"PATH": HOST_PATH}, cwd="/")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if "READY" in log.read_text():
            rec.anchor_pid = proc.pid
            rec.anchor_start = state.proc_start_time(proc.pid)
            return
        if proc.poll() is not None:
            raise LabError(f"{rec.name}: namespace set-up failed:\n{log.read_text()}")
        time.sleep(0.02)
    proc.kill()
    raise LabError(f"{rec.name}: namespace set-up timed out:\n{log.read_text()}")


def ensure_login_user(name: str, password: str) -> bool:
    """Create user nvidia (bash, fresh-Spark groups, sudo with password). True if changed."""
    r = nsexec(name, ["id", "-u", LOGIN_USER], check=False)
    changed = False
    if r.returncode != 0:
        have = set(nsexec(name, ["getent", "group"]).stdout.split("\n"))
        have = {g.split(":", 1)[0] for g in have if g}
        groups = ",".join(g for g in LOGIN_GROUPS if g in have)
        nsexec(name, ["useradd", "-m", "-s", "/bin/bash", "-G", groups, "-c",
                      "NVIDIA DGX Spark user", LOGIN_USER])
        changed = True
    if r.returncode != 0 or not _password_ok(name, password):
        nsexec(name, ["chpasswd"], input=f"{LOGIN_USER}:{password}\n")
        changed = True
    return changed


def _password_ok(name: str, password: str) -> bool:
    # verify with the shadow hash, inside the host, using only system python's crypt
    code = ("import crypt,spwd,sys;h=spwd.getspnam(sys.argv[1]).sp_pwdp;"
            "sys.exit(0 if crypt.crypt(sys.stdin.read(),h)==h else 1)")
    r = nsexec(name, ["/usr/bin/python3", "-W", "ignore", "-c", code, LOGIN_USER],
               input=password, check=False)
    return r.returncode == 0


def ensure_host_files(name: str, extra_hosts: Sequence[str] = ()) -> bool:
    """/etc/hostname and /etc/hosts of the host (so sudo resolves its own name; extra lines
    such as "10.77.0.1 nvcr.io" point registry names at the lab registry)."""
    hosts = (f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n::1\tlocalhost ip6-localhost "
             f"ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n"
             + "".join(f"{l}\n" for l in extra_hosts))
    changed = write_file(name, "/etc/hostname", name + "\n")
    return write_file(name, "/etc/hosts", hosts) or changed


def write_file(host_name: str, path: str, content: str | bytes, mode: int = 0o644,
               owner: str = "root:root") -> bool:
    """Write a file inside a host if its content differs. True if it changed."""
    data = content.encode() if isinstance(content, str) else content
    cur = nsexec(host_name, ["cat", path], check=False, text=False)
    if cur.returncode == 0 and cur.stdout == data:
        return False
    d = os.path.dirname(path)
    script = (f"set -e; mkdir -p {shlex.quote(d)}; t={shlex.quote(path)}.sparklab.$$; "
              f"cat > \"$t\"; chmod {mode:o} \"$t\"; chown {owner} \"$t\"; "
              f"mv -f \"$t\" {shlex.quote(path)}")
    nsexec(host_name, ["sh", "-c", script], input=data)
    return True


def new_password() -> str:
    return secrets.token_urlsafe(18)
