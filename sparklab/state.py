"""Where the lab keeps its state, and the record of what it made.

State (everything `lab.down` removes) lives in /run/sparkprov-lab; build caches live in
/var/cache/sparkprov-lab (see cache_root) and survive `lab.down` unless it is given --purge.
"""
from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_DIR = Path(os.environ.get("SPARKPROV_LAB_STATE", "/run/sparkprov-lab"))
REPO_ROOT = Path(__file__).resolve().parents[1]


def cache_root() -> Path:
    """Where the lab's builds are cached (images, the trained lab-tiny, generated hub repos, the
    Ray venv): $SPARKPROV_LAB_CACHE, else once per machine, /var/cache/sparkprov-lab. Everything
    in it is keyed by its content, so every checkout on the machine shares it: a fresh clone's
    `make demo` or CI run reuses what another built (a cold machine builds it: about five
    minutes). Without root (no lab then, only the tools that build) .lab-cache/ of the checkout."""
    env = os.environ.get("SPARKPROV_LAB_CACHE")
    if env:
        return Path(env)
    return Path("/var/cache/sparkprov-lab") if os.geteuid() == 0 else REPO_ROOT / ".lab-cache"


CACHE_DIR = cache_root()

BRIDGE = "sparklab0"
BRIDGE_IP = "10.77.0.1"
PREFIX = 24
RAIL_BRIDGES = {1: "sparklab-r1", 2: "sparklab-r2"}
# Fabric interface names of a DGX Spark's ConnectX-7 (two ports, two twins each).
FABRIC_IFACES = ("enp1s0f0np0", "enp1s0f1np1", "enP2p1s0f0np0", "enP2p1s0f1np1")
RAIL_IFACES = {1: "enp1s0f1np1", 2: "enP2p1s0f1np1"}  # the cabled twins (pair, switch)
DARK_IFACES = ("enp1s0f0np0", "enP2p1s0f0np0")        # present, no carrier (pair, switch)
# A Spark's two QSFP ports, each seen twice (one twin per PCIe domain, gb10-outputs.md)
PORT_TWINS = {0: ("enp1s0f0np0", "enP2p1s0f0np0"), 1: ("enp1s0f1np1", "enP2p1s0f1np1")}

# How the lab cables its hosts (`invoke lab.up --topology`):
# - pair: two hosts, one cable between their ports 1 (the lab's record says "p2p", as before);
# - switch: every host's port 1 on a switch: a bridge per twin (rail);
# - mesh: three hosts, each cabled to both others (a Spark has two ports: three is a full mesh);
# - ring: four or more hosts, each port 0 to the next host's port 1 (the cabling of
#   eugr/spark-vllm-docker's NETWORKING.md and sparkrun#157), the last back to the first.
# Mesh and ring cables are point-to-point: a veth per twin between the two hosts' ports (never a
# bridge), so a host reaches only its cabled neighbours on them, as on Sparks.
LAB_TOPOLOGIES = ("pair", "mesh", "ring", "switch")


def default_topology(n_hosts: int) -> str:
    """What `lab.up --hosts N` without --topology cables (as it always did): a pair at 2, a switch above."""
    return "p2p" if n_hosts == 2 else ("switch" if n_hosts > 2 else "none")


def topology_record(topology: str | None, n_hosts: int) -> str:
    """The lab record's name for a requested topology (pair is "p2p"), checked against the host
    count; ValueError with the reason when they do not fit."""
    if topology is None:
        return default_topology(n_hosts)
    need = {"pair": (2, 2, "two hosts"), "mesh": (3, 3, "three hosts (a Spark has two ports)"),
            "ring": (4, 200, "four hosts or more (three cabled in a ring are a mesh)"),
            "switch": (2, 200, "two hosts or more")}[topology]
    if not need[0] <= n_hosts <= need[1]:
        raise ValueError(f"--topology {topology} needs {need[2]}, not {n_hosts}")
    return "p2p" if topology == "pair" else topology


def cables(topology: str, n_hosts: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The point-to-point cables of a mesh or ring: ((host index, port), (host index, port)), hosts
    numbered from 1; each host's port 0 goes to the next host's port 1. [] for other topologies."""
    if topology not in ("mesh", "ring"):
        return []
    return [((i, 0), (i % n_hosts + 1, 1)) for i in range(1, n_hosts + 1)]
MGMT_IFACE = "enP7s7"                                  # the Spark's onboard 10 GbE
# The lab's rails are veth pairs, not 200G ConnectX-7 links: fabric qualification's floor and expected
# figure (inventory vars of modules/fabric_qualify.py) for what they carry, written into every lab
# inventory. Measured with the ib_write_bw stand-in on the 2-core lab (docs/fabric.md): 13.7-27.4 Gb/s
# per rail and direction, alone or both hosts at once. The floor is a fourteenth of the lowest (a
# loaded machine measures less), ten times the rail-slow fault's 0.1 Gb/s.
LAB_RAIL_VARS = {"rail_min_gbps": 1.0, "rail_expected_gbps": 2.0}


def lab_inventory(hosts: dict[str, str], *, defaults: dict | None = None, vars: dict | None = None) -> str:
    """An inventory of lab hosts (name -> address), all in group `sparks`, as YAML: the login user and
    `defaults`, and `vars` over the lab's rail figures (LAB_RAIL_VARS: veths, not 200G links). Every
    lab inventory (lab.up's, the tests') is made here."""
    import yaml   # here: the rest of this module is the standard library's (make demo builds the base with
    #               the machine's python3 while the venv is made: sparklab.image --base-only)

    doc = {"defaults": {"user": LOGIN_USER, **{k: str(v) if isinstance(v, Path) else v
                                                for k, v in (defaults or {}).items()}},
           "hosts": {name: {"address": address} for name, address in hosts.items()},
           "groups": {"sparks": list(hosts)},
           "vars": {**LAB_RAIL_VARS, **(vars or {})}}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


LOGIN_USER = "nvidia"
REGISTRY_PORT = 5000
HUB_PORT = 8080
# PATH a process started inside a host gets (Debian root default; no control-machine shims).
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def host_name(index: int) -> str:
    return f"spark{index}"


def host_address(index: int) -> str:
    return f"10.77.0.{10 + index}"


def host_dir(name: str) -> Path:
    return STATE_DIR / "hosts" / name


def key_path() -> Path:
    return STATE_DIR / "id_ed25519"


def known_hosts_path() -> Path:
    return STATE_DIR / "known_hosts"


def password_path() -> Path:
    return STATE_DIR / "become_password"


def inventory_path() -> Path:
    return STATE_DIR / "inventory.yaml"


@dataclass
class HostRecord:
    name: str
    index: int
    address: str
    anchor_pid: int = 0
    # /proc/PID/stat start time of the anchor, so a recycled PID is never mistaken for it.
    anchor_start: str = ""


@dataclass
class LabRecord:
    hosts: dict[str, HostRecord] = field(default_factory=dict)
    topology: str = ""          # "p2p" (a pair), "switch", "mesh" or "ring" (LAB_TOPOLOGIES)
    registry_url: str = ""
    hub_url: str = ""

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = STATE_DIR / "lab.json.tmp"
        tmp.write_text(json.dumps({"hosts": {k: asdict(v) for k, v in self.hosts.items()},
                                   "topology": self.topology,
                                   "registry_url": self.registry_url,
                                   "hub_url": self.hub_url}, indent=2))
        tmp.replace(STATE_DIR / "lab.json")

    @classmethod
    def load(cls) -> "LabRecord":
        p = STATE_DIR / "lab.json"
        if not p.exists():
            return cls()
        d = json.loads(p.read_text())
        return cls(hosts={k: HostRecord(**v) for k, v in d.get("hosts", {}).items()},
                   topology=d.get("topology", ""), registry_url=d.get("registry_url", ""),
                   hub_url=d.get("hub_url", ""))


def proc_start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


_lock_depth = 0


@contextmanager
def lab_lock():
    """Serialise lab.up / lab.down / faults between processes (flock on the state dir).

    Re-entrant within one process."""
    global _lock_depth
    if _lock_depth:
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
        return
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(STATE_DIR, 0o700)
    fd = os.open(STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _lock_depth = 1
        yield
    finally:
        _lock_depth = 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
