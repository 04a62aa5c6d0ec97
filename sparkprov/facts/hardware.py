"""Hardware facts of a Spark (or any NVIDIA Linux box): GPU, driver and CUDA from nvidia-smi, the
GPU's sensors, memory from /proc/meminfo, the kernel command line, the CUDA toolkit.

Every parser is a pure function of the command's text, tested on real captures
(tests/fixtures/gb10/, tests/fixtures/h200/). Commands are POSIX sh built with `quote`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sparkprov.facts.base import Fact, FactError, ShellCtx
from sparkprov.node import readings as node_readings
from sparkprov.transport.shell import quote

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
    """/proc/meminfo -> bytes per field (MemTotal, MemAvailable, Cached, ...): the node guard's parser."""
    out = node_readings.parse_meminfo(text)
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


@dataclass(frozen=True)
class BootId(Fact):
    """This boot's id (/proc/sys/kernel/random/boot_id, new at every boot): what a record made in an
    earlier boot is told apart by (the fabric qualification, the node guard's boot marker)."""

    def command(self, sh: ShellCtx) -> str:
        return "cat /proc/sys/kernel/random/boot_id"

    def parse(self, out: str, err: str, rc: int) -> str:
        if rc != 0 or not out.strip():
            raise FactError(err.strip() or "cannot read /proc/sys/kernel/random/boot_id")
        return out.strip()


# ---------------------------------------------------------------------------------------------
# CUDA toolkit (G36)
# ---------------------------------------------------------------------------------------------

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


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"
