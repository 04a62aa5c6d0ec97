"""The simulated Spark lab for tests: one 2-host lab per session (needs root).

The `lab` fixture itself is in tests/conftest.py, so that tests/lab and tests/reliability share
one lab per session; what it does is `lab_session` here."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

# What the lab needs on the machine besides root (`make deps` installs them).
LAB_TOOLS = ("ip", "nsenter", "unshare", "sshd", "dockerd", "ssh")


def in_ci() -> bool:
    """CI=true (or any value but empty, 0, false, no), as CI services set it."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing_prerequisites(tools=LAB_TOOLS, *, root: bool = True) -> list[str]:
    """What the machine lacks for the lab: root, and each tool (a name looked up on PATH and in
    /usr/sbin, or an absolute path), each named with how to get it."""
    missing = []
    if root and os.geteuid() != 0:
        missing.append(f"root (the lab makes network and mount namespaces; this is uid {os.geteuid()})")
    for tool in tools:
        found = (os.access(tool, os.X_OK) if "/" in tool
                 else shutil.which(tool) or os.access(f"/usr/sbin/{tool}", os.X_OK))
        if not found:
            missing.append(f"{tool} (not installed: make deps)")
    return missing


def require(missing: list[str]) -> None:
    """Stop a test that lacks a prerequisite, naming what is missing: under CI a failure (a
    suite that skips itself whole must not end green), elsewhere a skip."""
    if not missing:
        return
    what = "; ".join(missing)
    if in_ci():
        pytest.fail(f"lab prerequisite missing under CI (a failure here, never a skip): {what}",
                    pytrace=False)
    pytest.skip(f"lab prerequisite missing: {what}")


# the modules that use test_real_vllm's session-wide `env`, in the order they run
# (the drift test and the guard's replays, then test_real_tp2 share the pinned native tp 2 deployment
# `nat`, started once, and remove it at their end: the others need spark1's port)
REAL_ENGINE_MODULES = ("test_guard.py", "test_real_tp2.py", "test_monitoring.py", "test_real_layouts.py",
                       "test_real_vllm.py")
# The lab's modules that need neither lab-tiny nor the real vLLM's image (the stand-ins' base and torch
# layers at most): right after the fresh checks, in this order. On a cold machine the prebuild trains
# lab-tiny for about four minutes (base, torch and the real vLLM's layer first), and every other module
# waits for it (the hub serves lab-tiny); these run meanwhile.
BEFORE_THE_MODEL = ("test_engine_ssh.py", "test_fabric_qualify.py", "test_lab_multinode.py", "test_lab_reboot.py",
                    "test_provision.py")


def pytest_collection_modifyitems(config, items):
    # Unit tests first (`make test` runs them in a pytest of their own beside the lab's; in one run
    # of `pytest tests` they come first, while a prebuild of the lab's caches may still be going).
    # Then the lab's own tests, which check a *fresh* Spark (nvidia not in docker, MTU 1500,
    # no addresses), before any test that provisions the shared lab. The modules on the real vLLM
    # share one provisioned lab with lab-tiny staged (test_real_vllm's env), so they run one after
    # another, after the other lab tests. Of the others, BEFORE_THE_MODEL's come first. Tests that tear
    # the lab down run after every other test.
    unit_dir = Path(__file__).resolve().parents[1] / "unit"
    unit = [i for i in items if unit_dir in Path(str(i.fspath)).parents]
    placed = set(map(id, unit))
    last = [i for i in items if i.get_closest_marker("lab_teardown") and id(i) not in placed]
    placed |= set(map(id, last))
    rest = [i for i in items if id(i) not in placed]
    fresh = [i for i in rest if i.fspath.basename == "test_lab_hosts.py"]
    lab_dir = Path(__file__).resolve().parent
    real = sorted((i for i in rest if i.fspath.basename in REAL_ENGINE_MODULES and Path(str(i.fspath)).parent == lab_dir),
                  key=lambda i: REAL_ENGINE_MODULES.index(i.fspath.basename))   # stable: a module's own order kept
    placed = set(map(id, fresh + real))
    others = [i for i in rest if id(i) not in placed]
    in_lab = sorted((i for i in others if Path(str(i.fspath)).parent == lab_dir),
                    key=lambda i: BEFORE_THE_MODEL.index(i.fspath.basename) if i.fspath.basename in BEFORE_THE_MODEL
                    else len(BEFORE_THE_MODEL))   # stable: the other modules keep their order after them
    items[:] = unit + fresh + in_lab + real + [i for i in others if Path(str(i.fspath)).parent != lab_dir] + last


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report kept on the test (`rep_call`): tests/lab/test_real_vllm.py's cleanup
    reads it (a passing test marked keeps_serving leaves the deployments it names for the next)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def pytest_configure(config):
    config.addinivalue_line("markers", "lab_teardown: tears the lab down; runs last")
    config.addinivalue_line("markers", "keeps_serving(NAME, ...): a passing test leaves those deployments for the "
                                       "next (tests/lab/test_real_vllm.py nothing_left_running)")


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
        from sparklab.hosts import nsexec
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
                        store: str = "~/vllm", extra_vars: dict | None = None) -> Path:
        """An inventory of every lab host (the lab's key, known_hosts, sudo password file) with
        the model store and compile cache as provision uses them (sparklab.state.lab_inventory: the
        lab's rail figures too), and `extra_vars` under vars."""
        from sparklab.state import lab_inventory

        path.write_text(lab_inventory(
            self.hosts,
            defaults={"ssh_key": self.key, "known_hosts": known_hosts or self.known_hosts,
                      "become_password_file": password_file or self.password_file, "connect_timeout": 10},
            vars={"model_store": store, "compile_cache": "~/vllm-compile-cache", **(extra_vars or {})}))
        return path

    def ssh(self, host: str, cmd: str, *, input: str | None = None,
            known_hosts: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.ssh_argv(host, cmd, known_hosts=known_hosts), input=input,
                              capture_output=True, text=True, timeout=60)


def snapshot() -> dict:
    """What a lab could leave behind: namespaces, links, mounts, processes outside our netns."""
    from sparklab import net
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


def lab_session():
    """The session's lab, for the `lab` fixture (tests/conftest.py): a generator of one LabHandle.

    The lab tests check fresh Sparks (sudo asks for the password, rails at MTU 1500, nvidia not in
    the docker group) before anything provisions them. A lab this session did not make (`make
    demo`'s, `invoke lab.up`'s, one an earlier or crashed run left) may have been provisioned or
    changed, so it is taken down and made again from nothing, as on a clean machine; it is left
    up at the end as it was found (a fresh one now). A lab this session brought up is taken down."""
    require(missing_prerequisites())
    from sparklab import state, up

    found = state.STATE_DIR.is_dir() and any(state.STATE_DIR.iterdir())
    if found:
        up.down(quiet=True)
    baseline = snapshot()
    # SPARKPROV_LAB_HOSTS=3: a third host (a stranger on a switched fabric, test_ports_lockdown)
    # no hub: it serves lab-tiny, which a cold machine trains for minutes; the tests that use it start it
    # (ensure_lab_hub: test_cluster's hub, real_env, the README's, the reliability tests' lab_hub_token)
    res = up.up(int(os.environ.get("SPARKPROV_LAB_HOSTS") or 2), images=False, hub=False, quiet=True)
    yield LabHandle(hosts=res.hosts, key=state.key_path(), known_hosts=state.known_hosts_path(),
                    password=state.password_path().read_text().strip(),
                    password_file=state.password_path(), inventory=res.inventory,
                    state_dir=state.STATE_DIR, baseline=baseline)
    if not found:
        up.down(quiet=True)


def rails_and_guard_for_provision(lab) -> None:
    """The rails unaddressed and the node guard stopped on every host, so that the provision after this
    addresses the rails as it does and starts the guard on those addresses. Earlier lab tests addressed
    the rails otherwise (test_lab_multinode's 192.168.177.0/24, booted from its netplan), and a guard
    started in such a boot still listens on the address it found then (its /metrics on every rail
    address, the stale one included, which `status --ports` rightly reports as open to everyone)."""
    from sparklab.state import RAIL_IFACES

    for h in lab.names:
        lab.sh(h, "".join(f"ip addr flush dev {i} scope global; " for i in RAIL_IFACES.values())
               + "pid=$(cat /run/sparkprov-guard.pid 2>/dev/null); [ -z \"$pid\" ] || kill \"$pid\" 2>/dev/null; true")


# -- the real vLLM: one provisioned lab for every module on it, one pinned native tp 2 deployment -----

REAL_STORE = "~/realtest"
REAL_MODEL = "lab-tiny"


@pytest.fixture(scope="session")
def real_env(lab, tmp_path_factory):
    """The lab provisioned (which starts the guard) with lab-tiny staged in REAL_STORE: made once for
    every module on the real engine (REAL_ENGINE_MODULES run one after another); each test removes
    the deployments it does not leave on purpose (test_real_vllm.py nothing_left_running).

    The rails as provision leaves them, and only that (rails_and_guard_for_provision)."""
    import io

    from sparkprov.cli.common import run_playbook
    from sparkprov.data.inventory import load_inventory
    from sparkprov.engine.report import Report
    from sparkprov.plays.stage import StageOptions, run_stage
    from sparklab.hub import ensure_lab_hub
    from sparklab.image import VLLM_CPU_IMAGE, ensure_images
    from sparklab.state import BRIDGE_IP, HUB_PORT, REGISTRY_PORT

    repo = Path(__file__).resolve().parents[2]
    hub = ensure_lab_hub(lab.state_dir, BRIDGE_IP, HUB_PORT)
    ensure_images(f"http://{BRIDGE_IP}:{REGISTRY_PORT}", [VLLM_CPU_IMAGE])
    d = tmp_path_factory.mktemp("real")
    inv = lab.write_inventory(d / "inventory.yaml", store=REAL_STORE, extra_vars={"hf_endpoint": hub})
    rails_and_guard_for_provision(lab)
    assert run_playbook(playbook=str(repo / "playbooks" / "provision.yaml"), inventory=str(inv),
                        hosts=None, as_json=True) == 0
    loaded = load_inventory(inv)
    rep = Report(io.StringIO())
    run_stage(loaded, list(loaded.hosts), REAL_MODEL, StageOptions(), rep)
    assert rep.exit_code() == 0, [r.msg for r in rep.results if r.status == "failed"]
    yield {"inv": inv, "dir": d, "lab": lab}
    if not lab.state_dir.exists():
        return  # the session's last test took the lab down, and everything in it
    subprocess.run([str(repo / ".venv" / "bin" / "invoke"), "cluster-down", "--inventory", str(inv)], cwd=repo,
                   capture_output=True, timeout=300)
    for n in lab.names:
        lab.ssh(n, f"rm -rf {REAL_STORE}")


NAT = "nat"
NAT_HOSTS = ("spark1", "spark2")


@pytest.fixture
def nat(real_env):
    """The pinned native tp 2 deployment `nat` of lab-tiny on the real vLLM (rank 0 on spark1, rank 1
    on spark2, each rank by the registry digest its node holds): started by the first test that asks
    for it (about a minute on two cores), a no-op `cluster-up` for the others. A test that uses it
    and leaves it serving is marked keeps_serving("nat"); the last one removes it. The deployment's
    summary from cluster-up's document, with its API key read from rank 0's 0600 file."""
    from tests.lab.test_real_vllm import key_of, up

    rc, doc, out = up(real_env, "--tp", "2", "--hosts", ",".join(NAT_HOSTS), "--executor", "native", "--name", NAT,
                      "--pin")
    assert rc == 0, out
    d = doc["cluster"]["deployments"][NAT]
    return {**d, "key": key_of(real_env, d), "ranks": {"spark1": f"sparkprov-{NAT}-rank0",
                                                        "spark2": f"sparkprov-{NAT}-rank1"}}
