"""`invoke lab.*`: the simulated Spark lab (run as root); the repo's tasks.py adds this collection."""
from __future__ import annotations

import json

from invoke import Collection, task

from sparkprov.cli.common import user_errors
from sparkprov.options import OptionError, choice_option, float_option, int_option, text_option
from sparklab import faults as _faults
from sparklab import up as _up
from sparklab.state import LAB_TOPOLOGIES, topology_record


@task(help={"hosts": "number of simulated Sparks (2: point-to-point fabric cables; "
                     "more: one switch bridge per rail, unless --topology says otherwise)",
            "topology": "how the fabric is cabled: pair (2 hosts), mesh (3: each to both others), ring "
                        "(4 or more: port 0 to the next host's port 1), switch (a bridge per rail); "
                        "mesh and ring cables are point to point (a veth per twin). Default: pair at 2 "
                        "hosts, switch above",
            "images": "build (cached) and push the lab images to the lab registry "
                      "(--no-images skips it)",
            "ollama": "also start the Ollama stand-in (a model loaded, ~200 MB held) "
                      "on every host",
            "light": "light hosts: no dockerd (and no images pushed), for scale runs of "
                     "many hosts; a host already running dockerd keeps it"})
def up(c, hosts=None, images=True, ollama=False, light=False, topology=None):
    """Bring the lab up (idempotent): namespaces, links, sshd, users, stand-ins, dockerd,
    registry; writes /run/sparkprov-lab/inventory.yaml."""
    # hosts defaults to None so that Invoke passes the text through to our parser (an int
    # default makes Invoke cast it itself, with a traceback for `--hosts abc`)
    with user_errors():
        n = int_option("hosts", hosts, 1, 250, default=2)  # addresses 10.77.0.11.. stay in the /24
        topology = choice_option("topology", topology, LAB_TOPOLOGIES)
        if topology is not None:
            try:
                topology_record(topology, n)
            except ValueError as e:
                raise OptionError(str(e), fix="--hosts 2 for a pair, 3 for a mesh, 4 or more for a ring") from None
    _up.up(n, images=images, ollama=ollama, light=light, topology=topology)


@task(help={"purge": "also delete the build caches (/var/cache/sparkprov-lab, shared by every checkout)"})
def down(c, purge=False):
    """Remove everything the lab made (processes, namespaces, links, mounts, state files)."""
    _up.down(purge=purge)


@task(help={"json_": "print the status as JSON"})
def status(c, json_=False):
    """Show the lab's hosts, addresses and what runs on each."""
    st = _up.status()
    if json_:
        print(json.dumps(st, indent=2))
        return
    if not st["hosts"]:
        print("lab: no hosts (run `invoke lab.up`)")
        return
    print(f"topology: {st['topology']}  registry: {st['registry_url'] or '-'}  "
          f"hub: {st['hub_url'] or '-'}")
    for name, h in st["hosts"].items():
        if not h["running"]:
            print(f"{name:8} {h['address']:12} DOWN (namespaces gone; run lab.up)")
            continue
        fab = " ".join(f"{i}:{v['state']}/{v['mtu']}" for i, v in h["fabric"].items())
        print(f"{name:8} {h['address']:12} sshd={h['sshd_pid'] or 'stopped'} "
              f"dockerd={h['dockerd_pid'] or 'stopped'}"
              + (f" ollama={'up' if h.get('ollama') else 'stopped'}" if 'ollama' in h else "")
              + f"\n         {fab}")


@task(help={"action": "one of: " + ", ".join(sorted(_faults.ACTIONS)) + " (reboot: a power "
                      "cycle: every process killed, live network settings lost, booted again "
                      "from what is persisted: netplan, sshd, dockerd, restart policies)",
            "host": "lab host (spark1, ...)",
            "iface": "fabric interface (cut-link, restore-link, slow-link, unslow-link, "
                     "reset-mtu, rail-slow, clear-rail-slow: one of the cabled rails); default enp1s0f1np1",
            "rate": "slow-link: rate limit, tc syntax (default 100mbit)",
            "delay": "slow-link: added delay, e.g. 20ms (needs the netem qdisc)",
            "mtu": "reset-mtu: the MTU to set (default 1500)",
            "count": "nvrm-noise: how many NVRM lines (default 16: vllm#56824's burst; 75: #54200's start)",
            "seconds": "nvrm-noise: over how many seconds (default 1); page-cache-flood: how long the load "
                       "streams (default 60)",
            "stuck": "no-hugeblocks: compaction brings no block back (sparkring#173)"})
def fault(c, action, host, iface="enp1s0f1np1", rate="100mbit", delay="", mtu=None, count=None, seconds=None,
          stuck=False):
    """Inject or clear a fault on one host."""
    with user_errors():
        action = choice_option("action", action, sorted(_faults.ACTIONS))
        host = text_option("host", host)
        mtu = int_option("mtu", mtu, 68, 65535, default=1500)  # 68: the smallest MTU IPv4 allows
        count = int_option("count", count, 1, 10000)
        seconds = float_option("seconds", seconds, 0, 3600)
    print(_faults.apply(action, host, iface=iface, rate=rate, delay=delay or None, mtu=mtu, count=count,
                        seconds=seconds, stuck=bool(stuck) or None))


ns = Collection("lab")
ns.add_task(up)
ns.add_task(down)
ns.add_task(status)
ns.add_task(fault)
