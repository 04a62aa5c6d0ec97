"""`lab.fault reboot HOST`: a power cycle of one simulated Spark.

What a real power cycle does, step by step, and what the lab does for each:

1. **power off**: every link of the host loses signal first (peers get no FIN or RST: they find
   out by their own timeouts, or from the new kernel after the boot), then
   every process of the host dies at once, without a shutdown (sshd, dockerd,
   containerd, the container shims and the containers, login sessions, anything else in its
   namespaces). The lab SIGKILLs every process in the host's network namespace, its mount
   namespace and its containers' cgroups, including the anchor that holds the host's mount
   namespace, so every mount made inside the host goes too.
2. **volatile state is lost**: /run is a tmpfs and /tmp is emptied at boot (Ubuntu's
   tmpfiles.d), so both are emptied; /etc, /home, /var/lib (docker's data root), /var/log,
   /usr/local and /opt are disk and persist.
3. **live network settings are lost**: every fabric interface comes up as at a fresh boot
   (MTU 1500, no addresses, no routes, no qdisc: what `lab.up` makes for a fresh host). While
   the host is off its cabled rails carry no signal: the peer's end sees NO-CARRIER. A rail
   throttled by `lab.fault rail-slow` stays throttled (a degraded cable is not mended by a power
   cycle): the boot throttles it again once networkd has configured it, before the node guard;
   `clear-rail-slow` ends it.
4. **boot** (a new mount+UTS namespace, as a new kernel):
   a. `netplan generate` (Debian's netplan.io, the real one) renders /etc/netplan/*.yaml into
      /run/systemd/network (systemd-networkd's .network/.link files); a file netplan rejects
      leaves nothing rendered, as on a real boot, and the reason goes to /var/log/sparklab-boot.log;
   b. the lab's stand-in for systemd-networkd applies what was rendered, with iproute2 inside the
      host: for each .network file whose [Match] Name= is an interface of the host, MTUBytes=,
      Address= and Gateway= (and the link up). Nothing else configures the fabric;
   c. an enabled sparkprov-firewall.service (its link in multi-user.target.wants) loads
      /etc/sparkprov/nftables/*.nft, as systemd runs that oneshot before docker.service (a power
      off lost every nftables rule);
   d. sshd starts, then dockerd (its daemon.json as persisted). dockerd itself restores the
      containers: those with restart policy `always` or `unless-stopped` (and not stopped by
      hand) start again, others stay Exited, exactly as docker decides. Then the node guard,
      where provision installed it (a Spark's systemd starts its unit).

A missing or wrong fabric file in /etc/netplan therefore shows as a host whose fabric does not
come back, and a container without a restart policy as one that does not come back.

Why `kill-dockerd` + `start-dockerd` is not a reboot: when only dockerd dies, the containers
live on under their containerd shims; a dockerd started again without live-restore finds them
running and *shuts them down* (SIGTERM, 10 s, SIGKILL: Exited (137)) and does not start them
again whatever their restart policy (observed with Debian's docker.io 20.10 in the lab). After a
power cycle the shims are gone too, the containers are found dead, and the restart policy applies.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from . import dockerd, hosts, net, sshd, state
from .faults import slow_rails_again
from .hosts import LabError, nsexec
from .state import FABRIC_IFACES, MGMT_IFACE, LabRecord, host_dir

BOOT_LOG = "/var/log/sparklab-boot.log"
NETWORKD_DIR = "/run/systemd/network"
VOLATILE = ("run", "tmp")   # <host dir>/fs/<slug>: emptied at boot


def _say(msg: str) -> None:
    print(f"lab: {msg}", flush=True)


def power_off(name: str) -> dict:
    """Kill every process of the host at once (SIGKILL) and take its live network settings away."""
    from .up import _kill_cgroups   # the same cleanup lab.down uses
    rec = LabRecord.load().hosts.get(name)
    if rec is None:
        raise LabError(f"no lab host named {name!r} (is the lab up? `invoke lab.up`)")
    # the power goes: no signal on any link before anything else happens, so no process gets
    # to say goodbye (no FIN, no RST reaches a peer; peers find out by their own timeouts, or
    # from the new kernel's RST after the boot)
    links = net.links(name)
    for ifc in links:
        if ifc != "lo":
            net.ip("link", "set", ifc, "down", ns=name, check=False)
    killed = 0
    for _ in range(5):
        pids = hosts.host_pids(name)
        if rec.anchor_pid and hosts.anchor_alive(rec) and rec.anchor_pid not in pids:
            pids.append(rec.anchor_pid)
        if not pids:
            break
        killed += len(pids)
        for pid in pids:   # SIGKILL, no SIGTERM first: a power cut, not a shutdown
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    _kill_cgroups(name)
    left = hosts.host_pids(name)
    if left:
        raise LabError(f"{name}: processes survived the power-off: {left}")
    # the NICs lose their state: no addresses, no routes, default MTU, no shaping, no signal
    for ifc in FABRIC_IFACES:
        if ifc not in links:
            continue
        net.ip("addr", "flush", "dev", ifc, ns=name, check=False)
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "del", "dev", ifc, "root"],
                       capture_output=True)
        net.ip("link", "set", ifc, "down", "mtu", "1500", ns=name, check=False)
    net.ip("neigh", "flush", "all", ns=name, check=False)
    # nftables lives in the kernel: a power cycle loses every rule
    subprocess.run(["ip", "netns", "exec", name, "nft", "flush", "ruleset"], capture_output=True)
    return {"killed": killed}


def _empty_volatile(name: str) -> None:
    hdir = host_dir(name)
    for slug in VOLATILE:
        d = hdir / "fs" / slug
        if not d.is_dir():
            continue
        for child in d.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def _log(name: str, lines: list[str]) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    text = "".join(f"{stamp} {line}\n" for line in lines)
    nsexec(name, ["sh", "-c", f"mkdir -p /var/log && cat >> {BOOT_LOG}"], input=text, check=False)


def _networkd_files(name: str) -> dict[str, str]:
    r = nsexec(name, ["sh", "-c", f"cd {NETWORKD_DIR} 2>/dev/null || exit 0; for f in *.network; do "
                      "[ -f \"$f\" ] && printf '@@@ %s\\n' \"$f\" && cat \"$f\"; done"], check=False)
    out, cur = {}, None
    for line in r.stdout.splitlines():
        if line.startswith("@@@ "):
            cur = line[4:]
            out[cur] = ""
        elif cur:
            out[cur] += line + "\n"
    return out


def _parse_network(text: str) -> dict:
    # repeated keys (Address=) are legal in systemd units: collect them all
    sections: dict[str, dict[str, list[str]]] = {}
    cur = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            cur = sections.setdefault(line[1:-1], {})
            continue
        if cur is not None and "=" in line:
            k, v = line.split("=", 1)
            cur.setdefault(k.strip(), []).append(v.strip())
    return sections


def apply_networkd(name: str) -> list[str]:
    """The stand-in for systemd-networkd at boot: apply the rendered .network files (MTU,
    addresses, gateway, link up) to the host's interfaces with iproute2. Returns what it did."""
    links = net.links(name)
    done = []
    for fname, text in sorted(_networkd_files(name).items()):
        sec = _parse_network(text)
        names = " ".join(sec.get("Match", {}).get("Name", [])).split()
        ifaces = [n for n in names if n in links]
        if not ifaces:
            done.append(f"{fname}: no interface matches {names or '(no Name=)'}; nothing applied")
            continue
        mtu = (sec.get("Link", {}).get("MTUBytes") or [None])[-1]
        nw = sec.get("Network", {})
        addrs = nw.get("Address", []) + [a for s, kv in sec.items() if s == "Address"
                                          for a in kv.get("Address", [])]
        gws = nw.get("Gateway", [])
        for ifc in ifaces:
            steps = []
            if mtu:
                r = net.ip("link", "set", ifc, "mtu", mtu, ns=name, check=False)
                steps.append(f"mtu {mtu}" + ("" if r.returncode == 0 else f" FAILED ({r.stderr.strip()})"))
            net.ip("link", "set", ifc, "up", ns=name, check=False)
            for a in addrs:
                r = net.ip("addr", "replace", a, "dev", ifc, ns=name, check=False)
                steps.append(f"address {a}" + ("" if r.returncode == 0 else f" FAILED ({r.stderr.strip()})"))
            for g in gws:
                r = net.ip("route", "replace", "default", "via", g, "dev", ifc, ns=name, check=False)
                steps.append(f"gateway {g}" + ("" if r.returncode == 0 else f" FAILED ({r.stderr.strip()})"))
            done.append(f"{fname}: {ifc}: up" + (", " + ", ".join(steps) if steps else ""))
    return done


def boot(name: str) -> dict:
    """Start the host again from what is persisted (see the module docstring)."""
    lab = LabRecord.load()
    rec = lab.hosts[name]
    _empty_volatile(name)
    hosts.start_anchor(rec)   # a new mount+UTS namespace: a new kernel's view of the disks
    lab.hosts[name] = rec
    lab.save()
    # interfaces come up as a fresh boot leaves them (unconfigured: MTU 1500, no address)
    net.ip("link", "set", "lo", "up", ns=name, check=False)
    net.ip("link", "set", MGMT_IFACE, "up", ns=name, check=False)
    for ifc in FABRIC_IFACES:
        if ifc in net.links(name):
            net.ip("link", "set", ifc, "up", ns=name, check=False)
    lines = [f"boot of {name}"]
    have = nsexec(name, ["sh", "-c", "ls /etc/netplan/*.yaml 2>/dev/null"], check=False).stdout.split()
    r = nsexec(name, ["netplan", "generate"], check=False)
    if r.returncode != 0:
        lines.append(f"netplan generate failed (rc {r.returncode}): "
                     + (r.stderr.strip() or r.stdout.strip()).replace("\n", " | "))
    else:
        lines.append(f"netplan generate: {len(have)} file(s) in /etc/netplan: {' '.join(have) or '-'}")
    applied = apply_networkd(name) if r.returncode == 0 else []
    lines += [f"networkd: {a}" for a in applied] or ["networkd: nothing to apply"]
    lines += [f"cable fault kept: {x}" for x in _slow_rails_again(name)]
    lines += _enabled_firewall(name)
    _log(name, lines)
    sshd.start_sshd(name)
    dockerd.start_dockerd(name)
    start_guard(name)
    return {"netplan_rc": r.returncode, "netplan_files": have, "applied": applied,
            "netplan_error": (r.stderr.strip() or r.stdout.strip()) if r.returncode else ""}


def _slow_rails_again(name: str) -> list[str]:
    try:
        return slow_rails_again(name)
    except LabError as e:
        return [f"FAILED: {e}"]


def start_guard(name: str) -> bool:
    """init's part for the node guard where provision installed it (sparkprov/modules/guard.py): a
    host without systemd starts it at boot, after dockerd, with the command the module runs."""
    from sparkprov.modules.guard import start_script
    from sparkprov.node.guard import CONFIG_PATH

    if nsexec(name, ["test", "-f", CONFIG_PATH], check=False).returncode != 0:
        return False
    nsexec(name, ["sh", "-c", start_script()])
    return True


FIREWALL_WANTS = "/etc/systemd/system/multi-user.target.wants/sparkprov-firewall.service"


def _enabled_firewall(name: str) -> list[str]:
    """systemd's part for an enabled sparkprov-firewall.service (a oneshot before docker.service):
    load the rule files it names, before dockerd starts the containers."""
    r = nsexec(name, ["sh", "-c", f"[ -e {FIREWALL_WANTS} ] || exit 0; for f in /etc/sparkprov/nftables/*.nft; do "
                      '[ ! -e "$f" ] || nft -f "$f" || exit 1; echo "$f"; done'], check=False)
    if r.returncode:
        return [f"sparkprov-firewall.service failed: {(r.stderr or r.stdout).strip()}"]
    return [f"sparkprov-firewall.service: loaded {f}" for f in r.stdout.split()]


def reboot(name: str, down_seconds: float = 2.0) -> dict:
    """Power-cycle one lab host; returns what happened and how long each phase took."""
    with state.lab_lock():
        rec = LabRecord.load().hosts.get(name)
        if rec is None:
            raise LabError(f"no lab host named {name!r} (is the lab up? `invoke lab.up`)")
        if not hosts.anchor_alive(rec):
            raise LabError(f"lab host {name} is not running (run `invoke lab.up`)")
        t0 = time.monotonic()
        off = power_off(name)
        t1 = time.monotonic()
        time.sleep(max(0.0, down_seconds))
        t2 = time.monotonic()
        res = boot(name)
        t3 = time.monotonic()
    res.update(off)
    res["seconds"] = {"power_off": round(t1 - t0, 2), "off": round(t2 - t1, 2),
                      "boot": round(t3 - t2, 2), "total": round(t3 - t0, 2)}
    return res


def describe(name: str, res: dict) -> str:
    s = res["seconds"]
    parts = [f"{name}: rebooted in {s['total']:.1f}s (power off {s['power_off']:.1f}s: "
             f"{res['killed']} process(es) killed; off {s['off']:.1f}s; boot {s['boot']:.1f}s)"]
    if res["netplan_rc"]:
        parts.append(f"  netplan generate FAILED: {res['netplan_error']}")
    parts += [f"  networkd: {a}" for a in res["applied"]] or ["  networkd: nothing applied "
                                                               "(no fabric configuration persisted)"]
    parts.append("  sshd and dockerd started; containers follow their restart policy")
    return "\n".join(parts)

