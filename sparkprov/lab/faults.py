"""Faults to inject into the lab (and to clear again)."""
from __future__ import annotations

import subprocess

from . import dockerd, net, sshd
from .hosts import LabError, _record
from .state import FABRIC_IFACES


def _check_iface(iface: str) -> None:
    if iface not in FABRIC_IFACES:
        raise LabError(f"{iface!r} is not a fabric interface ({', '.join(FABRIC_IFACES)})")


def stop_sshd(host: str) -> str:
    return f"{host}: sshd " + ("stopped" if sshd.stop_sshd(host) else "was not running")


def start_sshd(host: str) -> str:
    return f"{host}: sshd " + ("started" if sshd.start_sshd(host) else "already running")


def cut_link(host: str, iface: str = "enp1s0f1np1") -> str:
    """`ip link set IFACE down` on this host's end: both ends lose carrier."""
    _check_iface(iface)
    _record(host)
    net.ip("link", "set", iface, "down", ns=host)
    return f"{host}: {iface} down"


def restore_link(host: str, iface: str = "enp1s0f1np1") -> str:
    _check_iface(iface)
    _record(host)
    net.ip("link", "set", iface, "up", ns=host)
    return f"{host}: {iface} up"


def netem_available() -> bool:
    r = subprocess.run(["modprobe", "-n", "sch_netem"], capture_output=True)
    if r.returncode == 0:
        return True
    return False


def slow_link(host: str, iface: str = "enp1s0f1np1", rate: str = "100mbit",
              delay: str | None = None) -> str:
    """Shape egress of this host's end: tbf (rate) always; netem (delay) if the kernel has it."""
    _check_iface(iface)
    _record(host)
    if delay:
        net.ip("link", "show", iface, ns=host)  # raises if the interface is missing
        p = subprocess.run(["ip", "netns", "exec", host, "tc", "qdisc", "replace", "dev", iface,
                            "root", "netem", "delay", delay, "rate", rate],
                           capture_output=True, text=True)
        if p.returncode == 0:
            return f"{host}: {iface} slowed to {rate}, +{delay} (netem)"
        raise LabError(f"netem is not available in this kernel ({p.stderr.strip()}); "
                       "use a rate limit only")
    # the bucket must hold a whole frame: tbf drops every packet larger than its burst, and the
    # rails carry 9000-byte jumbo frames (a 4 KB burst let nothing but small packets through)
    mtu = int(subprocess.run(["ip", "netns", "exec", host, "cat", f"/sys/class/net/{iface}/mtu"],
                             capture_output=True, text=True).stdout.strip() or 9000)
    p = subprocess.run(["ip", "netns", "exec", host, "tc", "qdisc", "replace", "dev", iface,
                        "root", "tbf", "rate", rate, "burst", str(max(32 * 1024, 4 * (mtu + 100))),
                        "latency", "400ms"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise LabError(f"tc tbf failed: {p.stderr.strip()}")
    return f"{host}: {iface} slowed to {rate} (tbf)"


def unslow_link(host: str, iface: str = "enp1s0f1np1") -> str:
    _check_iface(iface)
    _record(host)
    subprocess.run(["ip", "netns", "exec", host, "tc", "qdisc", "del", "dev", iface, "root"],
                   capture_output=True)
    return f"{host}: {iface} shaping removed"


def kill_dockerd(host: str) -> str:
    """SIGKILL the host's dockerd (as a crash would); `lab.up` or start_dockerd restarts it.

    Not a reboot: the containers live on under their shims, and a dockerd started again (no
    live-restore) shuts them down (Exited (137)) and does not restart them, whatever their
    restart policy (docker 20.10's restore). Use `reboot` for a power cycle."""
    return f"{host}: dockerd " + ("killed" if dockerd.stop_dockerd(host, sig="KILL", wait=5)
                                  else "was not running")


def start_dockerd(host: str) -> str:
    return f"{host}: dockerd " + ("started" if dockerd.start_dockerd(host)
                                  else "already running")


def reset_mtu(host: str, iface: str = "enp1s0f1np1", mtu: int = 1500) -> str:
    _check_iface(iface)
    _record(host)
    net.ip("link", "set", iface, "mtu", str(mtu), ns=host)
    return f"{host}: {iface} mtu {mtu}"


ACTIONS = {
    "stop-sshd": lambda h, **k: stop_sshd(h),
    "start-sshd": lambda h, **k: start_sshd(h),
    "cut-link": lambda h, iface, **k: cut_link(h, iface),
    "restore-link": lambda h, iface, **k: restore_link(h, iface),
    "slow-link": lambda h, iface, rate, delay, **k: slow_link(h, iface, rate, delay),
    "unslow-link": lambda h, iface, **k: unslow_link(h, iface),
    "kill-dockerd": lambda h, **k: kill_dockerd(h),
    "start-dockerd": lambda h, **k: start_dockerd(h),
    "reset-mtu": lambda h, iface, mtu, **k: reset_mtu(h, iface, mtu),
    "reboot": lambda h, **k: reboot(h),
}


def reboot(host: str, down_seconds: float = 2.0) -> str:
    """Power-cycle the host: every process killed, live network settings reset, then booted
    from what is persisted (netplan, sshd, dockerd; containers by their restart policy).
    See sparkprov.lab.boot."""
    from . import boot
    return boot.describe(host, boot.reboot(host, down_seconds))


def apply(action: str, host: str, *, iface: str = "enp1s0f1np1", rate: str = "100mbit",
          delay: str | None = None, mtu: int = 1500) -> str:
    """Run one fault action by name (see ACTIONS); returns what it did."""
    if action not in ACTIONS:
        raise LabError(f"unknown fault {action!r}; one of {', '.join(sorted(ACTIONS))}")
    return ACTIONS[action](host, iface=iface, rate=rate, delay=delay, mtu=mtu)
