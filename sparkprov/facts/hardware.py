"""Hardware facts of a Spark (or any NVIDIA Linux box): GPU, driver and CUDA from nvidia-smi,
memory from /proc/meminfo, the ConnectX-7 twins from ibdev2netdev, links/addresses/routes from
`ip -j`, docker, Ollama, the CUDA toolkit, the kernel command line, SSH identities.

Every parser is a pure function of the command's text, tested on real captures
(tests/fixtures/gb10/, tests/fixtures/h200/). Commands are POSIX sh built with `quote`.

FabricInfo is the fabric contract other commands rely on (stage-weights, cluster-up): gather it
in one call with any other facts; it yields, per host,

    {"rails": [{"iface", "address", "prefix", "hca", "mtu", "up"}],   # Up ConnectX-7 twins
     "node_ip", "nccl_socket_ifname", "gloo_socket_ifname", "ucx_net_devices", "nccl_ib_hca"}

Rails are the twins ibdev2netdev reports Up that carry a global IPv4 address, ordered by PCI
domain (enp1s0f1np1 before enP2p1s0f1np1); node_ip is the first rail's address.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx, home_of
from sparkprov.transport.shell import cmd, quote

# ---------------------------------------------------------------------------------------------
# GPU: nvidia-smi
# ---------------------------------------------------------------------------------------------

GPU_QUERY = "index,name,uuid,compute_cap,driver_version,memory.total,memory.used,pci.bus_id"
_NA = {"[N/A]", "N/A", "[Not Supported]", "Not Supported", ""}


def _mib(value: str) -> int | None:
    """'143771 MiB' -> 143771; '[N/A]' (GB10: unified memory, G16) -> None."""
    v = value.strip()
    if v in _NA:
        return None
    m = re.fullmatch(r"(\d+)(?:\s*MiB)?", v)
    if not m:
        raise ValueError(f"unexpected memory value {value!r}")
    return int(m.group(1))


def parse_gpu_query(text: str) -> list[dict[str, Any]]:
    """Lines of `nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader`."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(", ")]
        if len(parts) != 8:
            raise ValueError(f"unexpected nvidia-smi line {line!r}")
        index, name, uuid, cc, drv, total, used, bus = parts
        gpus.append({"index": int(index), "name": name, "uuid": uuid,
                     "compute_cap": None if cc in _NA else cc, "driver_version": drv,
                     "memory_total_mib": _mib(total), "memory_used_mib": _mib(used),
                     "bus_id": bus})
    return gpus


_HEADER_RE = re.compile(r"Driver Version:\s*([0-9.]+)\s+CUDA Version:\s*([0-9.]+|N/A)")


def parse_smi_header(text: str) -> dict[str, str | None]:
    """Driver and CUDA version from the table header of plain `nvidia-smi`."""
    m = _HEADER_RE.search(text)
    if not m:
        return {"driver_version": None, "cuda_version": None}
    return {"driver_version": m.group(1), "cuda_version": None if m.group(2) == "N/A" else m.group(2)}


def parse_smi_list(text: str) -> list[dict[str, Any]]:
    """`nvidia-smi -L`: GPU 0: NVIDIA GB10 (UUID: GPU-...)."""
    out = []
    for m in re.finditer(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9a-f-]+)\)", text, re.M):
        out.append({"index": int(m.group(1)), "name": m.group(2), "uuid": m.group(3)})
    return out


def parse_topo_nics(text: str) -> dict[str, str]:
    """NIC legend of `nvidia-smi topo -m`: NIC0 -> rocep1s0f0."""
    return dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, re.M))


def version_tuple(v: str) -> tuple[int, ...]:
    """'580.95.05' -> (580, 95, 5); '590.44' -> (590, 44)."""
    if not re.fullmatch(r"\d+(\.\d+)*", v.strip()):
        raise ValueError(f"not a version: {v!r}")
    return tuple(int(p) for p in v.strip().split("."))


def driver_at_least(found: str, needed: str) -> bool:
    a, b = version_tuple(found), version_tuple(needed)
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)) >= b + (0,) * (n - len(b))


@dataclass(frozen=True)
class NvidiaSmi(Fact):
    """GPUs, driver and CUDA version. {"present": False} without nvidia-smi; "error" when it
    runs but cannot talk to the driver."""

    def command(self, sh: ShellCtx) -> str:
        return ("if ! command -v nvidia-smi >/dev/null 2>&1; then echo @absent; exit 0; fi\n"
                f"echo @query; nvidia-smi --query-gpu={GPU_QUERY} --format=csv,noheader 2>&1; echo \"@rc=$?\"\n"
                "echo @table; nvidia-smi 2>&1 | sed -n '1,6p'")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_nvidia_smi(out)


def parse_nvidia_smi(out: str) -> dict[str, Any]:
    if out.strip() == "@absent":
        return {"present": False, "gpus": [], "driver_version": None, "cuda_version": None, "error": None}
    m = re.search(r"@query\n(.*?)@rc=(\d+)\n@table\n(.*)", out, re.S)
    if not m:
        raise FactError(f"unexpected nvidia-smi output: {out.strip()[:200]!r}")
    query, qrc, table = m.group(1), int(m.group(2)), m.group(3)
    header = parse_smi_header(table)
    if qrc != 0:
        text = (query.strip() or table.strip()).splitlines()
        return {"present": True, "gpus": [], **header, "error": text[0] if text else f"nvidia-smi exit status {qrc}"}
    gpus = parse_gpu_query(query)
    driver = header["driver_version"] or (gpus[0]["driver_version"] if gpus else None)
    return {"present": True, "gpus": gpus, "driver_version": driver, "cuda_version": header["cuda_version"],
            "error": None if gpus else "nvidia-smi lists no GPU"}


# ---------------------------------------------------------------------------------------------
# Memory and kernel
# ---------------------------------------------------------------------------------------------

def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> bytes per field (MemTotal, MemAvailable, Cached, ...)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(\S+):\s+(\d+)(?:\s+kB)?", line.strip())
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if line.strip().endswith("kB") else 1)
    if "MemTotal" not in out:
        raise ValueError("no MemTotal in /proc/meminfo")
    return out


def _sensor(text: str) -> float | None:
    text = text.strip().removesuffix("W").strip()
    try:
        return float(text)
    except ValueError:
        return None  # [N/A], Not Supported


def parse_gpu_sensors(out: str) -> dict[str, float | None]:
    """`nvidia-smi --query-gpu=temperature.gpu,power.draw --format=csv,noheader` (GB10: "39, 3.74 W")."""
    line = next((ln for ln in out.splitlines() if ln.strip()), "")
    if not line or line.startswith("@absent"):
        return {"temperature_c": None, "power_w": None}
    parts = [p.strip() for p in line.split(",")] + ["", ""]
    return {"temperature_c": _sensor(parts[0]), "power_w": _sensor(parts[1])}


@dataclass(frozen=True)
class GpuSensors(Fact):
    """GPU temperature and power draw where nvidia-smi reports them (None where it prints [N/A])."""

    def command(self, sh: ShellCtx) -> str:
        return ("nvidia-smi --query-gpu=temperature.gpu,power.draw --format=csv,noheader 2>/dev/null "
                "| head -n 1 || echo @absent")

    def parse(self, out: str, err: str, rc: int) -> dict[str, float | None]:
        return parse_gpu_sensors(out)


@dataclass(frozen=True)
class MemInfo(Fact):
    """/proc/meminfo in bytes: on GB10 the only place free memory can be read (G16)."""

    def command(self, sh: ShellCtx) -> str:
        return "cat /proc/meminfo"

    def parse(self, out: str, err: str, rc: int) -> dict[str, int]:
        if rc != 0:
            raise FactError(err.strip() or "cannot read /proc/meminfo")
        return parse_meminfo(out)


def parse_cmdline(text: str) -> dict[str, Any]:
    params: dict[str, str | None] = {}
    for word in text.split():
        k, sep, v = word.partition("=")
        params[k] = v if sep else None
    modeset = next((params[k] for k in ("nvidia-drm.modeset", "nvidia.modeset", "modeset") if k in params), None)
    return {"cmdline": text.strip(), "params": params, "modeset": modeset}


@dataclass(frozen=True)
class KernelCmdline(Fact):
    """/proc/cmdline; `modeset` is the nvidia(-drm) modeset parameter if set (G18)."""

    def command(self, sh: ShellCtx) -> str:
        return "cat /proc/cmdline"

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        if rc != 0:
            raise FactError(err.strip() or "cannot read /proc/cmdline")
        return parse_cmdline(out)



def parse_rdma_firmware(text: str) -> dict[str, str]:
    """`DEVICE FW_VER` lines (RdmaFirmware's script) -> {device: firmware version}."""
    out = {}
    for line in text.splitlines():
        dev, _, ver = line.strip().partition(" ")
        if dev and ver.strip():
            out[dev] = ver.strip()
    return out


def firmware_summary(devices: dict[str, str]) -> str | None:
    """One version when every ConnectX-7 function runs the same (a Spark's four do), else each
    device's; None where the host has no RDMA device (the lab, a host without a ConnectX-7)."""
    if not devices:
        return None
    versions = set(devices.values())
    if len(versions) == 1:
        return versions.pop()
    return ", ".join(f"{d} {v}" for d, v in sorted(devices.items()))


class RdmaFirmware(Fact):
    """The ConnectX-7 firmware of each RDMA device (/sys/class/infiniband/DEV/fw_ver: what `ibstat`
    prints as "Firmware version", without infiniband-diags installed). No device: {}."""

    def command(self, sh: ShellCtx) -> str:
        return ('for d in /sys/class/infiniband/*; do [ -r "$d/fw_ver" ] || continue; '
                'printf \'%s %s\\n\' "${d##*/}" "$(cat "$d/fw_ver")"; done; true')

    def parse(self, out: str, err: str, rc: int) -> dict[str, str]:
        return parse_rdma_firmware(out)

# ---------------------------------------------------------------------------------------------
# Fabric: ibdev2netdev, ip -j
# ---------------------------------------------------------------------------------------------

_IBDEV_RE = re.compile(r"^(\S+) port (\d+) ==> (\S+) \((\w+)\)\s*$")


def parse_ibdev2netdev(text: str) -> list[dict[str, Any]]:
    """`roceP2p1s0f1 port 1 ==> enP2p1s0f1np1 (Up)` lines."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _IBDEV_RE.match(line.strip())
        if not m:
            raise ValueError(f"unexpected ibdev2netdev line {line!r}")
        out.append({"hca": m.group(1), "port": int(m.group(2)), "iface": m.group(3), "up": m.group(4) == "Up"})
    return out


@dataclass(frozen=True)
class Ibdev2netdev(Fact):
    """The RDMA devices and their interfaces. {"present": False} without ibdev2netdev."""

    def command(self, sh: ShellCtx) -> str:
        return "if command -v ibdev2netdev >/dev/null 2>&1; then ibdev2netdev; else echo @absent; fi"

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        if out.strip() == "@absent":
            return {"present": False, "devices": []}
        if rc != 0:
            raise FactError(err.strip() or f"ibdev2netdev failed (rc={rc})")
        return {"present": True, "devices": parse_ibdev2netdev(out)}


def iface_order(name: str) -> tuple[int, str]:
    """ConnectX-7 twins in PCI-domain order: enp1s0f1np1 (domain 0) before enP2p1s0f1np1."""
    m = re.match(r"enP(\d+)p", name)
    return (int(m.group(1)) if m else 0, name)


def parse_ip_addr(text: str) -> dict[str, dict[str, Any]]:
    """`ip -j addr show` -> {ifname: {mtu, up, carrier, admin_up, mac, ipv4: [{address, prefix, scope}]}}."""
    links = {}
    for link in json.loads(text or "[]"):
        flags = link.get("flags", [])
        ipv4 = [{"address": a["local"], "prefix": int(a["prefixlen"]), "scope": a.get("scope", "global")}
                for a in link.get("addr_info", []) if a.get("family") == "inet"]
        links[link["ifname"]] = {"mtu": link.get("mtu"), "up": link.get("operstate") == "UP",
                                 "admin_up": "UP" in flags, "carrier": "NO-CARRIER" not in flags and "LOWER_UP" in flags,
                                 "mac": link.get("address"), "ipv4": ipv4}
    return links


def parse_ip_route(text: str) -> list[dict[str, Any]]:
    """`ip -j route show` -> [{dst, dev, gateway}] ("default" for the default route)."""
    return [{"dst": r.get("dst"), "dev": r.get("dev"), "gateway": r.get("gateway")} for r in json.loads(text or "[]")]


@dataclass(frozen=True)
class NetState(Fact):
    """Links with their addresses and MTU, routes (main table), which address the SSH session
    came in on (the management link: never touched), and whether netplan is installed."""

    def command(self, sh: ShellCtx) -> str:
        return ("printf 'ssh=%s\\n' \"${SSH_CONNECTION:-}\"\n"
                "printf 'netplan=%s\\n' \"$(command -v netplan || true)\"\n"
                "echo @addr; ip -j addr show\necho @route; ip -j -4 route show")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_net_state(out)


def parse_net_state(out: str) -> dict[str, Any]:
    m = re.search(r"ssh=(.*)\nnetplan=(.*)\n@addr\n(.*)\n@route\n(.*)", out, re.S)
    if not m:
        raise FactError(f"unexpected ip output: {out.strip()[:200]!r}")
    ssh = m.group(1).split()
    return {"ssh_server_addr": ssh[2] if len(ssh) >= 3 else None, "netplan": m.group(2).strip() or None,
            "links": parse_ip_addr(m.group(3).strip()), "routes": parse_ip_route(m.group(4).strip())}


def fabric_info(devices: list[dict[str, Any]], links: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The FabricInfo contract from ibdev2netdev devices and parsed `ip -j addr`."""
    rails = []
    for dev in sorted(devices, key=lambda d: iface_order(d["iface"])):
        link = links.get(dev["iface"])
        if not dev["up"] or link is None:
            continue
        glob = [a for a in link["ipv4"] if a["scope"] == "global" and not a["address"].startswith("169.254.")]
        if not glob:
            continue
        rails.append({"iface": dev["iface"], "address": glob[0]["address"], "prefix": glob[0]["prefix"],
                      "hca": dev["hca"], "mtu": link["mtu"], "up": link["up"]})
    return {"rails": rails, **nccl_settings(rails)}


def nccl_settings(rails: list[dict[str, Any]]) -> dict[str, Any]:
    """NCCL/Gloo/UCX bindings for a host's rails (G32): sockets on the first rail, RoCE on all."""
    first = rails[0] if rails else None
    return {"node_ip": first["address"] if first else None,
            "nccl_socket_ifname": first["iface"] if first else None,
            "gloo_socket_ifname": first["iface"] if first else None,
            "ucx_net_devices": first["iface"] if first else None,
            "nccl_ib_hca": ",".join(r["hca"] for r in rails if r.get("hca")) or None}


@dataclass(frozen=True)
class FabricInfo(Fact):
    """The fabric as NCCL should use it (see the module docstring for the shape)."""

    def command(self, sh: ShellCtx) -> str:
        return ("if command -v ibdev2netdev >/dev/null 2>&1; then ibdev2netdev; else echo @absent; fi\n"
                "echo @addr; ip -j addr show")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        ib, _, addr = out.partition("@addr\n")
        devices = [] if ib.strip() == "@absent" else parse_ibdev2netdev(ib)
        return fabric_info(devices, parse_ip_addr(addr.strip()))


def ping_targets_script(targets: tuple[tuple[str, str], ...], size: int) -> str:
    """Ping each (source address, target) pair; binding the source address needs no privilege."""
    lines = []
    for src, addr in targets:
        lines.append(f"printf '@ping %s %s\\n' {quote(src)} {quote(addr)}; o=$("
                     + cmd("ping", "-n", "-M", "do", "-s", size, "-c", "2", "-i", "0.2", "-W", "2", "-I", src, addr)
                     + " 2>&1); r=$?; printf '%s\\n' \"$o\" | tail -n 3; echo \"@rc=$r\"")
    return "\n".join(lines)


def parse_ping(text: str) -> dict[str, Any]:
    """Summary of `ping -c N`: received count and the first error line."""
    m = re.search(r"(\d+) packets transmitted, (\d+) (?:packets )?received", text)
    sent, got = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    err = next((ln.strip() for ln in text.splitlines()
                if re.search(r"error|too long|unreachable|Frag|not permitted|Cannot|invalid", ln, re.I)), None)
    # one unfragmented jumbo reply proves the path carries 9000-byte frames; a lost one among
    # them is loss, not a wrong MTU (which answers "message too long" and nothing)
    return {"sent": sent, "received": got, "ok": got > 0, "error": err}


SSH_AT_ONCE = 4  # logins one host runs at once (MaxStartups is 10 per sshd by default)
# pings one host runs at once: ping's raw socket sees every ICMP reply reaching the host, and 30
# jumbo pings at once overflowed its receive buffer (a lost reply read as a broken path)
PINGS_AT_ONCE = 8
PROOF_RECORD = "~/.cache/sparkprov/mesh-ssh-proof"  # the login user's: the digest its last full login round proved


@dataclass(frozen=True)
class MeshProbe(Fact):
    """From this host: unfragmented jumbo pings (`ping -M do -s SIZE -I SRC ADDR`) for every
    (own rail address, peer rail address), and `ssh -o BatchMode=yes -o StrictHostKeyChecking=yes user@addr
    true` to every ssh target, run as the login user."""

    pings: tuple[tuple[str, str], ...]
    size: int = 8972
    ssh_user: str = ""
    ssh_targets: tuple[str, ...] = ()
    # The logins are skipped when PROOF_RECORD holds proof_key: the digest of everything they
    # depend on that sparkprov manages (see fabric_mesh.proof_key); "" = always log in.
    proof_key: str = ""

    def command(self, sh: ShellCtx) -> str:
        # Probes run a few at a time (PINGS_AT_ONCE, SSH_AT_ONCE), each writing its own block
        # (head, output, exit status) to its own file, printed afterwards: the wall time is that of
        # the slowest wave, not the sum. One echo per try (the second of `-c 2` only waits out
        # ping's 0.2 s interval); a try that gets no reply is repeated twice, so a lost packet is
        # not a broken path. A ping costs one subshell and the ping itself: its output is filtered
        # on the control machine (parse), not by a grep per ping; at 16 hosts that is 480 pings.
        jobs = []
        for src, addr in self.pings:
            ping = cmd("ping", "-n", "-M", "do", "-s", self.size, "-c", "1", "-W", "2", "-I", src, addr)
            jobs.append((f"@ping {src} {addr}", f"for t in 1 2 3; do o=$({ping} 2>&1) && break; done; r=$?"))
        logins = []
        for addr in self.ssh_targets:
            login = cmd("ssh", "-n", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                        "-o", "ConnectTimeout=5", f"{self.ssh_user}@{addr}", "true")
            # An sshd sheds connections beyond its MaxStartups (10 unauthenticated by default)
            # before the key exchange: the targets come in an order rotated per host (so that at
            # any moment the hosts log in to different peers), at most SSH_AT_ONCE at a time, and
            # a shed connection is retried, never an authentication or host-key failure.
            logins.append((f"@ssh {addr}", f"for t in 1 2 3 4; do o=$({login} 2>&1); r=$?; "
                           "case \"$o\" in *kex_exchange_identification*|*'Connection reset'*|*'Connection closed'*) "
                           "[ $r -eq 255 ] && [ $t -lt 4 ] && { sleep $t; continue; } ;; esac; break; done"))
        if not jobs and not logins:
            return ":"
        lines = ['__mp=$(mktemp -d)', "trap 'rm -rf \"$__mp\"' EXIT"]

        def in_waves(kind: str, probes: list[tuple[str, str]], at_once: int) -> list[str]:
            # braces: `a; b &` would run a in the foreground and only b in the background (the
            # probes then ran one after another: 30 pings took 6 s instead of 0.2 s)
            out = []
            for k in range(0, len(probes), at_once):
                out += [f"{{ {body}; printf '%s\\n%s\\n@rc=%s\\n' {quote(head)} \"$o\" \"$r\" > \"$__mp/{kind}{n:04d}\"; }} &"
                        for n, (head, body) in enumerate(probes[k:k + at_once], start=k)] + ["wait"]
            return out

        lines += in_waves("p", jobs, PINGS_AT_ONCE)
        waves = in_waves("s", logins, SSH_AT_ONCE)
        show_pings = ['cat "$__mp"/p*'] if jobs else []
        show_logins = ['cat "$__mp"/s*'] if logins else []
        if logins and self.proof_key:
            record = sh.path(PROOF_RECORD)
            # proven before with the same keys, pins and addresses: the pings' lines only
            lines.append(f"if [ \"$(cat {record} 2>/dev/null)\" = {quote(self.proof_key)} ]; then __mp_proven=1; echo @ssh-proven")
            lines += ["else __mp_proven=0"] + waves + ["fi"]
            lines += show_pings + ["[ $__mp_proven = 1 ] || {"] + show_logins + ["}"]
        else:
            lines += waves + show_pings + show_logins
        return "\n".join(lines)

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        pings, ssh = {}, {}
        for block in re.split(r"(?m)^(?=@(?:ping|ssh) )", out):
            head, _, body = block.partition("\n")
            m = re.search(r"(?m)^@rc=(\d+)\s*$", body)
            code = int(m.group(1)) if m else -1
            body = re.sub(r"(?m)^@rc=\d+\s*$", "", body)
            if head.startswith("@ping "):
                # the error and statistics lines only (not the banner, replies, rtt or blanks)
                body = "\n".join(ln for ln in body.splitlines() if ln.strip() and not ln.startswith(("PING ", "---", "rtt "))
                                 and " bytes from " not in ln)
            body = "\n".join(body.strip().splitlines()[-3:])
            if head.startswith("@ping "):
                _, src, addr = head.split()
                res = parse_ping(body)
                res["ok"] = res["ok"] and code == 0
                if not res["ok"] and not res["error"]:
                    res["error"] = body.splitlines()[-1] if body else f"ping exit status {code}"
                pings[f"{src} {addr}"] = res
            elif head.startswith("@ssh "):
                addr = head.split()[1]
                ssh[addr] = {"ok": code == 0, "error": None if code == 0 else
                             (body.splitlines()[-1] if body else f"ssh exit status {code}")}
        return {"ping": pings, "ssh": ssh, "ssh_proven": re.search(r"(?m)^@ssh-proven$", out) is not None}


# ---------------------------------------------------------------------------------------------
# Docker
# ---------------------------------------------------------------------------------------------

def _kv(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep and re.fullmatch(r"[a-z_]+", k):
            out[k] = v
    return out


@dataclass(frozen=True)
class DockerState(Fact):
    """Docker as the login user sees it, in this session: CLI, daemon answering (`docker info`),
    session groups, socket ownership, the NVIDIA container toolkit."""

    def command(self, sh: ShellCtx) -> str:
        return (
            "printf 'cli=%s\\n' \"$(command -v docker || true)\"\n"
            "printf 'session_groups=%s\\n' \"$(id -Gn)\"\n"
            "s=/var/run/docker.sock; [ -S \"$s\" ] || s=/run/docker.sock\n"
            "printf 'socket=%s\\n' \"$( [ -S \"$s\" ] && stat -c '%n|%U|%G|%a' \"$s\" || true)\"\n"
            "if command -v docker >/dev/null 2>&1; then\n"
            "  o=$(docker info --format '{{.ServerVersion}}|{{.DefaultRuntime}}|{{range $k, $v := .Runtimes}}{{$k}} {{end}}' 2>&1); r=$?\n"
            "  printf 'info_rc=%s\\ninfo=%s\\n' \"$r\" \"$(printf '%s' \"$o\" | tr '\\n' ' ' | cut -c1-400)\"\n"
            "fi\n"
            "printf 'ctk=%s\\n' \"$(nvidia-ctk --version 2>/dev/null | head -n 1)\"\n"
            "printf 'hook=%s\\n' \"$(command -v nvidia-container-runtime-hook || true)\"\n"
            "printf 'toolkit_pkg=%s\\n' \"$(dpkg-query -W -f='${Status}|${Version}' nvidia-container-toolkit 2>/dev/null || true)\"\n"
            "printf 'systemctl=%s\\n' \"$(command -v systemctl || true)\""
        )

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_docker_state(out)


def parse_docker_state(out: str) -> dict[str, Any]:
    kv = _kv(out)
    sock = kv.get("socket", "")
    socket = None
    if sock:
        path, owner, group, mode = sock.split("|")
        socket = {"path": path, "owner": owner, "group": group, "mode": int(mode, 8)}
    info = kv.get("info", "")
    access = kv.get("info_rc") == "0"
    server = runtimes = default_rt = None
    if access:
        parts = info.split("|")
        server, default_rt = parts[0].strip() or None, (parts[1].strip() if len(parts) > 1 else None)
        runtimes = parts[2].split() if len(parts) > 2 else []
    pkg = kv.get("toolkit_pkg", "")
    pkg_version = pkg.split("|", 1)[1] if pkg.startswith("install ok installed|") else None
    ctk = kv.get("ctk") or None
    ctk_version = re.search(r"version ([0-9][\w.-]*)", ctk).group(1) if ctk and re.search(r"version ([0-9][\w.-]*)", ctk) else None
    return {"cli": kv.get("cli") or None, "session_groups": kv.get("session_groups", "").split(),
            "socket": socket, "access": access, "server_version": server, "default_runtime": default_rt,
            "runtimes": runtimes or [], "error": None if access or not kv.get("cli") else info.strip(),
            "toolkit": {"ctk": ctk_version, "hook": kv.get("hook") or None, "package": pkg_version},
            "systemctl": kv.get("systemctl") or None}


@dataclass(frozen=True)
class DockerDaemon(Fact):
    """Is the docker daemon running (and, given an image, is that image present)? Asked as root,
    so it does not depend on the login user's access (that is DockerState's question)."""

    image: str = ""
    needs_root = True

    def command(self, sh: ShellCtx) -> str:
        check = (f"if {cmd('docker', 'image', 'inspect', '--format', '{{.Id}}', self.image)} >/dev/null 2>&1; "
                 "then echo image=present; else echo image=absent; fi\n") if self.image else ""
        return ("command -v docker >/dev/null 2>&1 || { echo @nocli; exit 0; }\n"
                "o=$(docker info --format 'server={{.ServerVersion}}' 2>&1); r=$?\n"
                "printf '%s\\n' \"$o\" | tail -n 1\n"
                "[ $r -eq 0 ] || exit $r\n" + check)

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        lines = out.strip().splitlines()
        text = lines[0] if lines else ""
        if text == "@nocli":
            return {"running": False, "version": None, "error": "docker is not installed", "image": None}
        if text.startswith("server=") and rc == 0:
            image = next((ln[6:] for ln in lines[1:] if ln.startswith("image=")), None)
            return {"running": True, "version": text[7:], "error": None, "image": image}
        return {"running": False, "version": None, "image": None,
                "error": text or err.strip() or f"docker info failed (rc={rc})"}


SMOKE_DIR = "~/.cache/sparkprov/gpu-smoke"  # passed GPU smoke tests, one file per what they depend on


@dataclass(frozen=True)
class GpuSmokeRecord(Fact):
    """Whether `docker run --rm --gpus all IMAGE COMMAND` passed for this image build, docker
    server and driver (a record the smoke change writes): a read, never a container. The key
    changes with any of them, so a new driver or image is smoke-tested again."""

    image: str
    command_argv: tuple[str, ...] = ()
    gpus: bool = True

    def command(self, sh: ShellCtx) -> str:
        return ("docker info >/dev/null 2>&1 || { echo @noaccess; exit 0; }\n"
                f"i=$({cmd('docker', 'image', 'inspect', '--format', '{{.Id}}', self.image)} 2>/dev/null) || {{ echo @absent; exit 0; }}\n"
                "v=$(docker version --format '{{.Server.Version}}' 2>/dev/null)\n"
                "d=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)\n"
                f"k=$(printf '%s|%s|%s|%s|%s' \"$i\" \"$v\" \"$d\" {quote(' '.join(self.command_argv))} {int(self.gpus)} "
                "| sha256sum | cut -c1-32)\n"
                f"echo \"@key $k\"; f={sh.path(SMOKE_DIR)}/\"$k\"; [ -f \"$f\" ] && echo @passed; true")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        text = out.strip()
        if text in ("@noaccess", "@absent"):
            return {"state": text[1:], "key": None, "passed": False}
        m = re.search(r"@key ([0-9a-f]{32})", out)
        if not m:
            raise FactError(f"unexpected smoke record output: {text[:200]!r}")
        return {"state": "present", "key": m.group(1), "passed": "@passed" in out}


# ---------------------------------------------------------------------------------------------
# Ollama (G14), CUDA toolkit (G36)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OllamaState(Fact):
    """What an Ollama server at URL holds in memory (GET /api/ps)."""

    url: str = "http://127.0.0.1:11434"

    def command(self, sh: ShellCtx) -> str:
        u = quote(self.url.rstrip("/") + "/api/ps")
        return (f"if command -v curl >/dev/null 2>&1; then curl -s -m 3 --noproxy '*' {u}; "
                f"else python3 -c 'import sys,urllib.request as u;print(u.build_opener(u.ProxyHandler({{}})).open(sys.argv[1],timeout=3).read().decode())' {u} 2>/dev/null; fi; "
                "echo; echo \"@rc=$?\"")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_ollama_ps(out)


def parse_ollama_ps(out: str) -> dict[str, Any]:
    body = re.sub(r"@rc=\d+\s*$", "", out).strip()
    if not body:
        return {"running": False, "models": []}
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return {"running": False, "models": [], "error": body[:200]}
    models = [{"name": m.get("name") or m.get("model"), "size": m.get("size"), "size_vram": m.get("size_vram"),
               "expires_at": m.get("expires_at")} for m in data.get("models") or []]
    return {"running": True, "models": models}


_NVCC_RE = re.compile(r"release (\d+)\.(\d+), V([0-9.]+)")


def parse_nvcc_version(text: str) -> str | None:
    """`nvcc --version` / `ptxas --version` -> '13.0.88'."""
    m = _NVCC_RE.search(text)
    return m.group(3) if m else None


@dataclass(frozen=True)
class CudaToolkit(Fact):
    """nvcc and ptxas as a login shell finds them (PATH, TRITON_PTXAS_PATH), and the CUDA
    toolkits installed under /usr/local (G36)."""

    def command(self, sh: ShellCtx) -> str:
        version = "awk 'match($0, /V[0-9][0-9.]*/) {print substr($0, RSTART, RLENGTH); exit}'"
        # One login shell answers everything a login shell decides (PATH, TRITON_PTXAS_PATH):
        # a login shell reads /etc/profile and profile.d, which costs processes of its own.
        probe = ("printf 'nvcc=%s\\nptxas=%s\\ntriton_ptxas=%s\\n' \"$(command -v nvcc || true)\" "
                 "\"$(command -v ptxas || true)\" \"${TRITON_PTXAS_PATH:-}\"\n"
                 "for t in nvcc ptxas; do p=$(command -v $t) && "
                 f"printf '%s_version=%s\\n' \"$t\" \"$(\"$p\" --version 2>/dev/null | {version})\"; done; true")
        return (f"if command -v bash >/dev/null 2>&1; then bash -lc {quote(probe)} </dev/null 2>/dev/null; "
                f"else sh -lc {quote(probe)} </dev/null 2>/dev/null; fi\n"
                "for d in /usr/local/cuda-*/bin /usr/local/cuda/bin; do\n"
                "  [ -x \"$d/nvcc\" ] || continue\n"
                f"  printf 'toolkit=%s|%s|%s\\n' \"$d\" \"$(\"$d/nvcc\" --version 2>/dev/null | {version})\" "
                f"\"$( [ -x \"$d/ptxas\" ] && \"$d/ptxas\" --version 2>/dev/null | {version})\"\n"
                "done")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_cuda_toolkit(out)


def parse_cuda_toolkit(out: str) -> dict[str, Any]:
    kv: dict[str, str] = {}
    toolkits = []
    for line in out.splitlines():
        k, sep, v = line.partition("=")
        if not sep:
            continue
        if k == "toolkit":
            d, nv, px = (v.split("|") + ["", ""])[:3]
            toolkits.append({"bin": d, "nvcc": nv.lstrip("V") or None, "ptxas": px.lstrip("V") or None})
        else:
            kv[k] = v
    return {"nvcc": kv.get("nvcc") or None, "nvcc_version": kv.get("nvcc_version", "").lstrip("V") or None,
            "ptxas": kv.get("ptxas") or None, "ptxas_version": kv.get("ptxas_version", "").lstrip("V") or None,
            "triton_ptxas_path": kv.get("triton_ptxas") or None, "toolkits": toolkits}


# ---------------------------------------------------------------------------------------------
# Model store (G22, G23, G25)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoreState(Fact):
    """A directory tree the login user must own: its state, what in it is owned by someone
    else (root-owned leftovers of container downloads, G23), free space of its filesystem, and
    its entry count and size in bytes."""

    path: str
    owner: str
    subdirs: tuple[str, ...] = ()
    needs_root = True

    def command(self, sh: ShellCtx) -> str:
        p = sh.path(self.path)
        subs = "".join(f"  if [ -d \"$p\"/{quote(d)} ]; then echo sub={quote(d)}; fi\n" for d in self.subdirs)
        return (f"p={p}\n"
                "if [ -d \"$p\" ]; then\n"
                "  stat -c 'stat=%U|%G|%a' -- \"$p\"\n" + subs +
                # one walk for the count and the first five (a store holds thousands of files)
                f"  find \"$p\" -xdev ! -user {quote(self.owner)} -printf '%u %p\\n' 2>/dev/null | "
                "awk 'NR <= 5 {print \"foreign_path=\" $0} END {print \"foreign=\" NR}'\n"
                # entries by the shell's own globs (dot files too), size without a cut
                "  n=0; for e in \"$p\"/* \"$p\"/.[!.]* \"$p\"/..?*; do { [ -e \"$e\" ] || [ -L \"$e\" ]; } && n=$((n+1)); done\n"
                "  echo \"entries=$n\"; s=$(du -sb -- \"$p\" 2>/dev/null); echo \"size=${s%%[[:space:]]*}\"\n"
                "  d=\"$p\"\n"
                "elif [ -e \"$p\" ]; then echo notdir; d=$(dirname -- \"$p\")\n"
                "else echo absent; d=$(dirname -- \"$p\"); while [ ! -d \"$d\" ]; do d=$(dirname -- \"$d\"); done; fi\n"
                "df -P -B1 -- \"$d\" | awk 'NR==2 {print \"free=\" $4; print \"fs_total=\" $2; print \"mount=\" $6}'")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        return parse_store_state(out)


def parse_store_state(out: str) -> dict[str, Any]:
    lines = out.splitlines()
    state: dict[str, Any] = {"exists": False, "type": None, "foreign_count": 0, "foreign": [], "subdirs": []}
    for line in lines:
        if line.startswith("sub="):
            state["subdirs"].append(line[4:])
            continue
        if line == "absent":
            state["exists"] = False
        elif line == "notdir":
            state.update(exists=True, type="other")
        elif line.startswith("stat="):
            owner, group, mode = line[5:].split("|")
            state.update(exists=True, type="directory", owner=owner, group=group, mode=int(mode, 8))
        elif line.startswith("foreign="):
            state["foreign_count"] = int(line.split("=", 1)[1])
        elif line.startswith("foreign_path="):
            state["foreign"].append(line.split("=", 1)[1])
        elif line.startswith(("entries=", "size=", "free=", "fs_total=")):
            k, v = line.split("=", 1)
            state[k] = int(v) if v.strip() else None
        elif line.startswith("mount="):
            state["mount"] = line.split("=", 1)[1]
    return state


# ---------------------------------------------------------------------------------------------
# SSH identities (ssh_mesh)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SshIdentity(Fact):
    """A key pair of the login user (public half and private key's mode only: the private key
    itself is never read) and this host's public host keys."""

    keyfile: str  # path of the private key, e.g. ~/.ssh/id_ed25519_sparkprov

    def command(self, sh: ShellCtx) -> str:
        k = sh.path(self.keyfile)
        return (f"k={k}\n"
                "if [ -f \"$k\" ]; then stat -c 'key=%U|%a' -- \"$k\"; else echo key=absent; fi\n"
                # `read` is a builtin: no process per key file
                "if [ -f \"$k.pub\" ]; then l=; read -r l < \"$k.pub\"; printf 'pub=%s\\n' \"$l\"; fi\n"
                "for f in /etc/ssh/ssh_host_*_key.pub; do [ -r \"$f\" ] && read -r t b _ < \"$f\" && "
                "printf 'hostkey=%s %s\\n' \"$t\" \"$b\"; done; true")

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        state: dict[str, Any] = {"exists": False, "pub": None, "host_keys": []}
        for line in out.splitlines():
            k, _, v = line.partition("=")
            if k == "key" and v != "absent":
                owner, mode = v.split("|")
                state.update(exists=True, owner=owner, mode=int(mode, 8))
            elif k == "pub":
                state["pub"] = v.strip() or None
            elif k == "hostkey" and v.strip():
                state["host_keys"].append(v.strip())
        if state["pub"] and "PRIVATE KEY" in state["pub"]:
            raise FactError(f"{self.keyfile}.pub holds a private key")
        return state


@dataclass(frozen=True)
class AuthorizedKeys(Fact):
    """The authorized_keys file sshd reads for USER (first AuthorizedKeysFile entry from
    `sshd -T`, else sshd_config, else ~/.ssh/authorized_keys), with %u/%h expanded; its state
    and content."""

    user: str
    needs_root = True

    def command(self, sh: ShellCtx) -> str:
        u = quote(self.user)
        return (
            f"u={u}; " + home_of("h", '"$u"') + "\n"
            "f=$( (sshd -T -C user=\"$u\",host=localhost,addr=127.0.0.1 2>/dev/null || /usr/sbin/sshd -T -C user=\"$u\",host=localhost,addr=127.0.0.1 2>/dev/null) "
            "| awk 'tolower($1)==\"authorizedkeysfile\" {print $2; exit}')\n"
            "[ -n \"$f\" ] || f=$(cat /etc/ssh/sshd_config /etc/ssh/sshd_config.d/*.conf 2>/dev/null | "
            "awk 'tolower($1)==\"authorizedkeysfile\" {print $2; exit}')\n"
            "[ -n \"$f\" ] || f=.ssh/authorized_keys\n"
            "case \"$f\" in *%*) f=$(printf '%s' \"$f\" | sed -e \"s|%%|\\x01|g\" -e \"s|%u|$u|g\" -e \"s|%h|$h|g\" -e \"s|\\x01|%|g\");; esac\n"
            "case \"$f\" in /*) ;; *) f=\"$h/$f\";; esac\n"
            "printf 'path=%s\\n' \"$f\"\n"
            "if [ -f \"$f\" ]; then stat -c 'stat=%U|%G|%a' -- \"$f\"; echo @content; base64 < \"$f\"; fi"
        )

    def parse(self, out: str, err: str, rc: int) -> dict[str, Any]:
        head, _, content = out.partition("@content\n")
        kv = _kv(head)
        if "path" not in kv:
            raise FactError(err.strip() or "cannot find the authorized_keys file")
        state: dict[str, Any] = {"path": kv["path"], "exists": "stat" in kv, "content": ""}
        if "stat" in kv:
            owner, group, mode = kv["stat"].split("|")
            state.update(owner=owner, group=group, mode=int(mode, 8),
                         content=base64.b64decode("".join(content.split())).decode(errors="replace"))
        return state


# ---------------------------------------------------------------------------------------------
# `invoke facts`
# ---------------------------------------------------------------------------------------------

def hardware_profile() -> dict[str, Fact]:
    """Sections `invoke facts` shows besides the host identity; none needs root."""
    return {"gpu": NvidiaSmi(), "memory": MemInfo(), "kernel": KernelCmdline(), "fabric": FabricInfo(),
            "docker": DockerState(), "ollama": OllamaState(), "cuda_toolkit": CudaToolkit()}


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"
