"""The simulated Spark lab for tests: one 2-host lab per session (needs root)."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the lab needs root (network and mount namespaces)"
    for tool in ("ip", "nsenter", "unshare", "sshd", "dockerd", "ssh"):
        if subprocess.run(["sh", "-c", f"command -v {tool} || test -x /usr/sbin/{tool}"],
                          capture_output=True).returncode != 0:
            return f"{tool} is not installed (make deps)"
    return None


def pytest_collection_modifyitems(config, items):
    # The lab's own tests check a *fresh* Spark (nvidia not in docker, MTU 1500, no addresses):
    # they run before any test that provisions the shared lab. Tests that tear the lab down run
    # after every other test of the session.
    last = [i for i in items if i.get_closest_marker("lab_teardown")]
    rest = [i for i in items if not i.get_closest_marker("lab_teardown")]
    fresh = [i for i in rest if i.fspath.basename == "test_lab_hosts.py"]
    items[:] = fresh + [i for i in rest if i.fspath.basename != "test_lab_hosts.py"] + last


def pytest_configure(config):
    config.addinivalue_line("markers", "lab_teardown: tears the lab down; runs last")


@dataclass
class LabHandle:
    hosts: dict[str, str]          # name -> management address
    key: Path                      # control private key (ed25519)
    known_hosts: Path
    password: str                  # sudo password of user nvidia
    password_file: Path
    inventory: Path
    state_dir: Path
    baseline: dict | None          # machine snapshot before this session brought the lab up

    @property
    def names(self) -> list[str]:
        return list(self.hosts)

    def exec(self, host: str, argv, **kw) -> subprocess.CompletedProcess:
        from sparkprov.lab.hosts import nsexec
        return nsexec(host, argv, **kw)

    def sh(self, host: str, script: str, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("check", False)
        return self.exec(host, ["sh", "-c", script], **kw)

    def ssh_argv(self, host: str, *cmd: str, known_hosts: Path | None = None) -> list[str]:
        return ["ssh", "-i", str(self.key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=5",
                "-o", f"UserKnownHostsFile={known_hosts or self.known_hosts}",
                "-o", "GlobalKnownHostsFile=/dev/null", f"nvidia@{self.hosts[host]}", *cmd]

    def write_inventory(self, path: Path, *, known_hosts: Path | None = None, password_file: Path | None = None,
                        store: str = "~/vllm", extra_vars: str = "") -> Path:
        """An inventory of every lab host (the lab's key, known_hosts, sudo password file) with
        the model store and compile cache as provision uses them; `extra_vars` lines go under vars:."""
        path.write_text(
            "defaults:\n  user: nvidia\n"
            f"  ssh_key: {self.key}\n  known_hosts: {known_hosts or self.known_hosts}\n"
            f"  become_password_file: {password_file or self.password_file}\n  connect_timeout: 10\n"
            "hosts:\n" + "".join(f"  {n}: {{address: {a}}}\n" for n, a in self.hosts.items())
            + f"groups:\n  sparks: [{', '.join(self.hosts)}]\n"
            + f"vars:\n  model_store: {store}\n  compile_cache: ~/vllm-compile-cache\n{extra_vars}")
        return path

    def ssh(self, host: str, cmd: str, *, input: str | None = None,
            known_hosts: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.ssh_argv(host, cmd, known_hosts=known_hosts), input=input,
                              capture_output=True, text=True, timeout=60)


def snapshot() -> dict:
    """What a lab could leave behind: namespaces, links, mounts, processes outside our netns."""
    from sparkprov.lab import net
    own_net = os.stat("/proc/self/ns/net").st_ino
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            procs[int(d)] = (os.stat(f"/proc/{d}/ns/net").st_ino != own_net,
                             Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ")
                             .decode(errors="replace").strip())
        except OSError:
            continue
    mounts = {l.split()[4] for l in Path("/proc/self/mountinfo").read_text().splitlines()}
    cg = {str(p) for p in Path("/sys/fs/cgroup").glob("*/sparklab-*")}
    return {"netns": set(net.netns_list()), "links": set(net.links()), "mounts": mounts,
            "procs": procs, "cgroups": cg}


@pytest.fixture(scope="session")
def lab():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from sparkprov.lab import state, up
    from sparkprov.lab.hosts import anchor_alive
    rec = state.LabRecord.load()
    was_up = len(rec.hosts) == 2 and all(anchor_alive(h) for h in rec.hosts.values())
    baseline = None if was_up else snapshot()
    res = up.up(2, images=False, quiet=True)
    handle = LabHandle(hosts=res.hosts, key=state.key_path(),
                       known_hosts=state.known_hosts_path(),
                       password=state.password_path().read_text().strip(),
                       password_file=state.password_path(), inventory=res.inventory,
                       state_dir=state.STATE_DIR, baseline=baseline)
    yield handle
    if not was_up:
        up.down(quiet=True)
